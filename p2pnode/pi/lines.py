"""Cutting a Pi session (JSONL) into its lines: the one splitter of the node.

A session is stored as one turn per line and a peer's line manifest is checked to be the file
cut at its newlines, so every place that cuts or checks cuts must agree to the byte: a line
keeps its newline, the last one may lack it, nothing else (no `\\r` rule, unlike
`bytes.splitlines`)."""
from __future__ import annotations

import itertools
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import BinaryIO, overload


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


REF = struct.Struct("<32sI")
"""A LineRef packed: its hash, its length (docs/PROTOCOL.md: a line manifest's entry)."""


class LineRefs(Sequence[LineRef]):
    """Line refs packed back to back (REF, 36 bytes each; `entries` is a line manifest's body):
    a session's manifest as LineRef objects took about ten times that (a 2 GB session of
    112,000 lines: 42 MB of a node's memory, 4 MB packed).  Read-only; a LineRef is made
    when one is looked at."""

    __slots__ = ("entries",)

    def __init__(self, entries: bytes = b"") -> None:
        if len(entries) % REF.size:
            raise ValueError(f"{len(entries)} bytes are not whole line refs of {REF.size}")
        self.entries = entries

    @classmethod
    def of(cls, refs: Iterable[LineRef]) -> LineRefs:
        if isinstance(refs, LineRefs):
            return refs
        return cls(b"".join(REF.pack(r.hash, r.length) for r in refs))

    @classmethod
    def packed(cls, hashes: Iterable[bytes], lengths: Iterable[int]) -> LineRefs:
        return cls(b"".join(map(REF.pack, hashes, lengths)))

    def __len__(self) -> int:
        return len(self.entries) // REF.size

    @overload
    def __getitem__(self, index: int) -> LineRef: ...
    @overload
    def __getitem__(self, index: slice) -> LineRefs: ...
    def __getitem__(self, index: int | slice) -> LineRef | LineRefs:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step == 1:
                return LineRefs(self.entries[start * REF.size:max(start, stop) * REF.size])
            return LineRefs.of(self[i] for i in range(start, stop, step))
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"line {index} of {n}")
        return LineRef(*REF.unpack_from(self.entries, (index % n) * REF.size))

    def __iter__(self) -> Iterator[LineRef]:
        return itertools.starmap(LineRef, REF.iter_unpack(self.entries))

    def __add__(self, other: Iterable[LineRef]) -> LineRefs:
        return LineRefs(self.entries + LineRefs.of(other).entries)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LineRefs):
            return self.entries == other.entries
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def hashes(self) -> list[bytes]:
        entries, size = self.entries, REF.size
        return [entries[i:i + 32] for i in range(0, len(entries), size)]

    def __repr__(self) -> str:
        return f"LineRefs({len(self)} lines)"


def ref_runs(refs: Iterable[LineRef], limit: int) -> Iterator[list[LineRef]]:
    """`refs` in consecutive runs of about `limit` raw bytes (a run ends at the line that
    reaches it; at least one line): what one store read of held lines takes at a time."""
    run: list[LineRef] = []
    size = 0
    for ref in refs:
        run.append(ref)
        size += ref.length
        if size >= limit:
            yield run
            run, size = [], 0
    if run:
        yield run


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
