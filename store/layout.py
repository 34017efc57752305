"""Every on-disk byte layout of the store, in one place.  Sans-IO: bytes in, records out.

All integers are little-endian.  Each record ends in a CRC32 (zlib) over every byte before
it, so a torn or flipped record is recognised.  docs/FORMAT.md describes each layout and
carries test vectors that tests/store/test_api.py checks against this module.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from store.errors import CorruptRecord
from store.types import Patch, Turn

HASH_LEN = 32
ZERO_HASH = bytes(HASH_LEN)

# --- blobs.pack: BlobRecord ------------------------------------------------------------------
BLOB_MAGIC = 0x42534C42  # bytes "BLSB" on disk
BLOB_MAGIC_BYTES = struct.pack("<I", BLOB_MAGIC)
BLOB_VERSION = 1
CODEC_RAW = 0
CODEC_ZSTD = 1
BLOB_HEADER = struct.Struct("<IHHII32s")  # magic, version, codec, raw_len, stored_len, hash
BLOB_CRC = struct.Struct("<I")
BLOB_OVERHEAD = BLOB_HEADER.size + BLOB_CRC.size  # 52 bytes around the stored bytes


@dataclass(frozen=True, slots=True)
class BlobHeader:
    codec: int
    raw_len: int
    stored_len: int
    hash: bytes

    @property
    def record_len(self) -> int:
        return BLOB_OVERHEAD + self.stored_len


def blob_record(blob_hash: bytes, codec: int, raw_len: int, stored: bytes) -> tuple[bytes, bytes, bytes]:
    """A BlobRecord as its header, stored bytes and CRC: written as they are (BlobPack.append),
    a 200 MB record is not copied into one bytes beside its payload."""
    head = BLOB_HEADER.pack(BLOB_MAGIC, BLOB_VERSION, codec, raw_len, len(stored), blob_hash)
    crc = zlib.crc32(stored, zlib.crc32(head))
    return head, stored, BLOB_CRC.pack(crc)


def encode_blob(blob_hash: bytes, codec: int, raw_len: int, stored: bytes) -> bytes:
    return b"".join(blob_record(blob_hash, codec, raw_len, stored))


def decode_blob_header(buf: bytes | memoryview, offset: int = 0) -> BlobHeader | None:
    """The header at buf[offset:], or None when it is not a plausible BlobRecord header."""
    if len(buf) - offset < BLOB_HEADER.size:
        return None
    magic, version, codec, raw_len, stored_len, h = BLOB_HEADER.unpack_from(buf, offset)
    if magic != BLOB_MAGIC or version != BLOB_VERSION or codec not in (CODEC_RAW, CODEC_ZSTD):
        return None
    if codec == CODEC_RAW and raw_len != stored_len:
        return None
    return BlobHeader(codec, raw_len, stored_len, h)


def blob_record_ok(record: bytes | memoryview) -> bool:
    """True when a whole record (header, bytes, CRC) checks out."""
    if len(record) < BLOB_OVERHEAD:
        return False
    (crc,) = BLOB_CRC.unpack_from(record, len(record) - BLOB_CRC.size)
    return zlib.crc32(record[: len(record) - BLOB_CRC.size]) == crc


# --- blobs.idx ---------------------------------------------------------------------------------
IDX_MAGIC = 0x58444942  # "BIDX"
IDX_VERSION = 1
# magic, version, reserved, count, covered_len, last_offset, last_hash, entries_crc
IDX_HEADER = struct.Struct("<IHHQQQ32sI")
IDX_FANOUT = struct.Struct("<256I")
IDX_HEADER_CRC = struct.Struct("<I")  # over header + fan-out
IDX_PREFIX_LEN = IDX_HEADER.size + IDX_FANOUT.size + IDX_HEADER_CRC.size
# BlobIndexEntry: hash, pack_offset, raw_len, stored_len, codec, reserved
IDX_ENTRY = struct.Struct("<32sQIIHH")


@dataclass(frozen=True, slots=True)
class BlobLocation:
    offset: int
    raw_len: int
    stored_len: int
    codec: int


# --- turns.log: TurnRecordV1 -------------------------------------------------------------------
# turn_id, parent_turn_id, depth, codec, type_tag, payload_hash, flags, created_at_unix_ms, crc32
TURN = struct.Struct("<QQIIQ32sIQI")
TURN_SIZE = TURN.size  # 80
TURN_BODY = TURN_SIZE - 4


def encode_turn(t: Turn) -> bytes:
    body = TURN.pack(
        t.turn_id, t.parent_turn_id, t.depth, t.codec, t.type_tag, t.payload_hash, t.flags,
        t.created_at_unix_ms, 0,
    )[:TURN_BODY]
    return body + struct.pack("<I", zlib.crc32(body))


def decode_turn(buf: bytes, file: str = "turns.log", offset: int = 0) -> Turn:
    """Decode one record; CorruptRecord when its CRC fails."""
    rec = buf[offset : offset + TURN_SIZE]
    if len(rec) != TURN_SIZE:
        raise CorruptRecord(file, offset, f"short turn record ({len(rec)} of {TURN_SIZE} bytes)")
    tid, parent, depth, codec, type_tag, h, flags, created, crc = TURN.unpack(rec)
    if zlib.crc32(rec[:TURN_BODY]) != crc:
        raise CorruptRecord(file, offset, "turn record CRC mismatch")
    return Turn(tid, parent, depth, type_tag, codec, h, flags, created)


# --- turns.skip: one depth jump pointer per turn -------------------------------------------------
SKIP = struct.Struct("<QI")  # jump target turn id, crc32 over (own turn id, target) as two u64


def skip_crc(turn_id: int, target: int) -> int:
    return zlib.crc32(struct.pack("<QQ", turn_id, target))


# --- heads.wal.<gen>: head WAL records -----------------------------------------------------------
WAL_MAGIC = 0x4C415748  # "HWAL"
WAL_MAGIC_BYTES = struct.pack("<I", WAL_MAGIC)
WAL_HEAD = 1  # a context created, forked or moved without a new turn
WAL_TURN = 2  # a new turn (embedded TurnRecordV1) and the context head that now points at it
WAL_DELETE = 3  # a context deleted
# magic, kind, reserved, context_id, head_turn_id, head_depth, ctx_flags, ctx_created_ms,
# turn record (80 bytes, zero unless kind == WAL_TURN), blob_len, crc32; then blob_len bytes:
# a copy of the turn's new BlobRecord, so that one fdatasync of the WAL makes the turn durable
WAL = struct.Struct("<IHHQQIIQ80sII")
WAL_SIZE = WAL.size  # 128: the fixed part


@dataclass(frozen=True, slots=True)
class WalRecord:
    kind: int
    context_id: int
    head_turn_id: int
    head_depth: int
    ctx_flags: int
    ctx_created_ms: int
    turn: Turn | None
    blob_record: bytes = b""
    """A whole BlobRecord (as in blobs.pack) that the pack may not have durably yet, or b''."""
    damaged_copy: int = 0
    """Length of a blob copy that failed its own CRC (then blob_record is b''): the record's
    fixed part, with its own CRC, still holds the turn and the head."""

    @property
    def size(self) -> int:
        return WAL_SIZE + len(self.blob_record) + self.damaged_copy


def encode_wal(r: WalRecord) -> bytes:
    turn = encode_turn(r.turn) if r.turn is not None else NO_TURN_RECORD
    return encode_wal_fields(r.kind, r.context_id, r.head_turn_id, r.head_depth, r.ctx_flags,
                             r.ctx_created_ms, turn, r.blob_record)


NO_TURN_RECORD = bytes(TURN_SIZE)


def encode_wal_fields(kind: int, context_id: int, head_turn_id: int, head_depth: int, ctx_flags: int,
                      ctx_created_ms: int, turn_record: bytes, blob_record: bytes) -> bytes:
    """encode_wal of a WalRecord's fields, its turn already encoded (encode_turn): the store's
    batch writer encodes each turn once for the WAL and turns.log, and makes no WalRecord."""
    body = WAL.pack(
        WAL_MAGIC, kind, 0, context_id, head_turn_id, head_depth, ctx_flags, ctx_created_ms,
        turn_record, len(blob_record), 0,
    )[:-4]
    return body + struct.pack("<I", zlib.crc32(body)) + blob_record


def decode_wal(buf: bytes, offset: int, file: str) -> WalRecord:
    """The record at offset: its fixed part must pass its CRC; a blob copy that fails its own
    (whole in the buffer) is reported in damaged_copy, a cut-short copy is CorruptRecord."""
    rec = buf[offset : offset + WAL_SIZE]
    if len(rec) != WAL_SIZE:
        raise CorruptRecord(file, offset, "short head WAL record")
    magic, kind, _, ctx, head, depth, flags, created, turn, blob_len, crc = WAL.unpack(rec)
    if magic != WAL_MAGIC or zlib.crc32(rec[:-4]) != crc or kind not in (WAL_HEAD, WAL_TURN, WAL_DELETE):
        raise CorruptRecord(file, offset, "head WAL record CRC mismatch")
    t = decode_turn(turn, file, 0) if kind == WAL_TURN else None
    blob = bytes(buf[offset + WAL_SIZE : offset + WAL_SIZE + blob_len])
    if len(blob) != blob_len:
        raise CorruptRecord(file, offset, "blob copy in head WAL record is cut short")
    if blob_len and (decode_blob_header(blob) is None or not blob_record_ok(blob)):
        if t is None:
            raise CorruptRecord(file, offset, "blob copy in a head WAL record without a turn")
        return WalRecord(kind, ctx, head, depth, flags, created, t, b"", blob_len)
    return WalRecord(kind, ctx, head, depth, flags, created, t, blob)


def _torn(buf: bytes, offset: int, r: WalRecord) -> bool:
    """A record whose blob copy ends in zeros where its CRC belongs: a write the crash cut off
    (the WAL is pre-zeroed), not a record damaged after it was written."""
    end = offset + r.size
    return r.damaged_copy > 0 and buf[end - BLOB_CRC.size : end] == bytes(BLOB_CRC.size)


def scan_wal(buf: bytes, file: str) -> tuple[list[tuple[int, WalRecord]], list[int], int]:
    """(offset, record) of every valid record, offsets of damaged regions that valid records
    follow, and where valid data ends.  Records are back to back from offset 0; zeros end them.
    A last record whose blob copy was cut off by the crash (zeros where its CRC belongs) is a
    torn tail, not a valid record; any other damaged copy keeps its record (damaged_copy)."""
    records: list[tuple[int, WalRecord]] = []
    damaged: list[int] = []
    pos = 0
    while pos + WAL_SIZE <= len(buf):
        try:
            rec = decode_wal(buf, pos, file)
        except CorruptRecord:
            nxt = _next_wal(buf, pos + 1, file)
            if nxt is None:
                break
            damaged.append(pos)
            pos = nxt
            continue
        if _torn(buf, pos, rec) and _next_wal(buf, pos + rec.size, file) is None:
            break
        records.append((pos, rec))
        pos += rec.size
    return records, damaged, pos


def _next_wal(buf: bytes, pos: int, file: str) -> int | None:
    while (pos := buf.find(WAL_MAGIC_BYTES, pos)) >= 0:
        try:
            decode_wal(buf, pos, file)
            return pos
        except CorruptRecord:
            pos += 1
    return None


# --- heads.tbl: head snapshot --------------------------------------------------------------------
SNAP_MAGIC = 0x44414548  # "HEAD"
SNAP_VERSION = 2
# magic, version, reserved, generation, next_context_id, checkpoint_turn_id, patch_seq, count,
# crc32 of the entries
SNAP_HEADER = struct.Struct("<IHHQQQQQI")
SNAP_HEADER_CRC = struct.Struct("<I")
# context_id, head_turn_id, head_depth, flags, created_at_unix_ms
SNAP_ENTRY = struct.Struct("<QQIIQ")


@dataclass(frozen=True, slots=True)
class Snapshot:
    generation: int
    next_context_id: int
    checkpoint_turn_id: int
    patch_seq: int
    """The newest patch seq at the checkpoint: patches.log must reach it (a cut at a record
    boundary is otherwise invisible)."""
    heads: list[tuple[int, int, int, int, int]]


def encode_snapshot(s: Snapshot) -> bytes:
    entries = b"".join(SNAP_ENTRY.pack(*e) for e in s.heads)
    head = SNAP_HEADER.pack(
        SNAP_MAGIC, SNAP_VERSION, 0, s.generation, s.next_context_id, s.checkpoint_turn_id,
        s.patch_seq, len(s.heads), zlib.crc32(entries),
    )
    return head + SNAP_HEADER_CRC.pack(zlib.crc32(head)) + entries


def decode_snapshot(buf: bytes, file: str) -> Snapshot:
    n = SNAP_HEADER.size
    if len(buf) < n + 4:
        raise CorruptRecord(file, 0, "short head snapshot")
    magic, version, _, gen, next_ctx, ckpt, pseq, count, ecrc = SNAP_HEADER.unpack_from(buf)
    (hcrc,) = SNAP_HEADER_CRC.unpack_from(buf, n)
    if magic != SNAP_MAGIC or version != SNAP_VERSION or zlib.crc32(buf[:n]) != hcrc:
        raise CorruptRecord(file, 0, "bad head snapshot header")
    entries = buf[n + 4 :]
    if len(entries) != count * SNAP_ENTRY.size or zlib.crc32(entries) != ecrc:
        raise CorruptRecord(file, n + 4, "head snapshot entries do not match their CRC")
    heads = [SNAP_ENTRY.unpack_from(entries, i * SNAP_ENTRY.size) for i in range(count)]
    return Snapshot(gen, next_ctx, ckpt, pseq, heads)


# --- patches.log -----------------------------------------------------------------------------
PATCH_MAGIC = 0x48435450  # "PTCH"
PATCH_REPLACE = 1
PATCH_TOMBSTONE = 2
# magic, flags, seq, target_turn_id, new_payload_hash, created_at_unix_ms, crc32
PATCH = struct.Struct("<IIQQ32sQI")
PATCH_SIZE = PATCH.size  # 68


def encode_patch(p: Patch, created_ms: int) -> bytes:
    body = PATCH.pack(PATCH_MAGIC, p.flags, p.seq, p.target_turn_id, p.new_payload_hash, created_ms, 0)[:-4]
    return body + struct.pack("<I", zlib.crc32(body))


def decode_patch(buf: bytes, offset: int, file: str = "patches.log") -> Patch:
    rec = buf[offset : offset + PATCH_SIZE]
    if len(rec) != PATCH_SIZE:
        raise CorruptRecord(file, offset, "short patch record")
    magic, flags, seq, target, h, _, crc = PATCH.unpack(rec)
    if magic != PATCH_MAGIC or zlib.crc32(rec[:-4]) != crc or flags not in (PATCH_REPLACE, PATCH_TOMBSTONE):
        raise CorruptRecord(file, offset, "patch record CRC mismatch")
    return Patch(target, h, flags, seq)
