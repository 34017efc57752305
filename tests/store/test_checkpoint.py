"""Checkpoints off the append path: the checkpointer thread switches WAL generations under
the write lock, then syncs and writes the snapshot while appends go on into the new WAL.
(And, at the end, the fork check that GC's keep-live-chains rule needs.)

The crash tests are real: a child process stops its checkpointer in the window between the
switch and the snapshot (the snapshot write blocks), keeps appending durably into the new
generation, reports what was acknowledged and SIGKILLs itself.
"""
from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from store import Store, TurnInput, UnknownBlob
from store.files import headwal, snapshot
from store.fsck import fsck
from store.layout import Snapshot

REPO = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import json, os, signal, sys, threading
    from store import Store
    from store.files import headwal, snapshot
    from store.files.headwal import WAL_BYTES
    path, after = sys.argv[1], int(sys.argv[2])
    blocked = threading.Event()
    real_write = snapshot.write_snapshot

    def write_snapshot(root, snap, durable):
        if threading.current_thread().name == "store-checkpoint":
            blocked.set()
            threading.Event().wait()  # the checkpointer never gets to write its snapshot
        real_write(root, snap, durable)

    snapshot.write_snapshot = write_snapshot
    s = Store.open(path)
    gen0 = s._wal.gen
    ctx = s.create_context().context_id
    acked, i = [], 0
    while not blocked.is_set() or after:
        if blocked.is_set():
            after -= 1
        payload = os.urandom(2000)  # incompressible: ~2.2 KB per WAL record
        acked.append([s.append_turn(ctx, payload).turn_id, payload.hex()])
        i += 1
        assert i < 10 * WAL_BYTES // 2000, "the checkpointer never started"
    print(json.dumps({"ctx": ctx, "acked": acked, "gen0": gen0, "gen": s._wal.gen}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def crash_mid_checkpoint(path: Path, after: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path), str(after)], cwd=REPO,
                          capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()
    return json.loads(proc.stdout)


def test_crash_between_switch_and_snapshot_loses_nothing(tmp_path: Path) -> None:
    path = tmp_path / "s"
    run = crash_mid_checkpoint(path, after=40)
    assert run["gen"] == run["gen0"] + 1, "the checkpointer switched once and stopped there"
    assert (path / headwal.wal_name(run["gen"])).exists()
    with Store.open(path) as s:  # the older snapshot + both WALs hold every acknowledged turn
        turns = s.get_last(run["ctx"], len(run["acked"]) + 5)
        assert [t.turn_id for t in turns] == [a[0] for a in run["acked"]]
        assert s.payloads(turns) == [bytes.fromhex(a[1]) for a in run["acked"]]
    assert fsck(path, full=True).ok


def test_crash_right_after_the_switch(tmp_path: Path) -> None:
    path = tmp_path / "s"
    run = crash_mid_checkpoint(path, after=0)
    with Store.open(path) as s:
        assert s.get_head(run["ctx"]).head_turn_id == run["acked"][-1][0]
        assert s.payloads([s.get_turn(run["acked"][-1][0])]) == [bytes.fromhex(run["acked"][-1][1])]
    assert fsck(path, full=True).ok


def test_the_checkpointer_checkpoints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The append that crosses half the WAL only wakes the checkpointer; the WAL generation
    moves on with the checkpointer writing the snapshots (an append checkpoints inline only
    if the WAL fills before the checkpointer got to run), and a reopen finds everything."""
    path = tmp_path / "s"
    calls: list[str] = []
    real_write = snapshot.write_snapshot

    def write_snapshot(root: Path, snap: Snapshot, durable: bool) -> None:
        calls.append(threading.current_thread().name)
        real_write(root, snap, durable)

    monkeypatch.setattr(snapshot, "write_snapshot", write_snapshot)
    s = Store.open(path)
    gen0 = s._wal.gen
    ctx = s.create_context().context_id
    payloads = [random.Random(i).randbytes(2000) for i in range(1200)]  # ~2.2 KB WAL records
    for p in payloads:
        s.append_turn(ctx, p)
    deadline = time.monotonic() + 10
    while s._wal.gen < gen0 + 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s._wal.gen >= gen0 + 2 and "store-checkpoint" in calls
    s.close()
    with Store.open(path) as s:
        assert s.payloads(s.get_last(ctx, 2000)) == payloads


def test_batches_bigger_than_the_wal_while_the_checkpointer_runs(tmp_path: Path) -> None:
    """A WAL that fills while a checkpoint is being finished grows past its pre-zeroed size."""
    path = tmp_path / "s"
    with Store.open(path) as s:
        ctx = s.create_context().context_id
        payloads = [b"%d " % i * 400 for i in range(3000)]
        for i in range(0, 3000, 100):
            s.append_turns(ctx, [TurnInput(p) for p in payloads[i:i + 100]])
    with Store.open(path) as s:
        assert s.payloads(s.get_last(ctx, 5000)) == payloads
    assert fsck(path, full=True).ok


IDLE_CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    from store import Store
    from store.files import headwal, snapshot
    s = Store.open(sys.argv[1])
    ctx = s.create_context().context_id
    n = 0
    while not os.path.exists(os.path.join(sys.argv[1], headwal.NEXT)):  # prepared once a quarter full
        s.append_turn(ctx, os.urandom(2000))
        n += 1
        assert n < headwal.WAL_BYTES // 2000, "the next generation was never prepared"
    while os.path.getsize(os.path.join(sys.argv[1], headwal.NEXT)) < headwal.WAL_BYTES:
        time.sleep(0.01)
    print(n, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_prepared_generation_left_by_a_crash_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / "s"
    proc = subprocess.run([sys.executable, "-c", IDLE_CHILD, str(path)], cwd=REPO,
                          capture_output=True, timeout=60)
    assert proc.returncode == -9, proc.stderr.decode()
    n = int(proc.stdout)
    assert (path / headwal.NEXT).stat().st_size == headwal.WAL_BYTES
    assert fsck(path).ok
    with Store.open(path) as s:
        assert len(s.get_last(s.list_contexts()[0].context_id, n + 5)) == n
    assert not (path / headwal.NEXT).exists() and fsck(path, full=True).ok  # close removes it


def test_fork_is_refused_where_gc_dropped_an_ancestors_payload(tmp_path: Path) -> None:
    """(The fork check lives next to GC's rule: live heads' chains keep their payloads.)  A
    deleted context's turn whose own payload survived GC (a live context shares it) but whose
    parent's did not is refused; turns on live chains still fork."""
    with Store.open(tmp_path / "s") as s:
        live = s.create_context().context_id
        kept = s.append_turn(live, b"shared by both")
        doomed = s.create_context().context_id
        s.append_turn(doomed, b"only the deleted context had this")
        top = s.append_turn(doomed, b"shared by both")
        s.delete_context(doomed)
        assert s.gc().dropped_blobs == 1
        with pytest.raises(UnknownBlob):
            s.fork(top.turn_id)
        fork = s.fork(kept.turn_id)
        assert s.payloads(s.get_last(fork.context_id, 5)) == [b"shared by both"]
