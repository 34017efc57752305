"""Checkpoints: snapshot every head into heads.tbl and start the next head WAL generation.

A checkpoint has two halves.  The WAL switch (`switch_wal`) holds the write lock for one
fdatasync; the syncs of turns.log and the pack and the snapshot (`finish`) run without it,
so an append waits for one switch at most.  A background thread per store (`thread_main`)
zero-fills the next WAL generation ahead of time once the WAL is a quarter full and
checkpoints once it is half full; GC, close and a full WAL checkpoint by themselves (`run`).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from store.durability import packer
from store.files import headwal, snapshot
from store.layout import Snapshot

if TYPE_CHECKING:
    from store.api import Store

log = logging.getLogger(__name__)
INDEX_TAIL_MAX = 1 << 16  # blobs kept in memory beyond blobs.idx before a checkpoint folds them in


def run(store: Store, sync: bool | None = None) -> None:
    """Snapshot every head and start a new WAL generation.  Caller holds the write lock.
    Syncs unless the store is not durable (then only at close: sync=True)."""
    sync = store.config.durable if sync is None else sync
    old, snap = switch_wal(store, sync)
    finish(store, old, snap, sync)


def switch_wal(store: Store, sync: bool) -> tuple[headwal.HeadWal, Snapshot]:
    """First half of a checkpoint, under the write lock: sync the WAL, move writers to the
    next generation and take the snapshot of the heads the old one ends with."""
    new = take_next_wal(store)
    with store._sync_lock:
        old = store._wal
        if sync:
            try:
                old.sync()  # a leader about to sync would sync the new WAL, not this one
            except BaseException:
                new.close(trim=False)
                raise
        store._wal_synced = (new.gen, new.pos)
        store._wal = new
        heads = [(c, *v) for c, v in sorted(store._logged.items())]
        snap = Snapshot(new.gen, store._next_ctx, store._turns.count, store._patches.seq, heads)
    return old, snap


def finish(store: Store, old: headwal.HeadWal, snap: Snapshot, sync: bool) -> None:
    """Second half, without the write lock: make turns.log and the pack durable up to the
    switch, then write the snapshot that lets recovery skip the old WAL.  Until that
    snapshot exists, recovery replays the old generation and the new one."""
    try:
        packer.pack_pending(store)  # the old WAL's raw blob copies are about to be dropped
        end = store._pack.end
        if sync:
            store._turns.sync()
            store._pack.sync()
        with store._sync_lock:
            store._pack_synced = max(store._pack_synced, end)
        snapshot.write_snapshot(store.root, snap, durable=sync)
    except BaseException:
        old.close(trim=False)  # the store fails: its fd must not outlive close()
        raise
    old.close()
    if len(store._pack) - store._pack.indexed > INDEX_TAIL_MAX:
        store._pack.write_index()


def take_next_wal(store: Store) -> headwal.HeadWal:
    """The next WAL generation, from the file the checkpointer prepared if there is one.
    Its name becomes durable with the first sync (the snapshot may come later)."""
    with store._prepare_lock:
        fd, store._next_fd = store._next_fd, None
        new = headwal.HeadWal(store.root, store._wal.gen + 1, store.config.durable, prepared=fd)
    new.name_durable = False
    return new


def thread_main(store: Store) -> None:
    """Background thread: prepare the next WAL generation, and checkpoint once the WAL is
    half full, so that appends neither zero a new WAL nor wait for the syncs and the
    snapshot (only for the switch, which holds the write lock for one fdatasync)."""
    while True:
        store._wake.wait()
        store._wake.clear()
        if store._stopping:
            return
        try:
            with store._gate.shared():  # GC and close checkpoint by themselves
                prepare_next_wal(store)
                if store._wal.pos > headwal.WAL_BYTES // 2:
                    background(store)
                    prepare_next_wal(store)
        except OSError as exc:
            store._fail(exc)  # writers waiting for the checkpoint get StoreFailed
        except Exception:  # noqa: BLE001 - the append that finds the WAL full retries and raises
            log.exception("%s: background checkpoint failed", store.root)


def prepare_next_wal(store: Store) -> None:
    with store._prepare_lock:
        if store._next_fd is None and store.config.durable:
            store._next_fd = headwal.prepare_next(store.root)


def background(store: Store) -> None:
    with store._write_lock:
        if store._wal.pos <= headwal.WAL_BYTES // 2:
            return  # an append checkpointed meanwhile
        old, snap = switch_wal(store, store.config.durable)
        store._checkpointing = True
    try:
        finish(store, old, snap, store.config.durable)
    finally:
        store._checkpointing = False
