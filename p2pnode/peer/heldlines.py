"""Where a fetch reads the lines it holds already (a fork's lines shared with its parent): from
the file this node placed for the parent, when it is still exactly what was placed, else from
the store.

The placed file has the lines raw, where the fork has them but for the length of the header
(PlacedLines), so a run of held lines is one read there and no decompression, and not even the
parent's manifest is read (a walk of its turns).  A run whose first and last lines hash right
is taken as it is, one block (`held_run`), its lines unchecked one by one: the file is the
parent's by its stat, laid out as the fork says, and the getter hashes every byte into the
session's hash, which must be `src` before anything is committed or placed; where it is not,
the fetch takes its held lines again with each one checked (`read_held`) before it blames a
peer.  A run whose ends do not hash right (the fork is laid out otherwise, or the file changed
behind its stat) has each line checked, and a line the file does not give, or gives wrong,
comes from the store (Library.lines, each line checked against its hash there).
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


def held_run(placed: PlacedLines | None, refs: Sequence[LineRef], offset: int) -> bytes | None:
    """The lines `refs` (consecutive in the fetched version, from byte `offset`) as one block,
    as the placed file has them, when its first and last lines hash right: the lines between
    are not checked one by one (the session's hash checks them).  None: take them line by line
    (`read_held`)."""
    if placed is None:
        return None
    data = _read(placed, refs, offset + placed.shift)
    if data is None:
        return None
    view = memoryview(data)
    last = len(data) - refs[-1].length
    if blob_hash(view[:refs[0].length]) == refs[0].hash and blob_hash(view[last:]) == refs[-1].hash:
        return data
    return None


def read_held(lib: FetchTarget, refs: Sequence[LineRef], offset: int,
              placed: PlacedLines | None) -> list[bytes]:
    """The lines `refs` (consecutive in the fetched version, from byte `offset`), in order, each
    checked against its hash: from `placed` where it has them right (one read for the run), the
    rest from the store."""
    out: list[bytes | None] = [None] * len(refs)
    data = None if placed is None else _read(placed, refs, offset + placed.shift)
    if data is not None:
        view, pos = memoryview(data), 0
        for i, ref in enumerate(refs):
            if blob_hash(view[pos:pos + ref.length]) == ref.hash:
                out[i] = bytes(view[pos:pos + ref.length])
            pos += ref.length
    missing = [i for i, line in enumerate(out) if line is None]
    if missing:
        for i, line in zip(missing, lib.lines([refs[i].hash for i in missing]), strict=True):
            out[i] = line
    return [line for line in out if line is not None]


def _read(placed: PlacedLines, refs: Sequence[LineRef], start: int) -> bytes | None:
    """The bytes where the placed file would have the run `refs` from byte `start` on (one
    read), or None when it cannot give them all."""
    if start < 0 or not refs:
        return None
    size = sum(r.length for r in refs)
    try:
        fd = os.open(placed.path, os.O_RDONLY)
    except OSError:
        return None
    try:
        data = os.pread(fd, size, start)
    except OSError:
        return None  # all from the store
    finally:
        os.close(fd)
    return data if len(data) == size else None
