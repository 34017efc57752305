"""Real in-process nodes (`p2pnode.node.daemon.Node`) on loopback that trust each other, mDNS
off: for tests that drive a node's parts directly (its peer server, probes, follows)."""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from p2pnode.node.daemon import Node, NodeConfig
from p2pnode.paths import NodePaths


@contextlib.asynccontextmanager
async def trusting_nodes(tmp_path: Path, names: tuple[str, ...] = ("a", "b")) -> AsyncIterator[list[Node]]:
    """Started nodes, one per name (home `<name>/home`, Pi's folder `<name>/agent`), each
    trusting every other; closed after."""
    nodes = []
    for name in names:
        agent = tmp_path / name / "agent"
        agent.mkdir(parents=True)
        nodes.append(Node(NodePaths(tmp_path / name / "home"),
                          NodeConfig(host="127.0.0.1", port=0, mdns=False, agent_dir=agent)))
    try:
        for n in nodes:
            await n.start()
        for n in nodes:
            for other in nodes:
                if other is not n:
                    n.trust.trust(other.identity.node_id)
        yield nodes
    finally:
        for n in nodes:
            await n.close()
