"""A fetch run again after it was stopped (kill -9, Ctrl-C, a failure) does not ask for the
session's line manifest again: the first run kept it in the fetch's staging dir
(get.KeptManifests), and the run that verifies the version removes it.  The kept copy is not
trusted: a wrong or torn one is removed and a peer asked, and no peer is blamed for it.

Real mutual-TLS server (test_hostile_peer.LyingPeer, honest here), real fetcher, library and
store; the manifest requests are counted at the server.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import blake3
from aiohttp import web
from test_hostile_peer import A1, LyingPeer, b3, fetch, split, world  # noqa: F401

from p2pnode.peer import wire
from p2pnode.peer.get import KEPT_HEAD, KeptManifests, fetch_branch
from p2pnode.pi.lines import LineRef


def counting_manifests(peer: LyingPeer) -> list[str]:
    """The srcs of the line manifests `peer` is asked for, in order."""
    asked: list[str] = []
    honest = peer.handlers["lines"]

    async def lines(request: web.Request) -> web.StreamResponse:
        asked.append(request.match_info["src"])
        return await honest(request)

    peer.handlers["lines"] = lines
    return asked


async def test_a_fetch_run_again_does_not_ask_for_the_manifest_again(world) -> None:  # noqa: F811
    """The first run is stopped while its batch waits; the second asks for the lines only,
    and its batches are cut as the first run's were (the kept size); the kept copy goes with
    the verified version."""
    liar = world["liar"]
    data = (world["corpus"] / A1).read_bytes()
    branch = liar.add(data)
    src = blake3.blake3(data).hexdigest()
    asked = counting_manifests(liar)
    kept = KeptManifests(world["lib"].paths.fetching)
    batch_asked, stopped = asyncio.Event(), asyncio.Event()
    honest_batch = liar.handlers["batch"]

    async def stalled(request: web.Request) -> web.StreamResponse:
        batch_asked.set()
        await asyncio.wait_for(stopped.wait(), 30)
        return web.Response(status=503)

    liar.handlers["batch"] = stalled
    peer = await liar.start()
    try:
        first = asyncio.ensure_future(fetch_branch(world["lib"], branch, [peer], world["me"], world["trust"],
                                                   agent_dir=world["agent"]))
        await asyncio.wait_for(batch_asked.wait(), 30)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
    finally:
        stopped.set()
        await liar.close()
    assert asked == [src]
    body = kept.path(src).read_bytes()
    (sized,) = KEPT_HEAD.unpack_from(body)
    assert sized == sum({b3(ln): len(ln) for ln in split(data)}.values())
    assert wire.decode_line_manifest(body[KEPT_HEAD.size:], bytes.fromhex(src)) == [
        LineRef(b3(ln), len(ln)) for ln in split(data)]

    liar.handlers["batch"] = honest_batch
    result = await fetch(world, branch)
    assert asked == [src]  # not asked again
    assert Path(result.path or "").read_bytes() == data
    assert not kept.path(src).exists()


async def test_a_wrong_kept_manifest_is_dropped_and_a_peer_asked(world) -> None:  # noqa: F811
    """A kept manifest whose lines are each real but do not make the session (two swapped):
    the fetch asks the peer, completes byte-identical, and drops no peer."""
    liar = world["liar"]
    data = (world["corpus"] / A1).read_bytes()
    branch = liar.add(data)
    src = blake3.blake3(data).hexdigest()
    refs = [LineRef(b3(ln), len(ln)) for ln in split(data)]
    refs[1], refs[2] = refs[2], refs[1]
    kept = KeptManifests(world["lib"].paths.fetching)
    kept.save(src, wire.encode_line_manifest(bytes.fromhex(src), refs), len(data))
    asked = counting_manifests(liar)
    result = await fetch(world, branch)
    assert asked == [src]
    assert Path(result.path or "").read_bytes() == data
    assert result.dropped_peers == {}
    assert not kept.path(src).exists()


async def test_a_torn_kept_manifest_is_dropped_and_a_peer_asked(world) -> None:  # noqa: F811
    """A kept file cut short (what a crash of the machine may leave): refused by the decode,
    removed, and the peer's manifest used."""
    liar = world["liar"]
    data = (world["corpus"] / A1).read_bytes()
    branch = liar.add(data)
    src = blake3.blake3(data).hexdigest()
    refs = [LineRef(b3(ln), len(ln)) for ln in split(data)]
    kept = KeptManifests(world["lib"].paths.fetching)
    kept.save(src, wire.encode_line_manifest(bytes.fromhex(src), refs), len(data))
    whole = kept.path(src).read_bytes()
    kept.path(src).write_bytes(whole[:-7])
    assert kept.load(src, wire.DEFAULT_LIMITS) is None and not kept.path(src).exists()
    kept.path(src).write_bytes(whole[:KEPT_HEAD.size - 1])
    asked = counting_manifests(liar)
    result = await fetch(world, branch)
    assert asked == [src]
    assert Path(result.path or "").read_bytes() == data
    assert not kept.path(src).exists()
