"""The streaming fetch in one process: two node homes (a sharer served by a real PeerServer over
mutual TLS on loopback, a fetcher), so that a test can look inside the fetcher's store and
files.  Sessions are generated Pi-shaped files (test_stream_fetch.pi_session) or corpus files.
"""
from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_stream_fetch import SESSION_ID

from p2pnode.library.api import Library
from p2pnode.paths import NodePaths
from p2pnode.peer import wire
from p2pnode.peer.address import PeerAddress
from p2pnode.peer.get import FetchResult, fetch_branch
from p2pnode.peer.identity import Identity, load_or_create_identity
from p2pnode.peer.provider import PeerServer
from p2pnode.peer.trust import TrustStore
from p2pnode.pi.lines import split_lines

PROJECT = "sessions/--w--"
NAME = f"2026-11-21T20-00-00-000Z_{SESSION_ID}.jsonl"


@dataclass
class Duo:
    sharer: Library
    fetcher: Library
    me: Identity
    trust: TrustStore
    peer: PeerAddress
    share_agent: Path
    agent: Path

    def write(self, data: bytes) -> Path:
        """The sharer's session file (the same path every time: a session that grows)."""
        path = self.share_agent / PROJECT / NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return path

    async def fetch(self, branch: str, lib: Library | None = None,
                    limits: wire.Limits = wire.DEFAULT_LIMITS) -> FetchResult:
        return await fetch_branch(lib or self.fetcher, branch, [self.peer], self.me, self.trust,
                                  agent_dir=self.agent, limits=limits)

    @property
    def placed(self) -> Path:
        return self.agent / PROJECT / NAME


@pytest.fixture
async def duo(tmp_path: Path) -> AsyncIterator[Duo]:
    server_id = load_or_create_identity(tmp_path / "server-id")
    me = load_or_create_identity(tmp_path / "me-id")
    server_trust = TrustStore(tmp_path / "server-trust.json")
    my_trust = TrustStore(tmp_path / "me-trust.json")
    server_trust.trust(me.node_id)
    my_trust.trust(server_id.node_id)
    sharer = Library.open(NodePaths(tmp_path / "sharer"), tmp_path / "sharer-agent")
    fetcher = Library.open(NodePaths(tmp_path / "fetcher"), tmp_path / "agent")
    server = PeerServer(sharer, server_id, server_trust)
    await server.start("127.0.0.1", 0)
    try:
        yield Duo(sharer, fetcher, me, my_trust, PeerAddress(server_id.node_id, "127.0.0.1", server.port),
                  tmp_path / "sharer-agent", tmp_path / "agent")
    finally:
        await server.close()
        sharer.close()
        fetcher.close()


async def test_a_256_mib_line_end_to_end(duo: Duo) -> None:
    """PROTOCOL.md's largest line (256 MiB, the store's max_payload and the wire's max_blob) is
    shared, served, fetched, stored and placed.  Memory: about 1.5 GB at the peak (the line
    raw and compressed on both sides of one process)."""
    head = json.dumps({"type": "session", "version": 3, "id": SESSION_ID,
                       "timestamp": "2026-11-21T20:00:00.000Z", "cwd": "/w"}).encode() + b"\n"
    frame = b'{"type":"custom","data":"'
    body = os.urandom(((256 << 20) - len(frame) - 3) * 3 // 4 + 3).hex().encode()
    big = frame + body[:(256 << 20) - len(frame) - 3] + b'"}\n'
    assert len(big) == 256 << 20
    path = duo.write(head + big + b'{"type":"custom","data":"after"}\n')
    del body, big
    branch = duo.sharer.share(str(path)).branch
    # the server shares this process's event loop, which it blocks while it encrypts the line:
    # no stall detection here (what is tested is the size)
    result = await duo.fetch(branch, limits=wire.Limits(progress_timeout=300.0))
    assert result.written and Path(result.path or "").read_bytes() == path.read_bytes()
    assert duo.fetcher.branch(branch).lines == 3
    refs = duo.fetcher.line_manifest(result.src)
    assert [r.length for r in refs] == [len(x) for x in split_lines(path.read_bytes())]
