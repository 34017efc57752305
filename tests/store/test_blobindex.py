"""blobs.idx: folding new blobs into a mapped index splices them in without decoding it."""
from __future__ import annotations

import mmap
import os
import random
from pathlib import Path

from store.files.blobindex import BlobIndex, encode_index, index_entry
from store.layout import IDX_ENTRY, IDX_FANOUT, IDX_HEADER, IDX_PREFIX_LEN, BlobLocation


def _mapped(path: Path, data: bytes) -> BlobIndex:
    path.write_bytes(data)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    count = IDX_HEADER.unpack_from(mm, 0)[3]
    return BlobIndex(mm, IDX_FANOUT.unpack_from(mm, IDX_HEADER.size), count)


def _loc(i: int) -> BlobLocation:
    return BlobLocation(i * 100, i + 1, i + 2, i % 3)


def test_merged_index_equals_a_full_rebuild(tmp_path: Path) -> None:
    rng = random.Random(12)
    old = {rng.randbytes(32): _loc(i) for i in range(3000)}
    old[bytes(32)] = _loc(1)          # the first bucket's first entry
    old[b"\xff" * 32] = _loc(2)       # the last bucket's last entry
    index = _mapped(tmp_path / "a.idx", encode_index([index_entry(h, old[h]) for h in sorted(old)], 1, None))
    assert index.count == len(old)
    replaced = rng.sample(sorted(old), 5) + [bytes(32), b"\xff" * 32]
    new = {h: _loc(9000 + i) for i, h in enumerate(replaced)}
    new.update({rng.randbytes(32): _loc(8000 + i) for i in range(200)})
    new[b"\x00" * 31 + b"\x01"] = _loc(7)  # right after the first entry
    runs = index.merged(new)
    index.mm.close()  # type: ignore[union-attr]  # merged() holds no export of the mapping

    expected = {**old, **new}
    rebuilt = encode_index([index_entry(h, expected[h]) for h in sorted(expected)], 5, (4, b"\x01" * 32))
    assert encode_index(runs, 5, (4, b"\x01" * 32)) == rebuilt
    merged = _mapped(tmp_path / "b.idx", rebuilt)
    assert merged.count == len(expected)
    for h, loc in expected.items():
        assert merged.locate(h) == loc
    assert merged.locate(os.urandom(32)) is None
    assert len(rebuilt) == IDX_PREFIX_LEN + len(expected) * IDX_ENTRY.size


def test_an_empty_index_takes_the_new_entries_sorted(tmp_path: Path) -> None:
    new = {os.urandom(32): _loc(i) for i in range(50)}
    index = _mapped(tmp_path / "e.idx", encode_index([], 0, None))
    encoded = encode_index(index.merged(new), 0, None)
    assert encoded == encode_index(BlobIndex().merged(new), 0, None)
    assert _mapped(tmp_path / "f.idx", encoded).locate(min(new)) == new[min(new)]
