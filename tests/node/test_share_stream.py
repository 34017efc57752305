"""`share` (and `gc`, `rm`) through the running node stream their progress (node/answers.py): the
command's timeout bounds the silence between events, not the work (a share that took longer
than the 30 s of one silent reply failed in the command while the node went on).  Errors come
as the last event with the exit code a one-reply answer gives; a command that goes away leaves
the share to finish.  A real in-process node on its real control socket, real Pi files; the
import is held in the middle by wrapping the file hasher's sink (no timing)."""
from __future__ import annotations

import asyncio
import json
import logging
import shutil
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from pifork import find
from secretkeys import PLANTED, plant

from p2pnode.node import routing
from p2pnode.node.control_client import NodeError, call_node
from p2pnode.node.daemon import Node, NodeConfig
from p2pnode.node.routing import via_node_streamed
from p2pnode.paths import NodePaths
from p2pnode.pi.hashing import FileHasher

A3 = "*173a-7744-89ad-bbc16c12cc22.jsonl"  # 1.4 MB, images
BOUND = 10.0


@pytest.fixture
async def node(corpus_dir: Path, tmp_path: Path) -> AsyncIterator[Node]:
    agent = tmp_path / "agent"
    shutil.copytree(corpus_dir / "sessions", agent / "sessions")
    config = NodeConfig(host="127.0.0.1", port=0, mdns=False, agent_dir=agent)
    node = Node(NodePaths(tmp_path / "home"), config)
    await node.start()
    try:
        yield node
    finally:
        await node.close()


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Every import waits at its second chunk until the event is set."""
    go = threading.Event()
    scan = FileHasher.scan

    class Held:
        def __init__(self, inner: Any) -> None:
            self.inner, self.fed = inner, 0

        def begin(self, grown: Any) -> int:
            start: int = self.inner.begin(grown)
            return start

        def feed(self, chunk: bytes) -> None:
            self.fed += 1
            if self.fed == 2:
                assert go.wait(BOUND)
            self.inner.feed(chunk)

    def holding(self: FileHasher, path: Path, *, prefixes: Any = (), sink: Any = None) -> Any:
        return scan(self, path, prefixes=prefixes, sink=None if sink is None else Held(sink))

    monkeypatch.setattr("p2pnode.pi.hashing.CHUNK", 256 << 10)  # several chunks of a 1.4 MB file
    monkeypatch.setattr(FileHasher, "scan", holding)
    yield go
    go.set()


async def test_a_share_streams_progress_then_its_result(node: Node, held: threading.Event,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    path = find(node.config.agent_dir, A3)
    events: list[dict[str, Any]] = []
    monkeypatch.setattr(routing, "CONTROL_TIMEOUT", 1.0)  # bounds the silence only: held longer, it goes on
    sharing = asyncio.ensure_future(asyncio.to_thread(via_node_streamed, node.paths, "share",
                                                      {"target": str(path)}, events.append))
    for _ in range(int(BOUND * 20)):  # 8 events: held for 1.6 s
        if sum(e["event"] == "progress" for e in events) >= 8:
            break
        await asyncio.sleep(0.05)
    progress = [e for e in events if e["event"] == "progress"]
    assert len(progress) >= 8 and not sharing.done()
    assert all(e["bytes_total"] == path.stat().st_size for e in progress if e["bytes_total"])
    assert any(0 < e["bytes_done"] < path.stat().st_size for e in progress)
    held.set()
    result = await asyncio.wait_for(sharing, BOUND)
    assert result is not None and result["branch"] and result["fetch"].startswith("p2pnode fetch ")
    assert node.lib.branch(result["branch"]).offered
    assert node.lib.session_bytes(result["src"]) == path.read_bytes()


async def test_an_error_is_the_last_event_with_the_exit_code_of_one_reply(node: Node) -> None:
    path = find(node.config.agent_dir, A3)
    secret, _, _ = plant(path.read_bytes(), "toolResult", PLANTED[0][1])
    path.write_bytes(secret)
    errors = []
    for stream in (False, True):
        with pytest.raises(NodeError) as caught:
            if stream:
                await asyncio.to_thread(via_node_streamed, node.paths, "share", {"target": str(path)})
            else:
                await asyncio.to_thread(call_node, node.paths, "share", {"target": str(path)})
        errors.append((str(caught.value), caught.value.exit_code))
    assert errors[0] == errors[1] and "secret" in errors[0][0]
    missing = {"target": str(path.with_name("nope.jsonl"))}
    with pytest.raises(NodeError) as caught:
        await asyncio.to_thread(via_node_streamed, node.paths, "share", missing)
    assert caught.value.exit_code == 3


async def test_a_command_that_goes_away_leaves_the_share_to_finish(node: Node, held: threading.Event,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="p2pnode.node")
    path = find(node.config.agent_dir, A3)
    sock = str(node.paths.control_socket)
    body = json.dumps({"target": str(path), "stream": True})
    async with (aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=sock)) as s,
                s.post("http://node/v1/share", data=body) as r):
        assert json.loads(await r.content.readline())["event"] == "progress"
    held.set()  # the command is gone; the import goes on
    for _ in range(int(BOUND * 20)):
        if any(b.path == str(path) for b in node.lib.branches()):
            break
        await asyncio.sleep(0.05)
    (info,) = [b for b in node.lib.branches() if b.path == str(path)]
    assert info.offered and node.lib.session_bytes(info.src) == path.read_bytes()
    for _ in range(int(BOUND * 20)):  # the node logs (and announces) it when it ends
        if f"shared {info.branch}" in caplog.text:
            break
        await asyncio.sleep(0.05)
    assert "its command went away" in caplog.text


async def test_a_gc_that_waits_for_a_share_outlasts_the_commands_timeout(
        node: Node, held: threading.Event, monkeypatch: pytest.MonkeyPatch) -> None:
    """`gc` waits for a share in its import (it deletes the store contexts the state does not
    name yet); streamed as the share is, the command's timeout bounds only the silence."""
    monkeypatch.setattr(routing, "CONTROL_TIMEOUT", 1.0)
    path = find(node.config.agent_dir, A3)
    events: list[dict[str, Any]] = []
    sharing = asyncio.ensure_future(asyncio.to_thread(via_node_streamed, node.paths, "share",
                                                      {"target": str(path)}, events.append))
    for _ in range(int(BOUND * 20)):
        if any(e.get("bytes_done") for e in events):
            break
        await asyncio.sleep(0.05)
    collecting = asyncio.ensure_future(asyncio.to_thread(via_node_streamed, node.paths, "gc", {}))
    done, _ = await asyncio.wait([collecting], timeout=2.0)  # twice the command's timeout
    assert not done
    held.set()
    report = await asyncio.wait_for(collecting, BOUND)
    assert report is not None and report["skipped"] is None
    result = await asyncio.wait_for(sharing, BOUND)
    assert result is not None and node.lib.branch(result["branch"]).offered
    assert node.lib.session_bytes(result["src"]) == path.read_bytes()
