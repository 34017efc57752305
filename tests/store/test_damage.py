"""Recovery never drops acknowledged data: damaged blobs are reported and their turns kept.

The reproduction of issue 10: a real writer process appends durably (~100 KB incompressible
payloads, stored raw in the pack, and small ones) and dies by SIGKILL; then one bit flips in
one blob's bytes (in `blobs.pack`, or in a blob copy in the head WAL).  On reopen every
acknowledged turn is there, heads and contexts are intact, the damaged turn reads as a record
whose payload raises DamagedPayload naming the turn and the blob, fsck and damage.log report
it, and new appends get TurnIDs never handed out before.
"""
from __future__ import annotations

import inspect
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from store import CorruptRecord, DamagedPayload, Store
from store.codec import blob_hash
from store.files.blobpack import scan_pack
from store.fsck import fsck
from store.layout import BLOB_HEADER, CODEC_ZSTD, WAL_SIZE, scan_wal
from store.recovery import DAMAGE
from store.service.client import StoreClient
from store.service.limits import ServiceLimits
from store.service.server import StoreServer

REPO = Path(__file__).resolve().parents[2]



def payload(i: int, kind: str) -> bytes:
    """The payload of the i-th append (the child runs this function's source too)."""
    r = random.Random(i)
    if kind == "raw":  # incompressible: stored raw, too big for a copy in the head WAL
        return r.randbytes(100_000)
    if kind == "zstd":  # compresses, but still to more than the WAL's 64 KiB copy limit
        return r.randbytes(150_000).hex().encode()
    return b"small turn %d " % i * (3 + i % 5)


CHILD = "import random\n" + inspect.getsource(payload) + textwrap.dedent(
    """
    import itertools, os, sys
    from store import Store
    path, kinds, n, close = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]), sys.argv[4] == "1"
    s = Store.open(path)
    ctxs = [h.context_id for h in s.list_contexts()] or [s.create_context().context_id for _ in range(2)]
    start = s.turn_count
    for i in itertools.count(start):  # until killed (or n turns, then close)
        if close and i == start + n:
            s.close()
            break
        if i == start + n // 2:
            ctxs.append(s.create_context().context_id)  # a context created among the appends
        kind = kinds[i % len(kinds)]
        ctx = ctxs[i % len(ctxs)]
        t = s.append_turn(ctx, payload(i, kind))
        os.write(1, b"%d %d %d %s\\n" % (t.turn_id, ctx, i, kind.encode()))  # after the ack
    """
)


def writer(path: Path, kinds: str, n: int, close: bool = False) -> list[list]:
    """A writer process that appends durably: unless close, it is SIGKILLed while appending,
    once n turns were acknowledged.  Returns [turn_id, ctx, i, kind] of each acknowledged turn."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(path), kinds, str(n), "1" if close else "0"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    acked: list[list] = []
    try:
        for line in proc.stdout:
            if not line.endswith(b"\n"):
                break  # cut short by the kill: not an acknowledgement
            tid, ctx, i, kind = line.split()
            acked.append([int(tid), int(ctx), int(i), kind.decode()])
            if len(acked) == n and not close:
                os.kill(proc.pid, signal.SIGKILL)  # the writer is appending the next turn by now
    finally:
        if proc.poll() is None and not close:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=120)
    err = proc.stderr.read().decode() if proc.stderr else ""
    assert proc.returncode == (0 if close else -signal.SIGKILL), err
    assert len(acked) >= n
    return acked


def flip_in_pack(path: Path, h: bytes, at: int) -> None:
    """Flip one bit at byte `at` of the stored bytes of blob h's record in blobs.pack."""
    data = bytearray((path / "blobs.pack").read_bytes())
    offs = [off for off, hdr in scan_pack(bytes(data)).records if hdr.hash == h]
    assert len(offs) == 1
    data[offs[0] + BLOB_HEADER.size + at] ^= 0x08
    (path / "blobs.pack").write_bytes(bytes(data))


def check_everything_acknowledged(path: Path, acked: list, damaged_tid: int,
                                  noticed_at_open: bool = True) -> None:
    """Reopen twice: every acknowledged turn is there, each context's head is its last
    acknowledged turn or one the killed writer had in flight after it, the damaged turn's payload
    is DamagedPayload naming it and its blob, every other payload reads back, new ids are fresh."""
    by_tid = {tid: (ctx, payload(i, kind)) for tid, ctx, i, kind in acked}
    last = {ctx: tid for tid, ctx, _, _ in acked}
    top = max(by_tid)
    in_flight: set[int] = set()
    for round_ in range(2):
        with Store.open(path) as s:
            if round_ == 0 and noticed_at_open:
                assert s.recovery_notes.damage, list(s.recovery_notes)
            assert set(last) <= {h.context_id for h in s.list_contexts()}
            for ctx, tid in last.items():
                chain = s.get_last(ctx, 1000)
                assert [t.depth for t in chain] == list(range(len(chain)))
                ids = [t.turn_id for t in chain]
                after = ids[ids.index(tid) + 1 :]  # turns the killed writer had in flight
                assert all(i > top and i not in by_tid for i in after) or round_, (ctx, tid, ids)
                in_flight.update(after)
                assert set(ids) - in_flight == {t for t, (c, _) in by_tid.items() if c == ctx}
            if damaged_tid not in by_tid:  # the turn in flight at the kill, whose record made it
                with pytest.raises(DamagedPayload, match=f"turn {damaged_tid}:"):
                    s.payloads([s.get_turn(damaged_tid)])
            for tid, (_ctx, data) in by_tid.items():
                t = s.get_turn(tid)
                if tid == damaged_tid:
                    with pytest.raises(DamagedPayload) as ei:
                        s.payloads([t])
                    assert ei.value.turn_id == tid and ei.value.blob_hash == t.payload_hash
                    assert str(tid) in str(ei.value) and t.payload_hash.hex() in str(ei.value)
                    with pytest.raises(DamagedPayload):
                        s.payload_of(t)
                else:
                    assert s.payloads([t]) == [data], f"turn {tid}"
            ctx = next(iter(last))
            count = s.turn_count
            assert count >= top
            fresh = s.append_turn(ctx, b"after the damage, round %d" % round_)
            assert fresh.turn_id == count + 1, f"TurnID {fresh.turn_id} after {count}"
            top = fresh.turn_id
            last[ctx] = fresh.turn_id
            by_tid[fresh.turn_id] = (ctx, b"after the damage, round %d" % round_)
    report = fsck(path)
    h = blob_hash(by_tid[damaged_tid][1]).hex()
    assert not report.ok and any(h in e and "damaged" in e for e in report.errors), report.summary()
    assert h in (path / DAMAGE).read_text()  # found at open, or when first read


@pytest.mark.parametrize("which", ["middle", "last"])
def test_bit_flip_in_a_raw_blob_right_after_the_crash(tmp_path: Path, which: str) -> None:
    """The issue's case: the damage meets the recovery of the crash itself (the blob is in the
    part of the pack that opening scans, its turn in the WAL being replayed).  The last raw
    blob is the pack's last record (the small ones wait in the WAL for the packer)."""
    path = tmp_path / "s"
    run = writer(path, "raw,small,small,small", 48)
    raw = [a for a in run if a[3] == "raw"]
    victim = raw[3] if which == "middle" else raw[-1]
    h = blob_hash(payload(victim[2], "raw"))
    size_before = os.path.getsize(path / "turns.log")
    flip_in_pack(path, h, 777)
    check_everything_acknowledged(path, run, victim[0])
    assert os.path.getsize(path / "turns.log") >= size_before  # nothing truncated away


def test_bit_flip_in_a_raw_blob_found_only_when_read(tmp_path: Path) -> None:
    """A blob behind blobs.idx is not scanned at open: its damage shows when it is read, and
    the next crash's recovery must not be disturbed by it."""
    path = tmp_path / "s"
    run = writer(path, "raw,small,small", 30, close=True)
    victim = [a for a in run if a[3] == "raw"][2]
    run2 = writer(path, "raw,small,small", 12)
    h = blob_hash(payload(victim[2], "raw"))
    flip_in_pack(path, h, 50_000)
    with Store.open(path) as s:
        t = s.get_turn(victim[0])
        with pytest.raises(DamagedPayload, match=h.hex()):
            s.payloads([t])
    check_everything_acknowledged(path, run + run2, victim[0], noticed_at_open=False)


def test_bit_flip_in_a_compressed_blob(tmp_path: Path) -> None:
    path = tmp_path / "s"
    run = writer(path, "zstd,small", 20)
    victim = [a for a in run if a[3] == "zstd"][4]
    h = blob_hash(payload(victim[2], "zstd"))
    flip_in_pack(path, h, 20_000)
    check_everything_acknowledged(path, run, victim[0])
    with Store.open(path) as s:
        assert s.get_stored_blob(blob_hash(payload(run[0][2], "zstd"))).codec == CODEC_ZSTD


def test_bit_flip_in_a_blob_copy_in_the_head_wal(tmp_path: Path) -> None:
    """Small appends leave their blobs raw in the WAL (the packer's job at the next checkpoint):
    the WAL copy is the only one.  A flipped bit there loses that payload, not the turn or its head."""
    path = tmp_path / "s"
    run = writer(path, "small", 30)
    wal = sorted(path.glob("heads.wal.*"))[-1]
    buf = bytearray(wal.read_bytes())
    records = [(off, r) for off, r in scan_wal(bytes(buf), wal.name)[0] if r.blob_record]
    off, rec = records[len(records) // 2]
    assert rec.turn is not None
    buf[off + WAL_SIZE + BLOB_HEADER.size + 5] ^= 0x01
    wal.write_bytes(bytes(buf))
    check_everything_acknowledged(path, run, rec.turn.turn_id)


def test_bit_flip_in_the_last_wal_copy_is_damage_not_a_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "s"
    run = writer(path, "small", 12)
    wal = sorted(path.glob("heads.wal.*"))[-1]
    buf = bytearray(wal.read_bytes())
    records = scan_wal(bytes(buf), wal.name)[0]
    last = next(i for i, (_, r) in enumerate(records) if r.turn is not None and r.turn.turn_id == run[-1][0])
    if last + 1 < len(records):  # a turn in flight at the kill: as if the kill came before its write
        buf[records[last + 1][0]:] = bytes(len(buf) - records[last + 1][0])
    off, rec = records[last]
    assert rec.turn is not None
    buf[off + WAL_SIZE + BLOB_HEADER.size + 2] ^= 0x40
    wal.write_bytes(bytes(buf))
    check_everything_acknowledged(path, run, rec.turn.turn_id)


def test_a_damaged_blob_with_a_good_wal_copy_is_restored(tmp_path: Path) -> None:
    """A small blob packed by the checkpoint's packer still has its copy in the WAL: a flipped
    bit in the pack is repaired from it (and reported)."""
    path = tmp_path / "s"
    run = writer(path, "small", 8)
    image = tmp_path / "image"
    with Store.open(path) as s:  # pack the appends' blobs, then copy what a crash would leave
        ctx = run[0][1]
        more = [s.append_turn(ctx, payload(100 + i, "small")) for i in range(5)]
        s.pack_pending()
        image.mkdir()
        for name in os.listdir(path):
            if name != "LOCK":
                (image / name).write_bytes((path / name).read_bytes())
    victim = more[2]
    flip_in_pack(image, victim.payload_hash, 3)
    with Store.open(image) as s:
        assert any("restored from its copy" in n for n in s.recovery_notes.damage), list(s.recovery_notes)
        assert s.payloads([s.get_turn(victim.turn_id)]) == [payload(102, "small")]
        assert s.payloads(s.get_last(ctx, 100))[-5:] == [payload(100 + i, "small") for i in range(5)]


async def test_the_service_reports_a_damaged_payload_by_turn_and_blob(tmp_path: Path) -> None:
    """GET_LAST / GET_CHAIN / GET_PAYLOAD with payloads: ERROR DAMAGED_PAYLOAD (arg0 the turn,
    the message the blob), which the client raises as DamagedPayload; without payloads the
    turn records still come."""
    path = tmp_path / "s"
    run = writer(path, "raw,small", 10, close=True)
    victim = [a for a in run if a[3] == "raw"][2]
    h = blob_hash(payload(victim[2], "raw"))
    flip_in_pack(path, h, 99)
    ctx = victim[1]
    with Store.open(path) as s:
        async with StoreServer(s, tmp_path / "sock", limits=ServiceLimits()) as srv:
            assert srv.socket_path is not None
            c = await StoreClient.connect(srv.socket_path)
            try:
                turns = (await c.get_last(ctx, 100)).turns
                assert victim[0] in [t.turn_id for t in turns]
                for call in (c.get_last(ctx, 100, payloads=True), c.chain(victim[0], payloads=True),
                             c.payload_of(victim[0]), c.get_last(ctx, 100, payloads=True, patched=True)):
                    with pytest.raises(DamagedPayload) as ei:
                        await call
                    assert (ei.value.turn_id, ei.value.blob_hash) == (victim[0], h)
                with pytest.raises(CorruptRecord):
                    await c.get_blob(h)
            finally:
                await c.close()


def test_storing_the_same_bytes_again_heals_a_damaged_blob(tmp_path: Path) -> None:
    """Dedup must not make a new append point at the damaged record: once a read found it
    damaged, appending the same payload stores a good copy, which every turn of that blob reads."""
    path = tmp_path / "s"
    run = writer(path, "raw,small", 10, close=True)
    victim = [a for a in run if a[3] == "raw"][1]
    data = payload(victim[2], "raw")
    flip_in_pack(path, blob_hash(data), 1234)
    with Store.open(path) as s:
        old = s.get_turn(victim[0])
        with pytest.raises(DamagedPayload):
            s.payloads([old])
        with pytest.raises(CorruptRecord):
            s.get_blob(old.payload_hash)
        again = s.append_turn(victim[1], data)
        assert s.payloads([again, old]) == [data, data]
    with Store.open(path) as s:  # the new copy is what blobs.idx names now
        assert s.payloads([s.get_turn(victim[0])]) == [data]
    report = fsck(path, repair=True)
    assert report.ok, report.summary()


def test_fsck_names_a_damaged_record_once_and_a_healed_one_as_a_warning(tmp_path: Path) -> None:
    """One damaged record is one line of fsck's, however many opens and reads met it (the
    open's note, damage.log and fsck's own walk of the pack name the same record); once the
    same bytes are stored again it is a warning naming the good copy, and fsck is clean."""
    path = tmp_path / "s"
    run = writer(path, "raw,small", 10, close=True)
    victim = [a for a in run if a[3] == "raw"][1]
    data = payload(victim[2], "raw")
    h = blob_hash(data)
    flip_in_pack(path, h, 1234)
    for _ in range(3):
        with Store.open(path) as s, pytest.raises(DamagedPayload):
            s.payloads([s.get_turn(victim[0])])
    logged = (path / DAMAGE).read_text().splitlines()
    assert len(logged) == len(set(line.split(" ", 1)[1] for line in logged)) == 1, logged
    report = fsck(path)
    about_record = [e for e in report.errors if e.startswith("blobs.pack at offset") or "found when" in e]
    assert len(about_record) == 1 and h.hex() in about_record[0], report.summary()
    assert any(f"turn {victim[0]}" in e for e in report.errors), report.summary()
    with Store.open(path) as s:
        s.append_turn(victim[1], data)
    healed = fsck(path)
    assert healed.ok, healed.summary()
    assert [w for w in healed.warnings if h.hex() in w and "a good copy is at offset" in w], healed.summary()


@pytest.mark.parametrize("name", ["heads.tbl", "heads.tbl.prev"])
def test_fsck_calls_a_damaged_head_snapshot_damage_before_any_open(tmp_path: Path, name: str) -> None:
    """It said "ok" (exit 0, a warning) until a command had opened the store, then an error:
    the verdict depended on what ran before it.  Nothing is lost (the heads come back from the
    other snapshot and the WAL), but a snapshot that fails its CRC is damage either way."""
    root = tmp_path / "s"
    with Store.open(root) as s:
        ctx = s.create_context().context_id
        for i in range(3):
            s.append_turn(ctx, b"turn %d" % i)
            s.checkpoint()  # both snapshots written
    data = bytearray((root / name).read_bytes())
    data[len(data) // 2] ^= 0x10
    (root / name).write_bytes(bytes(data))
    report = fsck(root)
    assert not report.ok and any(name in e for e in report.errors), report
    with Store.open(root) as s:  # the heads are all there
        assert s.get_head(ctx).head_depth == 2
