"""The import's batches overlap (read and split, then prepared, then appended, up to
IN_FLIGHT at once): with batches small enough that a corpus file makes dozens, every line
is stored whole and in order; and a disk that fails in the middle of one batch's pack write
fails the share, leaves no version and no offer, and a share after the fault stores the
file byte for byte (fsck clean)."""
from __future__ import annotations

import errno
import json
import os
import random
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pifork import find

from p2pnode.library.api import Library
from p2pnode.paths import NodePaths
from p2pnode.pi.hashing import hash_file
from store.errors import StoreFull
from store.files import blobpack
from store.fsck import fsck

A3 = "*173a-7744-89ad-bbc16c12cc22.jsonl"  # 1.4 MB, images
B1 = "*4f3f-74a0-8c1a-0b533764bed8.jsonl"  # names itself (session_info)


@pytest.fixture
def agent(corpus_dir: Path, tmp_path: Path) -> Path:
    agent = tmp_path / "agent"
    shutil.copytree(corpus_dir / "sessions", agent / "sessions")
    return agent


@pytest.fixture
def small_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of ~300 KB or 32 lines: a 1.4 MB session makes several, each big enough to be
    compressed on the store's threads (store/api.py's _parallel)."""
    monkeypatch.setattr("p2pnode.library.sessions.BATCH_BYTES", 300_000)
    monkeypatch.setattr("p2pnode.library.sessions.BATCH_LINES", 256)


def long_session(agent: Path) -> Path:
    """A3's header and lines, then 2,000 more message lines of 1-2 KB: a dozen batches of
    300 KB, each big enough for one pack write of its new lines."""
    path = find(agent, A3)
    rng = random.Random(1)
    with open(path, "ab") as f:
        for i in range(2000):
            text = "".join(rng.choice("abcdefgh ij") for _ in range(rng.randint(1000, 2000)))
            entry = {"type": "message", "id": f"{i:08x}", "parentId": None,
                     "message": {"role": "user", "content": [{"type": "text", "text": text}]}}
            f.write(json.dumps(entry, separators=(",", ":")).encode() + b"\n")
    return path


@pytest.mark.usefixtures("small_batches")
def test_a_session_in_many_overlapping_batches_is_stored_line_for_line(agent: Path, tmp_path: Path,
                                                                       corpus_manifest: dict) -> None:
    with Library.open(NodePaths(tmp_path / "node"), agent_dir=agent) as lib:
        for entry in corpus_manifest["files"]:
            path = agent / entry["path"]
            result = lib.share(str(path))
            assert result.src == hash_file(path) and result.lines == entry["lines"]
            lines = path.read_bytes().splitlines(keepends=True)
            assert [lib.line(r.hash) for r in lib.line_manifest(result.src)] == lines
    assert fsck(tmp_path / "node" / "store", full=True).ok


@pytest.mark.usefixtures("small_batches")
def test_a_full_disk_in_a_middle_batch_fails_the_share_and_nothing_is_offered(
        agent: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = long_session(agent)
    real: Callable[..., Any] = blobpack.write_at
    writes: list[int] = []
    fail_at: list[int] = []

    def counted(fd: int, data: Any, offset: int) -> Any:
        if threading.current_thread().name.startswith("import_"):  # a batch's append, not a checkpoint
            writes.append(len(data))
            if len(writes) in fail_at:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)

    monkeypatch.setattr(blobpack, "write_at", counted)
    with Library.open(NodePaths(tmp_path / "clean"), agent_dir=agent) as lib:
        lib.share(str(path))
        clean = len(writes)  # the import's pack writes: one per batch
    assert clean >= 8
    writes.clear()
    fail_at.append(clean // 2)
    home = NodePaths(tmp_path / "node")
    with Library.open(home, agent_dir=agent) as lib:
        with pytest.raises(StoreFull):
            lib.share(str(path))
        assert len(writes) == clean // 2  # the batches after the failed one wrote nothing
    monkeypatch.setattr(blobpack, "write_at", real)
    assert fsck(home.store, full=True).ok
    with Library.open(home, agent_dir=agent) as lib:
        assert lib.branches(include_unshared=True) == []
        result = lib.share(str(path))
        assert lib.session_bytes(result.src) == path.read_bytes()
    assert fsck(home.store, full=True).ok


@pytest.mark.parametrize("chunk", [7, 64, 4099, 1 << 22])
def test_the_session_name_is_found_whatever_the_chunks(agent: Path, tmp_path: Path, chunk: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks without a session_info are not searched line by line once the first user message
    is known: a name in a line cut by the chunk edges (small chunks), in a chunk of its own,
    and renamed again far after the first user message is still the session's title."""
    path = find(agent, B1)  # names itself "beta main line" at line 16
    with open(path, "ab") as f:
        for i in range(300):
            entry: dict[str, Any] = {"type": "message", "id": f"{i:08x}", "parentId": None,
                                     "message": {"role": "assistant", "content": "x" * (i * 37 % 900)}}
            if i == 250:
                entry = {"type": "session_info", "id": "0000beef", "parentId": None, "name": "renamed late"}
            f.write(json.dumps(entry, separators=(",", ":")).encode() + b"\n")
    monkeypatch.setattr("p2pnode.pi.hashing.CHUNK", chunk)
    with Library.open(NodePaths(tmp_path / "node"), agent_dir=agent) as lib:
        assert lib.share(str(path)).title == "renamed late"
