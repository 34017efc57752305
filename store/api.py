"""`Store`: the public API of the turn and blob store, its locking and its write ordering.

An append writes, in this order: the blob (if new) to `blobs.pack`, the turn record to
`turns.log` (and its jump pointer to `turns.skip`), then one head WAL record that carries the
turn record, the new head and a copy of the new blob's record (up to EMBED_MAX bytes).  It
then waits for group commit, whose leader fdatasyncs the WAL (after the pack when a big blob
went to the pack alone) and only then makes the new head visible.  The pack and `turns.log`
are synced at checkpoints (store/durability/checkpoint.py); on open, the WAL since the last
checkpoint restores what they lost (store/recovery.py), and a WAL record whose blob is
nowhere ends the replay (it was never acknowledged).  A small append by a writer alone
leaves its new blob raw in the WAL for the packer (store/durability/packer.py).

Locks: one process per store directory (`flock` on `LOCK`); in the process a lock per context
(head updates are linearizable per context), 64 blob shard locks (double-checked insert), one
write lock (TurnID sequencer, log and WAL slots) and a gate that GC holds exclusively.

Over ~400 lines because the Store's state is shared by every public call; the parts that run
apart from a call (recovery, checkpoints, packing, group commit) live in their own modules.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

from store import recovery
from store.cache import LRU
from store.codec import DecodeError, blob_hash, decode_stored
from store.config import GCStats, StoreConfig
from store.durability import checkpoint, packer
from store.durability.commit import GroupCommit
from store.errors import (
    BlobMismatch,
    CorruptRecord,
    DamagedPayload,
    ParentConflict,
    PayloadTooLarge,
    StoreClosed,
    StoreError,
    StoreFailed,
    StoreLocked,
    StoreNeedsWrite,
    TurnNotInContext,
    UnknownBlob,
    UnknownContext,
    UnknownTurn,
)
from store.files import headwal, snapshot
from store.files.blobpack import PACK, BlobPack, remove_leftovers, scan_pack
from store.files.patchlog import PatchLog
from store.files.turnlog import LOG, TurnLog
from store.gc import Gate, mark
from store.layout import (
    BLOB_OVERHEAD,
    CODEC_RAW,
    IDX_ENTRY,
    PATCH_REPLACE,
    PATCH_TOMBSTONE,
    TURN_SIZE,
    WAL_DELETE,
    WAL_HEAD,
    WAL_TURN,
    ZERO_HASH,
    BlobLocation,
    WalRecord,
    blob_record,
    encode_blob,
    encode_turn,
    encode_wal,
    encode_wal_fields,
)
from store.types import (
    NO_TURN,
    ContextHead,
    Page,
    Patch,
    RecoveryNotes,
    StoredBlob,
    Turn,
    TurnBlobRef,
    TurnInput,
)
from sysio.background import in_background
from sysio.files import fsync_dir, private_dir
from sysio.flush import disk_full
from sysio.locks import lock_with_timeout

log = logging.getLogger(__name__)
R = TypeVar("R")
P = ParamSpec("P")
LOCK = "LOCK"
PARALLEL_BYTES = 256 << 10  # a batch this big is hashed and compressed on PREPARE_THREADS threads
PREPARE_THREADS = 2
WALK_RUN = 512
"""Turn records a walk towards the root reads at once (a chain's turns sit mostly together)."""
BATCH_COPY_MAX = 128 << 10
"""A batch's new blob records up to this many bytes are copied into the head WAL (its one
fdatasync makes them durable); more go durable by a pack fdatasync before the WAL's."""
FLUSH_BEHIND = 32 << 20
"""Bytes that staged blobs (`put_stored_blobs(verified=True)`, which waits for no sync) may
leave unsynced in the pack before a sync of them starts on a thread of its own: the append
that first references them (a fetch's commit, after its last byte) then syncs only the rest."""


def _sizes(items: Sequence[Any]) -> list[int]:
    return [len(i) if isinstance(i, bytes) else len(getattr(i, "stored", b"")) for i in items]


def _parallel(items: Sequence[Any], sizes: list[int]) -> bool:
    """Whether a batch is big enough for the prepare threads."""
    return len(items) >= 16 and sum(sizes) >= PARALLEL_BYTES


def _now_ms() -> int:
    return int(time.time() * 1000)


def _decode_checked(h: bytes, loc: BlobLocation, record: bytes | CorruptRecord) -> bytes | CorruptRecord:
    """A pack record decoded and hashed to its name, or why not (no state touched: it runs on
    the prepare threads)."""
    if isinstance(record, CorruptRecord):
        return record
    try:
        data = decode_stored(loc.codec, record, loc.raw_len)
    except DecodeError as exc:
        return CorruptRecord(PACK, loc.offset, f"blob {h.hex()} does not decode: {exc}")
    if blob_hash(data) != h:
        return CorruptRecord(PACK, loc.offset, f"blob {h.hex()} does not hash to its name")
    return data


def _writes(method: Callable[Concatenate[Store, P], R]) -> Callable[Concatenate[Store, P], R]:
    """A public write: refused once the store has failed, and an OS error on its way (EIO,
    ENOSPC on a write, flush or rename) fails the store (see Store._fail)."""
    @functools.wraps(method)
    def write(self: Store, *args: P.args, **kwargs: P.kwargs) -> R:
        self._check_writable()
        try:
            return method(self, *args, **kwargs)
        except OSError as exc:
            raise self._fail(exc) from exc
    return write


class Store:
    """A turn and blob store in one directory.  Thread-safe; see docs/ARCHITECTURE.md."""

    def __init__(self, root: Path, config: StoreConfig, lock_fd: int) -> None:
        self.root = root
        self.config = config
        self._lock_fd = lock_fd
        self.recovery_notes = RecoveryNotes()
        """What opening found and repaired (torn tails, rebuilt index or heads)."""
        self._closed = False
        self._failed: BaseException | None = None
        """The write error that failed the store: writes are refused until it is reopened."""
        self._gate = Gate()
        self._write_lock = threading.Lock()
        self._sync_lock = threading.Lock()
        self._ctx_locks_guard = threading.Lock()
        self._ctx_locks: dict[int, threading.Lock] = {}
        self._shards = [threading.Lock() for _ in range(64)]
        self._pool: ThreadPoolExecutor | None = None
        self._pins: dict[bytes, float] = {}
        self._pending: dict[bytes, bytes] = {}
        """New blobs whose only durable copy is in the WAL, raw, waiting to be packed."""
        self._pending_bytes = 0
        self._pending_lock = threading.Lock()
        self._turn_cache: LRU[int, Turn] = LRU(config.turn_cache_entries)
        self._blob_cache: LRU[bytes, bytes] = LRU(config.blob_cache_bytes, len)
        self._damaged: dict[bytes, str] = {}
        """Blobs of replayed turns that recovery found lost or damaged: what is wrong (the pack
        knows its own damaged records: BlobPack.damage_of)."""
        ro = config.read_only
        if not ro:
            remove_leftovers(root)
        notes = self.recovery_notes
        self._pack = BlobPack(root, config.durable, notes, readonly=ro)
        self._turns = TurnLog(root, readonly=ro)
        self._patches = PatchLog(root, config.durable, notes, readonly=ro)
        self._heads: dict[int, ContextHead] = {}
        self._next_ctx = 1
        self._commit = GroupCommit(self._sync, config.durable, self._failure)
        self._pack_synced = self._pack.end
        self._pack_wanted = False
        """Set by a writer whose blob is only in the pack: the next group syncs the pack too."""
        self._flushing: Future[None] | None = None
        """The sync of staged blobs running behind their writes (FLUSH_BEHIND), if any: one at
        a time (`_flushing_lock`, for concurrent stagers), so that close waits for it."""
        self._flushing_lock = threading.Lock()
        self._wal_synced = (0, 0)
        self._prepare_lock = threading.Lock()
        self._next_fd: int | None = None
        """The next WAL generation, zero-filled by the checkpointer (headwal.prepare_next)."""
        if not ro:
            (root / headwal.NEXT).unlink(missing_ok=True)
        self._checkpointing = False
        """The checkpointer switched WALs and is syncing and writing the snapshot."""
        self._logged: dict[int, tuple[int, int, int, int]] = {}
        """Each context's head as the WAL has it (head, depth, flags, created): what the next
        checkpoint snapshots; recovery fills it."""
        loaded = snapshot.load(root, notes, functools.partial(recovery.log_damaged, self))
        self._wal = recovery.recover(self, loaded)
        self._opened = self._written()
        """Where the files ended after recovery: a close finds whether anything was written since."""
        self._stopping = False
        self._wake = threading.Event()
        self._thread = threading.Thread(target=functools.partial(checkpoint.thread_main, self),
                                        name="store-checkpoint", daemon=True)
        if not ro:  # read-only: nothing to checkpoint
            self._thread.start()

    @classmethod
    def open(cls, path: str | os.PathLike[str], config: StoreConfig | None = None) -> Store:
        config = config or StoreConfig()
        if not 1 <= config.zstd_level <= 22:
            raise ValueError(f"zstd_level {config.zstd_level} is out of range")
        root = Path(path)
        if not config.read_only:
            private_dir(root)
            if not os.access(root, os.W_OK):  # refused before a write half done is logged as a failure
                raise StoreFailed(str(root), os.strerror(errno.EACCES), errno.EACCES)
        try:
            lock_fd = lock_with_timeout(root / LOCK, config.lock_timeout, config.read_only)
        except FileNotFoundError:  # read-only: never opened for writing, so never made
            raise StoreNeedsWrite(str(root), "has not been made yet") from None
        if lock_fd is None:
            raise StoreLocked(str(root))
        try:
            return cls(root, config, lock_fd)
        except BaseException as exc:
            os.close(lock_fd)
            if isinstance(exc, FileNotFoundError) and config.read_only:  # a writable open makes it
                raise StoreNeedsWrite(str(root), f"lacks {Path(exc.filename or '?').name}") from None
            raise

    # --- recovery ----------------------------------------------------------------------------

    def _sync(self) -> None:
        """The group commit leader's sync: the pack first if a writer needs it, then the WAL."""
        with self._sync_lock:
            if self._pack_wanted:
                self._pack_wanted = False
                self._sync_pack()
            mark = (self._wal.gen, self._wal.pos)
            if mark != self._wal_synced:
                self._wal.sync()
                if not self._wal.name_durable:
                    fsync_dir(self.root)
                    self._wal.name_durable = True
                self._wal_synced = mark

    def _sync_pack(self) -> None:
        """Caller holds _sync_lock: what the pack holds now made durable."""
        end = self._pack.end
        self._pack.sync()
        self._pack_synced = max(self._pack_synced, end)

    def _flush_behind(self) -> None:
        """Sync the staged blobs on a thread of their own once FLUSH_BEHIND bytes of them wait
        (one such sync at a time).  Its failure fails the store closed, as the group commit's
        does: the pages it could not write may be dropped (module docstring of commit.py)."""
        if self._pack.end - self._pack_synced < FLUSH_BEHIND or not self.config.durable:
            return

        def flush() -> None:
            with self._sync_lock:
                if self._failed is not None or self._closed:
                    return
                try:
                    self._sync_pack()
                except OSError as exc:
                    self._fail(exc)  # logged there

        with self._flushing_lock:
            if self._flushing is None or self._flushing.done():
                self._flushing = in_background(flush, name="store-flush")

    # --- helpers -----------------------------------------------------------------------------

    def _written(self) -> tuple[int, int, int, int, int]:
        """Where the WAL, the pack, turns.log and the patch log end (each write moves one)."""
        return self._wal.gen, self._wal.pos, self._pack.end, self._turns.count, self._patches.seq

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed()

    @property
    def failure(self) -> str | None:
        """Why the store refuses writes (its failed state, FORMAT.md), or None."""
        return None if self._failed is None else StoreFailed.of(str(self.root), self._failed).reason

    def _check_writable(self) -> None:
        self._check_open()
        if self.config.read_only:
            raise StoreNeedsWrite(str(self.root), "was opened read-only")
        if self._failed is not None:
            raise StoreFailed.of(str(self.root), self._failed)

    def _failure(self, cause: BaseException) -> StoreFailed:
        """Enter the failed state (the first cause stays) and return the error to raise.
        Reads go on: the heads in memory move only after a good flush (see FORMAT.md)."""
        if self._failed is None:
            self._failed = cause
            log.error("%s: write failed, the store refuses writes until reopened: %s", self.root, cause)
        return StoreFailed.of(str(self.root), self._failed)

    def _fail(self, cause: BaseException) -> StoreFailed:
        """_failure, and every writer waiting for group commit fails too."""
        err = self._failure(cause)
        self._commit.fail(cause)
        return err

    def _close_failed(self) -> None:
        """Close after a failure without writing anything but the rollback of what no flush
        made durable (best effort): zeros over the WAL records after the last good flush, and
        turns.log cut after the last durable turn.  Recovery on the next open then cannot
        bring back a write that was refused, unless the disk is still failing."""
        gen, pos = self._wal_synced
        try:
            if self.config.durable and gen == self._wal.gen and self._wal.reach > pos:
                self._wal.erase_from(pos)
            self._turns.truncate(self._commit.durable_turn_id)  # the count may lag what was written
        except OSError as exc:
            log.error("%s: could not roll back the unflushed writes after the failure: %s", self.root, exc)

    def _ctx_lock(self, ctx: int) -> threading.Lock:
        with self._ctx_locks_guard:
            lock = self._ctx_locks.get(ctx)
            if lock is None:
                lock = self._ctx_locks[ctx] = threading.Lock()
            return lock

    def _ensure_blob(self, p: packer.Prepared) -> bytes:
        """Double-checked insert: the blob is stored once however many writers race.  Returns
        the BlobRecord to copy into the WAL (b'' when the pack has it durably or it is too big
        to copy; then the pack is synced before the WAL)."""
        loc = self._stored_at(p)
        if loc is None:
            with self._shards[p.hash[0] & 63]:
                loc = self._stored_at(p)
                if loc is None:
                    waiting = self._pending.get(p.hash)
                    if waiting is not None:  # left raw by another append: this WAL record copies it too
                        return encode_blob(p.hash, CODEC_RAW, len(waiting), waiting)
                    # stored is None only for a blob found when prepared; GC cannot have dropped
                    # it since: callers hold the gate from packer.prepare through here
                    assert p.stored is not None
                    rec = blob_record(p.hash, p.codec, p.raw_len, p.stored)
                    if p.deferred:
                        with self._pending_lock:
                            self._pending[p.hash] = p.stored
                            self._pending_bytes += p.raw_len
                        return b"".join(rec)
                    self._pack.append(rec)
                    return self._copy_or_sync(rec)
        if loc.offset < self._pack_synced:
            return b""
        return self._copy_or_sync((self._pack.read_record(loc),))

    def _stored_at(self, p: packer.Prepared) -> BlobLocation | None:
        """Where the pack has p's blob: only what was appended since, when p was prepared as
        not stored (BlobPack.locate_since)."""
        return (self._pack.locate(p.hash) if p.absent_from is None
                else self._pack.locate_since(p.hash, p.absent_from))

    def _ensure_blobs(self, prepared: Sequence[packer.Prepared]) -> list[bytes]:
        """_ensure_blob of each, with the new compressed blobs written to the pack in one write
        (one syscall per batch, not per line) under their shard locks, taken in shard order (no
        deadlock between batches; single inserts take one).  When the new records come to more
        than BATCH_COPY_MAX bytes, the WAL gets no copies of them: the commit syncs the pack
        first (one fdatasync more), where copies would fill the 1 MiB WAL every few batches
        and each time stall the writers for a checkpoint."""
        fresh = [p for p in prepared
                 if p.stored is not None and not p.deferred and self._stored_at(p) is None]
        if len(fresh) < 2:
            return [self._ensure_blob(p) for p in prepared]
        written: dict[bytes, tuple[bytes, bytes, bytes]] = {}
        with contextlib.ExitStack() as held:
            for shard in sorted({p.hash[0] & 63 for p in fresh}):
                held.enter_context(self._shards[shard])
            for p in fresh:
                new = p.hash not in written and p.hash not in self._pending
                if new and self._stored_at(p) is None:
                    assert p.stored is not None
                    written[p.hash] = blob_record(p.hash, p.codec, p.raw_len, p.stored)
            self._pack.append_many(list(written.values()))
        copied = sum(BLOB_OVERHEAD + len(stored) for _, stored, _ in written.values())
        if copied > BATCH_COPY_MAX and self.config.durable:
            self._pack_wanted = True
            return [b"" if p.hash in written else self._ensure_blob(p) for p in prepared]
        return [self._copy_or_sync(written[p.hash]) if p.hash in written else self._ensure_blob(p)
                for p in prepared]

    @_writes
    def pack_pending(self) -> None:
        """Compress into the pack now the blobs recent appends left raw in the WAL (the next
        checkpoint would)."""
        with self._gate.shared():
            packer.pack_pending(self)

    def _copy_or_sync(self, rec: Sequence[bytes]) -> bytes:
        """The WAL's copy of a BlobRecord (given as its parts) when it is small enough, else
        b'' and the pack is synced before the WAL."""
        if not self.config.durable:
            return b""  # nothing is synced anyway; a process crash keeps the page cache
        if sum(map(len, rec)) <= headwal.EMBED_MAX:
            return b"".join(rec)
        self._pack_wanted = True
        return b""

    def _read_turn(self, turn_id: int) -> Turn:
        t = self._turn_cache.get(turn_id)
        if t is None:
            t = self._turns.read(turn_id)
            self._turn_cache.put(turn_id, t)
        return t

    def _walk(self, turn_id: int, n: int) -> list[Turn]:
        """Up to n turns from turn_id towards the root, chronological.  A walk longer than the
        turn cache does not go through it (it would only evict itself, at a cost per turn)."""
        out: list[Turn] = []
        run, first = b"", 0  # records read ahead (towards the root) in one read, WALK_RUN at a time
        cache = self._turn_cache if n <= self._turn_cache.capacity else None
        while turn_id != NO_TURN and len(out) < n:
            t = self._turn_cache.get(turn_id)
            if t is not None:
                out.append(t)
                turn_id = t.parent_turn_id
                continue
            if not first <= turn_id < first + len(run) // TURN_SIZE:
                first = max(1, turn_id - WALK_RUN + 1, turn_id - (n - len(out)) + 1)
                run = self._turns.read_run(first, turn_id)
            got = self._turns.decode_chain(run, first, turn_id, n - len(out))
            if cache is not None:
                cache.put_many((t.turn_id, t) for t in got)
            out += got
            turn_id = got[-1].parent_turn_id
        out.reverse()
        return out

    # --- blobs -------------------------------------------------------------------------------

    @_writes
    def put_blob(self, data: bytes) -> bytes:
        """Store data (once) durably; it survives GC for gc_grace_seconds until a turn uses it."""
        with self._gate.shared():
            p = packer.prepare(self, data)
            self._ensure_blob(p)
            self._pins[p.hash] = time.monotonic()
            if p.hash in self._pending:  # an append's WAL copy is not durable yet: pack and sync it
                packer.pack_pending(self)
            loc = self._pack.locate(p.hash)
            if loc is not None and loc.offset >= self._pack_synced:
                self._pack_wanted = True
                self._commit.wait(self._commit.note_write())
        return p.hash

    def get_blob(self, h: bytes, verify: bool = False) -> bytes:
        """The blob's bytes, checked against its hash when read from the pack (the cache holds
        only checked bytes); verify re-hashes cached bytes too.  CorruptRecord when damaged."""
        self._check_open()
        data = self._blob_cache.get(h)
        if data is None:
            with self._gate.shared():
                data = self._load_blob(h)
        if verify and blob_hash(data) != h:
            self._blob_cache.discard_if(lambda k: k == h)
            loc = self._pack.locate(h)
            raise CorruptRecord(PACK, loc.offset if loc else -1, f"blob {h.hex()} does not hash to its name")
        return data

    def _load_blob(self, h: bytes) -> bytes:
        """Caller holds the gate.  From the cache, the pending blobs or the pack; bytes read
        from the pack pass their CRC, their decoding and their BLAKE3 before they are cached
        or returned (a CRC alone cannot tell a record written wrong, or forged, from a good one)."""
        cached = self._blob_cache.get(h)
        if cached is not None:
            return cached
        loc = self._pack.locate(h)
        if loc is None:
            waiting = self._pending.get(h)
            if waiting is not None:
                return waiting
            raise self._not_found(h)
        return self._keep_checked(h, loc, _decode_checked(h, loc, self._read_record(h, loc)))

    def _not_found(self, h: bytes) -> CorruptRecord | UnknownBlob:
        """Why blob h, which no lookup finds, cannot be had: its record is damaged, or it is not stored."""
        lost = self._damaged.get(h) or self._pack.damage_of(h)
        if lost is not None:
            return CorruptRecord(PACK, -1, f"blob {h.hex()} is damaged: {lost}")
        return UnknownBlob(h)

    def get_blobs(self, hashes: Sequence[bytes]) -> list[bytes]:
        """Many blobs at once, each checked as get_blob checks it (CRC, decoding, BLAKE3): the
        records read in order, then decoded and hashed on the prepare threads (zstd and blake3
        release the GIL), not one call per blob.  UnknownBlob or CorruptRecord as get_blob."""
        self._check_open()
        out: list[bytes | None] = [self._blob_cache.get(h) for h in hashes]
        with self._gate.shared():
            wanted: list[tuple[int, bytes, BlobLocation, bytes | CorruptRecord]] = []
            for i, h in enumerate(hashes):
                if out[i] is not None:
                    continue
                loc = self._pack.locate(h)
                if loc is None:
                    out[i] = self._load_blob(h)  # pending, damaged or unknown: get_blob's answer
                else:
                    wanted.append((i, h, loc, self._read_record(h, loc)))
            decoded = self._map(lambda w: _decode_checked(w[1], w[2], w[3]), wanted,
                                [w[2].raw_len for w in wanted])
            for (i, h, loc, _), got in zip(wanted, decoded, strict=True):
                out[i] = self._keep_checked(h, loc, got)
        return [data for data in out if data is not None]

    def _read_record(self, h: bytes, loc: BlobLocation) -> bytes | CorruptRecord:
        """The record's stored bytes, CRC-checked, or why they are damaged."""
        try:
            return self._pack.read(h, loc)
        except CorruptRecord as exc:
            return exc

    def _keep_checked(self, h: bytes, loc: BlobLocation, got: bytes | CorruptRecord) -> bytes:
        """A checked blob cached and returned; a damaged one noted (damage.log) and raised."""
        if isinstance(got, CorruptRecord):
            self._found_damaged(h, f"{got.file} at offset {got.offset}: {got.reason}")
            raise got
        self._blob_cache.put(h, got)
        return got

    def _found_damaged(self, h: bytes, reason: str) -> None:
        """A read found blob h damaged: lookups stop finding that record (an append of the same
        bytes stores a good copy), and damage.log keeps it for fsck (not from a read-only
        opening, which writes nothing: fsck's own walk of the pack finds it)."""
        if self._pack.damage_of(h) is None:
            self._pack.mark_damaged(h, reason)
            log.warning("%s: blob %s is damaged: %s", self.root, h.hex(), reason)
            if not self.config.read_only:
                recovery.record_damage(self.root, [f"{reason} (found when read)"])

    def _payload(self, turn: Turn, h: bytes) -> bytes:
        """Caller holds the gate.  Blob h as the payload of turn: a damaged blob, or one that is
        gone although a live head reaches the turn (GC keeps those), is DamagedPayload naming both."""
        try:
            return self._load_blob(h)
        except CorruptRecord as exc:
            why = self._damaged.get(h) or self._pack.damage_of(h) or exc.reason
            raise DamagedPayload(turn.turn_id, h, why, exc.file, exc.offset) from None
        except UnknownBlob:
            if h != turn.payload_hash or self._on_live_chain(turn):
                raise DamagedPayload(turn.turn_id, h, "lost: neither blobs.pack nor the head WAL holds it",
                                     PACK, -1) from None
            raise

    def put_stored_blob(self, blob: StoredBlob) -> bytes:
        """Store a blob received in stored form (e.g. from a peer) without recompressing it.
        It is decoded and re-hashed first: BlobMismatch when it is not what it claims."""
        return self.put_stored_blobs([blob])[0]

    @_writes
    def put_stored_blobs(self, blobs: Sequence[StoredBlob], *, verified: bool = False) -> list[bytes]:
        """put_stored_blob for many, with one durable commit; a big batch is verified on two
        threads.  Nothing is stored when any blob fails its check.

        `verified=True` stages blobs the caller has just decoded and hashed itself (a peer's
        line, checked on arrival): they are not decoded and hashed a second time (a raw-codec
        blob is compressed as `put_blob` would, zstd when it shrinks), and the call does not
        wait for a sync: they are written to the pack, so a killed process loses none of them
        (the OS has them), a power cut may (they are unreferenced: a refetch costs no data);
        the append that first references them makes them durable first, as for any blob.
        Either way, the blobs survive GC for gc_grace_seconds until a turn uses them."""
        prepared = self._map(self._trusted if verified else self._verify_stored, blobs)
        with self._gate.shared():
            now = time.monotonic()
            unsynced = False
            self._ensure_blobs(prepared)
            for blob in blobs:
                self._pins[blob.hash] = now
                loc = self._pack.locate(blob.hash)
                unsynced = unsynced or (loc is not None and loc.offset >= self._pack_synced)
            if unsynced:
                self._pack_wanted = True
                if not verified:
                    self._commit.wait(self._commit.note_write())
        if verified:
            self._flush_behind()
        return [blob.hash for blob in blobs]

    def _verify_stored(self, blob: StoredBlob) -> packer.Prepared:
        h = blob.hash
        if blob.raw_len > self.config.max_payload:
            raise PayloadTooLarge(blob.raw_len, self.config.max_payload)
        try:
            data = decode_stored(blob.codec, blob.stored, blob.raw_len)
        except DecodeError as exc:
            raise BlobMismatch(h, f"its stored bytes do not decode: {exc}") from None
        if blob_hash(data) != h:
            raise BlobMismatch(h, "its bytes hash to a different BLAKE3")
        return packer.Prepared(h, blob.raw_len, blob.codec, bytes(blob.stored))

    def _trusted(self, blob: StoredBlob) -> packer.Prepared:
        """Looked up once, here: a blob found absent is prepared `absent_from` the index, so
        that the write's checks look at the blobs appended since, not the index again (two
        lookups a line less: 26k of them in a first fetch's staging)."""
        if blob.raw_len > self.config.max_payload:
            raise PayloadTooLarge(blob.raw_len, self.config.max_payload)
        index = self._pack.index  # before the lookup, as locate_since wants it
        if self._pack.has(blob.hash):  # its bytes kept: a GC before the gate may drop it
            return packer.Prepared(blob.hash, blob.raw_len, blob.codec, bytes(blob.stored))
        if blob.codec == CODEC_RAW:
            return packer.compress(self, blob.hash, bytes(blob.stored), absent_from=index)
        return packer.Prepared(blob.hash, blob.raw_len, blob.codec, bytes(blob.stored), absent_from=index)

    def raw_lengths(self, hashes: Sequence[bytes]) -> list[int]:
        """Each blob's raw length, from the index alone (no blob is read or decoded): what a
        line manifest needs.  UnknownBlob for a blob the store lacks, CorruptRecord for one
        whose record is damaged (found by the scan at open: a tail not folded into the index)."""
        self._check_open()
        with self._gate.shared():
            out = []
            for h in hashes:
                if (loc := self._pack.locate(h)) is not None:
                    out.append(loc.raw_len)
                elif (waiting := self._pending.get(h)) is not None:
                    out.append(len(waiting))
                else:
                    raise self._not_found(h)
            return out

    def get_stored_blob(self, h: bytes) -> StoredBlob:
        self._check_open()
        with self._gate.shared():
            if h in self._pending:
                packer.pack_pending(self)
            loc = self._pack.locate(h)
            if loc is None:
                raise UnknownBlob(h)
            return StoredBlob(h, loc.codec, loc.raw_len, self._pack.read(h, loc))

    def has_blob(self, h: bytes) -> bool:
        return self.has_blobs([h])[0]

    def has_blobs(self, hashes: Sequence[bytes]) -> list[bool]:
        """has_blob of each, under one hold of the gate (a fetch asks a manifest's worth)."""
        self._check_open()
        with self._gate.shared():
            return [self._pack.has(h) or h in self._pending for h in hashes]

    # --- contexts ----------------------------------------------------------------------------

    @_writes
    def create_context(self, base_turn_id: int = NO_TURN) -> ContextHead:
        """A new context: empty, or with its head on an existing turn (the same as fork)."""
        with self._gate.shared():  # GC cannot drop a payload between the check and the head
            depth = 0
            if base_turn_id != NO_TURN:
                base = self.get_turn(base_turn_id)
                depth = base.depth
                self._check_reachable(base)
            with self._write_lock:
                ctx = self._next_ctx
                self._next_ctx += 1
                head = ContextHead(ctx, base_turn_id, depth, _now_ms(), 0)
                ticket = self._log_head(WAL_HEAD, head)
            self._commit.wait(ticket)
            self._heads[ctx] = head
        return head

    def _check_reachable(self, base: Turn) -> None:
        """GC keeps the chains of live heads only: a deleted context's turns stay in the log
        without their payloads.  A new head on such a turn is refused (UnknownBlob).  A turn
        on a live head's chain is fine; any other turn gets its whole chain's payloads checked."""
        if self._on_live_chain(base):
            return
        for t in self._walk(base.turn_id, base.depth + 1):
            if not self._pack.has(t.payload_hash):
                raise UnknownBlob(t.payload_hash)

    def _on_live_chain(self, turn: Turn) -> bool:
        """Whether a live head reaches turn: O(contexts × log depth) reads, usually the first.
        A head whose chain cannot be read (damaged turn records) does not count."""
        heads = list(self._heads.values())
        if any(h.head_turn_id == turn.turn_id for h in heads):
            return True
        for h in heads:
            if h.head_depth > turn.depth:
                try:
                    top = self._read_turn(h.head_turn_id)
                    at = self._turns.ancestor_at_depth(top, turn.depth, self._read_turn)
                    if at.turn_id == turn.turn_id:
                        return True
                except (CorruptRecord, UnknownTurn):
                    continue
        return False

    def fork(self, turn_id: int) -> ContextHead:
        """O(1): a new context whose head is an existing turn; no history is copied.  A turn
        no live head reaches is checked first (see _check_reachable)."""
        if turn_id == NO_TURN:
            raise UnknownTurn(turn_id)
        return self.create_context(turn_id)

    def get_head(self, context_id: int) -> ContextHead:
        self._check_open()
        head = self._heads.get(context_id)
        if head is None:
            raise UnknownContext(context_id)
        return head

    def list_contexts(self) -> list[ContextHead]:
        self._check_open()
        return sorted(self._heads.values(), key=lambda h: h.context_id)

    @_writes
    def delete_context(self, context_id: int) -> None:
        """Forget the context; its turns stay in the log, GC drops blobs nothing else uses."""
        with self._gate.shared(), self._ctx_lock(context_id):
            head = self.get_head(context_id)
            with self._write_lock:
                ticket = self._log_head(WAL_DELETE, head)
            self._commit.wait(ticket)
            self._heads.pop(context_id, None)

    def _log_head(self, kind: int, head: ContextHead) -> int:
        """Append one head WAL record without a turn (caller holds the write lock); its ticket."""
        self._append_wal(self._wal_record(kind, head, None, b""))
        self._note_head(kind, head)
        return self._commit.note_write()

    @staticmethod
    def _wal_record(kind: int, head: ContextHead, turn: Turn | None, blob: bytes) -> bytes:
        return encode_wal(WalRecord(kind, head.context_id, head.head_turn_id, head.head_depth,
                                    head.flags, head.created_at_unix_ms, turn, blob))

    def _append_wal(self, data: bytes) -> None:
        """Caller holds the write lock.  A full WAL is checkpointed first, unless the
        checkpointer is finishing one (then the WAL grows past its pre-zeroed size)."""
        if not self._wal.has_room(len(data)) and not self._checkpointing:
            checkpoint.run(self)
        self._wal.append(data)
        pos = self._wal.pos
        if self._checkpointing or pos <= headwal.WAL_BYTES // 4:
            return
        if pos > headwal.WAL_BYTES // 2 or (self._next_fd is None and self.config.durable):
            self._wake.set()  # a quarter full: prepare the next generation; half: checkpoint

    def _note_head(self, kind: int, head: ContextHead) -> None:
        """The head as the WAL now has it (what the next checkpoint snapshots)."""
        if kind == WAL_DELETE:
            self._logged.pop(head.context_id, None)
        else:
            self._logged[head.context_id] = (head.head_turn_id, head.head_depth, head.flags,
                                             head.created_at_unix_ms)

    # --- turns -------------------------------------------------------------------------------

    def append_turn(self, context_id: int, payload: bytes, type_tag: int = 0, codec: int = 0,
                    expected_parent: int | None = None) -> Turn:
        return self.append_turns(context_id, [TurnInput(payload, type_tag, codec)], expected_parent)[0]

    def prepare_turns(self, inputs: Sequence[TurnInput | TurnBlobRef]) -> list[packer.Prepared]:
        """Hash and compress a batch's payloads for a later `append_turns(..., prepared=)`.
        No lock is taken, so a writer of many batches (an import) prepares the next batch
        while the store writes this one: zstd and BLAKE3 run beside the write's own work."""
        self._check_open()
        return self._prepare_all(inputs)

    @_writes
    def append_turns(self, context_id: int, inputs: Sequence[TurnInput | TurnBlobRef],
                     expected_parent: int | None = None,
                     prepared: Sequence[packer.Prepared] | None = None) -> list[Turn]:
        """Append turns in order as one durable batch; the head moves once they are durable.
        `prepared`: what `prepare_turns(inputs)` returned (else the payloads are prepared here)."""
        if not inputs:
            return []
        if prepared is not None and len(prepared) != len(inputs):
            raise ValueError(f"{len(prepared)} prepared payloads for {len(inputs)} turns")
        with self._gate.shared(), self._ctx_lock(context_id):
            with self._commit.writing():
                head = self.get_head(context_id)
                if expected_parent is not None and expected_parent != head.head_turn_id:
                    raise ParentConflict(context_id, expected_parent, head.head_turn_id)
                turns, head, ticket = self._write_turns(head, inputs, prepared)
            self._commit.wait(ticket)
            self._heads[context_id] = head
            for t in turns:  # referenced now: no longer in flight (GC rebuilds _pins only under the gate)
                self._pins.pop(t.payload_hash, None)
        return turns

    def _write_turns(self, head: ContextHead, inputs: Sequence[TurnInput | TurnBlobRef],
                     ready: Sequence[packer.Prepared] | None = None) -> tuple[list[Turn], ContextHead, int]:
        """Blobs first; then, under the write lock, TurnIDs, WAL records (with blob copies),
        turn records and jump pointers, each file written once per run that fits the WAL."""
        prepared = self._prepare_all(inputs) if ready is None else self._still_prepared(inputs, ready)
        copies = self._ensure_blobs(prepared)
        turns: list[Turn] = []
        ctx, created, flags = head.context_id, head.created_at_unix_ms, head.flags
        with self._write_lock:
            next_id = self._turns.count + 1
            wal: list[bytes] = []
            run: list[Turn] = []
            records: list[bytes] = []
            jumps: list[int] = []
            size = 0
            depths: dict[int, int] = {}  # this batch's turns: most jump lookups land here

            def depth_of(turn_id: int) -> int:
                d = depths.get(turn_id)
                return self._read_turn(turn_id).depth if d is None else d

            now = _now_ms()
            parent, depth = head.head_turn_id, head.head_depth
            for p, i, copy in zip(prepared, inputs, copies, strict=True):  # per turn: a hot loop
                parent_depth = depth
                depth = depth + 1 if parent != NO_TURN else 0
                t = Turn(next_id, parent, depth, i.type_tag, i.codec, p.hash, 0, now)
                record = encode_turn(t)
                rec = encode_wal_fields(WAL_TURN, ctx, next_id, depth, flags, created, record, copy)
                if wal and not self._wal.has_room(size + len(rec)):  # the run so far ends at `parent`
                    before = ContextHead(ctx, parent, depth - 1, created, flags)
                    self._flush_run(wal, run, records, jumps, before)
                    wal, run, records, jumps, size = [], [], [], [], 0
                wal.append(rec)
                size += len(rec)
                depths[next_id] = depth
                jump = self._turns.compute_jump(parent, parent_depth, depth_of)
                self._turns.remember_jump(next_id, jump)
                run.append(t)
                records.append(record)
                jumps.append(jump)
                turns.append(t)
                parent, next_id = next_id, next_id + 1
            head = ContextHead(ctx, parent, depth, created, flags)
            self._flush_run(wal, run, records, jumps, head)
            self._turn_cache.put_many((t.turn_id, t) for t in turns)
            ticket = self._commit.note_write(turns[-1].turn_id)
        return turns, head, ticket

    def _flush_run(self, wal: list[bytes], run: list[Turn], records: list[bytes], jumps: list[int],
                   head: ContextHead) -> None:
        """The WAL records of a run of new turns, then the turns; head is the run's last."""
        self._append_wal(b"".join(wal))
        self._turns.write_run(run, records, jumps)
        self._note_head(WAL_TURN, head)

    def _still_prepared(self, inputs: Sequence[TurnInput | TurnBlobRef],
                        ready: Sequence[packer.Prepared]) -> list[packer.Prepared]:
        """`ready` (prepared before the gate was taken), with each payload that was found stored
        then and is no longer (collected since) prepared again: the caller holds the gate now."""
        return [p if p.stored is not None or self._pack.has(p.hash) or p.hash in self._pending
                else packer.prepare(self, i.payload if isinstance(i, TurnInput) else i)
                for p, i in zip(ready, inputs, strict=True)]

    def _prepare_all(self, inputs: Sequence[TurnInput | TurnBlobRef]) -> list[packer.Prepared]:
        """Big batches compressed on PREPARE_THREADS of zstd's; small ones here, leaving their new blobs to
        the packer (packer.prepare with defer)."""
        items = [i.payload if isinstance(i, TurnInput) else i for i in inputs]
        if _parallel(items, _sizes(items)):
            return packer.prepare_many(self, items, PREPARE_THREADS)
        return [packer.prepare(self, i, defer=True) for i in items]

    def _map(self, fn: Callable[[Any], R], items: Sequence[Any], sizes: list[int] | None = None) -> list[R]:
        """fn over items (of `sizes` bytes each, else measured); a big batch on a small thread
        pool (zstd and blake3 release the GIL), handed over in a few runs of similar size, not
        item by item: one hand-off per item cost more than hashing and compressing a 10 KB line."""
        sizes = _sizes(items) if sizes is None else sizes
        if not _parallel(items, sizes):
            return [fn(i) for i in items]
        total = sum(sizes)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=PREPARE_THREADS, thread_name_prefix="store-prepare")
        runs, start, acc = [], 0, 0
        for i, size in enumerate(sizes):
            acc += size
            if acc >= total // (4 * PREPARE_THREADS):
                runs.append(items[start : i + 1])
                start, acc = i + 1, 0
        if start < len(items):
            runs.append(items[start:])
        done = self._pool.map(lambda run: [fn(i) for i in run], runs)
        return [r for run in done for r in run]

    def get_turn(self, turn_id: int) -> Turn:
        self._check_open()
        if not 0 < turn_id <= self._commit.durable_turn_id:
            raise UnknownTurn(turn_id)
        return self._read_turn(turn_id)

    def get_last(self, context_id: int, n: int) -> list[Turn]:
        """The last n turns of the context, oldest first."""
        return self._walk(self.get_head(context_id).head_turn_id, n)

    def get_before(self, context_id: int, before_turn_id: int, limit: int) -> Page:
        """Up to limit turns older than before_turn_id on the context's chain (NO_TURN: from the
        head), oldest first; next_cursor continues further back."""
        head = self.get_head(context_id)
        if before_turn_id == NO_TURN:
            start = head.head_turn_id
        else:
            b = self.get_turn(before_turn_id)
            top = self._read_turn(head.head_turn_id) if head.head_turn_id else None
            if top is None or top.depth < b.depth or \
                    self._turns.ancestor_at_depth(top, b.depth, self._read_turn).turn_id != b.turn_id:
                raise TurnNotInContext(context_id, before_turn_id)
            start = b.parent_turn_id
        turns = self._walk(start, limit)
        cursor = turns[0].turn_id if turns and turns[0].parent_turn_id != NO_TURN else NO_TURN
        return Page(turns, cursor)

    def range_by_depth(self, context_id: int, start_depth: int, limit: int) -> list[Turn]:
        """Turns at depths start_depth .. start_depth + limit - 1 of the context's chain; the
        jump pointers reach the window in O(log depth) reads."""
        head = self.get_head(context_id)
        if head.head_turn_id == NO_TURN or limit <= 0 or start_depth > head.head_depth or start_depth < 0:
            return []
        top_depth = min(head.head_depth, start_depth + limit - 1)
        top = self._turns.ancestor_at_depth(self._read_turn(head.head_turn_id), top_depth, self._read_turn)
        return self._walk(top.turn_id, top_depth - start_depth + 1)

    def chain(self, turn_id: int) -> list[Turn]:
        """Root → turn_id."""
        t = self.get_turn(turn_id)
        return self._walk(t.turn_id, t.depth + 1)

    def damaged_blobs(self) -> dict[bytes, str]:
        """The blobs whose only record in the pack fails its CRC, each with where (a read of the
        whole pack, fsck's walk: the records the index covers are not re-checked on open).  A
        damaged record stays until the same bytes are stored again; this names what it holds."""
        self._check_open()
        with open(self.root / PACK, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if not size:
                return {}
            with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mm:
                scan = scan_pack(mm)
        good = {hdr.hash for _, hdr in scan.records}
        return {hdr.hash: f"its record at offset {off} of {PACK} failed its CRC"
                for off, hdr in scan.damaged if hdr.hash not in good}

    def unreadable_chains(self, turn_ids: Sequence[int]) -> dict[int, StoreError]:
        """Of `turn_ids`, those whose chain (the turn and its ancestors) holds a turn record that
        cannot be read, each with why: a damaged `turns.log` record that no WAL copy repaired
        makes every chain through it unreadable for good, and its users must drop those heads
        (what `fsck` reports, before `fsck --repair`).  Shared ancestors are read once."""
        self._check_open()
        fine = bytearray(self._turns.count + 1)
        bad: dict[int, StoreError] = {}
        out: dict[int, StoreError] = {}
        for start in turn_ids:
            path, tid, why = [], start, None
            while tid != NO_TURN and why is None and not (0 < tid < len(fine) and fine[tid]):
                if (why := bad.get(tid)) is not None:
                    break
                path.append(tid)
                try:
                    parent = self.get_turn(tid).parent_turn_id
                except (CorruptRecord, UnknownTurn) as exc:
                    why = exc
                    break
                if parent >= tid:
                    why = CorruptRecord(LOG, (tid - 1) * TURN_SIZE, f"parent {parent} is not older")
                tid = parent
            for t in path:
                if why is None:
                    fine[t] = 1
                else:
                    bad[t] = why
            if why is not None:
                out[start] = why
        return out

    def payloads(self, turns: Sequence[Turn]) -> list[bytes]:
        self._check_open()
        out: list[bytes] = []
        with self._gate.shared():
            for t in turns:
                data = self._blob_cache.get(t.payload_hash)
                out.append(data if data is not None else self._payload(t, t.payload_hash))
        return out

    # --- patches -----------------------------------------------------------------------------

    @_writes
    def patch(self, target_turn_id: int, new_payload: bytes) -> Patch:
        """Overlay a new payload on a turn (the turn itself never changes)."""
        self.get_turn(target_turn_id)
        h = self.put_blob(new_payload)
        with self._gate.shared():
            p = self._patches.add(target_turn_id, h, PATCH_REPLACE)
            self._pins.pop(h, None)
        return p

    @_writes
    def tombstone(self, target_turn_id: int) -> Patch:
        self.get_turn(target_turn_id)
        with self._gate.shared():
            return self._patches.add(target_turn_id, ZERO_HASH, PATCH_TOMBSTONE)

    @property
    def patch_seq(self) -> int:
        """The newest patch seq (0: none): pass as as_of_seq to pin a view."""
        return self._patches.seq

    def payload_of(self, turn: Turn, as_of_seq: int | None = None) -> bytes | None:
        """The turn's payload with the patches up to as_of_seq (None: all); None if tombstoned."""
        self._check_open()
        p = self._patches.effective(turn.turn_id, as_of_seq)
        if p is not None and p.flags == PATCH_TOMBSTONE:
            return None
        h = turn.payload_hash if p is None else p.new_payload_hash
        data = self._blob_cache.get(h)
        if data is not None:
            return data
        with self._gate.shared():
            return self._payload(turn, h)

    def patches(self) -> list[Patch]:
        return self._patches.all()

    # --- GC and life cycle -------------------------------------------------------------------

    @_writes
    def gc(self, on_phase: Callable[[str], None] | None = None) -> GCStats:
        """Mark blobs reachable from live heads, patches and recent put_blobs; compact the pack.
        on_phase(name) is called after each durable step (tests kill the process there)."""
        phase = on_phase or (lambda _name: None)
        started = time.monotonic()
        with self._gate.exclusive():
            now = time.monotonic()
            self._pins = {h: t for h, t in self._pins.items() if now - t < self.config.gc_grace_seconds}
            live = mark(self._heads.values(), self._read_turn, self._turns.count, self._patches.all(),
                        self._pins)
            phase("marked")
            with self._write_lock:  # the WAL must not name blobs the sweep drops
                checkpoint.run(self)
            with self._write_lock, self._sync_lock:
                kept, dropped, freed = self._pack.compact(live, phase)
                self._pack_synced = self._pack.end
            self._blob_cache.discard_if(lambda h: h not in live)
        return GCStats(kept, dropped, freed, self._pack.end, time.monotonic() - started)

    @_writes
    def checkpoint(self) -> None:
        """Snapshot every head now and start a new WAL generation (the background thread does
        this when the WAL is half full; fault-injection tests call it directly)."""
        with self._gate.shared(), self._write_lock:
            checkpoint.run(self)

    def close(self) -> None:
        if self._closed:
            return
        if self.config.read_only:  # nothing was written: nothing to checkpoint or trim
            with self._gate.exclusive(), self._write_lock:
                self._closed = True
                self._close_files(trim=False)
            return
        self._stopping = True
        self._wake.set()
        self._thread.join()
        error: StoreFailed | None = None
        with self._gate.exclusive(), self._write_lock:
            self._closed = True  # a flush behind not yet begun does nothing now; one begun is waited for
            with self._flushing_lock:
                flushing = self._flushing
            if flushing is not None:
                with contextlib.suppress(BaseException):  # what it met failed the store already
                    flushing.result()
            untouched = self._written() == self._opened
            try:
                if self._failed is None:
                    # a bulk import's checkpoints were not synced
                    if self._wal.pos or not self.config.durable:
                        checkpoint.run(self, sync=True)
                    self._turns.sync()
                    self._pack.flush_for_close()
            except OSError as exc:
                if untouched and disk_full(exc):  # a read on a full disk (recovery left its
                    log.info("%s: no room to checkpoint at close: %s", self.root, exc)  # checkpoint)
                else:
                    error = self._fail(exc)
            if self._failed is not None:
                self._close_failed()
            failed = self._failed is not None  # then nothing more is written: the disk may be gone
            if self._next_fd is not None:
                os.close(self._next_fd)
                if not failed:  # else the next open removes it
                    (self.root / headwal.NEXT).unlink()
            self._close_files(trim=not failed)
        if error is not None:
            raise error

    def _close_files(self, trim: bool) -> None:
        self._wal.close(trim=trim)
        self._pack.close()
        self._turns.close()
        self._patches.close()
        if self._pool is not None:
            self._pool.shutdown()
        os.close(self._lock_fd)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def rebuild_index(self) -> None:
        """Rebuild blobs.idx from the pack (fsck --repair)."""
        with self._gate.exclusive():
            self._pack.rebuild_index()

    # --- introspection for fsck and tests ------------------------------------------------------

    @property
    def turn_count(self) -> int:
        return self._commit.durable_turn_id

    def blob_hashes(self) -> list[bytes]:
        return [*self._pack.hashes(), *self._pending]

    def stored_size(self, h: bytes) -> int:
        """The bytes of blob h's stored form in the pack; for one an append left raw in the WAL,
        what packing it will store (compressed here to count: nothing is written).  UnknownBlob
        when the store lacks it."""
        self._check_open()
        with self._gate.shared():
            loc = self._pack.locate(h)
            waiting = self._pending.get(h) if loc is None else None
        if loc is not None:
            return loc.stored_len
        if waiting is None:
            raise UnknownBlob(h)
        return len(packer.compress(self, h, waiting).stored or b"")

    @property
    def unpacked_bytes(self) -> int:
        """What the blobs appends left raw in the WAL will add to the pack and its index once
        packed (a checkpoint packs them): counted without packing them, so that a read (`status`)
        writes nothing."""
        return sum(BLOB_OVERHEAD + IDX_ENTRY.size + self.stored_size(h) for h in list(self._pending))

    @property
    def unwritten_index_bytes(self) -> int:
        """Bytes of blob index entries kept in memory only, not in blobs.idx yet (it is written
        whole at a fold or a GC): what the data files will grow by for the blobs packed so far."""
        with self._gate.shared():
            return (len(self._pack) - self._pack.indexed) * IDX_ENTRY.size
