"""Context heads: the `heads.tbl` snapshot and the head WAL (`heads.wal.<generation>`).

Every head change is one WAL record; a new turn's record carries the whole TurnRecordV1 and,
when the turn brought a new blob of at most EMBED_MAX bytes, a copy of its BlobRecord.  So a
commit fdatasyncs the WAL alone (the pack only for big blobs); turns.log and blobs.pack are
synced at checkpoints and repaired from the WAL on open.  A checkpoint writes a snapshot
of every head (generation G+1 = "replay WAL G+1 onward") by temp file + rename, keeps the
previous snapshot as `heads.tbl.prev` and its WAL, and deletes older WAL files.  If the newest
snapshot is damaged, the previous one plus the WAL since then rebuilds the same table.
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .commit import zero_extend
from .durability import flush_data, write_at
from .errors import CorruptRecord
from .fileio import atomic_write, fsync_dir, open_private
from .records import (
    WAL_DELETE,
    Snapshot,
    WalRecord,
    decode_snapshot,
    encode_snapshot,
    scan_wal,
)
from .types import RecoveryNotes, Turn

SNAPSHOT = "heads.tbl"
PREVIOUS = "heads.tbl.prev"
WAL_BYTES = 1 << 20  # one pre-zeroed WAL generation; a full WAL triggers a checkpoint
EMBED_MAX = 64 << 10  # blob records up to this size travel in the WAL record
NEXT = "heads.wal-next"  # the next generation, zero-filled ahead of time
_WAL_RE = re.compile(r"^heads\.wal\.(\d{8})$")


def wal_name(gen: int) -> str:
    return f"heads.wal.{gen:08d}"


def wal_generations(root: Path) -> list[int]:
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _WAL_RE.match(p.name)))


def prepare_next(root: Path) -> int:
    """Zero-fill and sync the next WAL generation under a temporary name, off the append path
    (see HeadWal); returns its file descriptor.  A leftover from a crash is never read."""
    fd = open_private(root / NEXT, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        zero_extend(fd, 0, WAL_BYTES)
        flush_data(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclass
class WalScan:
    records: list[WalRecord] = field(default_factory=list)
    end: int = 0
    """Where valid records stop: the next record goes here."""


def read_wal(path: Path, problems: RecoveryNotes) -> WalScan:
    """Valid records in order.  A damaged region with valid records after it is reported and
    skipped; anything but zeros after the last valid record is a torn tail."""
    data = path.read_bytes()
    records, damaged, end = scan_wal(data, path.name)
    for off in damaged:
        problems.add(f"{path.name} at offset {off}: damaged head WAL record skipped", damage=True)
    if data[end:].count(b"\0") != len(data) - end:
        problems.append(f"{path.name}: torn record at offset {end} dropped")
    return WalScan([r for _, r in records], end)


@dataclass
class LoadedHeads:
    snapshot: Snapshot
    replay: list[WalRecord]
    """WAL records newer than the snapshot, oldest first."""
    older_turns: list[WalRecord]
    """Records of the retained older WAL: used only to repair turns.log."""
    damaged: bool
    """Something was rebuilt or skipped: the engine checkpoints right after recovery."""
    fresh: bool
    """A new store: no snapshot and no WAL yet."""


def load(root: Path, problems: RecoveryNotes, need_older: Callable[[Snapshot], bool]) -> LoadedHeads:
    """The newest valid snapshot and the WAL records to replay on it; the older WAL's records
    too when need_older(snapshot) says turns.log is damaged behind the checkpoint."""
    snaps: list[tuple[Snapshot, str]] = []
    damaged = False
    for name in (SNAPSHOT, SNAPSHOT + ".tmp", PREVIOUS):
        path = root / name
        if not path.exists():
            continue
        try:
            snaps.append((decode_snapshot(path.read_bytes(), name), name))
        except CorruptRecord as exc:
            if name != SNAPSHOT + ".tmp":  # a half-written temp file is expected after a crash
                problems.add(f"{exc}: heads rebuilt from the previous snapshot and the head WAL", damage=True)
                damaged = True
    gens = wal_generations(root)
    if snaps:
        snap, name = max(snaps, key=lambda s: s[0].generation)
        damaged = damaged or name != SNAPSHOT
    else:
        if gens and gens[0] != 1:
            problems.add(f"no head snapshot, no WAL before generation {gens[0]}: heads lost", damage=True)
        elif gens:
            problems.add("no head snapshot: heads rebuilt from the head WAL", damage=True)
        damaged = damaged or bool(gens)
        snap = Snapshot(gens[0] if gens else 1, 1, 0, 0, [])
    replay: list[WalRecord] = []
    older: list[WalRecord] = []
    for gen in gens:
        if gen >= snap.generation:
            replay.extend(read_wal(root / wal_name(gen), problems).records)
        elif gen == snap.generation - 1 and need_older(snap):
            older.extend(read_wal(root / wal_name(gen), problems).records)
    return LoadedHeads(snap, replay, older, damaged, fresh=not snaps and not gens)


class HeadWal:
    """The WAL generation being written: records back to back in a pre-zeroed file.

    prepared: the fd of a prepare_next() file, renamed to this generation's name (unless
    that exists).  The rename is made durable by the first commit's sync (name_durable)."""

    def __init__(self, root: Path, gen: int, durable: bool, prepared: int | None = None) -> None:
        self.gen = gen
        self.path = root / wal_name(gen)
        self.name_durable = True
        self.reach = 0
        """How far writes may have reached: pos, or beyond it after a failed write."""
        if prepared is not None and not self.path.exists():
            os.rename(root / NEXT, self.path)
            self._fd, self.pos, self.name_durable = prepared, 0, False
            return
        if prepared is not None:
            os.close(prepared)
        self._fd = open_private(self.path, os.O_RDWR | os.O_CREAT)
        try:
            self.pos = read_wal(self.path, RecoveryNotes()).end
            size = os.fstat(self._fd).st_size
            if durable and size < WAL_BYTES:
                zero_extend(self._fd, size, WAL_BYTES)
        except BaseException:
            os.close(self._fd)
            raise

    def has_room(self, n: int) -> bool:
        """A record of n bytes fits (an empty WAL takes any record; it grows past WAL_BYTES)."""
        return self.pos == 0 or self.pos + n <= WAL_BYTES

    def append(self, rec: bytes) -> None:
        self.reach = max(self.reach, self.pos + len(rec))  # a failed write may have written part
        write_at(self._fd, rec, self.pos)
        self.pos += len(rec)

    def sync(self) -> None:
        flush_data(self._fd)

    def erase_from(self, pos: int) -> None:
        """Zero the records from pos on, as far as any write reached, and flush (the rollback
        of a failed store's unflushed records: replay stops at the first zero)."""
        zero_extend(self._fd, pos, self.reach)
        flush_data(self._fd)
        self.pos = self.reach = pos

    def close(self, trim: bool = True) -> None:
        if trim and self.pos == 0:  # an empty generation gives its zeros back; opening zero-fills it again
            os.ftruncate(self._fd, 0)
        os.close(self._fd)


def write_snapshot(root: Path, snap: Snapshot, durable: bool) -> None:
    """Make snap the newest snapshot; the one it replaces becomes heads.tbl.prev; WAL files
    older than both snapshots' are deleted."""
    tmp = root / (SNAPSHOT + ".tmp")
    atomic_write(tmp, encode_snapshot(snap), durable=durable)
    current = root / SNAPSHOT
    prev_gen = snap.generation
    if current.exists():
        try:
            prev_gen = decode_snapshot(current.read_bytes(), SNAPSHOT).generation
            os.replace(current, root / PREVIOUS)
        except CorruptRecord:
            pass  # keep the older heads.tbl.prev: it is the one that can still rebuild
    os.replace(tmp, current)
    if durable:
        fsync_dir(root)
    for gen in wal_generations(root):  # keep the WAL behind each snapshot: it can repair turns.log
        if gen < min(prev_gen, snap.generation - 1):
            (root / wal_name(gen)).unlink()


@dataclass
class Replayed:
    """The head table and turn log end that recovery arrives at (computed without writing)."""

    logged: dict[int, tuple[int, int, int, int]]
    """context_id -> (head_turn_id, head_depth, flags, created_at_unix_ms)"""
    next_context_id: int
    end: int
    """The last TurnID that stays; later records in turns.log were never acknowledged."""
    writes: list[Turn]
    """Turn records that turns.log lost and the WAL still holds: recovery rewrites them."""
    blobs: dict[bytes, bytes]
    """BlobRecords that blobs.pack lost and the WAL holds copies of: recovery appends them."""
    replayed: int
    notes: RecoveryNotes
    complete: bool = True
    """Every WAL record was replayed (no record ended the replay early)."""


def replay(loaded: LoadedHeads, log_count: int, slot_ok: Callable[[Turn], bool],
           readable: Callable[[int], bool], has_blob: Callable[[bytes], bool]) -> Replayed:
    snap = loaded.snapshot
    r = Replayed({e[0]: e[1:] for e in snap.heads}, snap.next_context_id, snap.checkpoint_turn_id,
                 [], {}, 0, RecoveryNotes())
    for rec in loaded.older_turns:  # repairs a turns.log damaged behind the last checkpoint
        t = rec.turn
        if t is not None and t.turn_id <= r.end and not slot_ok(t):
            r.writes.append(t)
    if r.writes:
        r.notes.add(f"turns.log: {len(r.writes)} turn records rewritten from the older head WAL", damage=True)
    count = max([log_count, *(t.turn_id for t in r.writes)])
    if count < r.end:
        r.notes.add(f"turns.log ends at turn {count} but turns up to {r.end} were checkpointed", damage=True)
        r.end = count
    for rec in loaded.replay:
        t = rec.turn
        if t is not None:
            if t.turn_id > r.end + 1 and not all(readable(i) for i in range(r.end + 1, t.turn_id)):
                r.notes.add(f"head WAL: turns {r.end + 1}..{t.turn_id - 1} missing: stop", damage=True)
                r.complete = False
                break
            h = t.payload_hash
            if not has_blob(h) and h not in r.blobs:
                if not rec.blob_record:
                    r.notes.add(f"head WAL: turn {t.turn_id} has no blob (never acknowledged): stop")
                    r.complete = False
                    break
                r.blobs[h] = rec.blob_record
            if t.turn_id > log_count or not slot_ok(t):
                r.writes.append(t)
            r.end = max(r.end, t.turn_id)
        elif rec.head_turn_id > r.end:
            r.notes.add(f"head WAL: context {rec.context_id} names turn {rec.head_turn_id} beyond the log",
                        damage=True)
            r.complete = False
            break
        if rec.kind == WAL_DELETE:
            r.logged.pop(rec.context_id, None)
        else:
            r.logged[rec.context_id] = (rec.head_turn_id, rec.head_depth, rec.ctx_flags, rec.ctx_created_ms)
        r.next_context_id = max(r.next_context_id, rec.context_id + 1)
        r.replayed += 1
    if r.blobs:
        r.notes.add(f"blobs.pack: {len(r.blobs)} blobs restored from their copies in the head WAL")
    return r
