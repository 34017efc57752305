"""Recovery on open: torn tails, lost turn records, a damaged head table, index rebuilds.

Crashes are real: a child process appends durably, reports what was acknowledged, then
SIGKILLs itself without closing the store.  (The big random-kill campaign, every-offset
truncation and bit flips are in tests/store/test_crash.py and tests/store/test_faults.py.)
"""
from __future__ import annotations

import functools
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from store import CorruptRecord, Store, TurnInput, UnknownBlob
from store.errors import StoreLocked
from store.files import blobpack
from store.fsck import fsck
from store.layout import CODEC_ZSTD, TURN_SIZE, encode_blob, scan_wal

REPO = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import json, os, signal, sys
    from store import Store, TurnInput
    path, n, big, pack = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "pack"
    s = Store.open(path)
    ctx = s.list_contexts()[0].context_id if s.list_contexts() else s.create_context().context_id
    acked = []
    for i in range(n):
        payload = (b"turn %d of %s " % (i, path.encode())) * (50 + i % 7)
        acked.append(s.append_turn(ctx, payload).turn_id)
    if pack:  # what the checkpointer does in time: the appends' new blobs, raw in the WAL, into the pack
        s.pack_pending()
    if big:  # one last blob too big to travel in the head WAL
        acked.append(s.append_turn(ctx, os.urandom(big)).turn_id)
    print(json.dumps({"ctx": ctx, "acked": acked}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def crash_after(path: Path, n: int, big: int = 0, pack: bool = False) -> dict:
    """Run a writer that appends n turns (and a random one of size big) and dies by SIGKILL
    without closing the store.  Unless pack, the small turns' blobs are in the WAL only."""
    args = [str(path), str(n), str(big), "pack" if pack else "-"]
    proc = subprocess.run([sys.executable, "-c", CHILD, *args], cwd=REPO, capture_output=True, timeout=60)
    assert proc.returncode == -9, proc.stderr.decode()
    return json.loads(proc.stdout)


def payload(path: Path, i: int) -> bytes:
    return (b"turn %d of %s " % (i, str(path).encode())) * (50 + i % 7)


def assert_all_there(path: Path, ctx: int, n: int) -> Store:
    s = Store.open(path)
    turns = s.get_last(ctx, n + 10)
    assert [t.depth for t in turns] == list(range(n))
    assert s.payloads(turns) == [payload(path, i) for i in range(n)]
    return s


def test_killed_writer_loses_nothing_acknowledged(tmp_path: Path) -> None:
    path = tmp_path / "s"
    run = crash_after(path, 40)
    with assert_all_there(path, run["ctx"], 40) as s:
        assert s.get_head(run["ctx"]).head_turn_id == run["acked"][-1]
        # their blobs were in the WAL only, raw (left for the packer): restored compressed
        assert {s.get_stored_blob(t.payload_hash).codec for t in s.get_last(run["ctx"], 40)} == {CODEC_ZSTD}
    assert fsck(path, full=True).ok


@pytest.mark.parametrize("cut", [29 * TURN_SIZE + 33, 20 * TURN_SIZE, 0])
def test_turn_records_lost_from_the_log_come_back_from_the_wal(tmp_path: Path, cut: int) -> None:
    path = tmp_path / "s"
    run = crash_after(path, 30)
    os.truncate(path / "turns.log", cut)  # mid-record, at a record boundary, everything
    with assert_all_there(path, run["ctx"], 30):
        pass  # from the WAL since the last checkpoint
    os.truncate(path / "turns.log", cut)
    with assert_all_there(path, run["ctx"], 30) as s:  # from the WAL kept behind the checkpoint
        assert any("rewritten from the older head WAL" in n for n in s.recovery_notes)
    assert_damage_reported_until_acknowledged(path, "rewritten")


def assert_damage_reported_until_acknowledged(path: Path, what: str) -> None:
    """Damage that opening repaired stays visible to fsck (damage.log) until --repair."""
    report = fsck(path)
    assert not report.ok and any(what in e and "found when opened" in e for e in report.errors)
    repaired = fsck(path, repair=True)
    assert repaired.ok and any(what in r for r in repaired.repaired), repaired.summary()
    assert fsck(path, full=True).ok


def test_torn_head_wal_record_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / "s"
    run = crash_after(path, 12)
    wal = sorted(path.glob("heads.wal.*"))[-1]
    records, _, end = scan_wal(wal.read_bytes(), wal.name)
    assert len(records) == 13  # the context's creation and 12 turns
    with open(wal, "r+b") as f:  # half a record where the next goes, as a torn write leaves it
        f.seek(end)
        f.write(b"\x48\x57\x41\x4c\x02\x00" + os.urandom(50))
    with assert_all_there(path, run["ctx"], 12) as s:
        assert any("torn record" in n for n in s.recovery_notes)
    assert fsck(path).ok


def cut_last_blob(path: Path) -> None:
    """As if the pack's last write was lost in a power cut (the pack is synced lazily)."""
    pack = path / "blobs.pack"
    os.truncate(pack, pack.read_bytes().rstrip(b"\0").rfind(b"BLSB"))


def test_blob_lost_from_the_pack_comes_back_from_its_wal_copy(tmp_path: Path) -> None:
    path = tmp_path / "s"
    run = crash_after(path, 10, pack=True)
    cut_last_blob(path)
    with assert_all_there(path, run["ctx"], 10) as s:
        assert any("restored from their copies" in n for n in s.recovery_notes)
    assert fsck(path, full=True).ok


def test_wal_record_whose_blob_is_nowhere_is_not_replayed(tmp_path: Path) -> None:
    """The WAL's last record names a blob the pack never got (a power cut between the pack's
    write and its sync): never acknowledged, so the head stays.  Its TurnID stays taken (the
    turn is kept without a head or payload): an id is never handed out twice."""
    path = tmp_path / "s"
    run = crash_after(path, 10, big=300_000)  # the big blob is in the pack only
    cut_last_blob(path)
    with Store.open(path) as s:
        assert s.get_head(run["ctx"]).head_turn_id == run["acked"][-2]
        assert any("never acknowledged" in n for n in s.recovery_notes)
        assert not s.recovery_notes.damage
        lost = s.get_turn(run["acked"][-1])
        with pytest.raises(UnknownBlob):
            s.payloads([lost])
        assert s.append_turn(run["ctx"], b"next").turn_id == run["acked"][-1] + 1
    assert fsck(path, full=True).ok


def test_torn_pack_tail_is_truncated_and_the_rest_kept(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with Store.open(path) as s:
        hashes = [s.put_blob(b"blob %d " % i * 100) for i in range(20)]
    rec = encode_blob(b"\x01" * 32, 0, 1000, b"x" * 1000)
    good = os.path.getsize(path / "blobs.pack")
    with open(path / "blobs.pack", "ab") as f:
        f.write(rec[:300])
    report = fsck(path)
    assert not report.ok and any("torn tail" in e for e in report.errors)
    with Store.open(path) as s:
        assert any("torn tail" in n for n in s.recovery_notes)
        assert [s.get_blob(h) for h in hashes] == [b"blob %d " % i * 100 for i in range(20)]
    assert os.path.getsize(path / "blobs.pack") == good
    assert fsck(path).ok


def test_corrupt_middle_blob_is_reported_not_returned(tmp_path: Path) -> None:
    path = tmp_path / "s"
    blobs = [random.Random(i).randbytes(500) for i in range(5)]
    with Store.open(path) as s:
        hashes = [s.put_blob(b) for b in blobs]
        loc = s._pack.locate(hashes[2])
    assert loc is not None
    with open(path / "blobs.pack", "r+b") as f:
        f.seek(loc.offset + 100)
        f.write(bytes([blobs[2][100 - 48] ^ 0x10]))
    with Store.open(path) as s:
        with pytest.raises(CorruptRecord, match="CRC"):
            s.get_blob(hashes[2])
        assert s.get_blob(hashes[3]) == blobs[3]
    assert not fsck(path).ok


@pytest.mark.parametrize("damage", ["missing", "flipped", "truncated", "foreign"])
def test_blob_index_is_rebuilt_from_the_pack(tmp_path: Path, damage: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blobpack, "FOLD_BYTES", 0)  # the closes fold every blob into blobs.idx
    path = tmp_path / "s"
    with Store.open(path) as s:
        hashes = [s.put_blob(b"blob %d " % i * 50) for i in range(300)]
    idx = path / "blobs.idx"
    if damage == "missing":
        idx.unlink()
    elif damage == "flipped":
        data = bytearray(idx.read_bytes())
        data[-10] ^= 0x40
        idx.write_bytes(bytes(data))
    elif damage == "truncated":
        os.truncate(idx, os.path.getsize(idx) - 7)
    else:  # the index of another store with other blobs
        with Store.open(tmp_path / "other") as o:
            for i in range(10):
                o.put_blob(b"other %d" % i)
        idx.write_bytes((tmp_path / "other" / "blobs.idx").read_bytes())
    assert not fsck(path).ok
    with Store.open(path) as s:
        assert any("blobs.idx" in n for n in s.recovery_notes)
        assert all(s.get_blob(h) == b"blob %d " % i * 50 for i, h in enumerate(hashes))
    assert fsck(path).ok


def test_blobs_appended_after_the_index_was_written_are_found(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with Store.open(path) as s:
        first = s.put_blob(b"first")
    old_idx = (path / "blobs.idx").read_bytes()
    with Store.open(path) as s:
        second = s.put_blob(b"second")
    (path / "blobs.idx").write_bytes(old_idx)  # an index that covers only a prefix of the pack
    with Store.open(path) as s:
        assert s.get_blob(first) == b"first" and s.get_blob(second) == b"second"


def test_damaged_head_table_is_rebuilt_from_previous_snapshot_and_wal(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with Store.open(path) as s:
        a = s.create_context().context_id
        s.append_turns(a, [TurnInput(b"%d" % i) for i in range(10)])
    with Store.open(path) as s:
        b = s.fork(3).context_id
        s.append_turn(b, b"b")
        s.append_turn(a, b"a")
        heads = s.list_contexts()
    data = bytearray((path / "heads.tbl").read_bytes())
    data[60] ^= 0x01
    (path / "heads.tbl").write_bytes(bytes(data))
    assert not fsck(path).ok or fsck(path).warnings
    with Store.open(path) as s:
        assert any("heads.tbl" in n for n in s.recovery_notes)
        assert s.list_contexts() == heads
    assert_damage_reported_until_acknowledged(path, "heads.tbl")


def flip_turn(path: Path, turn_id: int) -> None:
    with open(path / "turns.log", "r+b") as f:
        f.seek((turn_id - 1) * TURN_SIZE + 40)
        f.write(b"\x00\xff")


def test_damaged_turn_record_is_repaired_from_the_wal_or_reported(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with Store.open(path) as s:
        ctx = s.create_context().context_id
        s.append_turns(ctx, [TurnInput(b"%d" % i) for i in range(10)])
    flip_turn(path, 10)
    with Store.open(path) as s:  # the WAL behind the last checkpoint still holds turn 10
        assert any("rewritten" in n for n in s.recovery_notes) and s.get_turn(10).depth == 9
        s.append_turn(ctx, b"more")
    with Store.open(path) as s:
        s.append_turn(ctx, b"more")
    flip_turn(path, 5)  # a record in the middle: reported, not repaired
    with Store.open(path) as s:
        with pytest.raises(CorruptRecord, match="turns.log"):
            s.get_turn(5)
        assert s.get_turn(6).depth == 5
    report = fsck(path)
    assert not report.ok and any("turns.log" in e for e in report.errors)


def test_a_turn_record_no_wal_copy_repairs_fails_the_chains_through_it_until_their_heads_go(
        tmp_path: Path) -> None:
    """unreadable_chains names the heads whose chains go through the damaged record (a fork
    from below it is fine; one from above it is not); fsck calls the record an error while a
    head reaches it and a warning once none does, and GC works again then."""
    path = tmp_path / "s"
    with Store.open(path) as s:
        ctx = s.create_context().context_id
        turns = s.append_turns(ctx, [TurnInput(b"%d" % i) for i in range(10)])
        below, above = s.fork(turns[2].turn_id), s.fork(turns[7].turn_id)
        s.append_turn(below.context_id, b"own")
        other = s.create_context().context_id
        s.append_turn(other, b"alone")
        s.checkpoint()
        s.checkpoint()
    flip_turn(path, turns[5].turn_id)
    report = fsck(path)
    assert [e for e in report.errors if "cannot be read" in e], report.summary()
    with Store.open(path) as s:
        heads = {c.context_id: c.head_turn_id for c in s.list_contexts()}
        bad = s.unreadable_chains(list(heads.values()))
        assert {c for c, h in heads.items() if h in bad} == {ctx, above.context_id}
        assert all(isinstance(e, CorruptRecord) and e.offset == 5 * TURN_SIZE for e in bad.values())
        with pytest.raises(CorruptRecord):
            s.gc()
        s.delete_context(ctx)
        s.delete_context(above.context_id)
        s.gc()
        assert s.get_last(below.context_id, 4)[-1].depth == 3
    report = fsck(path)
    assert report.ok and any("no head reaches it" in w for w in report.warnings), report.summary()


@pytest.mark.parametrize("name", ["turns.log", "turns.skip", "blobs.pack", "patches.log"])
def test_fsck_reports_a_missing_store_file_and_repair_checks_what_that_lost(tmp_path: Path,
                                                                           name: str) -> None:
    """A store file gone (a sync tool, a user's cleanup) is a finding, not a crash of fsck; the
    repair's open makes it anew and the check says what was lost (turns.log: put back from the
    head WAL; the pack: every blob a head reaches)."""
    path = tmp_path / "s"
    with Store.open(path) as s:
        ctx = s.create_context().context_id
        s.append_turns(ctx, [TurnInput(b"%d" % i) for i in range(10)])
    (path / name).unlink()
    report = fsck(path)
    assert report.errors == [f"{name} is missing (the next open makes it anew, empty: fsck --repair does, "
                             "then checks what that lost)"]
    repaired = fsck(path, repair=True)
    assert (path / name).exists() and repaired.stats["turns"] == 10
    assert repaired.ok == (name != "blobs.pack"), repaired.summary()


def test_fsck_repair_truncates_torn_tails_and_rebuilds_the_index(tmp_path: Path) -> None:
    path = tmp_path / "s"
    run = crash_after(path, 15)
    with open(path / "turns.log", "ab") as f:
        f.write(b"\x07" * 30)
    with open(path / "blobs.pack", "r+b") as f:
        f.seek(0, os.SEEK_END)
        f.write(b"BLSB\x01\x00garbage")
    before = fsck(path)
    assert not before.ok
    report = fsck(path, repair=True)
    assert report.ok, report.summary()
    assert any("blobs.idx rebuilt" in r for r in report.repaired)
    with assert_all_there(path, run["ctx"], 15):
        pass
    out = subprocess.run([sys.executable, "-m", "store", "fsck", str(path), "--full", "--json"],
                         cwd=REPO, capture_output=True, timeout=60)
    assert out.returncode == 0 and json.loads(out.stdout)["ok"] is True


def test_fsck_of_a_store_in_use_reports_it(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A store another process holds is not checked, and that is not a finding: StoreLocked
    (the p2pnode CLI: exit 7 naming who holds it), `python -m store fsck`: exit 1 with the
    reason on stderr and no report."""
    from store import fsck as store_fsck
    from store.cli import main as store_main

    with Store.open(tmp_path / "s") as s:
        s.put_blob(b"x")
        with pytest.raises(StoreLocked, match="locked by another process"):
            fsck(tmp_path / "s", lock_timeout=0.2)
        with pytest.raises(StoreLocked):
            fsck(tmp_path / "s", repair=True, lock_timeout=0.2)
        capsys.readouterr()
        monkeypatch.setattr(store_fsck, "fsck", functools.partial(fsck, lock_timeout=0.2))
        assert store_main(["fsck", str(tmp_path / "s")]) == 1
        out, err = capsys.readouterr()
        assert out == "" and "locked by another process" in err and "stop the process" in err
    assert fsck(tmp_path / "s").ok
