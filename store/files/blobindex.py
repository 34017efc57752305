"""`blobs.idx`: the rebuildable index of blobs.pack, one sorted run of BlobIndexEntry with a
256-way fan-out table, read through mmap with a binary search, so opening costs nothing per
blob.  No I/O of its own: the pack maps it, checks it against the pack and writes it.
"""
from __future__ import annotations

import mmap
import zlib
from collections.abc import Callable
from dataclasses import dataclass

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


def index_entry(h: bytes, loc: BlobLocation) -> bytes:
    return IDX_ENTRY.pack(h, loc.offset, loc.raw_len, loc.stored_len, loc.codec, 0)


def encode_index(entries: list[bytes], covered_len: int, last: tuple[int, bytes] | None) -> bytes:
    """entries: sorted packed BlobIndexEntry bytes; last: (offset, hash) of the last covered record."""
    fan = [0] * 256
    for e in entries:
        fan[e[0]] += 1
    total = 0
    for i in range(256):
        total += fan[i]
        fan[i] = total
    body = b"".join(entries)
    last_off, last_hash = last if last else (0, ZERO_HASH)
    head = IDX_HEADER.pack(
        IDX_MAGIC, IDX_VERSION, 0, len(entries), covered_len, last_off, last_hash, zlib.crc32(body)
    ) + IDX_FANOUT.pack(*fan)
    return head + IDX_HEADER_CRC.pack(zlib.crc32(head)) + body


@dataclass(frozen=True)
class BlobIndex:
    """One mapped blobs.idx.  Replaced whole, never changed, so a lookup that took it keeps a
    consistent view while a newer index is swapped in."""

    mm: mmap.mmap | None = None
    fan: tuple[int, ...] = (0,) * 256
    count: int = 0

    def locate(self, h: bytes) -> BlobLocation | None:
        """Binary search within blob h's fan-out bucket."""
        mm = self.mm
        if mm is None or len(h) != 32:
            return None
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
                _, pack_off, raw_len, stored_len, codec, _ = IDX_ENTRY.unpack_from(mm, off)
                return BlobLocation(pack_off, raw_len, stored_len, codec)
        return None

    def entries(self) -> list[bytes]:
        """Every packed BlobIndexEntry, in hash order."""
        mm = self.mm
        if mm is None:
            return []
        esize = IDX_ENTRY.size
        body = mm[IDX_PREFIX_LEN:]
        return [body[i : i + esize] for i in range(0, len(body), esize)]


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
