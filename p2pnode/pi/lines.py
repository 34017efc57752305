"""Cutting a Pi session (JSONL) into its lines: the one splitter of the node.

A session is stored as one turn per line and a peer's line manifest is checked to be the file
cut at its newlines, so every place that cuts or checks cuts must agree to the byte: a line
keeps its newline, the last one may lack it, nothing else (no `\\r` rule, unlike
`bytes.splitlines`)."""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import BinaryIO


class LineSplitter:
    """Lines out of a stream of chunks: each complete line once its newline has arrived, the
    unfinished last one from `rest()`."""

    def __init__(self) -> None:
        self._pending: list[bytes] = []

    @property
    def pending(self) -> bool:
        """Whether a line has begun and not ended: the next line out began in an earlier chunk."""
        return bool(self._pending)

    def feed(self, chunk: bytes) -> Iterator[bytes]:
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            if self._pending:
                yield b"".join([*self._pending, chunk[start:end + 1]])
                self._pending.clear()
            else:
                yield chunk[start:end + 1]
            start = end + 1
        if start < len(chunk):
            self._pending.append(chunk[start:])

    def rest(self) -> bytes | None:
        """The last line if it lacks a newline (None if the stream ended at one)."""
        if not self._pending:
            return None
        line = b"".join(self._pending)
        self._pending.clear()
        return line


def line_runs(f: BinaryIO, chunk: int, size: int | None = None) -> Iterator[list[bytes]]:
    """The lines of an open file from where it stands, up to `size` bytes (None: to its end),
    in runs of about `chunk` bytes: never the whole file in memory."""
    splitter = LineSplitter()
    left = size
    while (left is None or left > 0) and (data := f.read(chunk if left is None else min(chunk, left))):
        left = None if left is None else left - len(data)
        if lines := list(splitter.feed(data)):
            yield lines
    if (last := splitter.rest()) is not None:
        yield [last]


def split_lines(data: bytes) -> list[bytes]:
    """JSONL lines with their newline; the last may lack one (the store's one turn per line)."""
    splitter = LineSplitter()
    lines = list(splitter.feed(data))
    if (last := splitter.rest()) is not None:
        lines.append(last)
    return lines


def is_split(lines: Sequence[bytes]) -> bool:
    """Whether `lines` are a JSONL file cut as split_lines cuts it: each line ends with its
    only newline, the last one may lack it.  (A peer's line manifest must not choose other
    cuts.)"""
    last = len(lines) - 1
    for i, line in enumerate(lines):
        end = line.find(b"\n")
        if end != len(line) - 1 and not (i == last and end < 0 and line):
            return False
    return True


@dataclass(frozen=True, slots=True)
class LineRef:
    """One line of a stored session as a line manifest lists it (the library builds them, the
    peer protocol carries them)."""

    hash: bytes
    """32-byte BLAKE3 of the line's bytes (newline included)."""
    length: int


def ref_runs(refs: Sequence[LineRef], limit: int) -> Iterator[Sequence[LineRef]]:
    """`refs` in consecutive runs of about `limit` raw bytes (a run ends at the line that
    reaches it; at least one line): what one store read of held lines takes at a time."""
    start = 0
    while start < len(refs):
        end, size = start, 0
        while end < len(refs) and size < limit:
            size += refs[end].length
            end += 1
        yield refs[start:end]
        start = end


def count_newlines(data: bytes | bytearray, lo: int, hi: int) -> int:
    """How many newlines data[lo:hi] holds.  `bytes.count` runs at ~1.8 GB/s while `find`
    hops with memchr at several GB/s: hop over long lines (Pi's are KBs, images MBs), and
    count a window where the lines are short (a bounded number of hops per window)."""
    n = 0
    while lo < hi:
        window = min(hi, lo + _WINDOW)
        for _ in range(_HOPS):
            at = data.find(b"\n", lo, window)
            if at < 0:
                break
            n, lo = n + 1, at + 1
        else:
            n += data.count(b"\n", lo, window)
        lo = window
    return n


_WINDOW, _HOPS = 1 << 20, 512
"""Up to 512 hops per MiB (lines of 2 KiB on average), else `count` for the rest of it."""
