"""Hostile peers against `follow` (node/follow.py), whose long poll of a peer's catalog drives
fetches: a peer that answers `GET /v1/catalog?wait=` at once every time (ignoring the wait, or
bumping its generation) must not make the follower poll it in a busy loop; a peer whose catalog
announces a "newer version" that does not extend what was placed gets nothing placed.  A real
in-process node follows a protocol server of the test's own over real mutual TLS on loopback."""
from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest
from aiohttp import web
from test_hostile_peer import A1, LyingPeer

from p2pnode.node import follow
from p2pnode.node.daemon import Node, NodeConfig
from p2pnode.paths import NodePaths
from p2pnode.peer import wire
from p2pnode.peer.address import PeerAddress
from p2pnode.peer.identity import load_or_create_identity
from p2pnode.peer.trust import TrustStore
from p2pnode.pi.session import parse_header


def entry(peer: LyingPeer, branch: str, **over: object) -> wire.CatalogEntry:
    sidecar = peer.objects[branch]
    src = sidecar.split(b'"src":"')[1][:64].decode()
    data = peer.objects[src]
    header = parse_header(data.split(b"\n", 1)[0], "test").as_dict()
    fields = dict(branch=branch, src=src, parent=None, size=len(data), lines=data.count(b"\n"),
                  header=header, title="t", previous=None, version=1)
    fields.update(over)
    return wire.CatalogEntry(**fields)  # type: ignore[arg-type]


async def follower_and_liar(tmp_path: Path) -> tuple[Node, LyingPeer]:
    """A real node (the follower) and a protocol server of the test's own, trusting each other."""
    agent = tmp_path / "agent"
    agent.mkdir()
    config = NodeConfig(host="127.0.0.1", port=0, mdns=False, agent_dir=agent)
    node = Node(NodePaths(tmp_path / "home"), config)
    await node.start()
    liar = LyingPeer(load_or_create_identity(tmp_path / "liar"), TrustStore(tmp_path / "liar-trust.json"))
    liar.trust.trust(node.identity.node_id)
    node.trust.trust(liar.identity.node_id)
    return node, liar


async def test_a_peer_answering_every_wait_at_once_is_not_polled_in_a_busy_loop(
        tmp_path: Path, corpus_dir: Path) -> None:
    node, liar = await follower_and_liar(tmp_path)
    branch = liar.add((corpus_dir / A1).read_bytes())
    generations = itertools.count()
    polls: list[str] = []

    async def instant(request: web.Request) -> web.Response:  # never waits; a new generation each time
        polls.append(request.query_string)
        msg = wire.CatalogMessage(next(generations), liar.identity.node_id, [entry(liar, branch)])
        return web.Response(body=wire.encode_catalog(msg), content_type="application/json")

    liar.handlers["catalog"] = instant
    address = await liar.start()
    try:
        await node.follows._c_follow({"target": branch, "peers": [str(address)]})
        f = node.follows.follows.items[branch]
        for _ in range(100):  # the first version arrives (a correctness bound, not a speed one)
            if f.branch == branch:
                break
            await asyncio.sleep(0.1)
        assert f.branch == branch, f.events
        polls.clear()
        await asyncio.sleep(2.0)
        # at most one poll per follow.MIN_POLL_INTERVAL: a handful, not thousands
        assert len(polls) <= 2.0 / follow.MIN_POLL_INTERVAL + 2, len(polls)
    finally:
        await node.close()
        await liar.close()


async def test_a_newer_version_that_is_not_an_extension_is_not_placed(tmp_path: Path,
                                                                     corpus_dir: Path) -> None:
    """The peer's catalog announces a version 2 of the followed session (its `previous` the
    version placed, larger) whose bytes do not start with version 1's: it is checked after the
    fetch and before placement, refused (a "waiting" event naming it), and the placed file stays."""
    node, liar = await follower_and_liar(tmp_path)
    v1 = (corpus_dir / A1).read_bytes()
    lines = v1.splitlines(keepends=True)
    v2 = b"".join([lines[0], *lines[2:], lines[1], lines[-1]])  # reordered and longer: not a growth
    assert len(v2) > len(v1) and not v2.startswith(v1)
    first, second = liar.add(v1), liar.add(v2)
    catalog = [entry(liar, first)]
    generation = itertools.count()

    async def announce(request: web.Request) -> web.Response:
        await asyncio.sleep(0.2)
        msg = wire.CatalogMessage(next(generation), liar.identity.node_id, catalog)
        return web.Response(body=wire.encode_catalog(msg), content_type="application/json")

    liar.handlers["catalog"] = announce
    address = await liar.start()
    try:
        await node.follows._c_follow({"target": first, "peers": [str(address)]})
        f = node.follows.follows.items[first]
        for _ in range(100):
            if f.path is not None:
                break
            await asyncio.sleep(0.1)
        assert f.branch == first and f.path is not None, list(f.events)
        assert Path(f.path).read_bytes() == v1
        catalog.append(entry(liar, second, previous=first, version=2))
        for _ in range(100):
            if any("does not start with its bytes" in e.get("message", "") for e in f.events):
                break
            await asyncio.sleep(0.1)
        assert any("does not start with its bytes" in e.get("message", "") for e in f.events), list(f.events)
        assert f.branch == first and Path(f.path).read_bytes() == v1
        assert sorted(p.name for p in Path(f.path).parent.iterdir()) == [Path(f.path).name]
    finally:
        await node.close()
        await liar.close()


async def test_a_catalog_cannot_pass_another_branch_off_as_the_one_asked_for(tmp_path: Path,
                                                                           corpus_dir: Path) -> None:
    """`fetch <branch hash>` looks for newer versions in the peers' catalogs.  A liar that does not
    list the branch but lists another whose header `id` is that hash (a "version" of it, v99) is
    not taken for one: the branch asked for is fetched as named (it was a RuntimeError from a
    StopIteration, exit 1, and matching by id could have fetched the liar's branch instead)."""
    me = load_or_create_identity(tmp_path / "me")
    trust = TrustStore(tmp_path / "me-trust.json")
    liar = LyingPeer(load_or_create_identity(tmp_path / "liar"), TrustStore(tmp_path / "liar-trust.json"))
    liar.trust.trust(me.node_id)
    trust.trust(liar.identity.node_id)
    asked = "ab" * 32
    other = liar.add((corpus_dir / A1).read_bytes())
    lie = entry(liar, other, version=99)
    lie = wire.CatalogEntry(**{**lie.__dict__, "header": dict(lie.header, id=asked)})

    async def lying(request: web.Request) -> web.Response:
        msg = wire.CatalogMessage(1, liar.identity.node_id, [lie])
        return web.Response(body=wire.encode_catalog(msg), content_type="application/json")

    liar.handlers["catalog"] = lying
    address = await liar.start()

    async def nobody(target: str) -> list[PeerAddress]:
        return []

    try:
        newest = await follow.newest_to_fetch(asked, [address], me, trust, nobody)
    finally:
        await liar.close()
    assert newest.branch == asked and newest.note is None
    assert follow.newest_entry([lie], asked) is None


async def test_a_peer_trickling_its_catalog_is_given_up(tmp_path: Path, corpus_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A catalog answered one byte at a time (each within the read timeout) holds a poll no longer
    than follow.POLL_TIMEOUT: the follow reports the peer and tries again later."""
    monkeypatch.setattr(follow, "POLL_TIMEOUT", 1.5)
    node, liar = await follower_and_liar(tmp_path)
    branch = liar.add((corpus_dir / A1).read_bytes())

    async def trickle(request: web.Request) -> web.StreamResponse:
        body = wire.encode_catalog(wire.CatalogMessage(1, liar.identity.node_id, [entry(liar, branch)]))
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        for byte in body:
            await response.write(bytes([byte]))
            await asyncio.sleep(0.2)
        return response

    liar.handlers["catalog"] = trickle
    address = await liar.start()
    try:
        await node.follows._c_follow({"target": branch, "peers": [str(address)]})
        f = node.follows.follows.items[branch]
        for _ in range(100):
            if any("not in within" in e.get("message", "") for e in f.events):
                break
            await asyncio.sleep(0.1)
        assert any("not in within 1.5 s" in e.get("message", "") for e in f.events), list(f.events)
        assert f.branch is None
    finally:
        await node.close()
        await liar.close()
