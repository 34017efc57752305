"""The peer server under the sharer's control, over real mutual TLS on loopback: `share --to`
(a peer not named gets exactly the not-found of a hash that does not exist), unshare and
expiry stopping a transfer in flight, and every answer in the audit log."""
from __future__ import annotations

import asyncio
import json
import logging
import random
import shutil
import ssl
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from corpus import A6

from p2pnode.errors import PeerUnavailable
from p2pnode.library import access
from p2pnode.library.api import Library, ShareResult
from p2pnode.paths import NodePaths
from p2pnode.peer import provider, wire
from p2pnode.peer.identity import Identity, load_or_create_identity
from p2pnode.peer.provider import PeerServer
from p2pnode.peer.tls import client_context
from p2pnode.peer.trust import TrustStore

NOWHERE = "e" * 64


class World:
    def __init__(self, tmp: Path, corpus: Path) -> None:
        self.tmp = tmp
        self.me = load_or_create_identity(tmp / "me-id")
        self.trust = TrustStore(tmp / "me-trust.json")
        self.agent = tmp / "agent"
        (self.agent / A6).parent.mkdir(parents=True)
        shutil.copy(corpus / A6, self.agent / A6)
        self.lib = Library.open(NodePaths(tmp / "home"), self.agent)
        self.peers = {name: self.client(name) for name in ("alice", "bob")}

    def client(self, name: str) -> tuple[Identity, ssl.SSLContext]:
        ident = load_or_create_identity(self.tmp / f"{name}-id")
        self.trust.trust(ident.node_id, name=name)
        theirs = TrustStore(self.tmp / f"{name}-trust.json")
        theirs.trust(self.me.node_id)
        return ident, client_context(ident, theirs, self.me.fingerprint)

    def big(self) -> ShareResult:
        """A session of 24 MB that does not compress: more than socket buffers hold."""
        path = self.agent / "sessions" / "--w--" / "2026-11-21T20-00-00-000Z_big.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        header = (b'{"type":"session","version":3,"id":"big","timestamp":"2026-11-21T20:00:00.000Z",'
                  b'"cwd":"/w"}\n')
        rnd = random.Random(5)
        body = b"".join(b'{"type":"custom","data":"' + rnd.randbytes(300_000).hex().encode() + b'"}\n'
                        for _ in range(40))
        path.write_bytes(header + body)
        return path  # type: ignore[return-value]


@pytest.fixture
def world(tmp_path: Path, corpus_dir: Path) -> Iterator[World]:
    w = World(tmp_path, corpus_dir)
    yield w
    w.lib.close()


@pytest.fixture
async def server(world: World) -> AsyncIterator[PeerServer]:
    server = PeerServer(world.lib, world.me, world.trust, wire.Limits(slow_reader_timeout=120.0))
    await server.start("127.0.0.1", 0)
    yield server
    await server.close()


def session(world: World, name: str) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=world.peers[name][1]))


async def answer(s: aiohttp.ClientSession, method: str, url: str, body: bytes | None = None) -> tuple:
    async with s.request(method, url, data=body) as r:
        return r.status, r.headers.get("Content-Type"), await r.read()


async def test_a_peer_not_named_gets_exactly_the_answer_of_a_hash_that_does_not_exist(
        world: World, server: PeerServer) -> None:
    shared = world.lib.share(str(world.agent / A6), to=[world.peers["alice"][0].node_id])
    refs = world.lib.line_manifest(shared.src)
    base = f"https://127.0.0.1:{server.port}"
    obj, lines = base + wire.PATH_OBJECT, base + wire.PATH_LINES
    async with session(world, "alice") as alice, session(world, "bob") as bob:
        missing = await answer(bob, "GET", obj.format(hash=NOWHERE))
        assert missing[0] == 404
        assert await answer(bob, "GET", lines.format(src=NOWHERE)) == missing
        for h in (shared.branch, shared.src, refs[2].hash.hex()):
            assert await answer(bob, "GET", obj.format(hash=h)) == missing
            assert (await answer(alice, "GET", obj.format(hash=h)))[0] == 200
        assert await answer(bob, "GET", lines.format(src=shared.src)) == missing
        assert (await answer(alice, "GET", lines.format(src=shared.src)))[0] == 200
        asked = b"".join(r.hash for r in refs)
        nothing = await answer(bob, "POST", base + wire.PATH_BATCH, b"\xee" * 32 * len(refs))
        assert await answer(bob, "POST", base + wire.PATH_BATCH, asked) == nothing
        assert len((await answer(alice, "POST", base + wire.PATH_BATCH, asked))[2]) > len(nothing[2])
        bob_catalog = wire.decode_catalog((await answer(bob, "GET", base + wire.PATH_CATALOG))[2])
        alice_catalog = wire.decode_catalog((await answer(alice, "GET", base + wire.PATH_CATALOG))[2])
    assert bob_catalog.branches == [] and [b.branch for b in alice_catalog.branches] == [shared.branch]
    kinds = {"sidecar", "session", "line", "lines", "batch"}
    for _ in range(100):  # logged after each answer, by the provider's audit writer
        served = [e for e in world.lib.audit.read() if e["event"] == "served"]
        if {e["kind"] for e in served} == kinds:
            break
        await asyncio.sleep(0.05)
    assert served and all(e["peer"] == world.peers["alice"][0].node_id and e["peer_name"] == "alice"
                          and e["branches"] == [shared.branch] for e in served)
    assert {e["kind"] for e in served} == kinds
    assert sum(e["bytes"] for e in served if e["kind"] == "session") == shared.size


async def stalled_download(world: World, server: PeerServer, name: str, url: str,
                           body: bytes | None = None) -> tuple[aiohttp.ClientSession, aiohttp.ClientResponse]:
    """A peer that starts a transfer and stops reading: the server is left blocked writing."""
    s = session(world, name)
    r = await s.request("POST" if body else "GET", url, data=body)
    assert r.status == 200
    for _ in range(200):
        await asyncio.sleep(0.02)
        if server._serving:
            break
    await asyncio.sleep(0.3)
    assert server._serving  # the answer is still being written
    return s, r


async def test_unshare_stops_a_transfer_in_flight(world: World, server: PeerServer) -> None:
    big = world.lib.share(str(world.big()))
    url = f"https://127.0.0.1:{server.port}" + wire.PATH_OBJECT.format(hash=big.src)
    s, stalled = await stalled_download(world, server, "alice", url)
    try:
        world.lib.unshare(big.branch)
        with pytest.raises(aiohttp.ClientPayloadError):  # cut off, long before the 120 s slow-reader timeout
            await asyncio.wait_for(stalled.read(), 30)
    finally:
        stalled.release()
        await s.close()
    for _ in range(100):  # the handler sees the abort once its read of the store returns
        if not server._serving:
            break
        await asyncio.sleep(0.05)
    assert not server._serving
    for _ in range(100):  # logged when the handler has seen the abort
        cut = [e for e in world.lib.audit.read() if e["event"] == "served" and not e["complete"]]
        if cut:
            break
        await asyncio.sleep(0.05)
    assert cut[0]["branches"] == [big.branch] and cut[0]["kind"] == "session"
    assert 0 <= cut[0]["bytes"] < big.size and cut[0]["peer_name"] == "alice"


async def test_expiry_stops_a_batch_in_flight(world: World, server: PeerServer,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    big = world.lib.share(str(world.big()), expires="1h")
    hashes = b"".join(r.hash for r in world.lib.line_manifest(big.src))
    url = f"https://127.0.0.1:{server.port}" + wire.PATH_BATCH
    s, stalled = await stalled_download(world, server, "bob", url, hashes)
    try:
        assert big.expires_at is not None
        monkeypatch.setattr(access, "now_ms", lambda: big.expires_at + 1)  # the server's timer notices
        try:
            body = await asyncio.wait_for(stalled.read(), 30)
        except aiohttp.ClientPayloadError:
            pass  # cut off in flight
        else:  # or the thread reading the next group noticed first: the lines left are left out
            decoder = wire.BatchDecoder([hashes[i:i + 32] for i in range(0, len(hashes), 32)])
            decoder.feed(body)
            assert decoder.received < len(hashes) // 32
    finally:
        stalled.release()
        await s.close()
    assert world.lib.branch(big.branch).withdrawn == "expired"
    assert [e["branch"] for e in world.lib.audit.read() if e["event"] == "expired"] == [big.branch]


async def test_a_transfer_to_a_peer_still_allowed_goes_on(world: World, server: PeerServer) -> None:
    """Narrowing `--to` stops only the peers taken off it."""
    big = world.lib.share(str(world.big()))
    url = f"https://127.0.0.1:{server.port}" + wire.PATH_OBJECT.format(hash=big.src)
    s_a, alice = await stalled_download(world, server, "alice", url)
    s_b, bob = await stalled_download(world, server, "bob", url)
    try:
        world.lib.share(str(world.big()), to=[world.peers["alice"][0].node_id])
        with pytest.raises(aiohttp.ClientPayloadError):
            await asyncio.wait_for(bob.read(), 30)
        assert len(await asyncio.wait_for(alice.read(), 60)) == big.size
    finally:
        alice.release()
        bob.release()
        await s_a.close()
        await s_b.close()


async def test_served_within_tells_the_background_gc_of_transfers(world: World, server: PeerServer) -> None:
    """A transfer in flight, or one ended within the quiet spell, counts as serving (the
    background GC waits: node/upkeep.py); a catalog request does not."""
    big = world.lib.share(str(world.big()))
    base = f"https://127.0.0.1:{server.port}"
    async with session(world, "alice") as alice:
        assert (await answer(alice, "GET", base + wire.PATH_CATALOG))[0] == 200
    assert not server.served_within(3600)
    s, stalled = await stalled_download(world, server, "alice", base + wire.PATH_OBJECT.format(hash=big.src))
    try:
        assert server.served_within(0)
        assert len(await asyncio.wait_for(stalled.read(), 60)) == big.size
    finally:
        stalled.release()
        await s.close()
    for _ in range(100):  # the handler ends once the last bytes are written
        if not server._serving:
            break
        await asyncio.sleep(0.05)
    assert server.served_within(3600) and not server.served_within(0)


async def test_catalog_waits_whose_peer_went_free_their_slots(world: World, server: PeerServer) -> None:
    """A peer whose waiting catalog requests went (its link dropped) may wait again within
    WAIT_CHECK_SECONDS, not only once catalog_wait (20 s) ran out."""
    url = f"https://127.0.0.1:{server.port}" + wire.PATH_CATALOG
    async with session(world, "alice") as s:
        generation = wire.decode_catalog((await answer(s, "GET", url))[2]).generation
    waits = [(s, asyncio.ensure_future(answer(s, "GET", f"{url}?wait={generation}")))
             for s in (session(world, "alice") for _ in range(2))]
    await asyncio.sleep(0.5)
    assert sum(server._waiting.values()) == 2
    for s, waiting in waits:
        waiting.cancel()
        await s.close()
    await asyncio.sleep(provider.WAIT_CHECK_SECONDS + 0.5)
    assert sum(server._waiting.values()) == 0
    async with session(world, "alice") as s:
        again = asyncio.ensure_future(answer(s, "GET", f"{url}?wait={generation}"))
        await asyncio.sleep(0.5)
        assert not again.done()  # held, not 429
        again.cancel()


async def test_a_lone_surrogate_in_a_session_does_not_break_the_catalog(world: World,
                                                                       server: PeerServer) -> None:
    """JavaScript cuts a string inside an emoji and writes the half as "\\ud83d": a session
    holding one (in a user message, in its cwd) is shared and listed with U+FFFD in its place,
    and the catalog, every peer's view of every share, is still served."""
    path = world.agent / "sessions" / "--w--" / "2026-11-21T20-00-00-000Z_cut.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b'{"type":"session","version":3,"id":"cut","timestamp":"2026-11-21T20:00:00.000Z",'
                     b'"cwd":"/w/\\ud800x"}\n'
                     b'{"type":"message","id":"a1","parentId":null,"timestamp":"2026-11-21T20:00:01.000Z",'
                     b'"message":{"role":"user","content":"small talk \\ud83d cut"}}\n')
    shared = world.lib.share(str(path))
    world.lib.share(str(world.agent / A6))
    async with session(world, "alice") as s:
        status, _, body = await answer(s, "GET", f"https://127.0.0.1:{server.port}" + wire.PATH_CATALOG)
    assert status == 200
    entries = {e.branch: e for e in wire.decode_catalog(body).branches}
    assert len(entries) == 2
    assert entries[shared.branch].title == "small talk \ufffd cut"
    assert entries[shared.branch].header["cwd"] == "/w/\ufffdx"


def test_a_peers_catalog_with_lone_surrogates_decodes_to_text_that_prints() -> None:
    entry = {"branch": "a" * 64, "src": "b" * 64, "parent": None, "size": 1, "lines": 1,
             "header": {"id": "x", "timestamp": None, "cwd": "\ud800", "parent_session": None},
             "title": "\udfff", "previous": None, "version": 1}
    body = json.dumps({"version": wire.PROTOCOL_VERSION, "generation": 1, "node": "n", "branches": [entry]})
    (got,) = wire.decode_catalog(body.encode()).branches
    assert got.title == "\ufffd" and got.header["cwd"] == "\ufffd"
    assert wire.encode_catalog(wire.CatalogMessage(1, "n", [got])).decode()


async def test_a_damaged_copy_is_not_served_and_logged_in_one_line(world: World,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A line whose record fails its CRC in this node's pack: a batch leaves it out (the fetcher
    asks other holders), the session as one object is cut, never sent wrong; one WARNING line
    each, no traceback (it was a 500 and a traceback per request)."""
    shared = world.lib.share(str(world.agent / A6))
    refs = world.lib.line_manifest(shared.src)
    world.lib.close()  # its blobs in the pack
    pack = world.lib.paths.store / "blobs.pack"
    data = bytearray(pack.read_bytes())
    data[len(data) // 2] ^= 0x40
    pack.write_bytes(bytes(data))
    world.lib = Library.open(world.lib.paths, world.agent)
    server = PeerServer(world.lib, world.me, world.trust)
    await server.start("127.0.0.1", 0)
    base = f"https://127.0.0.1:{server.port}"
    asked = [r.hash for r in refs]
    async with session(world, "alice") as s:
        status, _, body = await answer(s, "POST", base + wire.PATH_BATCH, b"".join(asked))
        assert status == 200
        decoder = wire.BatchDecoder(asked)
        got = decoder.feed(body)
        decoder.finish()
        assert 0 < len(got) < len(set(asked))  # the damaged one left out, the others sent
        assert all(wire.decode_blob(b) for b in got)  # each verifies
        for _ in range(2):  # asked again: the same answer, and no second warning
            with pytest.raises(aiohttp.ClientPayloadError):  # the whole session: cut where the damage is
                await answer(s, "GET", base + wire.PATH_OBJECT.format(hash=shared.src))
            assert (await answer(s, "POST", base + wire.PATH_BATCH, b"".join(asked)))[0] == 200
    await server.close()
    damaged = [r for r in caplog.records if "damaged" in r.getMessage()]
    assert len([r for r in damaged if r.levelname == "WARNING"]) == 2  # the line, the session
    assert all(not r.exc_info for r in damaged)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not [r for r in caplog.records if "Error handling request" in r.getMessage()]


async def test_a_copy_found_damaged_before_the_answer_is_a_503_the_fetcher_names(world: World) -> None:
    """A line manifest this node cannot make (lines lost from a pack cut short) is offered all
    the same, so it is not a 404 ("not offered", which would send the fetcher to the whole
    session): 503, and the fetch's error says that peer's copy is damaged."""
    from p2pnode.peer.address import PeerAddress
    from p2pnode.peer.downloader import PeerPool

    shared = world.lib.share(str(world.agent / A6))
    last = world.lib.line_manifest(shared.src)[-1].hash  # in the half of the pack cut off below
    world.lib.close()
    pack = world.lib.paths.store / "blobs.pack"
    pack.write_bytes(pack.read_bytes()[: pack.stat().st_size // 2])
    world.lib = Library.open(world.lib.paths, world.agent)
    server = PeerServer(world.lib, world.me, world.trust)
    await server.start("127.0.0.1", 0)
    try:
        async with session(world, "alice") as s:
            status, _, body = await answer(s, "GET", f"https://127.0.0.1:{server.port}"
                                           + wire.PATH_LINES.format(src=shared.src))
        assert (status, body) == (503, provider.DAMAGED_BODY)
        async with session(world, "alice") as s:  # a line asked for as an object: the same
            status, _, body = await answer(s, "GET", f"https://127.0.0.1:{server.port}"
                                           + wire.PATH_OBJECT.format(hash=last.hex()))
        assert (status, body) == (503, provider.DAMAGED_BODY)
        ident = load_or_create_identity(world.tmp / "alice-id")
        pool = PeerPool([PeerAddress(None, "127.0.0.1", server.port)], ident,
                        TrustStore(world.tmp / "alice-trust.json"), wire.DEFAULT_LIMITS)
        try:
            with pytest.raises(PeerUnavailable, match="its copy is damaged"):
                await pool.run("line manifest", lambda peer: peer.line_manifest(shared.src))
        finally:
            await pool.close()
    finally:
        await server.close()
