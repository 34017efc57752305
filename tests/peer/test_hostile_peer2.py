"""Hostile peers, round two (issue 13): each test mounts the attack for real, with a server or
client of its own speaking the protocol over real mutual TLS on loopback, against the real
fetcher, library, store and peer server, and asserts a clear error with the README's exit
code, bounded time, and nothing stored, overwritten or leaked.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import shutil
import time
from pathlib import Path

import aiohttp
import blake3
import pytest
from aiohttp import web
from test_hostile_peer import A1, A2, LyingPeer, b3, fetch, refused, snapshot, split, trusted_client, world  # noqa: F401

from p2pnode.errors import Conflict, PeerUnavailable, VerificationFailed
from p2pnode.library.api import Library
from p2pnode.node.daemon import CONTROL_MAX_BODY, FETCH_LIMITS, Node, NodeConfig
from p2pnode.paths import NodePaths
from p2pnode.peer import provider, wire
from p2pnode.peer.address import PeerAddress
from p2pnode.peer.get import OpenPerUse, fetch_branch
from p2pnode.peer.identity import load_or_create_identity
from p2pnode.peer.provider import NOT_FOUND_BODY, PeerServer
from p2pnode.peer.tls import server_context
from p2pnode.peer.trust import TrustStore
from p2pnode.pi.session import HostileHeader, InvalidHeader


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


async def test_deeply_nested_body_line_is_kept_verbatim(world) -> None:  # noqa: F811
    """A user message nested 5,000 deep (Pi's JSON.parse takes it; a share keeps it verbatim):
    fetched byte for byte, the title search taking it for no JSON, nothing parsing it."""
    header, rest = _header_and_rest(world)
    line = b'{"type":"message","message":{"role":"user","content":' + b"[" * 5000 + b"]" * 5000 + b"}}\n"
    data = json.dumps(header).encode() + b"\n" + line + rest
    result = await fetch(world, world["liar"].add(data))
    assert result.written and Path(result.path or "").read_bytes() == data


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
    from p2pnode.cli import main as cli
    from p2pnode.cli import render

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
    assert render.shown("a\u009bb\nc") == "a\\x9bb\\nc"


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
    assert wire.parse_range("bytes=-5", 100) == wire.parse_range("Bytes=-5", 100) == (95, 100)
    for bad in ("bytes=-0", "bytes=\u0661-", "bytes=1-\u0662", "lines=0-5", "bytes=0-1,3-4"):
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


# --- 5. time limits a slow peer cannot dodge ----------------------------------------------------

QUICK = wire.Limits(progress_timeout=1.0)
"""The stall bound made short for the tests (the default is 5 s); the mechanism is the same."""
BOUND = 20.0
"""Far above what a dropped peer costs here (a few progress windows), far below 'hangs'."""


async def raw_tls_peer(w, respond) -> tuple[asyncio.AbstractServer, PeerAddress]:
    """A server of the test's own: real mutual TLS with the liar's key, then raw bytes, so that
    it can answer in ways an HTTP framework would not (trickles, endless 1xx)."""
    liar = w["liar"]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            await respond(writer)
        except (OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0,
                                        ssl=server_context(liar.identity, liar.trust))
    return server, PeerAddress(liar.identity.node_id, "127.0.0.1", server.sockets[0].getsockname()[1])


async def trickle(writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    for _ in range(600):  # 1 byte a second: each one resets a per-read timeout
        writer.write(b"1\r\nx\r\n")
        await writer.drain()
        await asyncio.sleep(1.0)


async def processing(writer: asyncio.StreamWriter) -> None:
    for _ in range(1200):  # `102 Processing` every half second, never an answer
        writer.write(b"HTTP/1.1 102 Processing\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.5)


async def silent(writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(600)


@pytest.mark.parametrize("respond", [trickle, processing, silent])
async def test_a_slow_peer_is_dropped_within_the_bound(world, tmp_path: Path, respond) -> None:  # noqa: F811
    """Alone, the slow peer fails the fetch within the bound (exit 6, nothing stored); listed
    first before an honest peer, it is dropped and the honest one delivers."""
    data = (world["corpus"] / A1).read_bytes()
    branch = world["liar"].add(data)
    server, slow = await raw_tls_peer(world, respond)
    honest = honest_peer(world, tmp_path)
    honest.add(data)
    try:
        before = snapshot(world)
        t0 = time.monotonic()
        with pytest.raises(PeerUnavailable, match="no progress for 1 s"):
            await fetch_branch(world["lib"], branch, [slow], world["me"], world["trust"],
                               agent_dir=world["agent"], limits=QUICK)
        assert time.monotonic() - t0 < BOUND and snapshot(world) == before
        assert PeerUnavailable.exit_code == 6
        t0 = time.monotonic()
        result = await fetch_branch(world["lib"], branch, [slow, await honest.start()], world["me"],
                                    world["trust"], agent_dir=world["agent"], limits=QUICK)
        assert time.monotonic() - t0 < BOUND
        assert Path(result.path or "").read_bytes() == data
        assert "no progress" in result.dropped_peers[str(slow)]
    finally:
        server.close()
        await honest.close()


async def test_a_hung_one_shot_fetch_does_not_hold_the_store(world, tmp_path: Path) -> None:  # noqa: F811
    """A one-shot fetch (OpenPerUse, as `p2pnode fetch` without a node) waiting on a silent
    peer: meanwhile another command opens the same store, reads and shares."""
    data = (world["corpus"] / A1).read_bytes()
    branch = world["liar"].add(data)
    server, slow = await raw_tls_peer(world, silent)
    paths = NodePaths(tmp_path / "oneshot")
    Library.open(paths, world["agent"]).close()
    fetching = asyncio.ensure_future(fetch_branch(
        OpenPerUse(paths, world["agent"]), branch, [slow], world["me"], world["trust"],
        agent_dir=world["agent"], limits=wire.Limits(progress_timeout=4.0)))
    try:
        await asyncio.sleep(1.0)  # the fetch is now waiting on the peer
        assert not fetching.done()
        with Library.open(paths, world["agent"]) as other:  # StoreLocked if the fetch held it
            assert other.share(str(world["agent"] / A2)).branch
        with pytest.raises(PeerUnavailable, match="no progress"):
            await fetching
    finally:
        fetching.cancel()
        server.close()


class Ended(bytes):
    """What the server sent before the connection ended; `reset`: it ended with a TCP reset
    (an abort), not a FIN."""

    reset = False


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> Ended:
    """Everything the server sends until it closes or aborts the connection (fails if it
    does neither)."""
    got, reset = b"", False
    async with asyncio.timeout(seconds):
        try:
            while chunk := await reader.read(65536):
                got += chunk
        except ConnectionResetError:
            reset = True
    ended = Ended(got)
    ended.reset = reset
    return ended


@pytest.mark.parametrize("attack, answer", [("huge content-length", b"HTTP/1.1 413"),
                                            ("huge chunked body", b"HTTP/1.1 413"),
                                            ("broken chunks", b"HTTP/1.0 400"),  # aiohttp's parser
                                            ("gzip body", b"HTTP/1.1 400"),
                                            ("slow body", b"HTTP/1.1 408"),
                                            ("slowloris", b""), ("silent", b"")])
async def test_server_cuts_slow_requests(world, tmp_path: Path, attack: str, answer: bytes) -> None:  # noqa: F811
    """A trusted client of the test's own (raw bytes over real mTLS): a batch declaring 100 MB
    (413 at once), one declaring 1000 bytes and sending 10 (408 at the request deadline),
    headers trickled one line every 0.3 s, or nothing at all after the handshake (closed at
    the deadline): the server answers as PROTOCOL.md says and closes the connection without
    waiting for the rest of the body, and an honest request on another connection is
    answered meanwhile."""
    lib = world["lib"]
    client, tls = trusted_client(world, tmp_path)
    server = PeerServer(lib, world["me"], world["trust"], wire.Limits(request_timeout=1.5))
    await server.start("127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port, ssl=tls)
    trickling: asyncio.Task[None] | None = None
    try:
        if attack in ("huge content-length", "slow body"):
            declared = 100_000_000 if attack == "huge content-length" else 1000
            writer.write(f"POST /v1/batch HTTP/1.1\r\nHost: p\r\nContent-Length: {declared}\r\n\r\n".encode()
                         + b"\0" * 10)
        elif attack == "huge chunked body":  # 4097 hashes, one over the limit, then a catalog asked
            body = b"\0" * (32 * 4097)
            writer.write(b"POST /v1/batch HTTP/1.1\r\nHost: p\r\nTransfer-Encoding: chunked\r\n\r\n"
                         + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
                         + f"GET {wire.PATH_CATALOG} HTTP/1.1\r\nHost: p\r\n\r\n".encode())
        elif attack == "broken chunks":
            writer.write(b"POST /v1/batch HTTP/1.1\r\nHost: p\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"20\r\n" + b"\0" * 32 + b"XX\r\n0\r\n\r\n")
        elif attack == "gzip body":  # not gzip at all; the protocol has no encoded bodies either way
            writer.write(b"POST /v1/batch HTTP/1.1\r\nHost: p\r\nContent-Encoding: gzip\r\n"
                         b"Content-Length: 32\r\n\r\n" + b"\0" * 32)
        elif attack == "slowloris":
            async def trickle_headers() -> None:
                writer.write(b"GET /v1/catalog HTTP/1.1\r\n")
                for i in range(1000):
                    writer.write(f"X-{i}: y\r\n".encode())
                    await asyncio.sleep(0.3)

            trickling = asyncio.ensure_future(trickle_headers())
        t0 = time.monotonic()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls)) as s, \
                s.get(f"https://127.0.0.1:{server.port}{wire.PATH_CATALOG}") as r:
            assert r.status == 200 and wire.decode_catalog(await r.read()).branches
        got = await _closed_within(reader, BOUND)
        took = time.monotonic() - t0
        assert got.startswith(answer) and (answer or not got)
        assert got.count(b"HTTP/1.1 ") <= 1  # closed after the answer: nothing pipelined behind it served
        assert got.reset or answer  # a deadline with nothing to answer aborts: a reset, not a FIN
        deadline = 1.5 if attack in ("slow body", "slowloris", "silent") else 0.0  # request_timeout
        assert took < deadline + provider.LINGER_SECONDS + 1.0  # the body's rest not waited for
    finally:
        if trickling is not None:
            trickling.cancel()
        writer.close()
        await server.close()


# --- 6. bounded memory and descriptors on the serving side ----------------------------------------

FLOOD_RSS_BOUND = 32 << 20
"""What the flood below may add to the serving process: were the 5,000 answers queued, they
alone would take 5,000 x the line's size (about 45 MB for a 9 KB line)."""


def rss() -> int:
    """This process's resident set now (Linux /proc), else its peak (getrusage, macOS bytes)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


async def test_floods_keep_memory_bounded_and_a_trusted_fetch_completes(world, tmp_path: Path) -> None:  # noqa: F811
    """From 127.0.0.2: 200 plain TCP connections that never start TLS, and from 127.0.0.1 one
    trusted TLS connection that pipelines 5,000 GETs of a 9 KB line and never reads.  The
    node's RSS grows by less than FLOOD_RSS_BOUND, all but `max_handshakes_per_source` of the
    half-open connections are closed at once and the rest at the handshake deadline, and a
    trusted peer's fetch (from 127.0.0.1) completes meanwhile."""
    lib, agent = world["lib"], world["agent"]
    big = b'{"type":"custom","data":"' + b"z" * 9000 + b'"}\n'
    path = agent / "sessions" / "--f--" / "2026-11-21T20-00-00-000Z_flood.jsonl"
    path.parent.mkdir(parents=True)
    header = {"type": "session", "version": 3, "id": "flood", "timestamp": "2026-11-21T20:00Z", "cwd": "/f"}
    path.write_bytes(json.dumps(header).encode() + b"\n" + big)
    shared = lib.share(str(path))
    client, tls = trusted_client(world, tmp_path)
    limits = wire.Limits(tls_handshake_timeout=2.0)
    server = PeerServer(lib, world["me"], world["trust"], limits)
    await server.start("127.0.0.1", 0)
    before = rss()
    plain = [await asyncio.open_connection("127.0.0.1", server.port, local_addr=("127.0.0.2", 0))
             for _ in range(200)]
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port, ssl=tls)
    try:
        request = f"GET {wire.PATH_OBJECT.format(hash=b3(big).hex())} HTTP/1.1\r\nHost: p\r\n\r\n".encode()
        for _ in range(50):
            writer.write(request * 100)
            await asyncio.sleep(0.01)
        await asyncio.sleep(1.0)  # the server has answered what the socket buffers take
        with Library.open(NodePaths(tmp_path / "fetcher"), tmp_path / "fetcher-agent") as other:
            result = await fetch_branch(other, shared.branch,
                                        [PeerAddress(world["me"].node_id, "127.0.0.1", server.port)],
                                        client, TrustStore(tmp_path / "client-trust.json"),
                                        agent_dir=tmp_path / "fetcher-agent")
            assert Path(result.path or "").read_bytes() == path.read_bytes()
        grown = rss() - before
        assert grown < FLOOD_RSS_BOUND, f"RSS grew by {grown >> 20} MiB"
        t0 = time.monotonic()
        for r, _ in plain:  # closed by the server: at once, or at its TLS handshake deadline
            async with asyncio.timeout(BOUND):
                with contextlib.suppress(ConnectionResetError):
                    assert await r.read() == b""
        assert time.monotonic() - t0 < BOUND
    finally:
        writer.transport.abort()
        for _, w in plain:
            w.close()
        await server.close()


# --- 7. privacy on a shared machine ---------------------------------------------------------------


def _loose_home(tmp_path: Path) -> NodePaths:
    """A node home as a 0755 umask would leave it: dir 0755, files 0644."""
    home = tmp_path / "loose"
    home.mkdir(mode=0o755)
    home.chmod(0o755)
    (home / "manifest.json").write_text("{}")
    (home / "manifest.json").chmod(0o644)
    (home / "store").mkdir()
    (home / "store").chmod(0o755)
    return NodePaths(home)


def test_status_tightens_a_loose_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    from p2pnode.cli import main as cli

    paths = _loose_home(tmp_path)
    assert len(paths.privacy_problems()) == 3
    monkeypatch.setenv("PI_CODING_AGENT_DIR", str(tmp_path / "agent"))
    assert cli.main(["--home", str(paths.home), "status"]) == 0
    assert "warning" not in capsys.readouterr().err
    for path in (paths.home, paths.home / "store", paths.home / "store" / "store.lock"):
        if path.exists():
            assert path.stat().st_mode & 0o077 == 0, path
    assert (paths.home / "manifest.json").stat().st_mode & 0o777 == 0o600
    assert paths.privacy_problems() == []


def test_status_warns_when_it_cannot_tighten(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A home entry owned by another user cannot be chmodded; an ordinary user cannot create
    one, so chmod is made to fail as it would then (the only stand-in here)."""
    from p2pnode.cli import main as cli

    paths = _loose_home(tmp_path)

    def refused(path: object, mode: int) -> None:
        raise PermissionError(1, "Operation not permitted", str(path))

    monkeypatch.setattr("p2pnode.paths.os.chmod", refused)
    monkeypatch.setenv("PI_CODING_AGENT_DIR", str(tmp_path / "agent"))
    assert cli.main(["--home", str(paths.home), "status"]) == 0
    err = capsys.readouterr().err
    assert f"{paths.home / 'manifest.json'} is mode 0644: other local users can read it" in err
    assert f"{paths.home} is mode 0755: other local users can enter it" in err


async def test_a_node_fetch_stops_when_its_caller_goes(world, tmp_path: Path) -> None:  # noqa: F811
    """`p2pnode fetch` through the node, from a silent peer: when the caller disconnects
    (Ctrl-C), the node's fetch is cancelled at once instead of running to its bound."""
    agent = tmp_path / "node-agent"
    agent.mkdir()
    paths = NodePaths(tmp_path / "node-home")
    node = Node(paths, NodeConfig(host="127.0.0.1", port=0, mdns=False, agent_dir=agent))
    await node.start()
    liar = world["liar"]
    node.trust.trust(liar.identity.node_id)
    liar.trust.trust(node.identity.node_id)
    server, slow = await raw_tls_peer(world, silent)
    try:
        control = aiohttp.UnixConnector(path=str(paths.home / "control.sock"))
        async with aiohttp.ClientSession(connector=control) as s:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(1.0):
                    await s.post("http://node/v1/fetch", json={"branch": "a" * 64, "peers": [str(slow)]})
        assert [t["branch"] for t in node.transfers.listed()] == ["a" * 64]  # running: the peer is silent
        async with asyncio.timeout(FETCH_LIMITS.progress_timeout / 2):  # well before the stall bound
            while node.transfers.listed():
                await asyncio.sleep(0.05)
    finally:
        server.close()
        await node.close()


async def test_a_trusted_peer_gets_a_bounded_number_of_connections(world, tmp_path: Path) -> None:  # noqa: F811
    """Twenty TLS connections of one trusted peer: the first `max_connections_per_peer` are
    served, the rest closed after the handshake; closing some frees their places."""
    client, tls = trusted_client(world, tmp_path)
    limits = wire.Limits(max_connections_per_peer=4)
    server = PeerServer(world["lib"], world["me"], world["trust"], limits)
    await server.start("127.0.0.1", 0)
    request = f"GET {wire.PATH_CATALOG} HTTP/1.1\r\nHost: p\r\n\r\n".encode()

    async def served(conn: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> bool:
        reader, writer = conn
        writer.write(request)
        with contextlib.suppress(ConnectionError):
            async with asyncio.timeout(BOUND):
                return (await reader.readline()).startswith(b"HTTP/1.1 200")
        return False

    conns = [await asyncio.open_connection("127.0.0.1", server.port, ssl=tls) for _ in range(20)]
    try:
        outcomes = [await served(c) for c in conns]
        assert outcomes == [True] * 4 + [False] * 16
        for _, writer in conns[:2]:
            writer.close()
        await asyncio.sleep(0.2)
        again = [await asyncio.open_connection("127.0.0.1", server.port, ssl=tls) for _ in range(2)]
        conns += again
        assert [await served(c) for c in again] == [True, True]
    finally:
        for _, writer in conns:
            writer.close()
        await server.close()


async def test_a_malformed_request_is_answered_400_and_logged_in_one_line(
        world, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    """aiohttp logs a request it cannot parse at ERROR with a traceback: a trusted peer could
    fill the node's log with them.  Here: 400, and one INFO line saying what was wrong."""
    client, tls = trusted_client(world, tmp_path)
    server = PeerServer(world["lib"], world["me"], world["trust"])
    await server.start("127.0.0.1", 0)
    try:
        with caplog.at_level(logging.INFO):
            for _ in range(3):
                reader, writer = await asyncio.open_connection("127.0.0.1", server.port, ssl=tls)
                writer.write(b"GET /v1/catalog HTTP/1.1\r\nHost: p\r\nContent-Length: -1\r\n\r\n")
                assert (await _closed_within(reader, BOUND)).split(b"\r\n")[0].endswith(b" 400 Bad Request")
                writer.close()
        http = [r for r in caplog.records if r.name == "p2pnode.peer.http"]
        assert len(http) == 3 and all(r.levelno == logging.INFO and not r.exc_info for r in http)
        assert "Content-Length" in http[0].getMessage() and "\n" not in http[0].getMessage()
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        await server.close()


async def test_a_long_poll_whose_peer_went_away_as_the_catalog_changed(world, monkeypatch) -> None:  # noqa: F811
    """A follower's `?wait=` request whose connection is gone when the change comes (it stopped
    following, or restarted): the answer is made for the peer known when it began to wait
    (the transport has no peer by then: an AssertionError and an ERROR in the node's log)."""
    from types import SimpleNamespace

    server = PeerServer(world["lib"], world["me"], world["trust"])
    peer = world["trust"].peers()[0] if world["trust"].peers() else None
    fingerprint = peer.fingerprint if peer is not None else bytes(32)
    answers = iter([fingerprint])  # when the wait begins; None after: the peer has gone
    monkeypatch.setattr(provider, "_fingerprint", lambda transport: next(answers, None))
    monkeypatch.setattr(provider, "_connected", lambda request: True)
    catalog = world["lib"].catalog(None)
    request = SimpleNamespace(query={"wait": str(catalog.generation)}, transport=object())
    server.limits = dataclasses.replace(server.limits, catalog_wait=0.3)  # asked again at its end
    answered = await asyncio.wait_for(server._wait_for_change(request, catalog), 10)  # type: ignore[arg-type]
    assert answered.generation == catalog.generation


def _non_canonical(h: str, src: str) -> list[str]:
    """Targets that name an offered object (or the catalog) in a form PROTOCOL.md does not give
    it: aiohttp routes the decoded path, so each was served as the plain one."""
    return [f"/v1/object/%{ord(h[0]):02x}{h[1:]}", f"/v1/object/%{ord(h[0]):02X}{h[1:]}",
            f"/v1%2Fobject/{h}", f"/v1//object/{h}", f"/v1/x/../object/{h}", f"/v1/./object/{h}",
            f"/v1/object/{h}/", f"/v1/object/{h}#part", f"https://p/v1/object/{h}", f"/v1/object/{h}?x=1",
            f"/v1/object/{h}?", "/v1/catalog?wait=%31", "/v1/catalog?wait=1&wait=2", "/v1/catalog?x=1",
            f"/v1/lines/{src}?after={src}&x=1", f"/v1/lines/{src}?after={src.upper()}", "/v1/batch?wait=1"]


async def test_a_non_canonical_request_target_is_400_and_the_connection_closed(world, tmp_path: Path) -> None:  # noqa: F811
    """A protocol client written from PROTOCOL.md alone found the server serving `%61bc…`, an
    encoded slash or a query it takes none of as the plain path.  Each target is answered 400
    naming the rule, and the connection closes after it (nothing pipelined behind is served),
    on a connection of its own; the canonical targets are served as before, and a hash in
    uppercase is the malformed hash it always was (404)."""
    client, tls = trusted_client(world, tmp_path)
    server = PeerServer(world["lib"], world["me"], world["trust"])
    await server.start("127.0.0.1", 0)
    shown = world["lib"].branches()[0]
    catalog = f"GET {wire.PATH_CATALOG} HTTP/1.1\r\nHost: p\r\n\r\n".encode()
    try:
        for target in _non_canonical(shown.branch, shown.src):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port, ssl=tls)
            method = "POST" if target.startswith(wire.PATH_BATCH) else "GET"
            head = f"{method} {target} HTTP/1.1\r\nHost: p\r\nContent-Length: 0\r\n\r\n"
            writer.write(head.encode() + catalog)
            got = await _closed_within(reader, BOUND)
            writer.close()
            assert got.startswith(b"HTTP/1.1 400 "), (target, got[:200])
            assert b"is not canonical" in got and got.count(b"HTTP/1.1 ") == 1, (target, got)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port, ssl=tls)
        for target, status in [(wire.PATH_OBJECT.format(hash=shown.branch), b"200"),
                               (wire.PATH_OBJECT.format(hash=shown.branch.upper()), b"404"),
                               (f"{wire.PATH_LINES.format(src=shown.src)}?after={shown.src}", b"200"),
                               (f"{wire.PATH_CATALOG}?wait=123", b"200"), ("/v1/nothing?x=%41", b"404")]:
            writer.write(f"GET {target} HTTP/1.1\r\nHost: p\r\n\r\n".encode())  # one kept-alive connection
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BOUND)
            assert head.startswith(b"HTTP/1.1 " + status), (target, head)
            length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
        writer.close()
    finally:
        await server.close()


def test_request_targets_sans_io() -> None:
    """wire.check_request_target, the rule the server applies (PROTOCOL.md "Request targets")."""
    h = "ab" * 32
    for target in _non_canonical(h, h):
        endpoint = next((e for e in (wire.PATH_OBJECT, wire.PATH_LINES, wire.PATH_BATCH, wire.PATH_CATALOG)
                         if target.startswith(e.split("{")[0].rstrip("/"))), None)
        with pytest.raises(wire.WireError, match="is not canonical"):
            wire.check_request_target(target, endpoint)
    for target, endpoint in [(f"/v1/object/{h}", wire.PATH_OBJECT),
                             (f"/v1/lines/{h}?after={h},{h}", wire.PATH_LINES),
                             ("/v1/catalog?wait=0", wire.PATH_CATALOG), ("/v1/catalog", wire.PATH_CATALOG),
                             ("/v1/nothing?x=1", None), (f"/v1/lines/{h}?after=", wire.PATH_LINES)]:
        wire.check_request_target(target, endpoint)


@pytest.mark.parametrize("trailers", [
    b"".join(b"X-T%d: %s\r\n" % (i, b"y" * 100) for i in range(40)),  # many small fields
    b"X-T: " + b"y" * 9000 + b"\r\n",  # one field over max_request_field
    b"".join(b"X-T%d: %s\r\n" % (i, b"y" * 2000) for i in range(2000)),  # 4 MB of fields under it
], ids=["many", "long", "endless"])
async def test_a_requests_trailers_are_bounded_in_all(world, tmp_path: Path, trailers: bytes) -> None:  # noqa: F811
    """A batch whose chunked body ends in trailers: each field under aiohttp's per-field bound,
    a peer could send 128 of them (1 MiB) with every request.  The head and the trailers are
    bounded together (max_request_fields, max_request_field): 400, the connection closed
    without the rest read, and nothing pipelined behind served."""
    client, tls = trusted_client(world, tmp_path)
    server = PeerServer(world["lib"], world["me"], world["trust"])
    await server.start("127.0.0.1", 0)
    line = b3(split((world["corpus"] / A2).read_bytes())[0])
    request = (b"POST /v1/batch HTTP/1.1\r\nHost: p\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"20\r\n" + line + b"\r\n0\r\n" + trailers + b"\r\n"
               + f"GET {wire.PATH_CATALOG} HTTP/1.1\r\nHost: p\r\n\r\n".encode())
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port, ssl=tls)
        writer.write(request)
        got = await _closed_within(reader, BOUND)
        writer.close()
        assert got.startswith(b"HTTP/1.0 400 ") and b"HTTP/1.1 200" not in got, got[:300]
        assert world["lib"].line(line)  # within the bounds, the same request is served:
        fine = request.replace(trailers, b"X-T: y\r\n")
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port, ssl=tls)
        writer.write(fine)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BOUND)
        assert head.startswith(b"HTTP/1.1 200 ")
        writer.close()
    finally:
        await server.close()
