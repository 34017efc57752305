"""Several holders at once: real PeerServers (each over its own library and store) on loopback,
some behind a TCP relay that slows or cuts them, and the real `fetch_branch`.  The fetch must
complete from the healthy holders, byte-identical, and its result must say what each holder
did (served lines, or dropped and why).  No assertion on wall time: the stall deadline is
checked through the reason the result gives."""
from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import logging
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import blake3
import pytest
from corpus import A1
from relay import Relay

from p2pnode.errors import NotFound
from p2pnode.library.api import Library
from p2pnode.paths import NodePaths
from p2pnode.peer import batches, wire
from p2pnode.peer.address import PeerAddress
from p2pnode.peer.downloader import PeerPool, Share
from p2pnode.peer.get import FetchResult, fetch_branch
from p2pnode.peer.identity import Identity, load_or_create_identity
from p2pnode.peer.link import PeerLink
from p2pnode.peer.provider import PeerServer
from p2pnode.peer.trust import TrustStore
from p2pnode.pi.lines import LineRef
from store.layout import CODEC_RAW, CODEC_ZSTD
from store.types import StoredBlob

FETCH_LIMITS = wire.Limits(batch_target_bytes=64 << 10)
"""Small batches, so that a 3 MB session makes dozens of groups to share out."""
WORDS = [f"w{i:03d}" for i in range(400)]


IMAGE_LINE = 3
"""The line after the real header entries: an image of 200 KB (base64), alone in the first group."""


def big_session(corpus: Path, lines: int = 120, seed: int = 7) -> bytes:
    """A real Pi session (its header and first entries), an image line, then `lines` generated
    message lines of 16-32 KB of compressible text: enough groups to share, each line big
    enough not to arrive through a 1 KB/s trickle within the stall deadline."""
    rng = random.Random(seed)
    head = (corpus / A1).read_bytes().splitlines(keepends=True)[:IMAGE_LINE]
    parent = json.loads(head[-1])["id"]
    out = list(head)
    for i in range(lines + 1):
        content = ({"type": "image", "data": base64.b64encode(rng.randbytes(200_000)).decode(),
                    "mimeType": "image/png"} if i == 0 else
                   {"type": "text", "text": " ".join(rng.choices(WORDS, k=rng.randint(3200, 6400)))})
        entry = {"type": "message", "id": f"{i:08x}", "parentId": parent,
                 "timestamp": "2026-11-21T19:30:00.000Z",
                 "message": {"role": "user", "content": [content]}}
        out.append(json.dumps(entry, separators=(",", ":")).encode() + b"\n")
        parent = entry["id"]
    return b"".join(out)


class LyingLibrary:
    """A holder's real library, except that one line's stored bytes are wrong (same length)."""

    def __init__(self, lib: Library, victim: bytes) -> None:
        self.lib, self.victim = lib, victim

    def __getattr__(self, name: str) -> object:
        return getattr(self.lib, name)

    def stored_line(self, line_hash: bytes) -> StoredBlob:
        if line_hash != self.victim:
            return self.lib.stored_line(line_hash)
        raw = self.lib.line(line_hash).replace(b"w", b"v", 1)
        return StoredBlob(line_hash, CODEC_RAW, len(raw), raw)


@dataclass
class Holder:
    lib: Library
    identity: Identity
    server: PeerServer | None = None
    relay: Relay | None = None

    @property
    def port(self) -> int:
        assert self.server
        return self.server.port


@dataclass
class World:
    me: Identity
    trust: TrustStore
    lib: Library
    agent: Path
    data: bytes
    branch: str
    holders: list[Holder]

    async def serve(self, i: int, *, rate: int | None = None, slow_from: int = 0,
                    cut_after: int | None = None, lie_on: bytes | None = None,
                    limits: wire.Limits = wire.DEFAULT_LIMITS, hold: float = 0.0) -> PeerAddress:
        """Start holder i (behind a relay if `rate`, `cut_after` or `hold`: see Relay); its address."""
        h = self.holders[i]
        served = LyingLibrary(h.lib, lie_on) if lie_on is not None else h.lib
        trust = TrustStore(h.lib.paths.home / "trust-of-holder.json")
        trust.trust(self.me.node_id)
        h.server = PeerServer(served, h.identity, trust, limits)  # type: ignore[arg-type]
        await h.server.start("127.0.0.1", 0)
        port = h.port
        if rate is not None or cut_after is not None or hold:
            h.relay = Relay(port, rate=rate, slow_from=slow_from, cut_after=cut_after, hold=hold)
            port = await h.relay.start()
        return PeerAddress(h.identity.node_id, "127.0.0.1", port)

    async def fetch(self, peers: list[PeerAddress], limits: wire.Limits = FETCH_LIMITS) -> FetchResult:
        return await fetch_branch(self.lib, self.branch, peers, self.me, self.trust, agent_dir=self.agent,
                                  limits=limits)

    def lines(self) -> list[bytes]:
        return self.data.splitlines(keepends=True)


@pytest.fixture
async def world(tmp_path: Path, corpus_dir: Path) -> AsyncIterator[World]:
    """Four holders of one 3 MB session (each its own library, store and identity) and a
    fetching node that trusts them all."""
    data = big_session(corpus_dir)
    me = load_or_create_identity(tmp_path / "me-id")
    trust = TrustStore(tmp_path / "me-trust.json")
    holders = []
    branch = ""
    for i in range(4):
        agent = tmp_path / f"agent{i}"
        (agent / A1).parent.mkdir(parents=True)
        (agent / A1).write_bytes(data)
        lib = Library.open(NodePaths(tmp_path / f"home{i}"), agent)
        branch = lib.share(str(agent / A1)).branch
        identity = load_or_create_identity(tmp_path / f"holder{i}-id")
        trust.trust(identity.node_id)
        holders.append(Holder(lib, identity))
    agent = tmp_path / "me-agent"
    agent.mkdir()
    lib = Library.open(NodePaths(tmp_path / "me-home"), agent)
    w = World(me, trust, lib, agent, data, branch, holders)
    try:
        yield w
    finally:
        for h in holders:
            if h.relay:
                await h.relay.close()
            if h.server:
                await h.server.close()
            h.lib.close()
        lib.close()


def placed(w: World, result: FetchResult) -> bytes:
    assert result.path is not None
    return Path(result.path).read_bytes()


@pytest.mark.parametrize("stream", [False, True], ids=["per-line", "stream"])
async def test_cut_trickling_and_lying_holders_leave_the_rest_to_the_honest_one(world: World,
                                                                                stream: bool) -> None:
    """Four holders: one lies on a line of a group it is asked for first, one is cut after
    200 KB, one trickles at 1 KB/s, one is honest (at 100 KB/s per connection, so that the
    fetch outlasts the stall deadline).  The fetch completes, byte-identical, and the result
    names each holder's fate."""
    victim = blake3.blake3(world.lines()[IMAGE_LINE + 1]).digest()  # in the second group: the liar's
    liar = await world.serve(0, lie_on=victim)
    cut = await world.serve(1, cut_after=200_000)
    trickle = await world.serve(2, rate=1000)
    honest = await world.serve(3, rate=100_000)
    limits = dataclasses.replace(FETCH_LIMITS, stream_batches=stream)
    result = await world.fetch([liar, cut, trickle, honest], limits)
    assert placed(world, result) == world.data
    dropped = result.dropped_peers
    assert f"line blob {victim.hex()}" in dropped[str(liar)] and "failed verification" in dropped[str(liar)]
    assert dropped[str(trickle)].startswith("no verified progress for 2 s")
    assert world.holders[1].relay and world.holders[1].relay.cut
    assert dropped[str(cut)].startswith(("connection cut in the middle of an answer",
                                         "connection closed by the peer", "cannot connect"))
    assert str(honest) not in dropped and result.served[str(honest)]["lines"] > 0
    assert str(trickle) not in result.served  # no line came through the trickle
    assert set(result.served) <= {str(liar), str(cut), str(honest)}
    assert sum(s["lines"] for s in result.served.values()) == result.lines_fetched == len(set(world.lines()))
    assert sum(s["bytes"] for s in result.served.values()) == sum(len(ln) for ln in set(world.lines()))


async def test_a_node_that_answered_is_asked_at_that_address_only(world: World) -> None:
    """A node announced at two addresses, one of them a tarpit (a stale or forged mDNS record:
    it takes connections and never answers): once the real one answered the sidecar, the
    lines are asked there alone; the tarpit is never connected to (it would have cost the fetch
    its stall deadline)."""
    import socket

    real = await world.serve(0)
    with socket.socket() as tarpit:
        tarpit.bind(("127.0.0.1", 0))
        tarpit.listen(8)
        tarpit.setblocking(False)
        forged = PeerAddress(real.node_id, "127.0.0.1", tarpit.getsockname()[1])
        result = await world.fetch([real, forged])
        assert placed(world, result) == world.data
        assert result.served[str(forged)]["lines"] == 0 and str(forged) not in result.dropped_peers
        with pytest.raises(BlockingIOError):
            tarpit.accept()  # nothing connected


async def test_two_healthy_holders_both_serve_a_share(world: World) -> None:
    a, b = await world.serve(0), await world.serve(1)
    result = await world.fetch([a, b])
    assert placed(world, result) == world.data
    assert result.dropped_peers == {}
    assert set(result.served) == {str(a), str(b)}
    assert all(s["lines"] > 0 for s in result.served.values())
    assert sum(s["lines"] for s in result.served.values()) == result.lines_fetched == len(set(world.lines()))
    assert sum(s["bytes"] for s in result.served.values()) == sum(len(ln) for ln in set(world.lines()))


@pytest.mark.parametrize("damage", ["a line flipped", "the pack cut short"])
async def test_a_holder_whose_own_copy_is_damaged_leaves_the_fetch_to_a_sound_one(world: World,
                                                                                damage: str) -> None:
    """Holder 0's store was damaged on its disk (no peer lied): a bit flipped in one line's
    record or its pack cut in half: its line manifest is a 503 ("copy is damaged").  Holder 1,
    another node, is sound: the fetch completes from it, byte-identical, and the result names
    holder 0 as dropped for its damaged copy."""
    h = world.holders[0]
    refs = h.lib.line_manifest(h.lib.branch(world.branch).src)
    victim = max(refs, key=lambda r: r.length).hash  # the image line
    h.lib.close()
    pack = h.lib.paths.store / "blobs.pack"
    data = bytearray(pack.read_bytes())
    if damage == "a line flipped":
        data[data.index(victim) + 1000] ^= 0x40  # inside the record, past its header
    else:
        del data[len(data) // 2:]
    pack.write_bytes(bytes(data))
    h.lib = Library.open(h.lib.paths, h.lib.agent_dir)
    damaged, sound = await world.serve(0), await world.serve(1)
    result = await world.fetch([damaged, sound])
    assert placed(world, result) == world.data
    assert str(sound) not in result.dropped_peers and result.served[str(sound)]["lines"] > 0
    assert result.dropped_peers[str(damaged)] == "its copy is damaged (its user should run `p2pnode fsck`)"
    assert sum(s["lines"] for s in result.served.values()) == result.lines_fetched == len(set(world.lines()))


async def test_a_trickling_holder_is_dropped_at_the_stall_deadline(world: World) -> None:
    """The trickling holder gets its share of groups; it moves far less than `progress_bytes`
    and verifies no line within `stall_timeout`: dropped for that reason (not the 5 s
    `progress_timeout`, nor the 30 s read timeout), its groups go to the other.  (Listed
    second: the sidecar and manifest, asked of one peer at a time, come from the first.)"""
    honest = await world.serve(0, rate=100_000)  # the fetch outlasts the stall deadline
    trickle = await world.serve(1, rate=500)
    result = await world.fetch([honest, trickle])
    assert placed(world, result) == world.data
    reason = result.dropped_peers[str(trickle)]
    assert reason.startswith(f"no verified progress for {FETCH_LIMITS.stall_timeout:g} s (no line verified")
    assert result.served == {str(honest): {"lines": len(set(world.lines())),
                                           "bytes": sum(len(ln) for ln in set(world.lines()))}}


async def test_a_slow_holder_is_kept_and_its_last_groups_re_asked(world: World,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A holder slowed to 200 KB/s per connection (above the stall and hedge thresholds:
    `progress_bytes` per `hedge_timeout`) is not dropped; it gets the first group, whose 270 KB
    image line takes it over a second.  The fast holder, idle once the queue is empty, re-asks
    that group (the first verified copy wins)."""
    slow = await world.serve(0, rate=200_000)
    fast = await world.serve(1)
    with caplog.at_level(logging.INFO, logger="p2pnode.peer.downloader"):
        result = await world.fetch([slow, fast])
    assert placed(world, result) == world.data
    assert result.dropped_peers == {}
    re_asked = [r.getMessage() for r in caplog.records if "re-asking" in r.getMessage()]
    assert any(m.startswith(f"re-asking {fast} for") and m.endswith(f"that {slow} is serving")
               for m in re_asked)
    assert result.served[str(fast)]["lines"] > len(set(world.lines())) // 2


async def test_a_silent_holders_groups_are_asked_of_the_other_before_its_stall_deadline(
        world: World, caplog: pytest.LogCaptureFixture) -> None:
    """A holder whose link goes silent after 200 KB (a cut cable: nothing closes) has its
    groups asked of the other holder once it has stalled for `hedge_timeout`, before any group
    nobody is serving yet: the fetch goes on in order long before the stall deadline (here
    far beyond the fetch), and the silent holder is kept, never dropped, as it never reached it."""
    limits = dataclasses.replace(FETCH_LIMITS, stall_timeout=60.0, progress_timeout=60.0)
    silent = await world.serve(0, rate=1, slow_from=200_000)
    other = await world.serve(1, rate=400_000)  # fresh groups are left when the hedge starts
    with caplog.at_level(logging.INFO, logger="p2pnode.peer.downloader"):
        result = await world.fetch([silent, other], limits)
    assert placed(world, result) == world.data
    assert result.dropped_peers == {}
    hedged = f"{silent} has not delivered for {limits.hedge_timeout:g} s: its groups are asked of the others"
    assert any(r.getMessage().startswith(hedged) for r in caplog.records)  # a loaded machine may flag both
    assert sum(s["lines"] for s in result.served.values()) == result.lines_fetched == len(set(world.lines()))
    assert result.served[str(other)]["lines"] > len(set(world.lines())) // 2


@pytest.mark.parametrize(("client_stream", "server_stream"),
                         [(True, True), (True, False), (False, True), (False, False)])
async def test_old_and_new_batch_formats_interoperate(world: World, client_stream: bool,
                                                      server_stream: bool) -> None:
    """A fetcher that does not ask for stream batches, or a server that does not make them (an
    older peer), gets per-line frames; only both new make a stream.  Every pair fetches it whole."""
    addr = await world.serve(0, limits=wire.Limits(serve_stream_batches=server_stream))
    result = await world.fetch([addr], wire.Limits(batch_target_bytes=64 << 10, stream_batches=client_stream))
    assert placed(world, result) == world.data
    assert result.lines_fetched == len(set(world.lines()))
    assert world.lib.session_bytes(result.src) == world.data
    # kept compressed in the store, however the lines came (a stream segment is compressed again)
    text = world.lines()[IMAGE_LINE + 1]
    assert world.lib.stored_line(blake3.blake3(text).digest()).codec == CODEC_ZSTD


async def test_a_holder_of_an_older_version_serves_the_lines_it_has(world: World, tmp_path: Path) -> None:
    """A holder that offers only the first half of the session (an older version of it) is
    asked for lines too: it sends those it has and leaves out the rest, which the full holder
    sends; nobody is dropped for leaving lines out."""
    half = b"".join(world.lines()[: len(world.lines()) // 2])
    agent = tmp_path / "older-agent"
    (agent / A1).parent.mkdir(parents=True)
    (agent / A1).write_bytes(half)
    older = Holder(Library.open(NodePaths(tmp_path / "older-home"), agent),
                   load_or_create_identity(tmp_path / "older-id"))
    older.lib.share(str(agent / A1))
    world.trust.trust(older.identity.node_id)
    world.holders.append(older)
    full = await world.serve(0)
    partial = await world.serve(len(world.holders) - 1)
    result = await world.fetch([partial, full])
    assert placed(world, result) == world.data
    assert result.dropped_peers == {}
    assert result.served[str(partial)]["lines"] > 0 and result.served[str(full)]["lines"] > 0
    assert result.served[str(partial)]["bytes"] <= len(half)


class HidingLibrary(LyingLibrary):
    """A holder's real library that does not serve one line (as if it did not hold it)."""

    def offered_object(self, hash_hex: str, peer: str | None = None) -> str | None:
        return None if hash_hex == self.victim.hex() else self.lib.offered_object(hash_hex, peer)


async def test_a_line_no_holder_serves_fails_the_fetch_as_not_offered(world: World) -> None:
    """The only holder leaves one line out of every answer: asked once per line, not dropped
    (leaving out is no lie), and the fetch fails as not offered; nothing is stored or placed."""
    victim = blake3.blake3(world.lines()[-1]).digest()
    h = world.holders[0]
    trust = TrustStore(h.lib.paths.home / "trust-of-holder.json")
    trust.trust(world.me.node_id)
    h.server = PeerServer(HidingLibrary(h.lib, victim), h.identity, trust)  # type: ignore[arg-type]
    await h.server.start("127.0.0.1", 0)
    addr = PeerAddress(h.identity.node_id, "127.0.0.1", h.port)
    fate = f"not offered by any peer \\({addr}: does not serve some of them \\(no longer offered there"
    with pytest.raises(NotFound, match=f"lines of session .*: {fate}"):
        await world.fetch([addr])
    assert not world.lib.branches(include_unshared=True)
    assert not list(world.agent.rglob("*.jsonl"))


async def test_default_limits_cut_a_small_session_into_groups_for_both_holders(world: World) -> None:
    """With the default 4 MB batch target the 3 MB session would be one request: one holder
    would serve it and the other only re-ask it.  Groups are sized per holder (batches.py),
    so both serve a share and no line is counted twice."""
    a, b = await world.serve(0), await world.serve(1)
    result = await world.fetch([a, b], wire.DEFAULT_LIMITS)
    assert placed(world, result) == world.data
    assert result.dropped_peers == {}
    assert all(result.served[str(h)]["lines"] > 0 for h in (a, b))
    assert sum(s["lines"] for s in result.served.values()) == result.lines_fetched == len(set(world.lines()))


def test_group_size_follows_the_session_and_the_holders() -> None:
    """GROUPS_PER_HOLDER groups per holder, within [MIN_GROUP_BYTES, batch_target_bytes];
    a smaller configured target wins; the groups keep the lines' order."""
    limits = wire.DEFAULT_LIMITS
    refs = [LineRef(blake3.blake3(b"%d" % i).digest(), 100_000) for i in range(640)]  # 64 MB
    one, two = (batches.group_bytes(64_000_000, n, limits) for n in (1, 2))
    assert one == 64_000_000 // batches.GROUPS_PER_HOLDER and two == batches.MIN_GROUP_BYTES
    assert batches.group_bytes(1_280_000_000, 1, limits) == limits.batch_target_bytes
    assert batches.group_bytes(64_000_000, 1, FETCH_LIMITS) == FETCH_LIMITS.batch_target_bytes
    groups = batches._groups(refs, limits, two)
    assert [r for g in groups for r in g] == refs
    assert len(groups) >= 64_000_000 // (batches.MIN_GROUP_BYTES + 100_000)


async def test_the_only_holder_slow_to_answer_is_kept_to_the_progress_bound(world: World) -> None:
    """A lone holder (a busy node) that holds back each connection's first answer for longer
    than `stall_timeout` is not dropped by the stall clock, which is there to move lines to
    another holder; with none left, `progress_timeout` applies (a holder dropped for a stall
    while others are left: test_a_trickling_holder_is_dropped_at_the_stall_deadline)."""
    limits = dataclasses.replace(FETCH_LIMITS, stall_timeout=0.5, progress_timeout=5.0)
    slow = await world.serve(0, hold=1.5)
    result = await world.fetch([slow], limits)
    assert placed(world, result) == world.data
    assert result.dropped_peers == {} and result.served[str(slow)]["lines"] == len(set(world.lines()))


async def test_a_stalled_holder_stops_counting_in_the_fetchs_pace_until_it_progresses(world: World) -> None:
    """Share's own clock, with a real PeerPool and requests that are only awaited: a holder
    whose requests deliver nothing for `hedge_timeout` is no longer `delivering` (its link
    must not price the batch format, peer/pace.py) and the other holder is asked for its
    group before the fresh ones; it stays in the fetch until `stall_timeout`."""
    limits = dataclasses.replace(FETCH_LIMITS, hedge_timeout=0.2, stall_timeout=60.0)
    silent_addr, other_addr = await world.serve(0), await world.serve(1)
    pool = PeerPool([silent_addr, other_addr], world.me, world.trust, limits)
    silent, other = pool.peers
    refs = [LineRef(blake3.blake3(b"%d" % i).digest(), 1000) for i in range(12)]
    groups = [refs[:4], refs[4:8], refs[8:]]
    share = Share(pool, "a session", groups, in_flight=1)
    asked: list[tuple[PeerLink, list[LineRef]]] = []
    seen: list[bool] = []

    async def op(peer: PeerLink, group: list[LineRef]) -> None:
        asked.append((peer, group))
        if peer is silent:
            await asyncio.Event().wait()  # a cut link: nothing arrives, nothing closes
        for r in group:  # a line every 0.15 s: progress
            await asyncio.sleep(0.15)
            share.verified(peer, [wire.BatchBlob(r.hash, CODEC_RAW, r.length, b"")])
        seen.append(share.delivering(silent))

    try:
        await share.run(op)
    finally:
        await pool.close()
    assert asked[:3] == [(silent, groups[0]), (other, groups[1]), (other, groups[0])]  # before the fresh one
    assert seen and not any(seen) and share.delivering(other) and not silent.dropped
