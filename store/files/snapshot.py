"""The head snapshot (`heads.tbl`): every context's head at a checkpoint, and loading the
newest valid snapshot with the head WAL records to replay on it.

A checkpoint writes a snapshot of every head (generation G+1 = "replay WAL G+1 onward") by
temp file + rename, keeps the previous snapshot as `heads.tbl.prev` and its WAL, and deletes
older WAL files.  If the newest snapshot is damaged, the previous one plus the WAL since
then rebuilds the same table.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from store.errors import CorruptRecord
from store.files.headwal import read_wal, wal_generations, wal_name
from store.layout import (
    Snapshot,
    WalRecord,
    decode_snapshot,
    encode_snapshot,
)
from store.types import RecoveryNotes
from sysio.files import atomic_write, fsync_dir

SNAPSHOT = "heads.tbl"
PREVIOUS = "heads.tbl.prev"


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
