"""Where a fetch reads the lines it holds already (a fork's lines shared with its parent): from
the file this node placed for the parent, when it is still exactly what was placed, else from
the store.

The placed file has the lines raw, where the fork has them but for the length of the header
(PlacedLines), so a run of held lines is one read there and no decompression, and not even the
parent's manifest is read (a walk of its turns).  A run whose first and last lines hash right
is taken as it is, its lines unchecked one by one: the file is the parent's by its stat, laid
out as the fork says, and the getter hashes every byte into the session's hash, which must be
`src` before anything is committed or placed; where it is not, the fetch takes its held lines
again with each one checked (`read_held(check_each=True)`) before it blames a peer.  A run
whose ends do not hash right (the fork is laid out otherwise, or the file changed behind its
stat) has each line checked, and a line the file does not give, or gives wrong, comes from the
store (Library.lines, each line checked against its hash there).
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from p2pnode.errors import NotFound
from p2pnode.library.manifest import PlacedFiles
from p2pnode.peer.interfaces import FetchTarget
from p2pnode.pi.lines import LineRef
from p2pnode.pi.placement import appendable, target_path
from p2pnode.pi.session import HEADER_SCAN_BYTES, SessionHeader
from store.codec import blob_hash


@dataclass(frozen=True)
class PlacedLines:
    """A held version's placed file, unchanged by its stat, and where the fetched version's
    lines would sit in it: at their own offset + `shift`.  A fork's lines after its header are
    its parent's, in order (`pi --fork` copies them), so that is where they are; each line read
    there is hashed, so a wrong guess costs a store read, never a wrong byte."""

    path: Path
    shift: int


def placed_lines(lib: FetchTarget, branch: str, agent_dir: Path, session_dir: Path | None,
                 header_length: int) -> PlacedLines | None:
    """The placed file of held branch `branch`, for a version whose first line (its header) is
    `header_length` bytes; None when this node holds no such branch, or its file is gone or no
    longer what this node placed there.  Nothing of the file is read but its first line."""
    try:
        src = lib.branch(branch).src
    except NotFound:
        return None
    version = lib.version(src)
    target = target_path(agent_dir, SessionHeader(**version.header), session_dir)
    if appendable(target, PlacedFiles(lib.paths.placed), src, version.size, True) is None:
        return None
    try:
        with open(target, "rb") as f:
            first = f.readline(HEADER_SCAN_BYTES)
    except OSError:
        return None
    return PlacedLines(target, len(first) - header_length) if first.endswith(b"\n") else None


def read_held(lib: FetchTarget, refs: Sequence[LineRef], offset: int, placed: PlacedLines | None,
              check_each: bool = False) -> tuple[list[bytes], bool]:
    """The lines `refs` (consecutive in the fetched version, from byte `offset`), in order: from
    `placed` where it has them (one read for the run), the rest from the store; and whether
    the placed file gave lines not checked one by one (only the run's ends were: the session's
    hash checks them, unless `check_each`)."""
    out: list[bytes | None] = [None] * len(refs)
    unchecked = placed is not None and _from_file(placed, refs, offset + placed.shift, out, check_each)
    missing = [i for i, line in enumerate(out) if line is None]
    if missing:
        for i, line in zip(missing, lib.lines([refs[i].hash for i in missing]), strict=True):
            out[i] = line
    return [line for line in out if line is not None], unchecked


def _from_file(placed: PlacedLines, refs: Sequence[LineRef], start: int, out: list[bytes | None],
               check_each: bool) -> bool:
    """out[i] = line i of `refs` where the placed file has it from byte `start` on: all of the
    run, unchecked, when its first and last lines hash right (True), else each line that hashes
    right."""
    if start < 0 or not refs:
        return False
    try:
        fd = os.open(placed.path, os.O_RDONLY)
    except OSError:
        return False
    try:
        data = memoryview(os.pread(fd, sum(r.length for r in refs), start))
    except OSError:
        return False  # all from the store
    finally:
        os.close(fd)
    lines, pos = [], 0
    for ref in refs:
        lines.append(bytes(data[pos:pos + ref.length]))
        pos += ref.length
    ends = {0, len(refs) - 1}
    if not check_each and pos == len(data) and all(blob_hash(lines[i]) == refs[i].hash for i in ends):
        out[:] = lines
        return True
    for i, (line, ref) in enumerate(zip(lines, refs, strict=True)):
        if len(line) == ref.length and blob_hash(line) == ref.hash:
            out[i] = line
    return False
