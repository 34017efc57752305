"""`blobs.idx`: the rebuildable index of blobs.pack, one sorted run of BlobIndexEntry with a
256-way fan-out table, read through mmap with a binary search, so opening costs nothing per
blob.  No I/O of its own: the pack maps it, checks it against the pack and writes it.
"""
from __future__ import annotations

import bisect
import heapq
import mmap
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from store.layout import (
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


def index_entry(h: bytes, loc: BlobLocation) -> bytes:
    return IDX_ENTRY.pack(h, loc.offset, loc.raw_len, loc.stored_len, loc.codec, 0)


def encode_index(entries: list[bytes], covered_len: int, last: tuple[int, bytes] | None) -> bytes:
    """entries: sorted runs of packed BlobIndexEntry bytes (one entry each, or many: joined as
    they are); last: (offset, hash) of the last covered record."""
    body = b"".join(entries)
    firsts = body[::IDX_ENTRY.size]  # each entry's first hash byte: its fan-out bucket
    fan, total = [], 0
    for i in range(256):
        total += firsts.count(i)
        fan.append(total)
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

    def locate(self, h: bytes) -> BlobLocation | None:
        """Binary search within blob h's fan-out bucket."""
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

    def locate_many(self, hashes: Sequence[bytes]) -> list[BlobLocation | None]:
        """`locate` of each hash.  Many (a line manifest: one per line of a session) by bisecting a
        list of the index's keys read once, not a binary search in Python per hash (5 µs each:
        2.5 s for 500,000 lines)."""
        mm = self.mm
        if mm is None or len(hashes) * 16 < self.count:
            return [self.locate(h) for h in hashes]
        esize = IDX_ENTRY.size
        end = IDX_PREFIX_LEN + self.count * esize
        keys = [mm[off : off + 32] for off in range(IDX_PREFIX_LEN, end, esize)]
        out: list[BlobLocation | None] = []
        for h in hashes:
            at = bisect.bisect_left(keys, h)
            if at < len(keys) and keys[at] == h:
                _, off, raw_len, stored_len, codec, _ = IDX_ENTRY.unpack_from(mm, IDX_PREFIX_LEN + at * esize)
                out.append(BlobLocation(off, raw_len, stored_len, codec))
            else:
                out.append(None)
        return out

    def _entries(self) -> list[bytes]:
        """Every packed BlobIndexEntry, in hash order."""
        if self.mm is None:
            return []
        esize = IDX_ENTRY.size
        body = self.mm[IDX_PREFIX_LEN:]
        return [body[i : i + esize] for i in range(0, len(body), esize)]

    def _position(self, h: bytes) -> tuple[int, bool]:
        """Where h's entry is, or would go (its index in the run), and whether it is there."""
        mm = self.mm
        assert mm is not None
        b = h[0]
        lo = self.fan[b - 1] if b else 0
        hi = self.fan[b]
        esize = IDX_ENTRY.size
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

    def merged(self, new: dict[bytes, BlobLocation]) -> list[bytes]:
        """This index's entries with `new`'s put in their places (a new location replaces the
        one indexed for the same hash), as sorted runs for encode_index.  A few new entries
        (a +1 % fetch into a big store) are each found by binary search and the runs between
        them sliced from the mapping, not decoded: a copy of the index, not a Python object
        per entry.  Many (a first share) cost less merged with the decoded entries."""
        mm, esize = self.mm, IDX_ENTRY.size
        added = sorted(index_entry(h, loc) for h, loc in new.items())
        if mm is None or len(new) * max(self.count.bit_length(), 1) > self.count:
            return list(heapq.merge([e for e in self._entries() if e[:32] not in new], added))
        runs: list[bytes] = []
        done = 0
        with memoryview(mm) as view:  # released at once: the mapping is closed when replaced
            body = view[IDX_PREFIX_LEN:]
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
