"""What a fetch names to a holder, and what it fetches when a catalog names more than is served.

* `?after=` names only held versions of the Pi session being fetched (its id from the catalog),
  the largest first: the fetcher's other sessions (its unshared ones too) were sent to whoever
  served a root session.
* A catalog listing a newer version of the branch asked for that no holder serves: the branch
  asked for is fetched, and the note says so (it was exit 3 naming a hash never typed).
* A sidecar of a newer format (an ancestor's, or that of the newer version fetched in place of
  the one asked for): the error names the branch asked for, and the version found and read.

Real mutual-TLS server (test_hostile_peer.LyingPeer), the real fetcher, library and store.
"""
from __future__ import annotations

import json
from pathlib import Path

import blake3
import pytest
from aiohttp import web
from test_hostile_peer import A1, LyingPeer, split, world  # noqa: F401

from p2pnode.errors import InvalidInput
from p2pnode.node.follow import fetch_newest, newest_to_fetch
from p2pnode.peer import wire
from p2pnode.peer.address import PeerAddress
from p2pnode.peer.get import fetch_branch
from p2pnode.pi.sidecar import Sidecar


def recording_after(peer: LyingPeer) -> list[str | None]:
    """The `after` parameter of each line manifest request `peer` answers, in order."""
    seen: list[str | None] = []
    honest = peer.handlers["lines"]

    async def lines(request: web.Request) -> web.StreamResponse:
        seen.append(request.query.get("after"))
        return await honest(request)

    peer.handlers["lines"] = lines
    return seen


async def fetch_named(w, branch: str, session_id: str | None) -> None:
    peer = await w["liar"].start()
    try:
        await fetch_branch(w["lib"], branch, [peer], w["me"], w["trust"], agent_dir=w["agent"],
                           session_id=session_id)
    finally:
        await w["liar"].close()


def session_id(data: bytes) -> str:
    return json.loads(split(data)[0])["id"]


async def test_after_names_no_version_of_another_session(world) -> None:  # noqa: F811
    """The fetcher holds another root session (shared, then unshared: private): fetching a
    root of a session it holds no version of names nothing, known session id or not."""
    held = world["lib"].branches()[0]
    world["lib"].unshare(held.branch)
    data = (world["corpus"] / A1).read_bytes()
    branch = world["liar"].add(data)
    asked = recording_after(world["liar"])
    await fetch_named(world, branch, session_id(data))
    assert asked == [None]


async def test_after_names_held_versions_of_the_same_session_largest_first(world) -> None:  # noqa: F811
    """Two held versions of the session (and the fetcher's other session): the next version's
    manifest request names those two, the larger first, and not the other session's."""
    data = (world["corpus"] / A1).read_bytes()
    lines, sid = split(data), session_id(data)
    small, large = b"".join(lines[:3]), b"".join(lines[:6])
    asked = recording_after(world["liar"])
    await fetch_named(world, world["liar"].add(small), sid)
    await fetch_named(world, world["liar"].add(large), sid)
    await fetch_named(world, world["liar"].add(data), sid)
    hexes = [blake3.blake3(d).hexdigest() for d in (small, large)]
    assert asked == [None, hexes[0], f"{hexes[1]},{hexes[0]}"]
    await fetch_named(world, world["liar"].add(data + lines[-1]), None)
    assert asked[-1] is None  # the session not known: nothing named


async def test_a_newer_version_no_holder_serves_falls_back_to_the_branch_asked_for(world) -> None:  # noqa: F811
    """The catalog lists the branch asked for and a v2 of it that it does not serve: the fetch
    takes the branch asked for and says why."""
    liar = world["liar"]
    data = (world["corpus"] / A1).read_bytes()
    branch, asked = _asked(liar, data)
    phantom_src = "9" * 64
    phantom = wire.CatalogEntry(Sidecar(phantom_src, None).branch, phantom_src, None, len(data) + 10,
                                len(split(data)) + 1, asked.header, previous=branch, version=2)
    _lists(liar, [asked, phantom])
    peer: PeerAddress = await liar.start()
    try:
        newest = await newest_to_fetch(branch, [peer], world["me"], world["trust"], _no_lan)
        assert newest.branch == phantom.branch
        result = await fetch_newest(world["lib"], newest, world["me"], world["trust"],
                                    agent_dir=world["agent"])
    finally:
        await liar.close()
    assert result.branch == branch
    assert Path(result.path or "").read_bytes() == data
    assert result.note is not None and f"latest version {phantom.branch} no peer served" in result.note


async def _no_lan(target: str) -> list[PeerAddress]:
    return []


def _asked(liar: LyingPeer, data: bytes) -> tuple[str, wire.CatalogEntry]:
    """The branch of `data` the liar serves, and its catalog entry (version 1)."""
    branch = liar.add(data)
    header = {"id": session_id(data), "timestamp": None, "cwd": None, "parent_session": None}
    src = blake3.blake3(data).hexdigest()
    return branch, wire.CatalogEntry(branch, src, None, len(data), len(split(data)), header, version=1)


def _lists(liar: LyingPeer, entries: list[wire.CatalogEntry]) -> None:
    """The liar's catalog lists `entries`."""
    async def catalog(request: web.Request) -> web.StreamResponse:
        return web.Response(body=wire.encode_catalog(wire.CatalogMessage(1, liar.identity.node_id, entries)))

    liar.handlers["catalog"] = catalog


NEWER_SIDECAR = b'{"type":"branch","version":2,"src":"' + b"a" * 64 + b'","parent":null}'
NEWER = "has version 2; this p2pnode reads version 1 only (made by a newer p2pnode? update this one)"


async def test_a_newer_sidecar_of_an_ancestor_names_the_branch_asked_for(world) -> None:  # noqa: F811
    """The branch asked for is fine, its parent's sidecar is of a newer format: the message
    named only that parent, a hash the user never typed, and said "expected 1"."""
    liar = world["liar"]
    parent = blake3.blake3(NEWER_SIDECAR).hexdigest()
    liar.objects[parent] = NEWER_SIDECAR
    child = liar.add((world["corpus"] / A1).read_bytes(), parent=parent)
    with pytest.raises(InvalidInput) as raised:
        await fetch_named(world, child, None)
    message = str(raised.value)
    assert message.startswith(f"sidecar of branch {parent} (an ancestor of branch {child}): ")
    assert f"sidecar of branch {parent} {NEWER}" in message


async def test_a_newer_sidecar_of_the_latest_version_names_the_branch_asked_for(world) -> None:  # noqa: F811
    """`fetch <older version>` fetches the latest one a catalog lists; its sidecar is of a newer
    format: the error names the branch asked for, the one fetched in its place, and the
    versions (exit 4, the fallback to the one asked for is only for a version not served)."""
    liar = world["liar"]
    data = (world["corpus"] / A1).read_bytes()
    branch, asked = _asked(liar, data)
    newer = blake3.blake3(NEWER_SIDECAR).hexdigest()
    liar.objects[newer] = NEWER_SIDECAR
    latest = wire.CatalogEntry(newer, "a" * 64, None, len(data) + 10, len(split(data)) + 1, asked.header,
                               previous=branch, version=2)
    _lists(liar, [asked, latest])
    peer: PeerAddress = await liar.start()
    try:
        newest = await newest_to_fetch(branch, [peer], world["me"], world["trust"], _no_lan)
        with pytest.raises(InvalidInput) as raised:
            await fetch_newest(world["lib"], newest, world["me"], world["trust"], agent_dir=world["agent"])
    finally:
        await liar.close()
    message = str(raised.value)
    assert message.startswith(f"branch {newer}, the latest version of branch {branch}: "
                              f"sidecar of branch {newer}: ")
    assert NEWER in message and raised.value.exit_code == 4
