"""Where a fetch reads the lines it holds already (a fork's lines shared with its parent): from
the file this node placed for the parent, when it is still exactly what was placed, else from
the store.

The placed file has the lines raw, at offsets its version's manifest gives (from the store's
index: no line is read), so a run of held lines is one big read there (they sit together in
the parent as they do in the fork) and no decompression; each line read is hashed and kept
only if it is the line asked for (the file may have changed since its stat was checked).  A
line the file does not give, or gives wrong, comes from the store (Library.lines, each line
checked against its hash there).  Either way the getter hashes every byte into the session's
hash, and nothing is committed or placed unless that is `src`.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import blake3

from p2pnode.errors import NotFound
from p2pnode.library.manifest import PlacedFiles
from p2pnode.peer.interfaces import FetchTarget
from p2pnode.pi.placement import appendable, target_path
from p2pnode.pi.session import SessionHeader

BIG_LINE = 128 << 10
"""Lines from this size on are hashed on all cores (blake3's own threads)."""


@dataclass(frozen=True)
class PlacedLines:
    """A held version's placed file, checked unchanged by its stat, and where each of its lines
    (by hash, the first place it occurs) starts in it and how long it is."""

    path: Path
    at: dict[bytes, tuple[int, int]]


def placed_lines(lib: FetchTarget, branch: str, agent_dir: Path,
                 session_dir: Path | None) -> PlacedLines | None:
    """The placed file of held branch `branch` with its lines' places, or None when this node
    holds no such branch or its file is gone or no longer what this node placed there."""
    try:
        src = lib.branch(branch).src
    except NotFound:
        return None
    version = lib.version(src)
    target = target_path(agent_dir, SessionHeader(**version.header), session_dir)
    if appendable(target, PlacedFiles(lib.paths.placed), src, version.size, True) is None:
        return None
    at: dict[bytes, tuple[int, int]] = {}
    offset = 0
    for ref in lib.line_manifest(src):
        at.setdefault(ref.hash, (offset, ref.length))
        offset += ref.length
    return PlacedLines(target, at)


def read_held(lib: FetchTarget, hashes: Sequence[bytes], placed: PlacedLines | None) -> list[bytes]:
    """The lines `hashes`, in order, each one verified: from `placed` where it has them (runs
    that are contiguous there read at once), the rest from the store."""
    out: list[bytes | None] = [None] * len(hashes)
    if placed is not None:
        _from_file(placed, hashes, out)
    missing = [i for i, line in enumerate(out) if line is None]
    if missing:
        for i, line in zip(missing, lib.lines([hashes[i] for i in missing]), strict=True):
            out[i] = line
    return [line for line in out if line is not None]


def _from_file(placed: PlacedLines, hashes: Sequence[bytes], out: list[bytes | None]) -> None:
    """out[i] = the line hashes[i] where the placed file has it and it hashes right."""
    try:
        fd = os.open(placed.path, os.O_RDONLY)
    except OSError:
        return
    try:
        i = 0
        while i < len(hashes):
            first = placed.at.get(hashes[i])
            if first is None:
                i += 1
                continue
            j, end = i + 1, first[0] + first[1]
            while j < len(hashes) and (nxt := placed.at.get(hashes[j])) is not None and nxt[0] == end:
                end += nxt[1]
                j += 1
            data = memoryview(os.pread(fd, end - first[0], first[0]))
            pos = 0
            for k in range(i, j):
                length = placed.at[hashes[k]][1]
                line = bytes(data[pos:pos + length])
                pos += length
                if len(line) == length and _hash(line) == hashes[k]:
                    out[k] = line
            i = j
    except OSError:
        return  # the rest from the store
    finally:
        os.close(fd)


def _hash(line: bytes) -> bytes:
    if len(line) >= BIG_LINE:
        return blake3.blake3(line, max_threads=blake3.blake3.AUTO).digest()
    return blake3.blake3(line).digest()
