"""Streaming and incremental BLAKE3 of session files, the stat cache, and rewrite detection."""
from __future__ import annotations

import json
import os
from pathlib import Path

import blake3
import pytest

from p2pnode.pi.hashing import PROBE, FileHasher, Prefix, hash_file


class Recorder:
    """A sink that records what it is fed, from the offset it asks for."""

    def __init__(self, start_if_appended: int) -> None:
        self.start_if_appended = start_if_appended
        self.appended: bool | None = None
        self.grown: Prefix | None = None
        self.data = bytearray()

    def begin(self, grown: Prefix | None) -> int:
        self.appended, self.grown = grown is not None, grown
        return self.start_if_appended if grown is not None else 0

    def feed(self, data: bytes) -> None:
        assert type(data) is bytes  # the sink may keep it: no buffer the hasher reuses
        self.data += data


def lines(n: int, width: int = 300, tag: str = "x") -> bytes:
    return b"".join(b'{"type":"message","n":%d,"t":"%s"}\n' % (i, (tag * width).encode()) for i in range(n))



def counted_updates(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the bytes every BLAKE3 hasher is fed from now on (until monkeypatch.undo)."""
    fed: list[int] = []
    real_update = blake3.blake3.update

    def counting_update(self: blake3.blake3, data: bytes) -> blake3.blake3:
        fed.append(len(data))
        return real_update(self, data)

    monkeypatch.setattr(blake3.blake3, "update", counting_update)
    return fed

def test_corpus_files_hash_to_the_manifest(corpus_dir: Path, corpus_manifest: dict, tmp_path: Path) -> None:
    hasher = FileHasher(tmp_path / "cache.json")
    for entry in corpus_manifest["files"]:
        path = corpus_dir / entry["path"]
        scan = hasher.scan(path)
        assert hash_file(path) == scan.prefix.blake3 == entry["blake3"]
        assert scan.prefix.size == entry["bytes"] and scan.prefix.lines == entry["lines"]
        assert scan.how == "full"


def test_stat_cache_survives_a_restart_and_notices_changes(tmp_path: Path) -> None:
    f = tmp_path / "s.jsonl"
    f.write_bytes(lines(50))
    cache = tmp_path / "cache.json"
    first = FileHasher(cache)
    assert first.scan(f).how == "full"
    first.save()
    again = FileHasher(cache)  # a new process
    assert again.cached(f) == first.known(f)
    assert again.scan(f).how == "cached"
    os.utime(f, ns=(1, 1))  # same bytes, new mtime: not trusted, hashed again
    assert again.cached(f) is None
    assert again.scan(f).how == "full"


@pytest.mark.parametrize("damage", [b'{"version":1,"files":{"x":', b'{"version":1,"files":[]}', b'[1]',
                                    b'{"files":{"x":{"stat":1}}}'])
def test_damaged_cache_only_costs_a_rehash(tmp_path: Path, damage: bytes) -> None:
    f = tmp_path / "s.jsonl"
    f.write_bytes(lines(3))
    cache = tmp_path / "cache.json"
    cache.write_bytes(damage)
    hasher = FileHasher(cache)
    assert hasher.scan(f).prefix.blake3 == hash_file(f)
    hasher.save()
    assert json.loads(cache.read_bytes())["files"][str(f)]["prefix"]["blake3"] == hash_file(f)


def test_growth_hashes_only_new_bytes_with_live_state(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "s.jsonl"
    f.write_bytes(lines(2000))
    hasher = FileHasher(None)
    old = hasher.scan(f).prefix
    with open(f, "ab") as out:
        out.write(lines(10, tag="y"))
    fed = counted_updates(monkeypatch)
    sink = Recorder(old.size)
    scan = hasher.scan(f, prefixes=[old], sink=sink)
    monkeypatch.undo()
    assert scan.how == "appended" and not scan.rewritten and sink.appended
    assert scan.prefix.blake3 == hash_file(f)
    assert bytes(sink.data) == f.read_bytes()[old.size:]
    new_bytes = f.stat().st_size - old.size
    assert new_bytes <= sum(fed) <= new_bytes + 4 * PROBE  # the new bytes plus the probes, not the old MBs
    assert scan.prefix.lines == 2010 and scan.prefix.last_line_start == f.stat().st_size


def test_growth_after_restart_is_verified_by_the_prefix_digest(tmp_path: Path) -> None:
    f = tmp_path / "s.jsonl"
    f.write_bytes(lines(100))
    old = FileHasher(None).scan(f).prefix
    with open(f, "ab") as out:
        out.write(b'{"partial":')  # Pi mid-write: no newline yet
    sink = Recorder(old.size)
    scan = FileHasher(None).scan(f, prefixes=[old], sink=sink)
    assert scan.how == "appended" and sink.appended
    assert scan.prefix == Prefix(f.stat().st_size, hash_file(f), 101, old.size)


@pytest.mark.parametrize("live", [True, False])
@pytest.mark.parametrize("where", ["header", "end"])
def test_rewrite_is_detected_and_hashed_in_full(tmp_path: Path, live: bool, where: str) -> None:
    f = tmp_path / "s.jsonl"
    original = lines(500)
    f.write_bytes(original)
    hasher = FileHasher(None)
    old = hasher.scan(f).prefix
    data = bytearray(original)
    pos = 5 if where == "header" else len(data) - 10
    data[pos] ^= 0x01  # Pi's migration or header replacement rewrites the file in place
    with open(f, "r+b") as out:  # same inode, as writeFileSync does
        out.write(bytes(data) + lines(5, tag="z"))
    sink = Recorder(old.size)
    scan = (hasher if live else FileHasher(None)).scan(f, prefixes=[old], sink=sink)
    assert scan.rewritten and scan.how == "full" and sink.appended is False
    assert scan.prefix.blake3 == hash_file(f)
    assert bytes(sink.data) == f.read_bytes()


def test_shrunk_file_is_hashed_in_full(tmp_path: Path) -> None:
    f = tmp_path / "s.jsonl"
    f.write_bytes(lines(10))
    hasher = FileHasher(None)
    old = hasher.scan(f).prefix
    f.write_bytes(lines(3))
    scan = hasher.scan(f, prefixes=[old])
    assert scan.how == "full" and scan.prefix.blake3 == hash_file(f) and scan.prefix.lines == 3


def test_empty_and_unterminated_files(tmp_path: Path) -> None:
    f = tmp_path / "s.jsonl"
    f.write_bytes(b"")
    assert FileHasher(None).scan(f).prefix == Prefix(0, blake3.blake3(b"").hexdigest(), 0, 0)
    f.write_bytes(b"a\nbc")
    assert FileHasher(None).scan(f).prefix == Prefix(4, hash_file(f), 2, 2)


@pytest.mark.parametrize("live", [True, False])
def test_the_largest_older_version_that_is_a_prefix_is_the_one_grown_from(
        tmp_path: Path, live: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two continuations of one version: the file grew from v1, not from the larger vx (held,
    not a prefix); all of them are checked in one read of the prefix part."""
    v1, vx, vy = tmp_path / "v1.jsonl", tmp_path / "vx.jsonl", tmp_path / "vy.jsonl"
    v1.write_bytes(lines(300))
    vx.write_bytes(lines(300) + lines(10, tag="x"))
    vy.write_bytes(lines(300) + lines(20, tag="y"))
    hasher = FileHasher(None)
    old, other = hasher.scan(v1).prefix, hasher.scan(vx).prefix
    if live:  # vy's path last seen at v1's size (a session file Pi went on writing)
        vy.write_bytes(v1.read_bytes())
        assert hasher.scan(vy).prefix == old
        vy.write_bytes(lines(300) + lines(20, tag="y"))
    read = counted_updates(monkeypatch)
    sink = Recorder(old.size)
    scan = (hasher if live else FileHasher(None)).scan(vy, prefixes=[other, old], sink=sink)
    monkeypatch.undo()
    assert scan.grown == old == sink.grown and scan.how == "appended" and not scan.rewritten
    assert scan.prefix == FileHasher(None).scan(vy).prefix
    assert bytes(sink.data) == vy.read_bytes()[old.size:]
    # the file once, but for vx's bytes past v1 (read by the check, then for the sink), plus the probes
    assert sum(read) <= vy.stat().st_size + (other.size - old.size) + 4 * PROBE
