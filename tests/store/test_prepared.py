"""A batch prepared ahead of its append (`Store.prepare_turns`, then `append_turns(prepared=)`),
as an import prepares its next batch while the store writes the one before: the same blobs
as an append that prepares its own, and a blob that was stored when the batch was prepared
but collected by GC before the append is written again, not referenced while missing."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from store import Store, StoreConfig, TurnInput
from store.durability import packer
from store.fsck import fsck
from store.layout import CODEC_RAW, CODEC_ZSTD
from store.types import TurnBlobRef


def _batch(rng: random.Random) -> list[bytes]:
    """Lines as a session's: compressible text, an image (incompressible, over the probe),
    a compressible big line, tiny lines and a repeated line; big enough for the threads."""
    text = [bytes(rng.choice(b"abcdefgh {}\":,") for _ in range(2000)) * rng.randint(2, 20)
            for _ in range(40)]
    image = rng.randbytes(300_000)
    return [*text, image, b"x" * 200_000, b"{}\n", b"\n", text[0]]


def test_prepared_many_are_what_prepare_makes_of_each(tmp_path: Path) -> None:
    rng = random.Random(7)
    with Store.open(tmp_path / "s") as s:
        held = s.put_blob(b"held line\n" * 500)
        items: list[bytes | TurnBlobRef] = [*_batch(rng), b"held line\n" * 500, TurnBlobRef(held)]
        many = packer.prepare_many(s, items, threads=2)
        one = [packer.prepare(s, i) for i in items]
    assert many == one
    assert {p.codec for p in many if p.stored is not None} == {CODEC_RAW, CODEC_ZSTD}  # the image is raw


def test_an_append_with_its_batch_prepared_before_stores_the_same(tmp_path: Path) -> None:
    payloads = _batch(random.Random(8))
    with Store.open(tmp_path / "a") as a, Store.open(tmp_path / "b") as b:
        inputs = [TurnInput(p) for p in payloads]
        ready = a.prepare_turns(inputs)
        ctx_a, ctx_b = a.create_context().context_id, b.create_context().context_id
        turns_a = a.append_turns(ctx_a, inputs, prepared=ready)
        turns_b = b.append_turns(ctx_b, inputs)
        assert [t.payload_hash for t in turns_a] == [t.payload_hash for t in turns_b]
        assert a.payloads(turns_a) == payloads
        assert sorted(a.blob_hashes()) == sorted(b.blob_hashes())
        assert all(a.get_stored_blob(h) == b.get_stored_blob(h) for h in a.blob_hashes())
        with pytest.raises(ValueError, match="2 prepared payloads for 3 turns"):
            a.append_turns(ctx_a, inputs[:3], prepared=ready[:2])
    assert fsck(tmp_path / "a", full=True).ok


def test_a_blob_collected_between_prepare_and_append_is_stored_again(tmp_path: Path) -> None:
    payloads = _batch(random.Random(9))
    path = tmp_path / "s"
    with Store.open(path, StoreConfig(gc_grace_seconds=0)) as s:
        orphan = s.put_blob(payloads[1])  # stored, referenced by no turn
        inputs = [TurnInput(p) for p in payloads]
        ready = s.prepare_turns(inputs)
        assert ready[1].hash == orphan and ready[1].stored is None  # found stored: not compressed
        s.gc()
        assert not s.has_blob(orphan)
        turns = s.append_turns(s.create_context().context_id, inputs, prepared=ready)
        assert s.get_blob(orphan) == payloads[1]
        assert s.payloads(turns) == payloads
    with Store.open(path) as s:
        assert s.get_blob(orphan) == payloads[1]
    assert fsck(path, full=True).ok


@pytest.mark.parametrize("fold", [False, True])
def test_a_batch_prepared_before_others_stored_its_blobs_stores_each_once(tmp_path: Path, fold: bool) -> None:
    """The writer looks a prepared batch's new blobs up again only among the records appended
    since (BlobPack.locate_since), and in the whole index once a fold replaced the one they were
    prepared against: a blob another append stored meanwhile is never written twice."""
    from store.files.blobpack import scan_pack

    payloads = _batch(random.Random(10))
    path = tmp_path / "s"
    with Store.open(path) as s:
        inputs = [TurnInput(p) for p in payloads]
        ready = s.prepare_turns(inputs)
        assert all(p.absent_from is not None for p in ready if p.stored is not None)
        s.append_turns(s.create_context().context_id, inputs[::2])  # half of them stored meanwhile
        if fold:
            s._pack.write_index()  # the fold a checkpoint makes past INDEX_TAIL_MAX
        turns = s.append_turns(s.create_context().context_id, inputs, prepared=ready)
        assert s.payloads(turns) == payloads
    hashes = [record.hash for _, record in scan_pack((path / "blobs.pack").read_bytes()).records]
    assert len(hashes) == len(set(hashes)) == len(set(payloads))
    assert fsck(path, full=True).ok
