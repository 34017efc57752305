"""The node's background GC (node/upkeep.py) on a real library: it collects past the
threshold, and never while a fetch holds a transfer lease or peers are being served."""
from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
from pifork import find

from p2pnode.library import space
from p2pnode.library.api import Library
from p2pnode.node import upkeep
from p2pnode.paths import NodePaths

A3 = "*173a-7744-89ad-bbc16c12cc22.jsonl"  # 1.4 MB, images
A6 = "*2810-72f3-bf21-ab15b19d413f.jsonl"


@pytest.mark.parametrize("holder", ["fetch", "serving"])
async def test_background_gc_waits_for_fetches_and_served_peers_then_collects(
        holder: str, corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fetch's lease, or a peer served within the quiet spell, puts the collection off;
    once neither holds, the next round collects."""
    agent = tmp_path / "agent"
    shutil.copytree(corpus_dir / "sessions", agent / "sessions")
    monkeypatch.setattr(space, "GC_THRESHOLD_BYTES", 500_000)
    served = [True]
    quiets: list[float] = []

    def serving(quiet: float) -> bool:
        quiets.append(quiet)
        return served[0]

    with Library.open(NodePaths(tmp_path / "node"), agent_dir=agent) as lib:
        keep = lib.share(str(find(agent, A6)))
        big = lib.share(str(find(agent, A3)))
        assert not space.worth_collecting(lib.space()["reclaimable_bytes"], lib.space()["store_bytes"])
        lib.unshare(big.branch)
        assert space.worth_collecting(lib.space()["reclaimable_bytes"], lib.space()["store_bytes"])
        if holder == "fetch":
            served[0] = False
            assert lib.leases.try_acquire()  # a fetch in progress
        task = asyncio.ensure_future(upkeep.background_gc(lib, serving, every=0.05, quiet=0.02))
        try:
            await asyncio.sleep(0.5)  # several rounds, each one skipped
            assert lib.has_branch(big.branch) and not [e for e in lib.audit.read() if e["event"] == "gc"]
            if holder == "fetch":
                lib.leases.release()
            else:
                assert quiets and set(quiets) == {0.02}
                served[0] = False
            for _ in range(200):
                await asyncio.sleep(0.05)
                if not lib.has_branch(big.branch):
                    break
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert not lib.has_branch(big.branch) and lib.space()["reclaimable_bytes"] == 0
        assert lib.session_bytes(keep.src) == find(agent, A6).read_bytes()
        assert [e["branches"] for e in lib.audit.read() if e["event"] == "gc"] == [[big.branch]]


async def test_a_node_builds_line_manifests_before_peers_ask(corpus_dir: Path, tmp_path: Path) -> None:
    """At start (offered versions, newest first) and after each share: a session of 500,000
    lines took the peer's first manifest request past the fetcher's 5 s without progress.  A
    real in-process node, sharing through its control endpoint; a version it cannot read is
    left to the request that needs it."""
    from p2pnode.node.daemon import Node, NodeConfig

    agent = tmp_path / "agent"
    shutil.copytree(corpus_dir / "sessions", agent / "sessions")
    with Library.open(NodePaths(tmp_path / "node"), agent_dir=agent) as lib:
        before = lib.share(str(find(agent, A6)))
    config = NodeConfig(host="127.0.0.1", port=0, mdns=False, agent_dir=agent)
    node = Node(NodePaths(tmp_path / "node"), config)
    await node.start()
    try:
        for _ in range(100):
            if before.src in node.lib._manifests:
                break
            await asyncio.sleep(0.05)
        assert before.src in node.lib._manifests
        shared = await node._c_share({"target": str(find(agent, A3))})
        assert isinstance(shared, dict)
        for _ in range(100):
            if shared["src"] in node.lib._manifests:
                break
            await asyncio.sleep(0.05)
        assert shared["src"] in node.lib._manifests
        upkeep.warm_manifests(node.lib, ["0" * 64])  # not held: nothing, no error
    finally:
        await node.close()
