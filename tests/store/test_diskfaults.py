"""A failing disk, injected at the os-call layer: EIO and ENOSPC at every step.

For each operation (a single append, a batch, a batch big enough for one pack write of all
its new blobs, a fetch's staged blobs, an append with a big blob, a new context, a
patch, a checkpoint that also rewrites blobs.idx, a GC), a clean run counts the calls it
makes to os.write, os.pwrite, os.fdatasync, os.fsync, os.replace and os.rename; then each
call in turn fails once with EIO and once with ENOSPC, and each write is also cut short
(half its bytes written, the count returned, as a file system that fills up mid-record
does; the write of the rest then gets ENOSPC).  Each time: the operation raises
StoreFailed (StoreFull for ENOSPC), the store refuses the next write, no head moved in
memory, and after close and reopen every acknowledged turn is there with its payload, no
head names a turn that was not acknowledged, and fsck is clean.

The fault is transient (the next call succeeds), as after a lost write that the kernel
reported once: a disk that stays broken is what tests/store/test_blockdev.py runs on real devices.
"""
from __future__ import annotations

import errno
import os
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from store import Store, StoredBlob, TurnBlobRef, TurnInput
from store import api as store_api
from store.codec import blob_hash
from store.durability import checkpoint
from store.errors import StoreFailed, StoreFull
from store.fsck import fsck
from store.layout import CODEC_RAW
from store.service.client import StoreClient
from store.service.server import StoreServer
from store.types import NO_TURN

WRAPPED = ("write", "pwrite", "fdatasync", "fsync", "replace", "rename")


@dataclass
class FaultyOS:
    """Wraps the os calls that write or flush; counts them while armed and fails the Nth."""

    fail_at: int | None = None
    err: int = errno.EIO
    short: bool = False
    """The failing call is a write that writes half its bytes; the next write call raises."""
    armed: bool = False
    calls: list[str] = field(default_factory=list)
    failed: str | None = None

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in WRAPPED:
            monkeypatch.setattr(os, name, self._wrap(name, getattr(os, name)))

    def _wrap(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.armed:
                n = len(self.calls)
                self.calls.append(name)
                if n == self.fail_at and self.short:
                    self.failed = f"short {name} (call {n})"
                    data = memoryview(args[1])
                    return real(args[0], data[: len(data) // 2], *args[2:])
                if n == self.fail_at or (self.failed and self.short and name in ("write", "pwrite")):
                    self.failed = self.failed or f"{name} (call {n})"
                    raise OSError(self.err, os.strerror(self.err))
            return real(*args, **kwargs)
        return call


@dataclass
class Acked:
    """What the store acknowledged: turn id -> payload, context -> head."""

    turns: dict[int, bytes] = field(default_factory=dict)
    heads: dict[int, int] = field(default_factory=dict)


def _payload(rng: random.Random, n: int) -> bytes:
    return rng.randbytes(n)


def _setup(path: Path) -> tuple[Store, Acked]:
    """A store with two contexts, a deleted one (GC has something to drop) and a checkpoint
    behind some of its turns."""
    rng = random.Random(7)
    acked = Acked()
    s = Store.open(path)
    for _ in range(2):
        ctx = s.create_context().context_id
        for _ in range(3):
            t = s.append_turn(ctx, p := _payload(rng, 300))
            acked.turns[t.turn_id] = p
        acked.heads[ctx] = s.get_head(ctx).head_turn_id
    s.checkpoint()
    gone = s.create_context().context_id
    s.append_turn(gone, _payload(rng, 5000))
    s.delete_context(gone)
    ctx = next(iter(acked.heads))
    t = s.append_turn(ctx, p := _payload(rng, 200))
    acked.turns[t.turn_id] = p
    acked.heads[ctx] = t.turn_id
    return s, acked


def _append(s: Store, acked: Acked) -> None:
    ctx = next(iter(acked.heads))
    s.append_turn(ctx, b"one more turn " * 20)


def _batch(s: Store, acked: Acked) -> None:
    ctx = list(acked.heads)[1]
    s.append_turns(ctx, [TurnInput(b"batch %d " % i * 40) for i in range(5)])


def _big(s: Store, acked: Acked) -> None:
    """A blob too big for the WAL copy: the pack is flushed before the WAL."""
    ctx = next(iter(acked.heads))
    s.append_turn(ctx, random.Random(3).randbytes(100_000))


def _big_batch(s: Store, acked: Acked) -> None:
    """A batch big enough for the prepare threads: its new blobs go to the pack in one write
    (BlobPack.append_many), one of them too big for the WAL copy, one stored already.  The
    rest compress well: the WAL stays under a quarter full (no checkpointer thread's writes)."""
    rng = random.Random(5)
    ctx = list(acked.heads)[1]
    payloads = [_payload(rng, 200) * 80 for _ in range(18)]
    payloads += [_payload(rng, 100_000), next(iter(acked.turns.values()))]
    s.append_turns(ctx, [TurnInput(p) for p in payloads])


def _staged(s: Store, acked: Acked) -> None:
    """A fetch's lines staged in stored form, many at once: one pack write, one commit."""
    rng = random.Random(6)
    s.put_stored_blobs([_stored(_payload(rng, 20_000)) for _ in range(20)])


def _stored(payload: bytes) -> StoredBlob:
    return StoredBlob(blob_hash(payload), CODEC_RAW, len(payload), payload)


def _context(s: Store, acked: Acked) -> None:
    s.create_context()


def _patch(s: Store, acked: Acked) -> None:
    s.patch(next(iter(acked.turns)), b"patched payload")


def _checkpoint(s: Store, acked: Acked) -> None:
    s.checkpoint()  # INDEX_TAIL_MAX is 0 here: it rewrites blobs.idx too


def _gc(s: Store, acked: Acked) -> None:
    s.gc()


OPERATIONS: dict[str, Callable[[Store, Acked], None]] = {
    "append": _append, "batch": _batch, "big-batch": _big_batch, "staged-blobs": _staged,
    "big-blob": _big, "create-context": _context,
    "patch": _patch, "checkpoint+index": _checkpoint, "gc": _gc,
}


@pytest.fixture(autouse=True)
def _index_every_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checkpoint, "INDEX_TAIL_MAX", 0)


def _steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, op: Callable[[Store, Acked], None]) -> list[str]:
    """The os calls a clean run of op makes."""
    faulty = FaultyOS()
    faulty.install(monkeypatch)
    s, acked = _setup(tmp_path / "clean")
    faulty.armed = True
    op(s, acked)
    faulty.armed = False
    s.close()
    return faulty.calls


def _open_files(path: Path) -> list[str]:
    """Files under path that this process still has open (Linux /proc; elsewhere none)."""
    fds = Path("/proc/self/fd")
    if not fds.exists():
        return []
    out = []
    for fd in fds.iterdir():
        try:
            target = os.readlink(fd)
        except FileNotFoundError:  # the fd of the listing itself, closed meanwhile
            continue
        if target.startswith(str(path)):
            out.append(target)
    return out


def _check_reopened(path: Path, acked: Acked) -> None:
    with Store.open(path) as s:
        for tid, payload in acked.turns.items():
            assert s.payloads([s.get_turn(tid)]) == [payload], f"acknowledged turn {tid} lost"
        for head in s.list_contexts():
            for t in s.get_last(head.context_id, 1000):
                assert t.turn_id in acked.turns, f"context {head.context_id}: turn {t.turn_id} never acked"
        for ctx, tid in acked.heads.items():
            assert s.get_head(ctx).head_turn_id == tid
    report = fsck(path)
    assert report.ok, report.summary()


def _iter_faults(steps: list[str]) -> Iterator[tuple[int, int, bool]]:
    for i, name in enumerate(steps):
        yield i, errno.EIO, False
        yield i, errno.ENOSPC, False
        if name in ("write", "pwrite"):
            yield i, errno.ENOSPC, True


@pytest.mark.parametrize("name", list(OPERATIONS))
def test_every_step_fails_closed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    op = OPERATIONS[name]
    steps = _steps(tmp_path, monkeypatch, op)
    assert {"pwrite", "fdatasync"} <= set(steps) or name in ("patch", "checkpoint+index", "gc"), steps
    assert any(c in ("fdatasync", "fsync") for c in steps), f"{name} never flushes: {steps}"
    if name == "checkpoint+index":  # heads.tbl.tmp, heads.tbl.prev, heads.tbl, blobs.idx
        assert steps.count("replace") == 4, steps
    for i, err, short in _iter_faults(steps):
        path = tmp_path / f"{i}-{errno.errorcode[err]}{'-short' * short}"
        faulty = FaultyOS(fail_at=i, err=err, short=short)
        with monkeypatch.context() as m:
            faulty.install(m)
            s, acked = _setup(path)
            heads_before = {h.context_id: h.head_turn_id for h in s.list_contexts()}
            faulty.armed = True
            with pytest.raises(StoreFailed) as info:
                op(s, acked)
            faulty.armed = False
            where = f"{name}: {errno.errorcode[err]} at {faulty.failed} of {steps}"
            assert isinstance(info.value, StoreFull) == (err == errno.ENOSPC), where
            assert info.value.errno == err, where
            assert {h.context_id: h.head_turn_id for h in s.list_contexts()} == heads_before, where
            shown = {t.turn_id for h in s.list_contexts() for t in s.get_last(h.context_id, 1000)}
            assert shown <= set(acked.turns), where
            with pytest.raises(StoreFailed):
                s.append_turn(next(iter(acked.heads)), b"refused")
            with pytest.raises(StoreFailed):
                s.put_blob(b"refused too")
            with pytest.raises(StoreFailed):
                s.checkpoint()
            s.close()
            assert not _open_files(path), f"{where}: still open after close: {_open_files(path)}"
        try:
            _check_reopened(path, acked)
        except AssertionError as exc:
            raise AssertionError(f"{where}: {exc}") from None


def test_failed_sync_fails_every_waiter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fsyncgate: a writer whose bytes the failed flush covered is never acknowledged by a
    later flush.  Two writers on two contexts; the group's one fdatasync fails: both raise."""
    s = Store.open(tmp_path / "s")
    a, b = s.create_context().context_id, s.create_context().context_id
    real = os.fdatasync
    gate = threading.Event()
    calls = []

    def failing(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 1:
            gate.wait(5)  # the second writer writes its records meanwhile
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fdatasync", failing)
    errors: dict[str, BaseException] = {}

    def writer(name: str, ctx: int) -> None:
        try:
            s.append_turn(ctx, name.encode() * 10)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertions
            errors[name] = exc

    t1 = threading.Thread(target=writer, args=("a", a))
    t1.start()
    while not calls:
        threading.Event().wait(0.001)
    t2 = threading.Thread(target=writer, args=("b", b))
    t2.start()
    while s._commit._written < 2:  # b has its ticket: its bytes are behind the failing flush
        threading.Event().wait(0.001)
    gate.set()
    t1.join(10)
    t2.join(10)
    assert set(errors) == {"a", "b"} and all(isinstance(e, StoreFailed) for e in errors.values())
    assert s.get_head(a).head_turn_id == NO_TURN and s.get_head(b).head_turn_id == NO_TURN
    assert len(calls) == 1, "the failed flush was retried"
    s.close()
    monkeypatch.setattr(os, "fdatasync", real)
    with Store.open(tmp_path / "s") as s2:
        assert s2.get_head(a).head_turn_id == NO_TURN and s2.get_head(b).head_turn_id == NO_TURN
        s2.append_turn(a, b"after recovery")


async def test_service_reports_a_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC behind the service arrives as STORE_FAILED (24) with the errno: the client
    raises StoreFull, and the next write StoreFull again."""
    with Store.open(tmp_path / "store") as s:
        async with StoreServer(s, tmp_path / "store.sock") as srv:
            assert srv.socket_path is not None
            c = await StoreClient.connect(srv.socket_path)
            try:
                ctx = (await c.create_context()).context_id
                first = await c.append_turn(ctx, b"kept")
                faulty = FaultyOS(fail_at=0, err=errno.ENOSPC)
                faulty.install(monkeypatch)
                faulty.armed = True
                with pytest.raises(StoreFull) as info:
                    await c.append_turn(ctx, b"refused by a full disk")
                faulty.armed = False
                assert info.value.errno == errno.ENOSPC and "No space left" in str(info.value)
                with pytest.raises(StoreFull):
                    await c.create_context()
                assert (await c.get_head(ctx)).head_turn_id == first.turn_id
            finally:
                await c.close()


def test_a_full_disk_at_open_leaves_reads_working(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every open pre-zeroes its head WAL (1 MiB).  On a disk with no room left for that the
    store still opens: reads see what is durable (`ls`, `cat` on a full disk), the first
    write fails closed (StoreFull), and after room is made the next open writes again."""
    with Store.open(tmp_path / "s") as s:
        ctx = s.create_context().context_id
        kept = s.append_turn(ctx, b"kept").turn_id
    real = os.pwrite

    def full(fd: int, data: Any, offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", full)
    with Store.open(tmp_path / "s") as s:
        assert s.payloads([s.get_turn(kept)]) == [b"kept"] and s.failure is None
        with pytest.raises(StoreFull):
            s.append_turn(ctx, b"no room")
        assert s.failure == os.strerror(errno.ENOSPC)  # what `p2pnode status` shows of the node's store
    monkeypatch.setattr(os, "pwrite", real)
    with Store.open(tmp_path / "s") as s:
        assert s.payloads([s.get_turn(kept)]) == [b"kept"]
        s.append_turn(ctx, b"room again")
    assert fsck(tmp_path / "s").ok


def test_an_index_not_rewritable_at_open_leaves_reads_working(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A share that filled the disk leaves pack records past blobs.idx; each open folds them into
    a new index, and on a full disk that write failed the open: `ls` and `cat` exited 1 until
    room was made.  (Here blobs.idx is removed, which makes the open rebuild it the same way.)"""
    with Store.open(tmp_path / "s") as s:
        ctx = s.create_context().context_id
        kept = [s.append_turn(ctx, b"kept %d" % i).turn_id for i in range(3)]
    (tmp_path / "s" / "blobs.idx").unlink()
    real = os.write

    def full(fd: int, data: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    # injected: an ordinary user cannot fill a real disk here (the root part fills a real loop device)
    monkeypatch.setattr(os, "write", full)
    with Store.open(tmp_path / "s") as s:
        assert s.payloads([s.get_turn(t) for t in kept]) == [b"kept 0", b"kept 1", b"kept 2"]
    assert not [p for p in (tmp_path / "s").iterdir() if p.name.endswith(".tmp")]  # no temp file left
    monkeypatch.setattr(os, "write", real)
    with Store.open(tmp_path / "s") as s:
        assert s.payloads([s.get_turn(kept[0])]) == [b"kept 0"]
    assert (tmp_path / "s" / "blobs.idx").exists() and fsck(tmp_path / "s").ok


def test_a_full_disk_after_a_failed_write_leaves_reads_working(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that met the full disk leaves head WAL records since the last checkpoint; the
    next open replays them and checkpoints, and that checkpoint's new 1 MiB WAL met the full
    disk too: `ls`, `cat` and `status` exited 1 until room was made.  Now the open leaves the
    checkpoint for later (noted), reads work, a close after reads writes nothing, the first
    write is StoreFull, and with room again the next open checkpoints and writes.  (ENOSPC is
    injected: an ordinary user in CI cannot fill a real file system; the root tests in
    test_blockdev.py fill a real one.)"""
    path = tmp_path / "s"
    s, acked = _setup(path)
    faulty = FaultyOS(fail_at=0, err=errno.ENOSPC)
    with monkeypatch.context() as m:
        faulty.install(m)
        faulty.armed = True
        with pytest.raises(StoreFull):
            _big(s, acked)
        faulty.armed = False
        s.close()
    gens = sorted(p.name for p in path.iterdir() if p.name.startswith("heads.wal"))

    def full(*args: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as m:
        for name in ("write", "pwrite"):
            m.setattr(os, name, full)
        for _ in range(2):  # and again: nothing that first open left makes the second one fail
            with Store.open(path) as s:
                assert any("checkpoint not written" in n for n in s.recovery_notes), s.recovery_notes
                for tid, payload in acked.turns.items():
                    assert s.payloads([s.get_turn(tid)]) == [payload]
        with Store.open(path) as s, pytest.raises(StoreFull):
            _append(s, acked)
    assert sorted(p.name for p in path.iterdir() if p.name.startswith("heads.wal")) == gens, "WAL left"
    _check_reopened(path, acked)
    with Store.open(path) as s:
        assert not s.recovery_notes
        _append(s, acked)


def _pack_syncs(monkeypatch: pytest.MonkeyPatch, fail_behind: bool) -> list[str]:
    """os.fdatasync counted by thread name; `fail_behind`: EIO for the flush behind staging."""
    real, calls = os.fdatasync, []

    def sync(fd: int) -> None:
        calls.append(threading.current_thread().name)
        if fail_behind and calls[-1] == "store-flush":
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(fd)

    monkeypatch.setattr(os, "fdatasync", sync)
    return calls


def _wait_for(done: Callable[[], bool]) -> None:
    for _ in range(500):  # 5 s at most
        if done():
            return
        threading.Event().wait(0.01)
    raise AssertionError("not done in 5 s")


def test_staged_blobs_are_synced_behind_their_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fetch's staged lines (put_stored_blobs(verified=True): no sync waited for) are synced
    on a thread of their own once FLUSH_BEHIND bytes of them wait, so that the append that
    first references them (the fetch's commit, after its last byte) syncs only the rest."""
    monkeypatch.setattr(store_api, "FLUSH_BEHIND", 64 << 10)
    s, acked = _setup(tmp_path / "s")
    syncs = _pack_syncs(monkeypatch, fail_behind=False)
    rng = random.Random(8)
    staged = [_stored(_payload(rng, 20_000)) for _ in range(6)]
    s.put_stored_blobs(staged[:2], verified=True)  # 40 KB: not yet
    threading.Event().wait(0.05)
    assert syncs == []
    s.put_stored_blobs(staged[2:], verified=True)
    _wait_for(lambda: "store-flush" in syncs)
    ctx = next(iter(acked.heads))
    turns = s.append_turns(ctx, [TurnBlobRef(b.hash) for b in staged])
    acked.turns.update({t.turn_id: b.stored for t, b in zip(turns, staged, strict=True)})
    acked.heads[ctx] = turns[-1].turn_id
    s.close()
    _check_reopened(tmp_path / "s", acked)


def test_a_failed_sync_behind_staging_fails_the_store_closed(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """fsyncgate, for the sync behind staged blobs: once it failed (EIO), the append that
    would reference them raises StoreFailed (the kernel may have dropped those pages), no head
    moves, the store refuses writes until reopened, and a reopened store holds every
    acknowledged turn and nothing else."""
    monkeypatch.setattr(store_api, "FLUSH_BEHIND", 64 << 10)
    s, acked = _setup(tmp_path / "s")
    syncs = _pack_syncs(monkeypatch, fail_behind=True)
    rng = random.Random(9)
    staged = [_stored(_payload(rng, 20_000)) for _ in range(6)]
    s.put_stored_blobs(staged, verified=True)
    _wait_for(lambda: s.failure is not None)
    assert syncs == ["store-flush"]
    ctx = next(iter(acked.heads))
    heads = {h.context_id: h.head_turn_id for h in s.list_contexts()}
    with pytest.raises(StoreFailed) as info:
        s.append_turns(ctx, [TurnBlobRef(b.hash) for b in staged])
    assert info.value.errno == errno.EIO
    assert {h.context_id: h.head_turn_id for h in s.list_contexts()} == heads
    with pytest.raises(StoreFailed):
        s.put_blob(b"refused")
    s.close()
    monkeypatch.undo()
    _check_reopened(tmp_path / "s", acked)


def test_stagers_at_once_start_one_sync_behind_at_a_time(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Several fetches staging at once (a node's) start one sync behind their writes at a time,
    and close waits for the one running: none outlives the store's files."""
    monkeypatch.setattr(store_api, "FLUSH_BEHIND", 16 << 10)
    s, acked = _setup(tmp_path / "s")
    real, running, most, lock = os.fdatasync, [0], [0], threading.Lock()

    def slow(fd: int) -> None:
        behind = threading.current_thread().name == "store-flush"
        if behind:
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            threading.Event().wait(0.02)
        try:
            real(fd)
        finally:
            if behind:
                with lock:
                    running[0] -= 1

    monkeypatch.setattr(os, "fdatasync", slow)

    def stager(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(10):
            s.put_stored_blobs([_stored(_payload(rng, 10_000)) for _ in range(3)], verified=True)

    threads = [threading.Thread(target=stager, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    s.close()
    assert most[0] == 1 and running[0] == 0
    _check_reopened(tmp_path / "s", acked)
