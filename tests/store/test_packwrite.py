"""A batch's new blobs go to blobs.pack in one write (BlobPack.append_many): a process killed
in the middle of that write, or at any moment of a run of such batches, loses no
acknowledged turn, leaves no head on an unwritten turn, and leaves a store that opens, passes
fsck and takes the same batch again.

The writer is a real child process killed with SIGKILL (the page cache keeps what it wrote,
as after any process crash).  The first test tears the write itself: the child's one pack
write puts down half its bytes and the process kills itself, so the torn tail is certain.
"""
from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import blake3

from store import Store, TurnInput
from store.fsck import fsck
from store.types import NO_TURN

CHILD = r"""
import os, random, signal, sys
from store import Store, TurnInput
from store.files import blobpack

path, mode, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
rng = random.Random(seed)

def batch():
    # lines of 6-30 KB that compress about tenfold, as a session's
    return [rng.randbytes(2000) * rng.randint(3, 15) for _ in range(24)]

with Store.open(path) as s:
    heads = s.list_contexts()
    ctx = heads[0].context_id if heads else s.create_context().context_id
    if mode == "tear":
        real = blobpack.write_at
        def torn(fd, data, off):
            if len(data) > 20_000:  # the batch's one pack write: half of it, then die
                real(fd, memoryview(data)[: len(data) // 2], off)
                os.kill(os.getpid(), signal.SIGKILL)
            real(fd, data, off)
        blobpack.write_at = torn
    for _ in range(2000):  # bounded: the parent kills it long before
        payloads = batch()
        for t, p in zip(s.append_turns(ctx, [TurnInput(p) for p in payloads]), payloads):
            os.write(1, b"%d %d %d %s\n" % (ctx, t.turn_id, t.depth, t.payload_hash.hex().encode()))
"""


def _run(path: Path, mode: str, seed: int, kill_after: float | None) -> dict[int, tuple[int, int, bytes]]:
    """The child's acknowledged turns: turn id -> (context, depth, payload hash)."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(path), mode, str(seed)],
                            stdout=subprocess.PIPE)
    try:
        if kill_after is not None:
            time.sleep(kill_after)
            proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    acked: dict[int, tuple[int, int, bytes]] = {}
    for line in out.splitlines():
        fields = line.split()
        if len(fields) == 4:  # the last line may be cut by the kill: not acknowledged
            acked[int(fields[1])] = (int(fields[0]), int(fields[2]), bytes.fromhex(fields[3].decode()))
    return acked


def _verify(path: Path, acked: dict[int, tuple[int, int, bytes]]) -> None:
    with Store.open(path) as s:
        for tid, (_ctx, depth, h) in acked.items():
            t = s.get_turn(tid)
            assert t.depth == depth and t.payload_hash == h, tid
            assert blake3.blake3(s.payloads([t])[0]).digest() == h, f"turn {tid} lost its payload"
        for head in s.list_contexts():
            mine = [tid for tid, (ctx, _d, _p) in acked.items() if ctx == head.context_id]
            last = max(mine, default=NO_TURN)
            assert head.head_turn_id >= last, f"context {head.context_id} lost acknowledged turns"
            chain = s.get_last(head.context_id, head.head_depth + 1)
            depths = list(range(head.head_depth + 1)) if head.head_turn_id != NO_TURN else []
            assert [t.depth for t in chain] == depths
            assert all(s.payloads([t]) for t in chain[-24:])  # every blob a head reaches is there
    report = fsck(path, full=True)  # re-hashes every blob in the pack
    assert report.ok, report.summary()


def test_kill_in_the_middle_of_a_batchs_one_pack_write(tmp_path: Path) -> None:
    path = tmp_path / "s"
    acked = _run(path, "tear", 1, None)
    assert acked == {}  # the first batch's pack write was the torn one
    size = (path / "blobs.pack").stat().st_size
    assert size > 20_000 // 2  # the torn half is on disk
    _verify(path, acked)
    with Store.open(path) as s:  # the torn tail was cut off on open; the same batch goes in again
        rng = random.Random(1)
        payloads = [rng.randbytes(2000) * rng.randint(3, 15) for _ in range(24)]
        ctx = s.list_contexts()[0].context_id
        turns = s.append_turns(ctx, [TurnInput(p) for p in payloads])
        assert s.payloads(turns) == payloads
    assert fsck(path, full=True).ok


def test_sigkill_at_random_moments_of_big_batches(tmp_path: Path) -> None:
    path = tmp_path / "s"
    rng = random.Random(2026)
    acked: dict[int, tuple[int, int, bytes]] = {}
    for round_ in range(6):
        acked.update(_run(path, "run", round_, rng.uniform(0.4, 1.5)))
        _verify(path, acked)
    assert len(acked) >= 24 * 6, f"only {len(acked)} turns acknowledged: the batches never ran"
