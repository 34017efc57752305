"""Open-time replay and repair: the head WAL since the last checkpoint, replayed onto
turns.log and the pack, and what was found damaged kept in damage.log for fsck.

Nothing acknowledged is dropped and no TurnID is handed out twice (see `recover`); what
cannot be restored is reported, not hidden.
"""
from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from store.durability import checkpoint, packer
from store.errors import CorruptRecord, UnknownTurn
from store.files import heads as headfiles
from store.files.patchlog import patches_lost
from store.layout import TURN_SIZE, Snapshot
from store.types import ContextHead
from sysio.files import open_private
from sysio.flush import flush_data

if TYPE_CHECKING:
    from store.api import Store

DAMAGE = "damage.log"


def record_damage(root: Path, messages: list[str]) -> None:
    """Keep what recovery found damaged (it repaired or dropped it) for fsck to report."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    fd = open_private(root / DAMAGE, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    with open(fd, "a", encoding="utf-8") as f:
        f.writelines(f"{stamp} {m}\n" for m in messages)
        f.flush()
        flush_data(f.fileno())


def recover(store: Store, loaded: headfiles.LoadedHeads) -> headfiles.HeadWal:
    """Replay the head WAL onto turns.log and the pack.  Nothing acknowledged is dropped:
    a turn whose blob is damaged or lost is kept (its payload reads as DamagedPayload), and
    no TurnID that turns.log, the WAL or a head ever held is handed out again."""
    log = store._turns
    r = headfiles.replay(loaded, log.count, log.slot_ok, functools.partial(slot_readable, store),
                         lambda h: store._pack.locate(h) is not None, store._pack.damage_of)
    notes = store.recovery_notes
    notes.merge(r.notes)
    patch_loss = patches_lost(store._patches.seq, loaded.snapshot)
    if patch_loss:
        notes.add(patch_loss, damage=True)
        store._patches.seq = loaded.snapshot.patch_seq  # a seq is never handed out twice
    for rec in r.blobs.values():
        store._pack.append(packer.repacked(store, rec))
    for t in r.writes:
        log.write(t)
    store._damaged = {h: why for h, (_, why) in r.damaged.items()}
    end = _log_end(store, r.end, loaded.wal_damaged)
    if os.path.getsize(store.root / "turns.log") != end * TURN_SIZE:
        log.truncate(end)  # drops a torn tail; zero slots for ids lost everywhere
    for tid in range(log.skips_valid_upto() + 1, end + 1):
        try:
            log.set_jump(tid, log.compute_jump(log.read(tid), store._read_turn))
        except (CorruptRecord, UnknownTurn):
            continue  # a damaged record (or one its chain needs): reads walk by parent there
    store._logged = r.logged
    store._next_ctx = r.next_context_id
    store._heads = {c: ContextHead(c, head, depth, created, flags)
                   for c, (head, depth, flags, created) in r.logged.items()}
    store._commit.set_durable_turn_id(end)
    if notes.damage:
        record_damage(store.root, notes.damage)
    snap_gen = loaded.snapshot.generation
    if r.replayed or r.writes or loaded.damaged or loaded.fresh:
        top = max([snap_gen, *headfiles.wal_generations(store.root)])
        store._wal = headfiles.HeadWal(store.root, top, store.config.durable)
        checkpoint.run(store)  # the next WAL generation starts empty
        return store._wal
    return headfiles.HeadWal(store.root, snap_gen, store.config.durable)


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
