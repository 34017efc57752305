"""A share reads, stores and scans its file without the library's lock: the node goes on serving
peers meanwhile (a fetch from a node sharing a 1.5 GB session failed, "no progress for 5 s",
while the import held the lock for 15 s), and `gc` and `rm`, which delete every context the
state does not name, wait for it.  A real store and real Pi files; the import is paused in
the middle by wrapping the file hasher's sink (no timing)."""
from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from pifork import find

from p2pnode.library import api
from p2pnode.library.api import Library, ShareResult
from p2pnode.paths import NodePaths
from p2pnode.pi.hashing import FileHasher

A1 = "*0313-7475-8d45-88a780e9fa37.jsonl"
A3 = "*173a-7744-89ad-bbc16c12cc22.jsonl"  # 1.4 MB, images: fed in several chunks
BOUND = 10.0


@pytest.fixture
def agent(corpus_dir: Path, tmp_path: Path) -> Path:
    agent = tmp_path / "agent"
    shutil.copytree(corpus_dir / "sessions", agent / "sessions")
    return agent


class _Paused:
    """The sink of one share's import, stopped at its first chunk until `go` is set."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.reached, self.go = threading.Event(), threading.Event()

    def begin(self, grown: Any) -> int:
        start: int = self.inner.begin(grown)
        return start

    def feed(self, chunk: bytes) -> None:
        self.reached.set()
        assert self.go.wait(BOUND)
        self.inner.feed(chunk)


@pytest.fixture
def first(lib: Library, agent: Path) -> ShareResult:
    """A branch held and offered before the imports are paused."""
    return lib.share(str(find(agent, A1)))


@pytest.fixture
def paused(monkeypatch: pytest.MonkeyPatch, first: ShareResult) -> Iterator[list[_Paused]]:
    """From now on (`first` shared), every import's sink paused (FileHasher.scan with a sink:
    what a share's import runs)."""
    made: list[_Paused] = []
    scan = FileHasher.scan

    def pausing(self: FileHasher, path: Path, *, prefixes: Any = (), sink: Any = None) -> Any:
        if sink is not None:
            made.append(sink := _Paused(sink))
        return scan(self, path, prefixes=prefixes, sink=sink)

    monkeypatch.setattr(FileHasher, "scan", pausing)
    yield made
    for p in made:
        p.go.set()


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    return thread, out


def _share_paused(lib: Library, path: Path,
                  paused: list[_Paused]) -> tuple[threading.Thread, list[Any], _Paused]:
    thread, out = _in_thread(lambda: lib.share(str(path)))
    for _ in range(int(BOUND * 100)):
        if paused and paused[-1].reached.is_set():
            return thread, out, paused[-1]
        thread.join(0.01)
    raise AssertionError("the share's import never started")


def test_readers_are_answered_while_a_share_stores_its_file(lib: Library, agent: Path, first: ShareResult,
                                                            paused: list[_Paused]) -> None:
    held = find(agent, A1)
    thread, out, import_ = _share_paused(lib, find(agent, A3), paused)
    with ThreadPoolExecutor(1) as ex:  # the calls a peer's requests make, each within the bound
        catalog = ex.submit(lib.catalog).result(timeout=BOUND)
        assert [b.branch for b in catalog.branches] == [first.branch]
        assert len(ex.submit(lib.line_manifest, first.src).result(timeout=BOUND)) == first.lines
        runs = ex.submit(lambda: b"".join(lib.session_runs(first.src))).result(timeout=BOUND)
        assert runs == held.read_bytes()
        assert ex.submit(lib.expire_due).result(timeout=BOUND) == []
    assert thread.is_alive()  # still in its import
    import_.go.set()
    thread.join(BOUND)
    result: ShareResult = out[0]
    assert result.offered and lib.session_bytes(result.src) == find(agent, A3).read_bytes()
    assert {b.branch for b in lib.catalog().branches} == {first.branch, result.branch}


@pytest.mark.parametrize("op", ["gc", "rm"])
def test_gc_and_rm_wait_for_a_share_in_its_import(lib: Library, agent: Path, first: ShareResult,
                                                  paused: list[_Paused], op: str) -> None:
    """Both delete the store contexts the state does not name: the import's, until the share
    records it, would go with them."""
    thread, out, import_ = _share_paused(lib, find(agent, A3), paused)
    waiting, done = _in_thread(lib.gc if op == "gc" else lambda: lib.remove(first.branch))
    waiting.join(0.5)
    assert waiting.is_alive() and not done  # it waits for the share
    import_.go.set()
    thread.join(BOUND)
    waiting.join(BOUND)
    assert done and out
    assert lib.session_bytes(out[0].src) == find(agent, A3).read_bytes()
    assert lib.branch(out[0].branch).offered


def test_readers_are_answered_while_a_shared_back_session_is_scanned(
        lib: Library, agent: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fetched session continued and shared back: the version it was fetched as was never
    scanned on this node, so the share scans the file's first bytes for secrets (~0.2 s per
    256 MB, which the node's peers waited out behind the library's lock: for a 2.6 GB session
    the ~2 s after which a fetcher drops a holder); the scan is paused here by wrapping it."""
    path = find(agent, A3)
    data = path.read_bytes()
    with Library.open(NodePaths(tmp_path / "sender"), agent_dir=agent) as sender:
        sent = sender.share(str(path))
        fetched = lib.add_fetched(sender.sidecar_bytes(sent.branch), data.splitlines(keepends=True))
    placed = tmp_path / "placed" / "sessions" / path.parent.name / path.name
    placed.parent.mkdir(parents=True)
    placed.write_bytes(data + data.splitlines(keepends=True)[-1])  # continued: one line more
    reached, go = threading.Event(), threading.Event()
    scanned_prefix = api._scanned_prefix

    def paused(*args: Any) -> Any:
        reached.set()
        assert go.wait(BOUND)
        return scanned_prefix(*args)

    monkeypatch.setattr(api, "_scanned_prefix", paused)
    thread, out = _in_thread(lambda: lib.share(str(placed)))
    assert reached.wait(BOUND), "the share did not scan the version it grew from"
    with ThreadPoolExecutor(1) as ex:
        generation = ex.submit(lib.catalog).result(timeout=BOUND).generation
        assert len(ex.submit(lib.line_manifest, fetched.src).result(timeout=BOUND)) == fetched.lines
        assert ex.submit(lib.branch, fetched.branch).result(timeout=BOUND).src == fetched.src
    assert thread.is_alive()  # still scanning
    go.set()
    thread.join(BOUND)
    result: ShareResult = out[0]
    assert result.offered and result.secrets == [] and result.parent == fetched.parent
    assert lib.session_bytes(result.src) == placed.read_bytes()
    assert lib.catalog().generation > generation
