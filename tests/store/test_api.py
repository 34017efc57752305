"""The store's library API against a simple reference model, on real files."""
from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import threading
from pathlib import Path

import blake3
import pytest
from test_damage import flip_in_pack

from store import (
    NO_TURN,
    BlobMismatch,
    CorruptRecord,
    ParentConflict,
    PayloadTooLarge,
    Store,
    StoreClosed,
    StoreConfig,
    StoredBlob,
    StoreLocked,
    StoreNeedsWrite,
    TurnBlobRef,
    TurnInput,
    TurnNotInContext,
    UnknownBlob,
    UnknownContext,
    UnknownTurn,
)
from store.files import blobpack
from store.fsck import fsck
from store.layout import (
    CODEC_RAW,
    CODEC_ZSTD,
    TURN_SIZE,
    decode_blob_header,
    decode_turn,
    encode_blob,
    encode_turn,
)
from store.types import Turn

DOCS = Path(__file__).resolve().parents[2] / "docs" / "FORMAT.md"


@pytest.fixture
def store(tmp_path: Path):
    s = Store.open(tmp_path / "store")
    yield s
    s.close()


def text(i: int, size: int = 6000) -> bytes:
    """Compressible agent-like text, different for each i."""
    words = [b"read_file", b"def", b"return", b"import", b"assert", b"the", b"tool", b"result"]
    rnd = random.Random(i)
    out = bytearray(b"turn %d: " % i)
    while len(out) < size:
        out += rnd.choice(words) + b" "
    return bytes(out)


def test_append_and_read_back_every_call(store: Store) -> None:
    ctx = store.create_context()
    assert ctx.head_turn_id == NO_TURN and ctx.head_depth == 0
    t1 = store.append_turn(ctx.context_id, b"first", type_tag=7, codec=3)
    assert (t1.parent_turn_id, t1.depth, t1.type_tag, t1.codec) == (NO_TURN, 0, 7, 3)
    t2 = store.append_turn(ctx.context_id, b"second", expected_parent=t1.turn_id)
    assert store.get_turn(t2.turn_id) == t2
    assert store.get_head(ctx.context_id).head_turn_id == t2.turn_id
    assert store.get_head(ctx.context_id).head_depth == 1
    batch = store.append_turns(ctx.context_id, [TurnInput(b"a"), TurnInput(b"b", 1, 2)])
    assert [t.depth for t in batch] == [2, 3] and batch[0].parent_turn_id == t2.turn_id
    assert store.get_last(ctx.context_id, 2) == batch
    assert store.payloads(store.chain(batch[-1].turn_id)) == [b"first", b"second", b"a", b"b"]
    assert store.get_blob(t1.payload_hash, verify=True) == b"first"
    assert store.has_blob(blake3.blake3(b"a").digest())
    assert [c.context_id for c in store.list_contexts()] == [ctx.context_id]
    h = store.put_blob(b"loose")
    assert h == blake3.blake3(b"loose").digest() and store.get_blob(h) == b"loose"
    sb = store.get_stored_blob(h)
    assert (sb.hash, sb.codec, sb.raw_len, sb.stored) == (h, CODEC_RAW, 5, b"loose")
    base = store.create_context(base_turn_id=t2.turn_id)
    assert (base.head_turn_id, base.head_depth) == (t2.turn_id, 1)
    store.delete_context(base.context_id)
    with pytest.raises(UnknownContext):
        store.get_head(base.context_id)


def test_dedup_stores_a_payload_once(store: Store, tmp_path: Path) -> None:
    payload = text(1, 20000)
    ctxs = [store.create_context().context_id for _ in range(20)]
    store.append_turn(ctxs[0], payload)
    store.pack_pending()  # the append left its new blob raw in the WAL for the packer
    size = os.path.getsize(tmp_path / "store" / "blobs.pack")
    end = store._pack.end
    for c in ctxs:
        store.append_turn(c, payload)
        store.put_blob(payload)
    assert store._pack.end == end and os.path.getsize(tmp_path / "store" / "blobs.pack") == size
    assert len(store.blob_hashes()) == 1
    (held,) = store.blob_hashes()
    assert store.has_blobs([held, bytes(32), held]) == [True, False, True] and store.has_blob(held)


def test_concurrent_puts_of_one_payload_store_it_once(store: Store) -> None:
    payload = text(2, 30000)
    barrier = threading.Barrier(8)

    def put() -> None:
        barrier.wait()
        store.put_blob(payload)

    threads = [threading.Thread(target=put) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(store.blob_hashes()) == 1


def test_compression_choice_and_both_lengths(store: Store) -> None:
    noise = os.urandom(1 << 20)
    prose = text(3, 20000)
    h_noise, h_prose = store.put_blob(noise), store.put_blob(prose)
    raw, packed = store.get_stored_blob(h_noise), store.get_stored_blob(h_prose)
    assert raw.codec == CODEC_RAW and raw.raw_len == len(raw.stored) == len(noise)
    assert packed.codec == CODEC_ZSTD and packed.raw_len == len(prose)
    assert len(packed.stored) < len(prose) // 2
    loc = store._pack.locate(h_prose)
    assert loc is not None and (loc.raw_len, loc.stored_len) == (len(prose), len(packed.stored))
    assert store.get_blob(h_noise) == noise and store.get_blob(h_prose, verify=True) == prose


def test_expected_parent_conflict_is_an_error_not_a_fork(store: Store) -> None:
    ctx = store.create_context().context_id
    t1 = store.append_turn(ctx, b"one")
    store.append_turn(ctx, b"two", expected_parent=t1.turn_id)
    with pytest.raises(ParentConflict) as err:
        store.append_turn(ctx, b"three", expected_parent=t1.turn_id)
    assert err.value.expected == t1.turn_id and "expected parent" in str(err.value)
    assert store.get_head(ctx).head_depth == 1
    with pytest.raises(ParentConflict):
        store.append_turns(ctx, [TurnInput(b"x")], expected_parent=NO_TURN)


def test_bad_input_raises_specific_errors(tmp_path: Path) -> None:
    with Store.open(tmp_path / "s", StoreConfig(max_payload=1000)) as s:
        ctx = s.create_context().context_id
        with pytest.raises(PayloadTooLarge, match="1001 bytes exceeds the limit of 1000"):
            s.append_turn(ctx, b"x" * 1001)
        with pytest.raises(PayloadTooLarge):
            s.put_blob(b"x" * 1001)
        with pytest.raises(UnknownContext, match="unknown context 99"):
            s.append_turn(99, b"x")
        with pytest.raises(UnknownTurn, match="unknown turn 42"):
            s.get_turn(42)
        with pytest.raises(UnknownTurn):
            s.fork(42)
        with pytest.raises(UnknownTurn):
            s.create_context(base_turn_id=42)
        with pytest.raises(UnknownBlob, match="00" * 32):
            s.get_blob(bytes(32))
        other = s.create_context().context_id
        t = s.append_turn(other, b"elsewhere")
        with pytest.raises(TurnNotInContext):
            s.get_before(ctx, t.turn_id, 5)
        assert s.get_head(ctx).head_depth == 0 and s.turn_count == 1
    with pytest.raises(StoreClosed):
        s.get_head(ctx)


def test_a_second_opener_waits_then_gets_store_locked(tmp_path: Path) -> None:
    with Store.open(tmp_path / "s"), pytest.raises(StoreLocked, match="locked by another process"):
        Store.open(tmp_path / "s", StoreConfig(lock_timeout=0.2))


def test_fork_is_constant_time(store: Store, tmp_path: Path) -> None:
    ctx = store.create_context().context_id
    turns = store.append_turns(ctx, [TurnInput(b"t%d" % i) for i in range(300)])
    log_size = os.path.getsize(tmp_path / "store" / "turns.log")
    pack_end = store._pack.end
    fork = store.fork(turns[150].turn_id)
    assert (fork.head_turn_id, fork.head_depth) == (turns[150].turn_id, 150)
    assert os.path.getsize(tmp_path / "store" / "turns.log") == log_size and store._pack.end == pack_end
    t = store.append_turn(fork.context_id, b"branch")
    assert t.parent_turn_id == turns[150].turn_id and t.depth == 151
    assert store.get_head(ctx).head_turn_id == turns[-1].turn_id


class Model:
    """Reference: every context's chain as a plain list of turns."""

    def __init__(self) -> None:
        self.chains: dict[int, list[Turn]] = {}


def test_reads_match_a_reference_model(store: Store) -> None:
    rnd = random.Random(7)
    model = Model()
    root = store.create_context().context_id
    model.chains[root] = []
    for step in range(1500):
        ctx = rnd.choice(list(model.chains))
        chain = model.chains[ctx]
        if chain and rnd.random() < 0.04:
            at = rnd.randrange(len(chain))
            f = store.fork(chain[at].turn_id).context_id
            model.chains[f] = chain[: at + 1]
        else:
            t = store.append_turn(ctx, b"p%d" % (step % 300))
            model.chains[ctx] = [*chain, t]
    for ctx, chain in model.chains.items():
        assert store.get_head(ctx).head_depth == max(len(chain) - 1, 0)
        for n in (0, 1, 5, 64, 10_000):
            assert store.get_last(ctx, n) == (chain[-n:] if n else [])
        if not chain:
            continue
        assert store.chain(chain[-1].turn_id) == chain
        for _ in range(5):
            start, limit = rnd.randrange(len(chain) + 2), rnd.randrange(1, 40)
            assert store.range_by_depth(ctx, start, limit) == chain[start : start + limit]
        pages, cursor = [], NO_TURN
        while True:
            page = store.get_before(ctx, cursor, 7)
            pages = page.turns + pages
            if page.next_cursor == NO_TURN:
                break
            cursor = page.next_cursor
        assert pages == chain
        assert store.payloads(chain[-3:]) == [store.get_blob(t.payload_hash) for t in chain[-3:]]


@pytest.mark.parametrize("damage", ["bit flip", "another turn's record"])
def test_a_walk_checks_every_record_of_a_chain_appended_in_one_go(tmp_path: Path, damage: str) -> None:
    """A walk takes a chain's records a run at a time where each turn's parent is the slot
    before it (TurnLog.decode_chain), with no turn-cache lookup between them: each record is
    still checked (its CRC, that its slot holds it), and a damaged one is named by where it
    is in turns.log; the chain above it is read as before."""
    path = tmp_path / "s"
    with Store.open(path) as s:
        ctx = s.create_context().context_id
        turns = s.append_turns(ctx, [TurnInput(b"line %d" % i) for i in range(300)])
        s.checkpoint()  # the WAL holds no copy that would repair turns.log at the next open
    log = path / "turns.log"
    data = bytearray(log.read_bytes())
    at = (turns[149].turn_id - 1) * TURN_SIZE
    if damage == "bit flip":
        data[at + 20] ^= 0xFF
    else:
        other = (turns[10].turn_id - 1) * TURN_SIZE
        data[at:at + TURN_SIZE] = data[other:other + TURN_SIZE]
    log.write_bytes(bytes(data))
    with Store.open(path) as s:
        assert s.get_last(ctx, 150) == turns[150:]
        with pytest.raises(CorruptRecord) as info:
            s.chain(turns[-1].turn_id)
    assert (info.value.file, info.value.offset) == ("turns.log", at)
    assert ("CRC" if damage == "bit flip" else f"holds turn {turns[10].turn_id}") in info.value.reason


def test_range_by_depth_far_below_the_head_reads_log_depth_records(store: Store) -> None:
    ctx = store.create_context().context_id
    for _ in range(20):
        store.append_turns(ctx, [TurnInput(b"%d" % i) for i in range(500)])
    store._turn_cache = type(store._turn_cache)(1)  # measure reads, not cache hits
    reads = []
    real = store._turns.read
    store._turns.read = lambda tid: reads.append(tid) or real(tid)  # type: ignore[method-assign]
    turns = store.range_by_depth(ctx, 37, 3)
    assert [t.depth for t in turns] == [37, 38, 39]
    assert len(reads) < 3 * 14 + 3 + 5  # a walk from depth 9999 would read ~9960 records


def test_patches_latest_and_as_of(store: Store) -> None:
    ctx = store.create_context().context_id
    t = store.append_turn(ctx, b"original")
    assert store.payload_of(t) == b"original" and store.patch_seq == 0
    p1 = store.patch(t.turn_id, b"edited")
    p2 = store.tombstone(t.turn_id)
    p3 = store.patch(t.turn_id, b"restored")
    assert (p1.seq, p2.seq, p3.seq) == (1, 2, 3)
    assert store.payload_of(t, as_of_seq=0) == b"original"
    assert store.payload_of(t, as_of_seq=1) == b"edited"
    assert store.payload_of(t, as_of_seq=2) is None
    assert store.payload_of(t) == b"restored"
    assert store.get_turn(t.turn_id).payload_hash == t.payload_hash  # the turn never changes
    with pytest.raises(UnknownTurn):
        store.patch(999, b"x")
    assert [p.seq for p in store.patches()] == [1, 2, 3]


def test_everything_survives_close_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with Store.open(path) as s:
        a = s.create_context().context_id
        turns = s.append_turns(a, [TurnInput(text(i, 3000)) for i in range(50)])
        b = s.fork(turns[20].turn_id).context_id
        s.append_turn(b, b"b-side")
        s.patch(turns[0].turn_id, b"patched")
        gone = s.create_context().context_id
        s.delete_context(gone)
        heads = s.list_contexts()
    with Store.open(path) as s:
        assert s.recovery_notes == []
        assert s.list_contexts() == heads
        assert s.payloads(s.get_last(a, 50)) == [text(i, 3000) for i in range(50)]
        assert s.payload_of(s.get_turn(turns[0].turn_id)) == b"patched"
        assert s.create_context().context_id == gone + 1  # context ids are never reused


def files_of(path: Path) -> dict[str, tuple[int, bytes]]:
    return {f.name: (f.stat().st_mtime_ns, f.read_bytes()) for f in path.iterdir()}


def test_a_read_only_open_reads_and_writes_nothing_unless_a_crash_left_work(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """StoreConfig(read_only=True): the same reads as a writable open, no byte or mtime of any
    file changed, every write refused, a damaged record read not noted in damage.log; a store
    never made, or one whose head WAL holds turns turns.log lost (a crash), is StoreNeedsWrite:
    a writable open restores them first."""
    monkeypatch.setattr(blobpack, "FOLD_BYTES", 0)  # the blobs behind the index: a read finds damage
    path = tmp_path / "s"
    with pytest.raises(StoreNeedsWrite, match="not been made"):
        Store.open(path, StoreConfig(read_only=True))
    with Store.open(path) as s:
        a = s.create_context().context_id
        s.append_turns(a, [TurnInput(text(i, 3000)) for i in range(20)])
        heads = s.list_contexts()
    before = files_of(path)
    with Store.open(path, StoreConfig(read_only=True)) as s:
        assert s.list_contexts() == heads
        assert s.payloads(s.get_last(a, 20)) == [text(i, 3000) for i in range(20)]
        with pytest.raises(StoreNeedsWrite, match="opened read-only"):
            s.append_turn(a, b"more")
        damaged = s.get_last(a, 20)[3].payload_hash
    assert files_of(path) == before
    flip_in_pack(path, damaged, 5)
    before = files_of(path)
    with Store.open(path, StoreConfig(read_only=True)) as s, pytest.raises(CorruptRecord):
        s.get_blob(damaged)  # a damaged record read: noted in memory, not in damage.log
    assert files_of(path) == before

    crash = ("import os; from store import Store, TurnInput\n"  # appended, never closed
             f"s = Store.open({str(path)!r})\n"
             "s.append_turns(1, [TurnInput(b'late %d' % i) for i in range(5)])\n"
             "os._exit(0)")
    subprocess.run([sys.executable, "-c", crash], check=True, cwd=Path(__file__).resolve().parents[2])
    log = path / "turns.log"
    os.truncate(log, log.stat().st_size - 2 * TURN_SIZE)  # a power cut: the unsynced tail of turns.log
    before = files_of(path)
    with pytest.raises(StoreNeedsWrite, match="must restore 2 turn record"):
        Store.open(path, StoreConfig(read_only=True))
    assert files_of(path) == before
    with Store.open(path) as s:  # restores them
        pass
    with Store.open(path, StoreConfig(read_only=True)) as s:
        assert s.payloads(s.get_last(a, 5)) == [b"late %d" % i for i in range(5)]


def test_non_durable_bulk_mode_round_trips(tmp_path: Path) -> None:
    with Store.open(tmp_path / "s", StoreConfig(durable=False)) as s:
        ctx = s.create_context().context_id
        s.append_turns(ctx, [TurnInput(b"%d" % i) for i in range(20_000)])  # crosses WAL checkpoints
    with Store.open(tmp_path / "s") as s:
        assert s.get_head(ctx).head_depth == 19_999 and s.get_last(ctx, 1)[0].turn_id == 20_000


def _vector(name: str) -> bytes:
    m = re.search(rf"```hex {name}\n(.*?)```", DOCS.read_text(), re.S)
    assert m, f"docs/FORMAT.md has no `hex {name}` block"
    return bytes.fromhex("".join(m.group(1).split()))


def test_format_md_test_vectors() -> None:
    payload = b"hello, store"
    h = blake3.blake3(payload).digest()
    blob = _vector("blob-record")
    assert blob == encode_blob(h, CODEC_RAW, len(payload), payload)
    hdr = decode_blob_header(blob)
    assert hdr is not None and (hdr.hash, hdr.raw_len, hdr.codec) == (h, len(payload), CODEC_RAW)
    turn = Turn(2, 1, 1, 7, 5, h, 0, 1_700_000_000_000)
    vec = _vector("turn-record")
    assert len(vec) == TURN_SIZE and vec == encode_turn(turn) and decode_turn(vec) == turn


def test_put_stored_blob_verifies_and_keeps_the_stored_bytes(tmp_path: Path) -> None:
    prose = text(9, 30000)
    with Store.open(tmp_path / "a") as a:
        sent = a.get_stored_blob(a.put_blob(prose))
    with Store.open(tmp_path / "b") as b:
        assert b.put_stored_blob(sent) == sent.hash
        assert b.get_stored_blob(sent.hash) == sent and b.get_blob(sent.hash, verify=True) == prose
        ctx = b.create_context().context_id
        t = b.append_turns(ctx, [TurnBlobRef(sent.hash, type_tag=4)])[0]
        assert (t.payload_hash, t.type_tag) == (sent.hash, 4) and b.payloads([t]) == [prose]
        bad = [
            (StoredBlob(sent.hash, sent.codec, sent.raw_len, sent.stored[:-3]), "do not decode"),
            (StoredBlob(sent.hash, sent.codec, sent.raw_len + 1, sent.stored), "declares"),
            (StoredBlob(bytes(32), sent.codec, sent.raw_len, sent.stored), "different BLAKE3"),
            (StoredBlob(sent.hash, 9, sent.raw_len, sent.stored), "unknown codec"),
        ]
        for blob, why in bad:
            with pytest.raises(BlobMismatch, match=why):
                b.put_stored_blob(blob)
        assert not b.has_blob(bytes(32))
        with pytest.raises(UnknownBlob):
            b.append_turns(ctx, [TurnBlobRef(b"\x01" * 32)])
        assert b.get_head(ctx).head_turn_id == t.turn_id


def test_a_batch_bigger_than_a_wal_generation_is_durable_and_ordered(tmp_path: Path) -> None:
    payloads = [text(i, 12_000) for i in range(400)]  # ~4 MB of copies: crosses WAL checkpoints
    with Store.open(tmp_path / "s") as s:
        ctx = s.create_context().context_id
        turns = s.append_turns(ctx, [TurnInput(p) for p in payloads])
        assert [t.depth for t in turns] == list(range(400))
        assert [t.turn_id for t in turns] == list(range(1, 401))
    with Store.open(tmp_path / "s") as s:
        assert s.payloads(s.get_last(ctx, 400)) == payloads
        assert s.range_by_depth(ctx, 390, 5) == turns[390:395]


def test_put_stored_blobs_checks_all_then_commits_once(tmp_path: Path) -> None:
    payloads = [text(100 + i, 20000) for i in range(40)]  # big enough for the two-thread check
    with Store.open(tmp_path / "a") as a:
        sent = [a.get_stored_blob(a.put_blob(p)) for p in payloads]
    with Store.open(tmp_path / "b") as b:
        bad = StoredBlob(sent[7].hash, sent[7].codec, sent[7].raw_len, sent[8].stored)
        with pytest.raises(BlobMismatch, match=sent[7].hash.hex()):
            b.put_stored_blobs([*sent[:7], bad, *sent[8:]])
        assert not any(b.has_blob(s.hash) for s in sent)  # nothing stored from a failed batch
        syncs = []
        real = b._commit._sync
        b._commit._sync = lambda: syncs.append(1) or real()  # type: ignore[method-assign]
        assert b.put_stored_blobs(sent) == [s.hash for s in sent]
        assert len(syncs) == 1 and b.payloads([]) == []
        assert [b.get_blob(s.hash, verify=True) for s in sent] == payloads


def test_a_big_batch_writes_its_new_blobs_in_one_write_once_each(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from store.files import blobpack

    payloads = [text(500 + i, 12_000) for i in range(60)]  # big enough for the prepare threads
    batch = payloads + payloads[:10] + [payloads[0]]  # repeats inside the batch, and of held blobs
    writes: list[int] = []
    real_write = blobpack.write_at
    monkeypatch.setattr(blobpack, "write_at", lambda fd, data, off: (writes.append(len(data)),
                                                                     real_write(fd, data, off))[1])
    with Store.open(tmp_path / "s") as s:
        ctx = s.create_context().context_id
        s.append_turn(ctx, payloads[5])
        s.pack_pending()
        writes.clear()
        end = s._pack.end
        s.append_turns(ctx, [TurnInput(p) for p in batch])
        assert writes == [s._pack.end - end]  # the 59 new records, in one write
        assert len(s.blob_hashes()) == 60
    with Store.open(tmp_path / "s") as s:
        assert s.payloads(s.get_last(ctx, len(batch))) == batch
    report = fsck(tmp_path / "s", full=True)  # re-hashes every blob in the pack
    assert report.ok, report.summary()


def test_concurrent_big_batches_of_shared_lines_store_each_once(tmp_path: Path) -> None:
    payloads = [text(700 + i, 12_000) for i in range(80)]
    barrier = threading.Barrier(4)
    with Store.open(tmp_path / "s") as s:
        ctxs = [s.create_context().context_id for _ in range(4)]

        def append(k: int) -> None:
            barrier.wait()
            rnd = random.Random(k)
            s.append_turns(ctxs[k], [TurnInput(p) for p in rnd.sample(payloads, 60)])

        threads = [threading.Thread(target=append, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)  # shard locks taken in order: no deadlock
        picked = [random.Random(k).sample(payloads, 60) for k in range(4)]
        assert len(s.blob_hashes()) == len({p for chosen in picked for p in chosen})
        for k in range(4):
            assert s.payloads(s.get_last(ctxs[k], 60)) == picked[k]
