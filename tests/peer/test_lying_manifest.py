"""A holder whose line manifest lies about a line's length, and one whose stream answer names a
lane position it cannot have, fetched beside an honest holder of the same session: the liar is
dropped and the honest holder delivers, in the same fetch; the honest holder is never blamed
for the manifest's lie, and a lie is not kept for the next fetch.

Real mutual-TLS servers (test_hostile_peer.LyingPeer: one lies, one is honest), the real
fetcher, library and store.
"""
from __future__ import annotations

from pathlib import Path

import blake3
import pytest
from aiohttp import web
from test_hostile_peer import A1, LyingPeer, b3, split, world  # noqa: F401

from p2pnode.errors import VerificationFailed
from p2pnode.peer import wire
from p2pnode.peer.address import PeerAddress
from p2pnode.peer.batches import CHECKABLE_MIN
from p2pnode.peer.get import FetchResult, KeptManifests, fetch_branch
from p2pnode.peer.identity import load_or_create_identity
from p2pnode.peer.trust import TrustStore
from p2pnode.pi.lines import LineRef


def second_holder(w) -> LyingPeer:
    """Another holder both sides trust (honest unless a test swaps a handler)."""
    ident = load_or_create_identity(w["tmp"] / "honest-id")
    trust = TrustStore(w["tmp"] / "honest-trust.json")
    trust.trust(w["me"].node_id)
    w["trust"].trust(ident.node_id)
    return LyingPeer(ident, trust)


def lying_lengths(peer: LyingPeer, src: str, line: int, by: int) -> None:
    """`peer`'s line manifest of `src` gives line `line` a length `by` bytes off."""
    async def lines(request: web.Request) -> web.StreamResponse:
        refs = [LineRef(b3(ln), len(ln)) for ln in peer.manifests[src]]
        refs[line] = LineRef(refs[line].hash, refs[line].length + by)
        return web.Response(body=wire.encode_line_manifest(bytes.fromhex(src), refs))

    peer.handlers["lines"] = lines


async def fetch_from(w, branch: str, holders: list[LyingPeer]) -> FetchResult:
    peers: list[PeerAddress] = [await h.start() for h in holders]
    try:
        return await fetch_branch(w["lib"], branch, peers, w["me"], w["trust"], agent_dir=w["agent"])
    finally:
        for h in holders:
            await h.close()


def with_big_line(w) -> bytes:
    """A1 followed by one line longer than CHECKABLE_MIN (a manifest can understate it by more
    than a batch answer is read to check)."""
    big = b'{"type":"custom","customType":"x","data":"' + b"y" * (2 * CHECKABLE_MIN) + b'"}\n'
    return (w["corpus"] / A1).read_bytes() + big


@pytest.mark.parametrize("by", [2, -2], ids=["overstated", "understated"])
async def test_a_manifest_length_lie_drops_its_sender_and_the_honest_holder_delivers(world, by: int) -> None:  # noqa: F811
    """The liar is asked for the manifest first and lies about line 2's length; every line it
    and the honest holder send is genuine.  The genuine line of another length proves the
    manifest wrong: its sender is dropped, the honest holder's manifest is used, and the fetch
    completes byte-identical."""
    data = (world["corpus"] / A1).read_bytes()
    liar, honest = world["liar"], second_holder(world)
    branch = liar.add(data)
    assert honest.add(data) == branch
    src = blake3.blake3(data).hexdigest()
    lying_lengths(liar, src, 1, by)
    result = await fetch_from(world, branch, [liar, honest])
    assert Path(result.path or "").read_bytes() == data
    liar_addr = f"{liar.identity.node_id}@127.0.0.1:{liar.port}"
    assert list(result.dropped_peers) == [liar_addr]
    assert "line manifest" in result.dropped_peers[liar_addr]
    assert not KeptManifests(world["lib"].paths.fetching).path(src).exists()


async def test_a_kept_manifest_with_a_length_lie_is_dropped_and_the_honest_holder_not_blamed(world) -> None:  # noqa: F811
    """A kept manifest (fetching/<src>.lines, left by an earlier fetch from a liar) with one
    wrong length: the fetch from the honest holder alone removes it, asks that holder for the
    manifest and completes; no peer is dropped (it was exit 5, naming the honest holder, on
    every fetch after)."""
    data = (world["corpus"] / A1).read_bytes()
    honest = world["liar"]
    branch = honest.add(data)
    src = blake3.blake3(data).hexdigest()
    refs = [LineRef(b3(ln), len(ln)) for ln in split(data)]
    refs[1] = LineRef(refs[1].hash, refs[1].length + 2)
    kept = KeptManifests(world["lib"].paths.fetching)
    kept.save(src, wire.encode_line_manifest(bytes.fromhex(src), refs), len(data))
    result = await fetch_from(world, branch, [honest])
    assert Path(result.path or "").read_bytes() == data
    assert result.dropped_peers == {}
    assert not kept.path(src).exists()


async def test_a_length_lie_too_big_to_check_is_not_kept_for_the_next_fetch(world) -> None:  # noqa: F811
    """A manifest that understates a line by more than a batch answer is read to check (the
    frame is refused from its head, wire.BatchDecoder's `checkable`): that fetch fails (the
    holder that sent the line cannot be told from a liar), but the kept manifest goes with it,
    so the next fetch, from the same honest holder, asks for the manifest again and completes."""
    data = with_big_line(world)
    liar, honest = world["liar"], second_holder(world)
    branch = liar.add(data)
    assert honest.add(data) == branch
    src = blake3.blake3(data).hexdigest()
    lines = split(data)
    lying_lengths(liar, src, len(lines) - 1, -(len(lines[-1]) - 100))
    liar.handlers["batch"] = lambda request: _nothing(request)  # only the manifest comes from it
    with pytest.raises(VerificationFailed, match="where the manifest says 100"):
        await fetch_from(world, branch, [liar, honest])
    assert not KeptManifests(world["lib"].paths.fetching).path(src).exists()
    result = await fetch_from(world, branch, [honest])
    assert Path(result.path or "").read_bytes() == data
    assert result.dropped_peers == {}


async def _nothing(request: web.Request) -> web.StreamResponse:
    await request.read()
    return web.Response(body=wire.encode_batch_end(0))


async def test_a_wrong_stream_continue_header_drops_that_holder_only(world) -> None:  # noqa: F811
    """A stream answer whose X-P2P-Stream-Continue names a lane position the fetcher does not
    hold: that batch fails as a corrupt frame does (the holder dropped, with the reason), and
    the honest holder delivers every line (it ended the whole fetch as an unexpected error)."""
    data = (world["corpus"] / A1).read_bytes()
    liar, honest = world["liar"], second_holder(world)
    branch = liar.add(data)
    assert honest.add(data) == branch

    async def continues(request: web.Request) -> web.StreamResponse:
        body = liar.frames(wire.decode_batch_request(await request.read()))
        return web.Response(body=body, headers={wire.BATCH_FORMAT_HEADER: wire.BATCH_FORMAT_STREAM,
                                                wire.STREAM_CONTINUE_HEADER: "7"})

    liar.handlers["batch"] = continues
    result = await fetch_from(world, branch, [liar, honest])
    assert Path(result.path or "").read_bytes() == data
    liar_addr = f"{liar.identity.node_id}@127.0.0.1:{liar.port}"
    assert list(result.dropped_peers) == [liar_addr]
    assert "continues after 7 answers" in result.dropped_peers[liar_addr]
