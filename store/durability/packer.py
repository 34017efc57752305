"""The packer: new blobs are hashed and compressed before any lock is taken, or left raw.

A small append by a writer alone does not wait for zstd: its new blob goes into the WAL raw
and waits in memory (`Store._pending`, where reads find it) until the next checkpoint
compresses it into the pack (`pack_pending`), just before it syncs the pack.  Until then the
WAL copy is what makes it durable, and recovery compresses such copies as it restores them
(`repacked`).  Packing only at checkpoints also keeps the pack from growing between them, so
an append's fdatasync of the pre-zeroed WAL has no file size to commit.  Compressing on
another thread while the append waits loses on two loaded cores: the hand-off waits for a
core (docs/BENCHMARKS.md); here nobody waits.  Big batches (share imports) compress on the
prepare threads, and put_blob, which has no WAL record, always compresses first.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import zstandard

from store.codec import blob_hash, compressor, decode_stored
from store.errors import PayloadTooLarge, UnknownBlob
from store.files import headwal
from store.layout import (
    BLOB_HEADER,
    BLOB_OVERHEAD,
    CODEC_RAW,
    CODEC_ZSTD,
    blob_record,
    decode_blob_header,
    encode_blob,
)
from store.types import TurnBlobRef

if TYPE_CHECKING:
    from store.api import Store
    from store.files.blobindex import BlobIndex

PROBE = 64 << 10  # a payload larger than 2 * PROBE is first probed with its first PROBE bytes
ALONE = 8 << 20
"""prepare_many compresses a payload this big by itself, into a bytes of its own: out of the
batch's shared buffer it would be copied (a 200 MB image line held a third time), and it
keeps one of zstd's threads busy either way."""
PENDING_MAX = 8 << 20  # raw bytes of new blobs that may wait to be compressed into the pack


@dataclass(frozen=True, slots=True)
class Prepared:
    """A payload hashed and (unless already stored) compressed, before any lock is taken."""

    hash: bytes
    raw_len: int
    codec: int = CODEC_RAW
    stored: bytes | None = None
    deferred: bool = False
    """Raw for now: the WAL carries it and the packer compresses it later."""
    absent_from: BlobIndex | None = field(default=None, compare=False)
    """The pack's index when the payload was found not stored (BlobPack.locate_since)."""


def prepare(store: Store, payload: bytes | TurnBlobRef, defer: bool = False) -> Prepared:
    """Hash, and compress unless stored already or (defer) small enough to leave for the
    packer: raw in the WAL, compressed later (see the module docstring).  Only a writer
    alone defers: with others in flight its compression overlaps their sync anyway, and
    deferring would only pile work on the checkpointer and fill the WAL four times faster."""
    if isinstance(payload, TurnBlobRef):
        h = payload.payload_hash
        loc = store._pack.locate(h)
        if loc is not None:
            return Prepared(h, loc.raw_len)
        waiting = store._pending.get(h)
        if waiting is None:
            raise UnknownBlob(h)
        return Prepared(h, len(waiting))
    n = len(payload)
    if n > store.config.max_payload:
        raise PayloadTooLarge(n, store.config.max_payload)
    h = blob_hash(payload)
    if store._pack.has(h) or h in store._pending:
        return Prepared(h, n)
    if (defer and store.config.durable and n + BLOB_OVERHEAD <= headwal.EMBED_MAX
            and store._commit.writers <= 1 and store._pending_bytes < PENDING_MAX):
        return Prepared(h, n, CODEC_RAW, bytes(payload), deferred=True)
    return compress(store, h, bytes(payload))


def prepare_many(store: Store, items: Sequence[bytes | TurnBlobRef], threads: int) -> list[Prepared]:
    """prepare() of a big batch, its compression in one call on zstd's own `threads`
    (`multi_compress_to_buffer`): the GIL is released once per batch, not once per line, so
    the other Python threads of a busy process (an import's reader and writer) do not hold
    each line's compression back at every hand-back of the GIL."""
    cctx = compressor(store.config.zstd_level)
    index = store._pack.index  # before the lookups: a fold meanwhile makes the writer look again
    out: list[Prepared | None] = []
    todo: list[tuple[int, bytes]] = []  # (index in out, hash) of each payload compressed below
    raw: list[bytes | bytearray | memoryview] = []  # zstandard's stubs want this list type
    for item in items:
        if isinstance(item, TurnBlobRef):
            out.append(prepare(store, item))
            continue
        n = len(item)
        if n > store.config.max_payload:
            raise PayloadTooLarge(n, store.config.max_payload)
        h = blob_hash(item)
        if store._pack.has(h) or h in store._pending:
            out.append(Prepared(h, n))
        elif n >= ALONE:
            out.append(compress(store, h, bytes(item), absent_from=index))
        elif _incompressible(cctx, item):
            out.append(Prepared(h, n, CODEC_RAW, bytes(item), absent_from=index))
        else:
            todo.append((len(out), h))
            raw.append(bytes(item))
            out.append(None)
    if todo:
        packed = cctx.multi_compress_to_buffer(raw, threads=threads)
        for k, (i, h) in enumerate(todo):
            payload, frame = raw[k], packed[k]
            n = len(payload)
            out[i] = (Prepared(h, n, CODEC_ZSTD, frame.tobytes(), absent_from=index) if len(frame) < n
                      else Prepared(h, n, CODEC_RAW, bytes(payload), absent_from=index))  # not shrunk
    return cast(list[Prepared], out)  # every None was filled just above


def _incompressible(cctx: zstandard.ZstdCompressor, payload: bytes) -> bool:
    """A big payload whose first PROBE bytes zstd cannot shrink (an image): not compressed."""
    return len(payload) > 2 * PROBE and len(cctx.compress(payload[:PROBE])) >= PROBE * 0.97


def compress(store: Store, h: bytes, payload: bytes, absent_from: BlobIndex | None = None) -> Prepared:
    """zstd when it shrinks the payload, else raw; a 64 KiB probe rejects big incompressible
    payloads (images) without compressing all of them."""
    cctx = compressor(store.config.zstd_level)
    n = len(payload)
    if _incompressible(cctx, payload):
        return Prepared(h, n, CODEC_RAW, payload, absent_from=absent_from)
    packed = cctx.compress(payload)
    if len(packed) >= n:
        return Prepared(h, n, CODEC_RAW, payload, absent_from=absent_from)
    return Prepared(h, n, CODEC_ZSTD, packed, absent_from=absent_from)


def pack_pending(store: Store) -> None:
    """Caller holds the gate.  No sync: the WAL copies cover the blobs until the next
    checkpoint, which syncs the pack before it drops them."""
    for h in list(store._pending):
        with store._shards[h[0] & 63]:
            data = store._pending.get(h)
            if data is None:  # another packer was first
                continue
            p = compress(store, h, data)
            assert p.stored is not None
            store._pack.append(blob_record(h, p.codec, p.raw_len, p.stored))
            with store._pending_lock:
                del store._pending[h]
                store._pending_bytes -= p.raw_len


def wait_pending(store: Store, rec: bytes) -> None:
    """Keep a blob's WAL copy in memory, raw, as an append leaves one (reads find it; the next
    checkpoint packs it): recovery's restore when the pack has no room for it."""
    hdr = decode_blob_header(rec)
    assert hdr is not None  # recovery restores only copies that passed their CRC
    data = decode_stored(hdr.codec, rec[BLOB_HEADER.size : BLOB_HEADER.size + hdr.stored_len], hdr.raw_len)
    with store._pending_lock:
        store._pending[hdr.hash] = data
        store._pending_bytes += hdr.raw_len


def repacked(store: Store, rec: bytes) -> bytes:
    """A blob's WAL copy as the pack should hold it: compressed, if an append left it raw."""
    hdr = decode_blob_header(rec)
    if hdr is None or hdr.codec != CODEC_RAW:
        return rec
    p = compress(store, hdr.hash, rec[BLOB_HEADER.size : BLOB_HEADER.size + hdr.stored_len])
    assert p.stored is not None
    return rec if p.codec == CODEC_RAW else encode_blob(hdr.hash, p.codec, p.raw_len, p.stored)
