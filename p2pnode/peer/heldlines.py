"""Where a fetch reads the lines it holds already (a fork's lines shared with its parent): from
the file this node placed for the parent, when it is still exactly what was placed, else from
the store.

The placed file has the lines raw, where the fork has them but for the length of the header
(PlacedLines), so a run of held lines is one read there and no decompression.  Within the
lines the fork shares with its parent from its first on (the manifest's hashes are the
parent's there, line for line, as the store holds them: what the fork's version will reference
is checked), a run is taken as it is, one block (`held_run`), its lines not hashed one by one,
when its first and last lines hash right: the file is the parent's by its stat, and the getter
hashes every byte into the session's hash, which must be `src` before anything is committed or
placed; where it is not (the file changed behind its stat), the fetch takes its held lines
again with each one checked (`read_held`) before it blames a peer.  Other runs have each line
checked, and a line the file does not give, or gives wrong, comes from the store
(Library.lines, each line checked against its hash there).
"""
from __future__ import annotations

import itertools
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
    """A held version's placed file, unchanged by its stat and its bytes as they were stored
    (Pi's header first), and where the fetched version's lines would sit in it: at their own
    offset + `shift`.  A fork's lines after its header are its parent's, in order (`pi --fork`
    copies them), so that is where they are; a wrong guess costs a store read, never a wrong
    byte."""

    path: Path
    shift: int
    common: int
    """The fetched version's lines 1..common (after the header) are the held version's lines
    1..common by their hashes (the manifest's, the store's): there, the guess is right."""


def placed_lines(lib: FetchTarget, branch: str, agent_dir: Path, session_dir: Path | None,
                 refs: Sequence[LineRef]) -> PlacedLines | None:
    """The placed file of held branch `branch`, for a version whose manifest is `refs`; None
    when this node holds no such branch, or its file is gone, no longer what this node placed
    there or not its version's bytes (the header was moved first).  Nothing of the file is
    read but its first line."""
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
    hashes = lib.line_hashes(src)
    if not first.endswith(b"\n") or blob_hash(first) != hashes[0]:
        return None
    common = 0
    for held, ref in zip(itertools.islice(hashes, 1, None), itertools.islice(refs, 1, None), strict=False):
        if held != ref.hash:
            break
        common += 1
    return PlacedLines(target, len(first) - refs[0].length, common)


def held_run(placed: PlacedLines | None, refs: Sequence[LineRef], first: int, offset: int) -> bytes | None:
    """The lines `refs` (consecutive in the fetched version, from line `first` at byte
    `offset`) as one block, as the placed file has them, where they are the held version's
    lines there (within `placed.common`) and the run's first and last lines hash right (the
    file is what its stat says): the lines between are not hashed one by one (the session's
    hash covers their bytes).  None: take them line by line (`read_held`)."""
    if placed is None or not 1 <= first <= first + len(refs) - 1 <= placed.common:
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
