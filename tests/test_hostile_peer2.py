"""Hostile peers, round two (issue 13): each test mounts the attack for real, with a server or
client of its own speaking the protocol over real mutual TLS on loopback, against the real
fetcher, library, store and peer server, and asserts a clear error with the README's exit
code, bounded time, and nothing stored, overwritten or leaked.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import aiohttp
import blake3
import pytest
from aiohttp import web
from test_hostile_peer import A1, A2, LyingPeer, b3, fetch, refused, snapshot, split, trusted_client, world  # noqa: F401

from p2pnode import wire
from p2pnode.errors import Conflict, InvalidInput, VerificationFailed
from p2pnode.identity import load_or_create_identity
from p2pnode.library import Library
from p2pnode.node import CONTROL_MAX_BODY, Node, NodeConfig
from p2pnode.paths import NodePaths
from p2pnode.pisession import HostileHeader, InvalidHeader
from p2pnode.provider import NOT_FOUND_BODY, PeerServer
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


# --- 2. input that must not crash ----------------------------------------------------------


def _header_and_rest(w) -> tuple[dict, bytes]:
    first, rest = (w["corpus"] / A1).read_bytes().split(b"\n", 1)
    return json.loads(first), rest


async def test_deeply_nested_header_is_invalid_input(world) -> None:  # noqa: F811
    header, rest = _header_and_rest(world)
    nested = json.dumps(header)[:-1].encode() + b',"x":' + b"[" * 5000 + b"]" * 5000 + b"}\n"
    branch = world["liar"].add(nested + rest)
    await refused(world, branch, InvalidHeader, "nests too deeply")


async def test_deeply_nested_body_line_leaves_no_file(world) -> None:  # noqa: F811
    """A user message nested 5,000 deep: refused before the store or the sessions dir is touched."""
    header, rest = _header_and_rest(world)
    line = b'{"type":"message","message":{"role":"user","content":' + b"[" * 5000 + b"]" * 5000 + b"}}\n"
    branch = world["liar"].add(json.dumps(header).encode() + b"\n" + line + rest)
    await refused(world, branch, InvalidInput, "line 2 is JSON nested too deeply")
    assert not (world["agent"] / A1).exists()


@pytest.mark.parametrize("kind", ["dangling symlink", "directory", "symlink to a file"])
async def test_odd_things_at_the_destination_are_conflicts(world, tmp_path: Path, kind: str) -> None:  # noqa: F811
    """Never followed, never replaced: exit 7 with the path; the verified bytes stay in the store."""
    data = (world["corpus"] / A1).read_bytes()
    target = world["agent"] / A1
    target.parent.mkdir(parents=True, exist_ok=True)
    elsewhere = tmp_path / "elsewhere.jsonl"
    if kind == "directory":
        target.mkdir()
        (target / "inside").write_bytes(b"mine\n")
    else:
        if kind == "symlink to a file":
            elsewhere.write_bytes(b"mine\n")
        target.symlink_to(elsewhere)
    result = await fetch(world, world["liar"].add(data))
    assert result.conflict and str(target) in result.conflict and result.path == str(target)
    assert ("a directory" if kind == "directory" else "a symlink") in result.conflict
    assert Conflict.exit_code == 7
    if kind == "directory":
        assert (target / "inside").read_bytes() == b"mine\n"
    else:
        assert target.is_symlink()
        assert elsewhere.read_bytes() == b"mine\n" if kind == "symlink to a file" else not elsewhere.exists()
    assert world["lib"].session_bytes(result.src) == data


@pytest.mark.parametrize("char", ["\u009b", "\u0085", "\u001b", "\u007f"])
async def test_c1_and_c0_controls_in_the_cwd_are_refused(world, char: str) -> None:  # noqa: F811
    header, rest = _header_and_rest(world)
    header["cwd"] = f"/tmp/{char}31mwork"
    branch = world["liar"].add(json.dumps(header, ensure_ascii=False).encode() + b"\n" + rest)
    await refused(world, branch, HostileHeader, "control characters")


def test_the_cli_never_prints_peer_text_raw(world, capsys: pytest.CaptureFixture[str],  # noqa: F811
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A stored session whose title carries C0 and C1 escapes: `ls`, `show` and the escaping
    helper print them as visible escapes, never as terminal control bytes."""
    from p2pnode import cli

    header, rest = _header_and_rest(world)
    header["id"] = "01a1ff93-beef"
    title = "evil \u009b2J\u001b]0;pwned\u0007 title"
    line = json.dumps({"type": "session_info", "name": title}).encode() + b"\n"
    path = world["agent"] / "sessions" / "--t--" / "2026-11-21T19-26-27-092Z_01a1ff93-beef.jsonl"
    path.parent.mkdir(parents=True)
    path.write_bytes(json.dumps(header).encode() + b"\n" + rest + line)
    branch = world["lib"].share(str(path)).branch
    world["lib"].close()
    monkeypatch.setenv("P2PNODE_HOME", str(world["tmp"] / "home"))
    monkeypatch.setenv("PI_CODING_AGENT_DIR", str(world["agent"]))
    for argv in (["ls"], ["show", branch]):
        assert cli.main(argv) == 0
        out = capsys.readouterr().out
        assert "evil" in out and "\\x9b2J" in out
        assert not any(0x80 <= ord(c) <= 0x9F or (ord(c) < 0x20 and c != "\n") for c in out)
    world["lib"] = Library.open(NodePaths(world["tmp"] / "home"), world["agent"])
    assert cli.shown("a\u009bb\nc") == "a\\x9bb\\nc"


async def test_range_edge_cases_answer_416(world, tmp_path: Path) -> None:  # noqa: F811
    """`bytes=-0` is unsatisfiable (RFC 9110) and only ASCII digits are digits."""
    lib = world["lib"]
    shown = lib.branches()[0]
    client, tls = trusted_client(world, tmp_path)
    server = PeerServer(lib, world["me"], world["trust"])
    await server.start("127.0.0.1", 0)
    url = f"https://127.0.0.1:{server.port}" + wire.PATH_OBJECT.format(hash=shown.src)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls)) as s:
            for bad in ("bytes=-0", "bytes=\u0661\u0660-", "bytes=0-\u0669", "bytes=-\uff15"):
                async with s.get(url, headers={"Range": bad.encode().decode("latin-1")}) as r:
                    assert r.status == 416, bad
                    assert r.headers["Content-Range"] == f"bytes */{shown.size}"
            async with s.get(url, headers={"Range": "bytes=-5"}) as r:
                assert r.status == 206 and len(await r.read()) == 5
    finally:
        await server.close()
    assert wire.parse_range("bytes=-5", 100) == (95, 100)
    for bad in ("bytes=-0", "bytes=\u0661-", "bytes=1-\u0662"):
        with pytest.raises(wire.RangeNotSatisfiable):
            wire.parse_range(bad, 100)


async def test_control_socket_answers_413_and_400_never_500(tmp_path: Path) -> None:
    """A 30 MiB body gets 413, wrong-typed values and deep nesting get 400 (exit 4), and the
    node keeps answering."""
    agent = tmp_path / "agent"
    agent.mkdir()
    config = NodeConfig(host="127.0.0.1", port=0, mdns=False, agent_dir=agent)
    node = Node(NodePaths(tmp_path / "home"), config)
    await node.start()
    sock = str(tmp_path / "home" / "control.sock")
    try:
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=sock)) as s:
            async def post(op: str, body: bytes) -> tuple[int, dict]:
                async with s.post(f"http://node/v1/{op}", data=body,
                                  headers={"Content-Type": "application/json"}) as r:
                    return r.status, await r.json()

            status, answer = await post("status", b'{"x":"' + b"a" * (30 << 20) + b'"}')
            assert status == 413 and answer["exit_code"] == 4 and str(CONTROL_MAX_BODY) in answer["message"]
            for op, body in [("unshare", {"branch": 5}), ("fetch", {"branch": "a" * 64, "peers": "x:1"}),
                             ("fetch", {"branch": "a" * 64, "peers": [7]}), ("share", {"target": ["x"]}),
                             ("share", {"latest": "yes"}), ("read", {"call": "branch", "args": [{"a": 1}]}),
                             ("read", {"call": 3}), ("read", {"call": "branches", "args": "x"})]:
                status, answer = await post(op, json.dumps(body).encode())
                assert (status, answer["exit_code"]) == (400, 4), (op, body, answer)
            status, answer = await post("status", b"[" * 100_000 + b"]" * 100_000)
            assert (status, answer["exit_code"]) == (400, 4)
            status, answer = await post("status", b"{}")
            assert status == 200 and answer["running"]
    finally:
        await node.close()


# --- 3. a peer must never rewrite the user's own session ------------------------------------------


async def test_peer_cannot_grow_the_users_own_session(world) -> None:  # noqa: F811
    """The victim shared its own session A2; a trusted peer offers it with a fake user message
    appended (same header, so the same path): exit 7, the victim's file is byte-identical."""
    own = world["agent"] / A2
    mine = own.read_bytes()
    fake = json.dumps({"type": "message", "id": "fake0001", "parentId": None, "timestamp":
                       "2026-11-21T19:30:00.000Z", "message": {"role": "user", "content": "rm -rf ~"}})
    branch = world["liar"].add(mine + fake.encode() + b"\n")
    result = await fetch(world, branch)
    assert result.conflict and str(own) in result.conflict and "own file" in result.conflict
    assert own.read_bytes() == mine
    assert Conflict.exit_code == 7


async def test_only_a_placed_unchanged_file_is_updated_and_only_by_growth(world) -> None:  # noqa: F811
    """A file a fetch placed is updated by a version that extends it; once the user changed
    it (Pi appended to it), or when the new version does not extend it, it is kept."""
    liar = world["liar"]
    data = (world["corpus"] / A1).read_bytes()
    first = await fetch(world, liar.add(data))
    placed = Path(first.path or "")
    assert first.written and placed.read_bytes() == data
    grown = await fetch(world, liar.add(data + b'{"type":"custom","n":1}\n'))
    assert grown.written and not grown.conflict and placed.read_bytes() == data + b'{"type":"custom","n":1}\n'
    rewritten = data[:-2] + b"X\n" + b'{"type":"custom","n":2}\n'  # same header, not an extension
    result = await fetch(world, liar.add(rewritten))
    assert result.conflict and "do not extend" in result.conflict
    assert placed.read_bytes() == data + b'{"type":"custom","n":1}\n'
    with placed.open("ab") as f:  # the user continued it
        f.write(b'{"type":"custom","by":"me"}\n')
    mine = placed.read_bytes()
    result = await fetch(world, liar.add(mine + b'{"type":"x"}\n'))  # even one that extends it
    assert result.conflict and "own file" in result.conflict and placed.read_bytes() == mine


# --- 4. what the user unshared stays unshared ---------------------------------------------------


async def test_a_fetched_child_does_not_reoffer_an_unshared_parent(world, tmp_path: Path) -> None:  # noqa: F811
    """The victim shares U, then unshares it.  A peer that remembers U's hash offers a child
    whose parent is U; the victim fetches it.  U (sidecar, session, its own lines) is still
    404 like an unknown hash, and the fetched child is not offered on either."""
    lib, agent, corpus = world["lib"], world["agent"], world["corpus"]
    (agent / A1).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(corpus / A1, agent / A1)
    u = lib.share(str(agent / A1))
    lib.unshare(u.branch)
    header, rest = _header_and_rest(world)
    header["id"] = "01a1ff93-c41d"
    child = json.dumps(header).encode() + b"\n" + rest + b'{"type":"custom","child":true}\n'
    branch = world["liar"].add(child, parent=u.branch)
    result = await fetch(world, branch)
    assert result.fetched == [branch] and result.parent == u.branch
    own_lines = {b3(ln) for ln in split((corpus / A2).read_bytes())}
    u_line = next(b3(ln) for ln in split((corpus / A1).read_bytes()) if b3(ln) not in own_lines)
    client, tls = trusted_client(world, tmp_path)
    server = PeerServer(lib, world["me"], world["trust"])
    await server.start("127.0.0.1", 0)
    base = f"https://127.0.0.1:{server.port}"
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls)) as s:
            for h in (u.branch, u.src, u_line.hex(), branch, result.src, "0" * 64):
                async with s.get(base + wire.PATH_OBJECT.format(hash=h)) as r:
                    assert (r.status, await r.read()) == (404, NOT_FOUND_BODY), h
            async with s.post(base + wire.PATH_BATCH, data=u_line) as r:
                assert await r.read() == wire.encode_batch_end(0)
            async with s.get(base + wire.PATH_CATALOG) as r:
                offered = {b.branch for b in wire.decode_catalog(await r.read()).branches}
    finally:
        await server.close()
    assert offered == {lib.branches()[0].branch} and u.branch not in offered and branch not in offered
    assert not lib.branch(branch).offered and not lib.branch(u.branch).offered
