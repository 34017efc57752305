"""Delete and mark-and-sweep GC, including GCs killed by SIGKILL at each durable step."""
from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from store import Store, StoreConfig, TurnInput, UnknownBlob
from store.files import blobpack
from store.fsck import fsck

REPO = Path(__file__).resolve().parents[2]


def blob(i: int, size: int = 3000) -> bytes:
    return random.Random(i).randbytes(size)


def build(path: Path) -> tuple[dict[int, list[bytes]], list[bytes]]:
    """Contexts keep and drop; returns live payloads per kept context and the dead payloads."""
    with Store.open(path) as s:
        keep = s.create_context().context_id
        s.append_turns(keep, [TurnInput(blob(i)) for i in range(40)])
        fork = s.fork(20).context_id  # shares turns 1..20 with keep
        s.append_turns(fork, [TurnInput(blob(100 + i)) for i in range(10)])
        drop = s.create_context().context_id
        s.append_turns(drop, [TurnInput(blob(200 + i)) for i in range(30)])
        s.append_turn(drop, blob(5))  # also used by a live context: must survive
        s.delete_context(drop)
        patched = s.get_last(keep, 1)[0]
        s.patch(patched.turn_id, blob(300))
        live = {keep: [blob(i) for i in range(40)],
                fork: [blob(i) for i in range(20)] + [blob(100 + i) for i in range(10)]}
    return live, [blob(200 + i) for i in range(30)]


def check_live(s: Store, live: dict[int, list[bytes]]) -> None:
    for ctx, payloads in live.items():
        assert s.payloads(s.get_last(ctx, 1000)) == payloads
    last = s.get_last(min(live), 1)[0]
    assert s.payload_of(last) == blob(300)


def test_delete_then_gc_drops_only_dead_blobs(tmp_path: Path) -> None:
    path = tmp_path / "s"
    live, dead = build(path)
    before = os.path.getsize(path / "blobs.pack")
    with Store.open(path) as s:
        stats = s.gc()
        assert stats.dropped_blobs == 30 and stats.live_blobs == 40 + 10 + 1
        assert stats.bytes_freed > 30 * 3000 and stats.pack_bytes == before - stats.bytes_freed
        check_live(s, live)
        for d in dead:
            assert not s.has_blob(__import__("blake3").blake3(d).digest())
        with pytest.raises(UnknownBlob):  # a deleted context's turns stay, their blobs do not
            s.get_blob(s.get_turn(80).payload_hash)
    assert os.path.getsize(path / "blobs.pack") == before - stats.bytes_freed
    with Store.open(path) as s:
        assert s.recovery_notes == []
        check_live(s, live)
    assert fsck(path, full=True).ok


def test_in_flight_blobs_survive_gc_until_referenced_or_expired(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with Store.open(path) as s:
        ctx = s.create_context().context_id
        h = s.put_blob(blob(1))  # written, no turn references it yet
        assert s.gc().live_blobs == 1 and s.get_blob(h) == blob(1)
        s.append_turn(ctx, blob(1))
        s.gc()
        assert s.get_blob(h) == blob(1)
    with Store.open(path, StoreConfig(gc_grace_seconds=0)) as s:
        orphan = s.put_blob(blob(2))
        s.gc()
        assert not s.has_blob(orphan) and s.get_blob(h) == blob(1)


def test_appends_and_gc_run_concurrently(tmp_path: Path) -> None:
    import threading

    path = tmp_path / "s"
    with Store.open(path) as s:
        ctxs = [s.create_context().context_id for _ in range(4)]
        errors: list[BaseException] = []

        def writer(ctx: int) -> None:
            try:
                for i in range(60):
                    s.append_turn(ctx, blob(ctx * 1000 + i, 500))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=writer, args=(c,)) for c in ctxs]
        for t in threads:
            t.start()
        for _ in range(5):
            s.gc()
        for t in threads:
            t.join()
        assert not errors
        for c in ctxs:
            assert s.payloads(s.get_last(c, 100)) == [blob(c * 1000 + i, 500) for i in range(60)]
    assert fsck(path, full=True).ok


GC_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from store import Store
    path, at = sys.argv[1], sys.argv[2]
    def on_phase(name):
        if name == at:
            os.kill(os.getpid(), signal.SIGKILL)
    s = Store.open(path)
    s.gc(on_phase=on_phase)
    print("finished without being killed")
    """
)


def test_a_gc_with_nothing_to_collect_leaves_the_pack_as_it_is(tmp_path: Path) -> None:
    """Every blob live and the records end to end: nothing is copied, no step is taken (the
    whole pack was rewritten on every such `gc`); the next GC with garbage compacts."""
    path = tmp_path / "s"
    live, _ = build(path)
    with Store.open(path) as s:
        s.gc()
    pack = path / "blobs.pack"
    before = pack.stat()
    with Store.open(path) as s:
        phases: list[str] = []
        stats = s.gc(on_phase=phases.append)
        assert (stats.dropped_blobs, stats.bytes_freed, stats.live_blobs) == (0, 0, 40 + 10 + 1)
        assert phases == ["marked"]  # no new pack, no swap
        assert (pack.stat().st_ino, pack.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
        check_live(s, live)
        doomed = s.create_context().context_id
        s.append_turns(doomed, [TurnInput(blob(400 + i)) for i in range(5)])
        s.delete_context(doomed)
    with Store.open(path, StoreConfig(gc_grace_seconds=0)) as s:
        stats = s.gc()
        assert stats.dropped_blobs == 5 and stats.bytes_freed > 5 * 3000
        check_live(s, live)
    assert pack.stat().st_ino != before.st_ino
    assert fsck(path, full=True).ok


@pytest.mark.parametrize("phase", ["marked", "new-pack-written", "pack-swapped", "index-swapped"])
def test_gc_killed_at_each_step_leaves_every_live_blob(tmp_path: Path, phase: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blobpack, "FOLD_BYTES", 0)  # blobs.idx describes the pack before the GC
    path = tmp_path / "s"
    live, _ = build(path)
    proc = subprocess.run([sys.executable, "-c", GC_CHILD, str(path), phase], cwd=REPO,
                          capture_output=True, timeout=60)
    assert proc.returncode == -9, proc.stdout + proc.stderr
    with Store.open(path) as s:
        check_live(s, live)
        if phase == "pack-swapped":  # the old index does not describe the new pack
            assert any("blobs.idx" in n for n in s.recovery_notes)
    assert not list(path.glob("*.gc"))
    assert fsck(path, full=True).ok
    with Store.open(path) as s:  # and a GC run to the end afterwards still works
        s.gc()
        check_live(s, live)
