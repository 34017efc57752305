"""`blobs.idx`: the rebuildable index of blobs.pack, one sorted run of BlobIndexEntry with a
256-way fan-out table, read through mmap with a binary search, so opening costs nothing per
blob.  No I/O of its own: the pack maps it, checks it against the pack and writes it.
"""
from __future__ import annotations

import array
import bisect
import functools
import mmap
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from store.layout import (
    HASH_LEN,
    IDX_ENTRY,
    IDX_FANOUT,
    IDX_HEADER,
    IDX_HEADER_CRC,
    IDX_MAGIC,
    IDX_PREFIX_LEN,
    IDX_VERSION,
    ZERO_HASH,
    BlobHeader,
    BlobLocation,
)

INDEX = "blobs.idx"
FOUND_MAX = 1 << 14
"""BlobIndex.found's bound: a batch's worth of lines (the library appends 4096 at a time)."""
MERGE_WHOLE, MERGE_WHOLE_MAX = 8, 1 << 17
"""`merged` sorts all the entries anew once the new ones are at least one per MERGE_WHOLE
indexed (below it, a bisection per new entry costs less than a pass over every entry: a
bisection costs about what eight entries of the pass do), in an index of at most
MERGE_WHOLE_MAX entries: the pass makes a Python object of each, a transient that grows
with the index (22 MB at this bound, measured), where a bisection per new entry copies the
index once."""
PREFIXES_AFTER = 1 / 64
"""An index bisects its key prefixes (BlobIndex._prefixes) once it was searched this many
times per entry: building them costs ~30 ns an entry, a search without them ~5 µs, with them
~1.7 µs.  A +1 % fetch's few hundred lookups in each opening of a store of 231k blobs would
otherwise spend 7 ms on each build."""


def index_entry(h: bytes, loc: BlobLocation) -> bytes:
    return IDX_ENTRY.pack(h, loc.offset, loc.raw_len, loc.stored_len, loc.codec, 0)


def encode_index(entries: list[bytes], covered_len: int, last: tuple[int, bytes] | None) -> bytes:
    """entries: sorted runs of packed BlobIndexEntry bytes (one entry each, or many: joined as
    they are); last: (offset, hash) of the last covered record."""
    body = b"".join(entries)
    firsts = body[::IDX_ENTRY.size]  # each entry's first hash byte, in order: its fan-out bucket
    fan = [bisect.bisect_right(firsts, b) for b in range(256)]  # not 256 counts over all of them
    last_off, last_hash = last if last else (0, ZERO_HASH)
    head = IDX_HEADER.pack(
        IDX_MAGIC, IDX_VERSION, 0, len(firsts), covered_len, last_off, last_hash, zlib.crc32(body)
    ) + IDX_FANOUT.pack(*fan)
    return head + IDX_HEADER_CRC.pack(zlib.crc32(head)) + body


@dataclass(frozen=True)
class BlobIndex:
    """One mapped blobs.idx.  Replaced whole, never changed, so a lookup that took it keeps a
    consistent view while a newer index is swapped in."""

    mm: mmap.mmap | None = None
    fan: tuple[int, ...] = (0,) * 256
    count: int = 0
    found: dict[bytes, BlobLocation] = field(default_factory=dict, compare=False, repr=False)
    """Blobs located lately (at most FOUND_MAX): a batch of turns that reference stored blobs
    looks each up twice (prepared, then made durable), and a binary search in Python costs
    microseconds.  Valid as long as this index: it is replaced whole, never changed."""
    searches: list[int] = field(default_factory=lambda: [0], compare=False, repr=False)
    """How many times `_position` searched the mapping without the key prefixes (one counter,
    in a list: the dataclass is frozen)."""

    @functools.cached_property
    def _prefixes(self) -> array.array[int]:
        """Each entry's first 8 key bytes as a number, in order (8 bytes an entry, built once
        per index at C speed): `bisect` over them finds an entry in C, not by a binary search
        in Python over the mapping (docs/BENCHMARKS.md (15))."""
        out = array.array("Q")
        if self.mm is None or not self.count:
            return out
        end = IDX_PREFIX_LEN + self.count * IDX_ENTRY.size
        packed = bytearray(8 * self.count)
        for i in range(8):  # the i-th key byte of every entry, at once (no copy of the index)
            packed[i::8] = self.mm[IDX_PREFIX_LEN + i : end : IDX_ENTRY.size]
        out.frombytes(packed)
        if sys.byteorder == "little":
            out.byteswap()  # the key bytes read big-endian: numbers in the keys' order
        return out

    def has(self, h: bytes) -> bool:
        """Whether blob h has an entry: `locate` without making (and caching) its location, for
        a fetch that asks about a whole manifest's lines at once."""
        return h in self.found or (self.mm is not None and len(h) == 32 and self._position(h)[1])

    def locate(self, h: bytes) -> BlobLocation | None:
        """Blob h's entry, found by bisecting the key prefixes (`_prefixes`)."""
        if (loc := self.found.get(h)) is not None:
            return loc
        if self.mm is None or len(h) != 32:
            return None
        at, found = self._position(h)
        if not found:
            return None
        entry = IDX_ENTRY.unpack_from(self.mm, IDX_PREFIX_LEN + at * IDX_ENTRY.size)
        _, pack_off, raw_len, stored_len, codec, _ = entry
        if len(self.found) >= FOUND_MAX:
            self.found.clear()
        loc = self.found[h] = BlobLocation(pack_off, raw_len, stored_len, codec)
        return loc

    def _position(self, h: bytes) -> tuple[int, bool]:
        """Where h's entry is, or would go (its index in the run), and whether it is there:
        by a binary search in the fan-out bucket of h's first byte over the mapping, until the
        index was searched often enough to bisect its key prefixes (PREFIXES_AFTER)."""
        if "_prefixes" in self.__dict__ or self.searches[0] >= self.count * PREFIXES_AFTER:
            return self._bisected(h)
        self.searches[0] += 1
        mm, esize = self.mm, IDX_ENTRY.size
        assert mm is not None
        b = h[0]
        lo, hi = self.fan[b - 1] if b else 0, self.fan[b]
        while lo < hi:
            mid = (lo + hi) // 2
            off = IDX_PREFIX_LEN + mid * esize
            key = mm[off : off + 32]
            if key < h:
                lo = mid + 1
            elif key > h:
                hi = mid
            else:
                return mid, True
        return lo, False

    def _bisected(self, h: bytes) -> tuple[int, bool]:
        """`_position` by bisecting the key prefixes in C."""
        mm, prefixes, esize = self.mm, self._prefixes, IDX_ENTRY.size
        assert mm is not None
        prefix = int.from_bytes(h[:8], "big")
        at = bisect.bisect_left(prefixes, prefix)
        while at < self.count and prefixes[at] == prefix:  # keys alike in 8 bytes: compared whole
            off = IDX_PREFIX_LEN + at * esize
            key = mm[off : off + 32]
            if key >= h:
                return at, key == h
            at += 1
        return at, False

    def merged(self, new: dict[bytes, BlobLocation]) -> list[bytes]:
        """This index's entries with `new`'s put in their places (a new location replaces the
        one indexed for the same hash), as sorted runs for encode_index.  A few new entries
        are each found by bisection and the runs between them sliced from the mapping, not
        decoded: a copy of the index, not a Python object per entry.  Many of them (one per
        MERGE_WHOLE entries indexed, or more: a fetch's lines folded into a young store) are
        merged with all the entries in one sort, which takes the two sorted runs in one pass:
        a bisection per new entry then costs more (docs/BENCHMARKS.md, 2026-11-29 (20))."""
        added = sorted(index_entry(h, loc) for h, loc in new.items())
        if self.mm is None or not self.count:
            return added
        esize = IDX_ENTRY.size
        runs: list[bytes] = []
        done = 0
        with memoryview(self.mm) as view:  # released at once: the mapping is closed when replaced
            body = view[IDX_PREFIX_LEN:]
            if len(added) * MERGE_WHOLE >= self.count and self.count <= MERGE_WHOLE_MAX:
                kept = body.tobytes()
                body.release()
                old = (kept[at:at + esize] for at in range(0, len(kept), esize))
                return sorted([e for e in old if e[:HASH_LEN] not in new] + added)
            for entry in added:
                at, found = self._position(entry[:32])
                runs += (body[done * esize : at * esize].tobytes(), entry)
                done = at + found
            runs.append(body[done * esize :].tobytes())
            body.release()
        return runs


def check_index(mm: mmap.mmap, size: int, pack_size: int,
                header_at: Callable[[int], BlobHeader | None]) -> str | None:
    """Why the mapped blobs.idx cannot serve a pack of pack_size bytes (header_at reads the
    pack's record header at an offset), or None when it can."""
    magic, version, _, count, covered, last_off, last_hash, ecrc = IDX_HEADER.unpack_from(mm, 0)
    hlen = IDX_HEADER.size + IDX_FANOUT.size
    (hcrc,) = IDX_HEADER_CRC.unpack_from(mm, hlen)
    if magic != IDX_MAGIC or version != IDX_VERSION or zlib.crc32(memoryview(mm)[:hlen]) != hcrc:
        return "header damaged"
    if size != IDX_PREFIX_LEN + count * IDX_ENTRY.size:
        return "has the wrong length"
    if zlib.crc32(memoryview(mm)[IDX_PREFIX_LEN:]) != ecrc:
        return "entries damaged"
    if covered > pack_size:
        return "is stale (covers more than the pack holds)"
    if count:
        hdr = header_at(last_off)
        if hdr is None or hdr.hash != last_hash or last_off + hdr.record_len != covered:
            return "is stale (does not describe this pack)"
    elif covered:
        return "is stale"
    return None
