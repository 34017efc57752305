"""Blobs that small appends leave raw in the WAL for the packer (store/api.py docstring).

An append of a new small blob by a writer alone does not compress it: the WAL record carries
it raw, reads find it in memory, and the next checkpoint (or GC, close, put_blob,
get_stored_blob, pack_pending) compresses it into the pack.  These tests check that it is
readable and stored once all along, that put_blob and peers never see it half-stored, that
a checkpoint packs it before dropping its WAL, that a crash before packing loses nothing
(tests/store/test_recovery.py) and that recovery packs it compressed.
"""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path

from store import Store, TurnInput
from store.files import headwal
from store.fsck import fsck
from store.layout import CODEC_RAW, CODEC_ZSTD
from store.service.client import StoreClient
from store.service.server import StoreServer


def text(seed: int, n: int = 12_000) -> bytes:
    rng = random.Random(seed)
    words = [b"read_file", b"ok", b"def", b"return", b"\n", b"error", b"the", b"diff"]
    return b" ".join(rng.choice(words) for _ in range(n // 5))[:n]


def test_an_append_leaves_its_new_blob_for_the_packer(tmp_path: Path) -> None:
    with Store.open(tmp_path / "s") as s:
        ctx = s.create_context().context_id
        end = s._pack.end
        t = s.append_turn(ctx, text(1))
        assert s._pack.end == end and t.payload_hash in s._pending
        assert s.payloads([t]) == [text(1)] and s.get_blob(t.payload_hash, verify=True) == text(1)
        assert s.has_blob(t.payload_hash) and s.blob_hashes() == [t.payload_hash]
        s.pack_pending()
        assert not s._pending and s._pending_bytes == 0
        stored = s.get_stored_blob(t.payload_hash)
        assert stored.codec == CODEC_ZSTD and len(stored.stored) < len(text(1)) // 2
        assert s.get_blob(t.payload_hash, verify=True) == text(1)
    assert fsck(tmp_path / "s", full=True).ok


def test_a_blob_left_raw_is_stored_once_whoever_appends_it(tmp_path: Path) -> None:
    with Store.open(tmp_path / "s") as s:
        ctxs = [s.create_context().context_id for _ in range(5)]
        turns = [s.append_turn(c, text(2)) for c in ctxs]
        assert len(s._pending) == 1
        s.pack_pending()
        end = s._pack.end
        turns += [s.append_turn(c, text(2)) for c in ctxs]  # in the pack now: nothing new
        assert s._pack.end == end and not s._pending
        assert s.payloads(turns) == [text(2)] * 10 and len(s.blob_hashes()) == 1


def test_put_blob_and_peers_get_a_pending_blob_packed(tmp_path: Path) -> None:
    with Store.open(tmp_path / "s") as s:
        ctx = s.create_context().context_id
        a, b = s.append_turn(ctx, text(3)), s.append_turn(ctx, text(4))
        assert s.put_blob(text(3)) == a.payload_hash  # durable on return: so in the synced pack
        assert a.payload_hash not in s._pending and s._pack.locate(a.payload_hash) is not None
        assert s.get_stored_blob(b.payload_hash).codec == CODEC_ZSTD  # what a peer is sent
        assert not s._pending


def test_checkpoints_pack_what_waits_before_they_drop_its_wal(tmp_path: Path) -> None:
    with Store.open(tmp_path / "s") as s:
        ctx = s.create_context().context_id
        first = [s.append_turn(ctx, text(10 + i)) for i in range(5)]
        assert len(s._pending) == 5
        gen = s._wal.gen
        for n in range(headwal.WAL_BYTES // 12_000 + 10):  # fills the WAL: a checkpoint comes
            s.append_turn(ctx, os.urandom(8) + text(100 + n))
        for _ in range(500):
            if s._wal.gen > gen and all(t.payload_hash not in s._pending for t in first):
                break
            threading.Event().wait(0.01)
        assert all(s._pack.locate(t.payload_hash) is not None for t in first)
        assert s._pending_bytes < headwal.WAL_BYTES
        assert s.payloads(first) == [text(10 + i) for i in range(5)]


def test_big_batches_and_big_blobs_are_compressed_at_once(tmp_path: Path) -> None:
    with Store.open(tmp_path / "s") as s:
        ctx = s.create_context().context_id
        s.append_turns(ctx, [TurnInput(text(200 + i, 20_000)) for i in range(20)])  # 400 KB: threads
        s.append_turn(ctx, text(300, 100_000))  # too big to travel in the WAL
        assert not s._pending


def test_concurrent_appends_reads_and_packers_agree(tmp_path: Path) -> None:
    """16 writers share a few payloads (dedup races), readers check every payload they see,
    and two threads pack all along: every payload right, each blob in the pack once."""
    payloads = [text(500 + i, 3000 + i) for i in range(24)]
    errors: list[str] = []
    stop = threading.Event()
    with Store.open(tmp_path / "s") as s:
        ctxs = [s.create_context().context_id for _ in range(16)]

        def writer(k: int) -> None:
            rng = random.Random(k)
            for _ in range(40):
                s.append_turn(ctxs[k], rng.choice(payloads))

        def reader() -> None:
            while not stop.is_set():
                for c in ctxs:
                    turns = s.get_last(c, 8)
                    for t, p in zip(turns, s.payloads(turns), strict=True):
                        if p not in payloads:
                            errors.append(f"turn {t.turn_id}: a payload nobody wrote")

        def packer() -> None:
            while not stop.is_set():
                s.pack_pending()

        side = [threading.Thread(target=f) for f in (reader, packer, packer)]
        writers = [threading.Thread(target=writer, args=(k,)) for k in range(16)]
        for t in side + writers:
            t.start()
        for t in writers:
            t.join()
        stop.set()
        for t in side:
            t.join()
        assert not errors, errors[:3]
        s.pack_pending()
        assert sorted(s.blob_hashes()) == sorted(set(s.blob_hashes()))
        assert len(s._pack) == len({t.payload_hash for c in ctxs for t in s.get_last(c, 100)})
    assert fsck(tmp_path / "s", full=True).ok


async def test_the_service_reads_blobs_that_wait_for_the_packer(tmp_path: Path) -> None:
    with Store.open(tmp_path / "s") as s:
        async with StoreServer(s, tmp_path / "sock"):
            client = await StoreClient.connect(tmp_path / "sock")
            ctx = (await client.create_context()).context_id
            turns = [await client.append_turn(ctx, text(700 + i)) for i in range(3)]
            assert all(t.payload_hash in s._pending for t in turns)
            listing = await client.get_last(ctx, 3, payloads=True)
            assert listing.payloads == [text(700 + i) for i in range(3)]
            assert await client.get_blob(turns[0].payload_hash, verify=True) == text(700)
            await client.close()


def test_incompressible_blobs_are_packed_raw(tmp_path: Path) -> None:
    with Store.open(tmp_path / "s") as s:
        t = s.append_turn(s.create_context().context_id, os.urandom(5000))
        s.pack_pending()
        assert s.get_stored_blob(t.payload_hash).codec == CODEC_RAW
