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

from store.durability.commit import zero_extend
from store.errors import CorruptRecord
from store.layout import (
    WAL_DELETE,
    Snapshot,
    WalRecord,
    decode_snapshot,
    encode_snapshot,
    scan_wal,
)
from store.types import RecoveryNotes, Turn
from sysio.files import atomic_write, fsync_dir, open_private
from sysio.flush import flush_data, write_at

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
    damaged: bool = False
    """A damaged region with valid records after it was skipped."""


def read_wal(path: Path, problems: RecoveryNotes) -> WalScan:
    """Valid records in order.  A damaged region with valid records after it is reported and
    skipped; anything but zeros after the last valid record is a torn tail."""
    data = path.read_bytes()
    records, damaged, end = scan_wal(data, path.name)
    for off in damaged:
        problems.add(f"{path.name} at offset {off}: damaged head WAL record skipped", damage=True)
    for off, r in records:
        if r.damaged_copy and r.turn is not None:
            tid = r.turn.turn_id
            problems.add(f"{path.name} at offset {off}: the blob copy of turn {tid} failed its CRC",
                         damage=True)
    if data[end:].count(b"\0") != len(data) - end:
        problems.append(f"{path.name}: torn record at offset {end} dropped")
    return WalScan([r for _, r in records], end, bool(damaged))


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
    wal_damaged: bool = False
    """A WAL generation being replayed had a damaged region: it may have lost records."""


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
    wal_damaged = False
    for gen in gens:
        if gen >= snap.generation:
            scan = read_wal(root / wal_name(gen), problems)
            replay.extend(scan.records)
            wal_damaged = wal_damaged or scan.damaged
        elif gen == snap.generation - 1 and need_older(snap):
            older.extend(read_wal(root / wal_name(gen), problems).records)
    return LoadedHeads(snap, replay, older, damaged, fresh=not snaps and not gens, wal_damaged=wal_damaged)


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
    """The highest TurnID that the snapshot, a WAL record or a head names: no id up to here
    is handed out again, whatever was lost."""
    writes: list[Turn]
    """Turn records that turns.log lost and the WAL still holds: recovery rewrites them."""
    blobs: dict[bytes, bytes]
    """BlobRecords that blobs.pack lost (or holds damaged) and the WAL holds copies of:
    recovery appends them."""
    replayed: int
    notes: RecoveryNotes
    damaged: dict[bytes, tuple[int, str]] = field(default_factory=dict)
    """Blobs of replayed turns that are damaged or lost: hash -> (first turn, what is wrong).
    Their turns are kept; reading their payload is DamagedPayload."""
    unacknowledged: list[int] = field(default_factory=list)
    """Turns of the WAL's last records whose blobs never reached the pack: their heads are not
    moved (their ids stay taken)."""


def replay(loaded: LoadedHeads, log_count: int, slot_ok: Callable[[Turn], bool],
           readable: Callable[[int], bool], has_blob: Callable[[bytes], bool],
           damaged_blob: Callable[[bytes], str | None]) -> Replayed:
    """Apply the WAL records to the snapshot.  A record with a valid CRC is never dropped
    because of what it references, with one exception: the last records of the WAL whose blobs
    are nowhere (no pack record, not even a damaged one, no copy) were never acknowledged
    (the pack is synced before the WAL for such blobs; a crash between the two leaves exactly
    this).  The same record followed by any other record was acknowledged: its blob is lost
    (damage), its turn and head are kept."""
    snap = loaded.snapshot
    r = Replayed({e[0]: e[1:] for e in snap.heads}, snap.next_context_id, snap.checkpoint_turn_id,
                 [], {}, 0, RecoveryNotes())
    checkpointed = r.end
    for rec in loaded.older_turns:  # repairs a turns.log damaged behind the last checkpoint
        t = rec.turn
        if t is not None and t.turn_id <= r.end and not slot_ok(t):
            r.writes.append(t)
    if r.writes:
        r.notes.add(f"turns.log: {len(r.writes)} turn records rewritten from the older head WAL", damage=True)
    count = max([log_count, *(t.turn_id for t in r.writes)])
    if count < checkpointed:
        r.notes.add(f"turns.log ends at turn {count} but turns up to {checkpointed} were checkpointed: "
                    f"turns {count + 1}..{checkpointed} are lost (their ids are not handed out again)",
                    damage=True)
    r.end = max([r.end, *(head for head, _, _, _ in r.logged.values())])
    held: list[WalRecord] = []
    for rec in loaded.replay:
        if rec.turn is not None and not _blob_found(r, rec, has_blob, damaged_blob):
            held.append(rec)  # acknowledged or not: decided by whether any record follows
            continue
        for h in held:
            assert h.turn is not None
            _damage(r, h.turn, "lost: neither blobs.pack nor the head WAL holds it")
            _apply(r, h, log_count, slot_ok, readable)
        held = []
        _apply(r, rec, log_count, slot_ok, readable)
    for rec in held:
        t = rec.turn
        assert t is not None
        r.unacknowledged.append(t.turn_id)
        if t.turn_id > log_count or not slot_ok(t):
            r.writes.append(t)  # kept as a turn without a head: its id is never handed out again
        r.end = max(r.end, t.turn_id)
    if r.unacknowledged:
        first, last = r.unacknowledged[0], r.unacknowledged[-1]
        r.notes.append(f"head WAL: turns {first}..{last} at its end name blobs that never reached the pack: "
                       "never acknowledged, their heads not moved (the turns stay, without payload)")
    if r.blobs:
        r.notes.add(f"blobs.pack: {len(r.blobs)} blobs restored from their copies in the head WAL")
    return r


def _blob_found(r: Replayed, rec: WalRecord, has_blob: Callable[[bytes], bool],
                damaged_blob: Callable[[bytes], str | None]) -> bool:
    """Whether the turn's blob is accounted for: in the pack, restorable from this record's
    copy, or known damaged (then recorded as such)."""
    t = rec.turn
    assert t is not None
    h = t.payload_hash
    if h in r.blobs or h in r.damaged or has_blob(h):
        return True
    bad = damaged_blob(h)
    if rec.blob_record:
        r.blobs[h] = rec.blob_record
        if bad is not None:
            r.notes.add(f"blob {h.hex()} ({bad}) restored from its copy in the head WAL", damage=True)
        return True
    if bad is None and rec.damaged_copy:
        bad = "its only copy, in the head WAL, failed its CRC"
    if bad is None:
        return False
    _damage(r, t, bad)
    return True


def _damage(r: Replayed, t: Turn, reason: str) -> None:
    r.damaged.setdefault(t.payload_hash, (t.turn_id, reason))
    r.notes.add(f"turn {t.turn_id}: payload blob {t.payload_hash.hex()} is damaged ({reason}); "
                "the turn is kept, its payload cannot be read", damage=True)


def _apply(r: Replayed, rec: WalRecord, log_count: int, slot_ok: Callable[[Turn], bool],
           readable: Callable[[int], bool]) -> None:
    t = rec.turn
    if t is not None:
        if t.turn_id > r.end + 1 and not all(readable(i) for i in range(r.end + 1, t.turn_id)):
            r.notes.add(f"turns {r.end + 1}..{t.turn_id - 1}: records damaged or missing in turns.log "
                        "and the head WAL (their ids are not handed out again)", damage=True)
        if t.turn_id > log_count or not slot_ok(t):
            r.writes.append(t)
        r.end = max(r.end, t.turn_id)
    elif rec.head_turn_id > r.end and not readable(rec.head_turn_id):
        r.notes.add(f"head WAL: context {rec.context_id} names turn {rec.head_turn_id}, which neither "
                    "turns.log nor the head WAL holds", damage=True)
    r.end = max(r.end, rec.head_turn_id)
    if rec.kind == WAL_DELETE:
        r.logged.pop(rec.context_id, None)
    else:
        r.logged[rec.context_id] = (rec.head_turn_id, rec.head_depth, rec.ctx_flags, rec.ctx_created_ms)
    r.next_context_id = max(r.next_context_id, rec.context_id + 1)
    r.replayed += 1
