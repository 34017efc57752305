"""Open-time replay and repair: the head WAL since the last checkpoint, replayed onto
turns.log and the pack, and what was found damaged kept in damage.log for fsck.

`replay` computes, without writing, the head table and the turn log end that the snapshot
and the WAL arrive at (fsck runs it too, read-only); `recover` writes what it found missing
back into turns.log and the pack.  Nothing acknowledged is dropped and no TurnID is handed
out twice; what cannot be restored is reported, not hidden.
"""
from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from store.durability import checkpoint, packer
from store.errors import CorruptRecord, StoreNeedsWrite, UnknownTurn
from store.files import headwal
from store.files.patchlog import patches_lost
from store.files.snapshot import LoadedHeads
from store.layout import TURN_SIZE, WAL_DELETE, Snapshot, WalRecord
from store.types import ContextHead, RecoveryNotes, Turn
from sysio.files import open_private
from sysio.flush import disk_full, flush_data

if TYPE_CHECKING:
    from store.api import Store

DAMAGE = "damage.log"


def damage_found(root: Path) -> list[tuple[str, str]]:
    """damage.log's lines as (when, what); none when it is absent."""
    try:
        lines = (root / DAMAGE).read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return []
    return [(stamp, what) for stamp, _, what in (line.partition(" ") for line in lines)]


def record_damage(root: Path, messages: list[str]) -> None:
    """Keep what recovery found damaged (it repaired or dropped it) for fsck to report: once
    each, however many opens find the same record damaged again."""
    known = {what for _, what in damage_found(root)}
    messages = [m for m in dict.fromkeys(messages) if m not in known]
    if not messages:
        return
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    fd = open_private(root / DAMAGE, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    with open(fd, "a", encoding="utf-8") as f:
        f.writelines(f"{stamp} {m}\n" for m in messages)
        f.flush()
        flush_data(f.fileno())


def recover(store: Store, loaded: LoadedHeads) -> headwal.HeadWal:
    """Replay the head WAL onto turns.log and the pack.  Nothing acknowledged is dropped:
    a turn whose blob is damaged or lost is kept (its payload reads as DamagedPayload), and
    no TurnID that turns.log, the WAL or a head ever held is handed out again."""
    log = store._turns
    r = replay(loaded, log.count, log.slot_ok, functools.partial(slot_readable, store),
                         store._pack.has, store._pack.damage_of)
    notes = store.recovery_notes
    notes.merge(r.notes)
    patch_loss = patches_lost(store._patches.seq, loaded.snapshot)
    if patch_loss:
        notes.add(patch_loss, damage=True)
        store._patches.seq = loaded.snapshot.patch_seq  # a seq is never handed out twice
    if store.config.read_only:
        return _as_it_is(store, loaded, r)
    _unless_full(notes, f"blobs.pack: {len(r.blobs)} blobs restored from the head WAL not written (they "
                 "wait in memory, the WAL keeps them)", functools.partial(_restore_blobs, store, r.blobs))
    for t in r.writes:
        log.write(t)
    store._damaged = {h: why for h, (_, why) in r.damaged.items()}
    end = _log_end(store, r.end, loaded.wal_damaged)
    if os.path.getsize(store.root / "turns.log") != end * TURN_SIZE:
        log.truncate(end)  # drops a torn tail; zero slots for ids lost everywhere
    _unless_full(notes, "turns.skip: jump pointers not written (reads walk by parent)",
                 functools.partial(_set_jumps, store, end))
    store._logged = r.logged
    store._next_ctx = r.next_context_id
    store._heads = {c: ContextHead(c, head, depth, created, flags)
                   for c, (head, depth, flags, created) in r.logged.items()}
    store._commit.set_durable_turn_id(end)
    if notes.damage:  # what is not recorded now is found, and recorded, again by the next open
        _unless_full(notes, f"{DAMAGE} not written",
                     functools.partial(record_damage, store.root, notes.damage))
    snap_gen = loaded.snapshot.generation
    if r.replayed or r.writes or loaded.damaged or loaded.fresh:
        top = max([snap_gen, *headwal.wal_generations(store.root)])
        store._wal = headwal.HeadWal(store.root, top, store.config.durable, at_open=True)
        _unless_full(notes, "checkpoint not written: the next open replays the head WAL again",
                     functools.partial(checkpoint.run, store))  # the next WAL generation starts empty
        return store._wal
    return headwal.HeadWal(store.root, snap_gen, store.config.durable, at_open=True)


def _as_it_is(store: Store, loaded: LoadedHeads, r: Replayed) -> headwal.HeadWal:
    """A read-only open: the heads the snapshot and the WAL arrive at, in memory, when the
    files hold every turn and blob they name (a clean close, or a crash that lost nothing);
    else StoreNeedsWrite, naming what recovery must write first."""
    end = _log_end(store, r.end, loaded.wal_damaged)
    needs = [why for why, needed in (
        ("has never been opened for writing", loaded.fresh),
        (f"must restore {len(r.writes)} turn record(s) from its head WAL", bool(r.writes)),
        (f"must restore {len(r.blobs)} blob(s) from its head WAL", bool(r.blobs)),
        ("must cut a torn tail of turns.log", store._turns.count != end)) if needed]
    if needs:
        raise StoreNeedsWrite(str(store.root), f"{needs[0]} before it can be read (a crash)")
    store._damaged = {h: why for h, (_, why) in r.damaged.items()}
    store._logged = r.logged
    store._next_ctx = r.next_context_id
    store._heads = {c: ContextHead(c, head, depth, created, flags)
                    for c, (head, depth, flags, created) in r.logged.items()}
    store._commit.set_durable_turn_id(end)
    return headwal.HeadWal(store.root, loaded.snapshot.generation, durable=False, read_only=True)


def _restore_blobs(store: Store, blobs: dict[bytes, bytes]) -> None:
    """Append the blobs the pack lost from their WAL copies; on a full disk those not appended
    wait in memory as an append's raw blob does (the checkpoint that drops the WAL packs them)."""
    try:
        for rec in blobs.values():
            store._pack.append((packer.repacked(store, rec),))
    except OSError as exc:
        if disk_full(exc):
            for h, rec in blobs.items():
                if not store._pack.has(h):
                    packer.wait_pending(store, rec)
        raise


def _set_jumps(store: Store, end: int) -> None:
    log = store._turns
    for tid in range(log.skips_valid_upto() + 1, end + 1):
        try:
            t = log.read(tid)
            jump = log.compute_jump(t.parent_turn_id, t.depth - 1, lambda i: store._read_turn(i).depth)
            log.set_jump(tid, jump)
        except (CorruptRecord, UnknownTurn):
            continue  # a damaged record (or one its chain needs): reads walk by parent there


def _unless_full(notes: RecoveryNotes, skipped: str, write: Callable[[], None]) -> None:
    """Run one of recovery's writes that only save time (the checkpoint, jump pointers, the
    damage log), or on a full disk leave it to a later open and note what was skipped: the
    store opens for reading all the same, with nothing lost (the head WAL still holds it all),
    and the first write meets the full disk (README: `ls` and `cat` work on a full disk)."""
    try:
        write()
    except OSError as exc:
        if not disk_full(exc):
            raise
        notes.append(f"{skipped} ({exc.strerror})")


def _log_end(store: Store, end: int, wal_damaged: bool) -> int:
    """Where turns.log ends after recovery: after every id the WAL, a head or the snapshot
    names (end), and after every valid record beyond that too.  Records beyond the WAL's
    are kept without a head (the WAL lost them, or they were never acknowledged): their
    ids may have been seen, so they are never reused.  Only damaged records past all of
    that, a crash's torn tail, are dropped."""
    last = store._turns.count
    while last > end and not slot_readable(store, last):
        last -= 1
    if last > end:
        store.recovery_notes.add(
            f"turns.log: turns {end + 1}..{last} have no head WAL record: kept, no head moved to them"
            + (" (the head WAL lost their records)" if wal_damaged else " (never acknowledged)"),
            damage=wal_damaged)
    elif store._turns.count > end:
        store.recovery_notes.append(f"turns.log: torn tail after turn {end} dropped")
    return max(end, last)


def log_damaged(store: Store, snap: Snapshot) -> bool:
    """turns.log lost its end: shorter than the checkpoint, or the last record is bad."""
    end = snap.checkpoint_turn_id
    return store._turns.count < end or (end > 0 and not slot_readable(store, end))


def slot_readable(store: Store, turn_id: int) -> bool:
    try:
        store._turns.read(turn_id)
        return True
    except (CorruptRecord, UnknownTurn):
        return False


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
