"""blobs.idx: folding new blobs into a mapped index splices a few of them in without decoding
it, sorts many of them in with all its entries, and folds only once there are enough of them."""
from __future__ import annotations

import mmap
import os
import random
from pathlib import Path

import pytest

from store import Store
from store.files import blobindex
from store.files.blobindex import BlobIndex, encode_index, index_entry
from store.files.blobpack import FOLD_BLOBS, FOLD_BYTES
from store.fsck import fsck
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


@pytest.mark.parametrize("whole_max", [blobindex.MERGE_WHOLE_MAX, 0])
def test_many_new_entries_merge_as_a_few_splice(tmp_path: Path, whole_max: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Into an empty, a small and a big index: the same bytes as a rebuild, whichever way (one
    sort of every entry where the new ones are many, MERGE_WHOLE, and the index is at most
    MERGE_WHOLE_MAX; a bisection per new entry otherwise), a new location replacing the
    indexed one."""
    assert 400 * blobindex.MERGE_WHOLE >= 40 and 20 * blobindex.MERGE_WHOLE < 3000  # both ways below
    monkeypatch.setattr(blobindex, "MERGE_WHOLE_MAX", whole_max)
    rng = random.Random(3)
    for old_count, new_count in ((0, 50), (40, 400), (3000, 3000), (3000, 20)):
        old = {rng.randbytes(32): _loc(i) for i in range(old_count)}
        new = {rng.randbytes(32): _loc(5000 + i) for i in range(new_count)}
        new.update({h: _loc(9) for h in list(old)[:3]})
        index = _mapped(tmp_path / f"{old_count}.idx",
                        encode_index([index_entry(h, old[h]) for h in sorted(old)], 0, None))
        expected = {**old, **new}
        assert encode_index(index.merged(new), 0, None) == encode_index(
            [index_entry(h, expected[h]) for h in sorted(expected)], 0, None)
    assert encode_index(BlobIndex().merged(new), 0, None) == encode_index(
        [index_entry(h, new[h]) for h in sorted(new)], 0, None)


def test_a_small_tail_is_left_to_the_next_open_and_a_big_one_folded(tmp_path: Path) -> None:
    """A close folds the new blobs into blobs.idx only past FOLD_BLOBS or FOLD_BYTES: the fold
    rewrites the whole index (it grows with the store), the next open scans a small tail in
    milliseconds.  Either way every blob is found again, with no recovery note."""
    path = tmp_path / "s"
    with Store.open(path) as s:
        first = [s.put_blob(random.Random(i).randbytes(3000)) for i in range(FOLD_BLOBS + 1)]
    idx = path / "blobs.idx"
    folded = idx.stat()
    assert IDX_HEADER.unpack_from(idx.read_bytes(), 0)[3] == len(first)  # more than FOLD_BLOBS: folded

    with Store.open(path) as s:
        small = [s.put_blob(b"small %d" % i) for i in range(10)]
    assert (idx.stat().st_ino, idx.stat().st_mtime_ns) == (folded.st_ino, folded.st_mtime_ns)
    with Store.open(path) as s:
        assert not s.recovery_notes
        assert all(s.get_blob(h) == b"small %d" % i for i, h in enumerate(small))
        assert s.get_blob(first[7]) == random.Random(7).randbytes(3000)
        big = s.put_blob(random.Random(99).randbytes(FOLD_BYTES + 1))  # stored raw: incompressible
    assert IDX_HEADER.unpack_from(idx.read_bytes(), 0)[3] == len(first) + len(small) + 1
    with Store.open(path) as s:
        assert not s.recovery_notes and s.get_blob(big) == random.Random(99).randbytes(FOLD_BYTES + 1)
    assert fsck(path, full=True).ok


@pytest.mark.parametrize("prefixes_after", [0.0, 1 / 64, 1e9])
def test_locate_finds_what_a_dict_finds(tmp_path: Path, prefixes_after: float,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup searches the mapping, or (once searched PREFIXES_AFTER times an entry)
    bisects each entry's first 8 key bytes and compares whole the keys alike in those: a
    dict's answers either way, for held and absent hashes, at both ends of the index and
    among keys that share their first 8 bytes; `has` answers as `in` does."""
    monkeypatch.setattr(blobindex, "PREFIXES_AFTER", prefixes_after)
    rng = random.Random(3)
    held = {rng.randbytes(32): _loc(i) for i in range(2000)}
    held[bytes(32)], held[b"\xff" * 32] = _loc(1), _loc(2)
    twins = b"\x7f" * 8
    held.update({twins + rng.randbytes(24): _loc(3000 + i) for i in range(5)})
    entries = [index_entry(h, held[h]) for h in sorted(held)]
    index = _mapped(tmp_path / "a.idx", encode_index(entries, 1, None))
    asked = [*held, *(rng.randbytes(32) for _ in range(300)), b"\x00" * 31 + b"\x01",
             *(twins + rng.randbytes(24) for _ in range(5)), twins + bytes(24), twins + b"\xff" * 24]
    rng.shuffle(asked)
    assert [index.has(h) for h in asked] == [h in held for h in asked]  # before locate fills `found`
    assert [index.locate(h) for h in asked] == [held.get(h) for h in asked]
    assert [index.has(h) for h in asked] == [h in held for h in asked]
    assert BlobIndex().locate(asked[0]) is None and not BlobIndex().has(asked[0])
