"""Hostile peers, round two (issue 13): each test mounts the attack for real, with a server or
client of its own speaking the protocol over real mutual TLS on loopback, against the real
fetcher, library, store and peer server, and asserts a clear error with the README's exit
code, bounded time, and nothing stored, overwritten or leaked.
"""
from __future__ import annotations

from pathlib import Path

import blake3
import pytest
from aiohttp import web
from test_hostile_peer import A1, LyingPeer, fetch, refused, snapshot, world  # noqa: F401

from p2pnode.errors import VerificationFailed
from p2pnode.identity import load_or_create_identity
from p2pnode.trust import TrustStore


async def plain_http_server(hits: list[str]) -> tuple[web.AppRunner, int]:
    """A plain-http server (no TLS) that records every request: what a redirect would reach."""
    async def any_request(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.Response(body=b"internal service\n")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", any_request)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1]


def honest_peer(w, tmp_path: Path, name: str = "honest") -> LyingPeer:
    peer = LyingPeer(load_or_create_identity(tmp_path / name), TrustStore(tmp_path / f"{name}-trust.json"))
    peer.trust.trust(w["me"].node_id)
    w["trust"].trust(peer.identity.node_id)
    return peer


# --- 1. no redirects -------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["object", "lines", "batch"])
async def test_redirects_are_never_followed(world, tmp_path: Path, endpoint: str) -> None:  # noqa: F811
    """A peer answers 302 to http://127.0.0.1/<internal>: the fetcher never goes there, the
    peer is dropped for a protocol error (exit 5), and the next peer delivers."""
    liar = world["liar"]
    data = (world["corpus"] / A1).read_bytes()
    branch = liar.add(data)
    hits: list[str] = []
    internal, port = await plain_http_server(hits)

    async def redirect(request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound(f"http://127.0.0.1:{port}/internal{request.path}")

    liar.handlers[endpoint] = redirect
    try:
        await refused(world, branch, VerificationFailed, "redirect")
        assert VerificationFailed.exit_code == 5
        honest = honest_peer(world, tmp_path)
        honest.add(data)
        before = snapshot(world)
        try:
            result = await fetch(world, branch, [await liar.start(), await honest.start()])
        finally:
            await honest.close()
        assert snapshot(world) != before and Path(result.path or "").read_bytes() == data
        (reason,) = result.dropped_peers.values()
        assert "302 (a redirect)" in reason
    finally:
        await internal.cleanup()
    assert hits == []
    assert blake3.blake3(data).hexdigest() == result.src
