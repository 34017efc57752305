"""BLAKE3 of session files without reading them whole, and without reading them twice.

Pi only appends to a session file (except for a few documented rewrites), so:
- a running process keeps, per file, the hasher state at the last size it saw
  (`blake3.copy()`); when the file grows only the new bytes are hashed;
- a persisted stat cache ((dev, inode, size, mtime_ns) -> hash) skips unchanged files
  across restarts;
- a grown file is checked to still start with the bytes we hashed before: against the live
  state by re-hashing two 4 KiB probes (the start, and the end of the old size), and
  without live state by comparing the digest of the old-size prefix on the way through.
  Several older versions can be tried in that one pass (two continuations of one session:
  the larger held one may not be a prefix, an older one is): the digest is compared at
  each one's size, and the largest that matches is the one the file grew from.  No match
  means the file was rewritten; the bytes read for the check count as hashed all the same.

`FileHasher.scan` can also hand the bytes it reads to a sink (the store importer), so a
first share reads each byte once.
"""
from __future__ import annotations

import io
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import Sequence

import blake3

from p2pnode.errors import Conflict
from p2pnode.pi.lines import count_newlines
from sysio.files import atomic_write
from sysio.locks import locked
from sysio.memory import read_buffer

CHUNK = 4 * 1024 * 1024
PREFIX_CHUNK = 1 << 20
"""prefix_hasher's reads: a buffer the hash reads back from the CPU's cache (10 % faster than CHUNK)."""
PROBE = 4096
MAX_LIVE = 1024
"""Live hasher states kept in memory (each is a few KB)."""


def new_hasher() -> blake3.blake3:
    return blake3.blake3(max_threads=blake3.blake3.AUTO)


def hash_file(path: Path) -> str:
    """BLAKE3 of a whole file, memory-mapped (no stat cache: for one-off checks, tests and benchmarks)."""
    hasher = new_hasher()
    if os.path.getsize(path):
        hasher.update_mmap(path)
    return hasher.hexdigest()


def hash_prefix(path: Path, size: int) -> str:
    """BLAKE3 of a file's first `size` bytes (all of it if shorter)."""
    return prefix_hasher(path, size).hexdigest()


def prefix_hasher(path: Path, size: int) -> blake3.blake3:
    """The hasher state after a file's first `size` bytes, read in PREFIX_CHUNK pieces into
    one page-aligned buffer (the file is not memory-mapped: a mapping's pages count in the
    resident memory, the whole file's worth, and a file cut short under its mapping kills the
    process with SIGBUS), on one thread: it runs beside a fetch's own work, where blake3's
    threads gained nothing (docs/BENCHMARKS.md)."""
    hasher = blake3.blake3(max_threads=1)
    with open(path, "rb", buffering=0) as f:
        buf = read_buffer(PREFIX_CHUNK)
        while size > 0 and (n := f.readinto(buf[: min(PREFIX_CHUNK, size)])):
            hasher.update(buf[:n])
            size -= n
    return hasher


def complete_lines_end(f: io.BufferedReader, size: int) -> int:
    """The offset just after the last newline before `size` (0 if there is none): where the
    complete lines of a file that Pi may be appending to end."""
    end = size
    while end > 0:
        start = max(0, end - PROBE * 16)
        f.seek(start)
        found = f.read(end - start).rfind(b"\n")
        if found >= 0:
            return start + found + 1
        end = start
    return 0


@dataclass(frozen=True, slots=True)
class Prefix:
    """What we know about a file at one size: its hash and where its lines are."""

    size: int
    blake3: str
    lines: int
    """Lines at this size; a last line without a newline counts."""
    last_line_start: int
    """Offset of the last line's first byte; == size when the data ends with a newline."""


@dataclass(frozen=True, slots=True)
class Scan:
    prefix: Prefix
    how: str
    """"cached" (stat cache hit, nothing read), "appended" (only new bytes hashed) or "full"."""
    rewritten: bool
    """Previous versions were expected as a prefix and the file starts with none of them."""
    left_out: int = 0
    """Bytes after the last newline that a `complete_lines` hasher did not hash."""
    grown: Prefix | None = None
    """The expected prefix the file was found to start with (the largest, if several)."""


@dataclass(frozen=True, slots=True)
class _StatKey:
    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> _StatKey:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass
class _Live:
    key: _StatKey
    hasher: blake3.blake3
    prefix: Prefix
    head_probe: bytes
    tail_probe: bytes


class Sink(Protocol):
    def begin(self, grown: Prefix | None) -> int:
        """Called once the prefixes are checked, with the one the file starts with (None: the
        file is read from its start); returns the file offset to feed bytes from."""

    def feed(self, data: bytes) -> None:
        """The next bytes of the file, a bytes object of their own: the sink may keep it or
        cut lines out of it, with no copy of its own first."""


def _probes(f: io.BufferedReader, size: int) -> tuple[bytes, bytes]:
    f.seek(0)
    head = f.read(min(PROBE, size))
    f.seek(max(0, size - PROBE))
    tail = f.read(size - max(0, size - PROBE))
    return blake3.blake3(head).digest(), blake3.blake3(tail).digest()


class _Counter:
    """Counts lines over the bytes as they are hashed, each byte once."""

    def __init__(self, start: Prefix | None) -> None:
        self.newlines = 0 if start is None else start.lines - (start.last_line_start < start.size)
        self.last_line_start = 0 if start is None else start.last_line_start

    def add(self, buf: bytes, lo: int, hi: int, offset: int) -> None:
        """Count buf[lo:hi], the bytes at `offset` in the file (in place: no copy of the chunk)."""
        n = count_newlines(buf, lo, hi)
        if n:
            self.newlines += n
            self.last_line_start = offset + buf.rfind(b"\n", lo, hi) - lo + 1

    def prefix(self, size: int, digest: str) -> Prefix:
        return Prefix(size, digest, self.newlines + (self.last_line_start < size), self.last_line_start)


class FileHasher:
    """Hashes files with a persisted stat cache (at `cache_path`) and in-memory hasher states.

    `complete_lines`: hash each file only up to its last newline, never a line that a writer
    (Pi) has only half written; the stat cache then holds those hashes."""

    def __init__(self, cache_path: Path | None, *, complete_lines: bool = False) -> None:
        self.cache_path = cache_path
        self.complete_lines = complete_lines
        self._cache: dict[str, tuple[_StatKey, Prefix]] = {}
        self._dirty: set[str] = set()
        self._live: dict[str, _Live] = {}
        if cache_path is not None:
            self._cache = self._load(cache_path)

    @staticmethod
    def _load(path: Path) -> dict[str, tuple[_StatKey, Prefix]]:
        try:
            files = json.loads(path.read_bytes())["files"]
            return {p: (_StatKey(**e["stat"]), Prefix(**e["prefix"])) for p, e in files.items()}
        except FileNotFoundError:
            return {}
        except (ValueError, KeyError, TypeError, AttributeError):  # not JSON, or not as written
            return {}  # a damaged cache only costs a re-hash; save() replaces it

    def cached(self, path: Path) -> Prefix | None:
        """The hash of an unchanged file from the stat cache, without reading it."""
        key = str(Path(path).absolute())
        entry = self._cache.get(key)
        if entry is None or entry[0] != _StatKey.of(os.stat(path)):
            return None
        return entry[1]

    def known(self, path: Path) -> Prefix | None:
        """The last version of this path we hashed, changed since or not."""
        entry = self._cache.get(str(Path(path).absolute()))
        return entry[1] if entry else None

    def scan(self, path: Path, *, prefixes: Sequence[Prefix] = (), sink: Sink | None = None) -> Scan:
        """Hash `path` as it is now, reusing the largest of `prefixes` (earlier versions) that
        the file starts with."""
        key = str(Path(path).absolute())
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            stat_key = _StatKey.of(st)
            entry = self._cache.get(key)
            if sink is None and entry is not None and entry[0] == stat_key:
                return Scan(entry[1], "cached", False, st.st_size - entry[1].size)
            size = complete_lines_end(f, st.st_size) if self.complete_lines else st.st_size
            expected = sorted({p for p in prefixes if 0 < p.size <= size}, key=lambda p: p.size)
            hasher, counter, hashed, grown = self._resume(f, key, st, expected)
            start = sink.begin(grown) if sink is not None else hashed
            if grown is None and sink is not None and start:
                raise ValueError("a sink must start at offset 0 when the file is not an append")
            pos = min(start, hashed)
            f.seek(pos)
            while pos < size:
                chunk = f.read(min(CHUNK, size - pos))  # a new bytes each time: the sink keeps it
                n = len(chunk)
                if not n:
                    raise Conflict(f"{path} shrank to {pos} bytes while being read (it was {size})")
                if pos + n > hashed:
                    skip = max(0, hashed - pos)
                    hasher.update(memoryview(chunk)[skip:])
                    counter.add(chunk, skip, n, pos + skip)
                    hashed = pos + n
                if sink is not None and pos + n > start:
                    sink.feed(chunk[start - pos:] if start > pos else chunk)
                pos += n
            result = counter.prefix(size, hasher.hexdigest())
            head_probe, tail_probe = _probes(f, size)
        self._remember(key, stat_key, hasher, result, head_probe, tail_probe)
        return Scan(result, "full" if grown is None else "appended", bool(expected) and grown is None,
                    st.st_size - size, grown)

    def _resume(
        self, f: io.BufferedReader, key: str, st: os.stat_result, expected: list[Prefix]
    ) -> tuple[blake3.blake3, _Counter, int, Prefix | None]:
        """(hasher, line counter, bytes hashed, the largest of `expected` (by size) the file
        starts with) to continue from: from the live state if it is one of them and the probes
        still match, then by hashing on to the largest one, comparing the digest at each size
        (one read however many there are).  When the largest is not a prefix, the bytes after
        the one that is are read again, counted (the check does not count lines)."""
        found: tuple[blake3.blake3, Prefix] | None = None
        hasher, pos = new_hasher(), 0
        live = self._live.get(key)
        same_file = live is not None and (live.key.dev, live.key.ino) == (st.st_dev, st.st_ino)
        if (live is not None and same_file and live.prefix in expected
                and _probes(f, live.prefix.size) == (live.head_probe, live.tail_probe)):
            hasher, pos = live.hasher.copy(), live.prefix.size
            found = (hasher, live.prefix)
        f.seek(pos)
        buf = read_buffer(CHUNK)
        for candidate in (p for p in expected if p.size > pos):
            if found is not None and found[0] is hasher:
                hasher = hasher.copy()  # `found` keeps its state; the check reads on
            while pos < candidate.size and (n := f.readinto(buf[: min(CHUNK, candidate.size - pos)])):
                hasher.update(buf[:n])
                pos += n
            if pos == candidate.size and hasher.hexdigest() == candidate.blake3:
                found = (hasher, candidate)
        if found is None:
            return new_hasher(), _Counter(None), 0, None
        state, grown = found
        return state, _Counter(grown), grown.size, grown

    def _remember(self, key: str, stat_key: _StatKey, hasher: blake3.blake3, prefix: Prefix,
                  head_probe: bytes, tail_probe: bytes) -> None:
        self._live.pop(key, None)
        if len(self._live) >= MAX_LIVE:
            self._live.pop(next(iter(self._live)))
        self._live[key] = _Live(stat_key, hasher, prefix, head_probe, tail_probe)
        self._cache[key] = (stat_key, prefix)
        self._dirty.add(key)

    def save(self) -> None:
        """Merge our new entries into the cache file (other processes may have added theirs)."""
        if self.cache_path is None or not self._dirty:
            return
        with locked(self.cache_path.with_name(self.cache_path.name + ".lock")):
            merged = self._load(self.cache_path)
            merged.update({k: self._cache[k] for k in self._dirty})
            files = {p: {"stat": asdict(s), "prefix": asdict(pre)} for p, (s, pre) in merged.items()
                     if os.path.exists(p)}
            atomic_write(self.cache_path, json.dumps({"version": 1, "files": files}).encode(), durable=False)
        self._dirty.clear()
