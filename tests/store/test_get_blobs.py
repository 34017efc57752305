"""Store.get_blobs: many blobs read in one call (a fetch's held lines), each checked as
get_blob checks it (CRC, decoding, BLAKE3), on real pack files; a flipped bit in one of them
is found, reported like get_blob's, and marks only that blob damaged."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
from test_damage import flip_in_pack

from store import CorruptRecord, Store, UnknownBlob
from store.codec import blob_hash
from store.files.blobpack import scan_pack
from store.layout import CODEC_RAW, encode_blob
from store.recovery import DAMAGE


def _blobs(n: int) -> list[bytes]:
    """Compressible and incompressible blobs, big enough in all for the prepare threads."""
    r = random.Random(5)
    return [r.randbytes(20_000) if i % 3 == 0 else (b'{"line":%d,"text":"%s"}\n' % (i, b"ab" * (500 + i)))
            for i in range(n)]


def _stored(path: Path, blobs: list[bytes]) -> list[bytes]:
    with Store.open(path) as s:
        hashes = [s.put_blob(b) for b in blobs]
        s.checkpoint()
    return hashes


def test_get_blobs_gives_what_get_blob_gives_in_order(tmp_path: Path) -> None:
    blobs = _blobs(90)
    hashes = _stored(tmp_path / "s", blobs)
    with Store.open(tmp_path / "s") as s:
        assert s.get_blob(hashes[4]) == blobs[4]  # one of them cached already
        pending = b"written after the checkpoint, not packed yet"
        wanted = [*hashes, hashes[7], s.put_blob(pending), hashes[0]]  # repeats, and a pending one
        assert s.get_blobs(wanted) == [*blobs, blobs[7], pending, blobs[0]]
        assert s.get_blobs([]) == []
        missing = blob_hash(b"never stored")
        with pytest.raises(UnknownBlob):
            s.get_blobs([hashes[1], missing])


@pytest.mark.parametrize("victim", [3, 10])  # raw (incompressible) and zstd-compressed
def test_a_flipped_bit_in_one_blob_of_a_batch_is_found(tmp_path: Path, victim: int) -> None:
    path = tmp_path / "s"
    blobs = _blobs(60)
    hashes = _stored(path, blobs)
    flip_in_pack(path, hashes[victim], 5)
    with Store.open(path) as s:
        with pytest.raises(CorruptRecord, match=hashes[victim].hex()):
            s.get_blobs(hashes)
        assert s.get_blobs(hashes[:victim] + hashes[victim + 1:]) == blobs[:victim] + blobs[victim + 1:]
        with pytest.raises(CorruptRecord):  # noted: get_blob sees the same damage
            s.get_blob(hashes[victim])
    assert hashes[victim].hex() in (path / DAMAGE).read_text()


def test_a_forged_record_with_a_good_crc_fails_its_hash_on_the_prepare_threads(tmp_path: Path) -> None:
    """A record rewritten with other bytes of the same length and a CRC that matches them: only
    the BLAKE3 after decoding (done on the prepare threads for a batch) can tell."""
    path = tmp_path / "s"
    blobs = _blobs(60)
    hashes = _stored(path, blobs)
    victim = 6  # incompressible: stored raw, so other bytes decode
    data = bytearray((path / "blobs.pack").read_bytes())
    (off,) = [o for o, hdr in scan_pack(bytes(data)).records if hdr.hash == hashes[victim]]
    forged = encode_blob(hashes[victim], CODEC_RAW, len(blobs[victim]), bytes(len(blobs[victim])))
    data[off : off + len(forged)] = forged
    (path / "blobs.pack").write_bytes(bytes(data))
    with Store.open(path) as s:
        with pytest.raises(CorruptRecord, match="does not hash to its name"):
            s.get_blobs(hashes)
        assert s.get_blobs(hashes[:victim]) == blobs[:victim]
    assert hashes[victim].hex() in (path / DAMAGE).read_text()
