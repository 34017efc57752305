"""The fetcher's HTTPS client (peer/https.py) against a server of the test's own: real mutual
TLS on loopback with two real identities, then raw HTTP/1.1 bytes, so that each framing a peer
may send (kept-alive, chunked, cut, oversized, endless 1xx, silent) is shown as it is read, on
both event loops (conftest.py)."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from p2pnode.peer import https
from p2pnode.peer.identity import load_or_create_identity
from p2pnode.peer.tls import client_context, server_context
from p2pnode.peer.trust import TrustStore

Answer = Callable[[int, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
"""answer(request number on this connection, reader, writer), after the request's head was read."""


@dataclass
class Peer:
    session: https.Session
    connections: int = 0
    open_now: int = 0
    most_open: int = 0
    heads: list[bytes] = field(default_factory=list)


@pytest.fixture
async def serve(tmp_path: Path) -> AsyncIterator[Callable[[Answer], Awaitable[Peer]]]:
    ids = {n: load_or_create_identity(tmp_path / n) for n in ("server", "client")}
    trusts = {n: TrustStore(tmp_path / f"{n}-trust.json") for n in ids}
    trusts["server"].trust(ids["client"].node_id)
    trusts["client"].trust(ids["server"].node_id)
    servers: list[asyncio.AbstractServer] = []
    peers: list[Peer] = []

    async def start(answer: Answer) -> Peer:
        peer: Peer

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            peer.connections += 1
            peer.open_now += 1
            peer.most_open = max(peer.most_open, peer.open_now)
            try:
                for n in range(100):
                    head = await reader.readuntil(b"\r\n\r\n")
                    peer.heads.append(head)
                    if b"Content-Length: " in head:
                        await reader.readexactly(int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0]))
                    await answer(n, reader, writer)
                    await writer.drain()
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                peer.open_now -= 1
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0,
                                            ssl=server_context(ids["server"], trusts["server"]))
        servers.append(server)
        port = server.sockets[0].getsockname()[1]
        context = client_context(ids["client"], trusts["client"], ids["server"].fingerprint)
        peer = Peer(https.Session("127.0.0.1", port, context, https.Timeouts(connect=5, read=0.5)))
        peers.append(peer)
        return peer

    yield start
    for p in peers:
        await p.session.close()
    for s in servers:
        s.close()


async def get(peer: Peer, path: str = "/", data: bytes = b"") -> tuple[int, https.Headers, bytes]:
    async with peer.session.request("POST" if data else "GET", path, data) as r:
        return r.status, r.headers, b"".join([c async for c in r.chunks()])


def fixed(body: bytes, extra: bytes = b"") -> Answer:
    async def answer(n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body))
    return answer


async def test_requests_go_over_one_kept_alive_connection(serve) -> None:
    peer = await serve(fixed(b"x" * 100_000, b"X-P2P-Thing: yes\r\n"))
    for _ in range(5):
        status, headers, body = await get(peer, "/v1/catalog", b"hashes")
        assert (status, headers.get("x-p2p-THING"), body) == (200, "yes", b"x" * 100_000)
    assert peer.connections == 1
    assert peer.heads[0].startswith(b"POST /v1/catalog HTTP/1.1\r\n")
    assert b"Content-Length: 6\r\n" in peer.heads[0]


async def test_chunked_bodies_with_extensions_and_trailers(serve) -> None:
    async def answer(n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"5;name=value\r\nhello\r\n1\r\n \r\n5\r\nworld\r\n0\r\nTrailer: t\r\n\r\n")
    peer = await serve(answer)
    assert [(await get(peer))[2] for _ in range(3)] == [b"hello world"] * 3
    assert peer.connections == 1


@pytest.mark.parametrize("over", [0, 1])
async def test_the_trailer_section_is_bounded_in_all(serve, over: int) -> None:
    """Short trailer lines, each far under any per-line bound, were read for as long as the
    peer sent them: the section (its lines, CRLFs and the empty line) is at most MAX_TRAILERS
    bytes, exactly that is read, one more is a PayloadError and the connection is not kept."""
    fields = b"X-T: 12345678\r\n" * (https.MAX_TRAILERS // 15 - 1)  # 15 bytes each
    last = https.MAX_TRAILERS - len(fields) - len(b"X-T: \r\n\r\n") + over
    section = fields + b"X-T: " + b"y" * last + b"\r\n\r\n"
    assert len(section) == https.MAX_TRAILERS + over
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n"
    peer = await serve(raw(head + section, then_close=False))
    if over:
        bound = rf"trailer section \(at most {https.MAX_TRAILERS} bytes\)"
        with pytest.raises(https.PayloadError, match=bound):
            await get(peer)
        assert peer.session._idle == []
    else:
        assert (await get(peer))[2] == b"ok"


async def test_a_body_is_read_as_it_comes(serve) -> None:
    """The first bytes are there before the rest is sent (a batch is verified as it comes)."""
    more = asyncio.Event()

    async def answer(n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await writer.drain()
        await more.wait()
        writer.write(b"3\r\ndef\r\n0\r\n\r\n")
    peer = await serve(answer)
    async with peer.session.request("GET", "/") as r:
        assert await r.read_some() == b"abc"
        more.set()
        assert (await r.read_some(), await r.read_some()) == (b"def", b"")


def raw(data: bytes, then_close: bool = True) -> Answer:
    async def answer(n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(data)
        if then_close:
            await writer.drain()
            writer.close()
    return answer


@pytest.mark.parametrize(("answer", "error", "match"), [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", https.PayloadError, "cut with 5 of 10"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab", https.PayloadError, "cut"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", https.PayloadError, "bad chunk size"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-5\r\n", https.PayloadError, "bad chunk size"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXY", https.PayloadError, "CRLF"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1" * 2000 + b"\r\n", https.PayloadError,
     "too long"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n", https.ResponseError,
     "framing"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", https.ResponseError, "framing"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", https.ResponseError,
     "two different"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -3\r\n\r\n", https.ResponseError, "Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: \xb2\r\n\r\n", https.ResponseError, "Content-Length"),  # "²"
    (b"SSH-2.0-OpenSSH\r\n\r\n", https.ResponseError, "status line"),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", https.ResponseError, "malformed header"),
    (b"HTTP/1.1 200 OK\r\nX: " + b"y" * https.MAX_HEAD + b"\r\n\r\n", https.ResponseError, "head over"),
    (b"HTTP/1.1 102 Processing\r\n\r\n" * (https.MAX_INTERIM + 1), https.ResponseError, "interim"),
    (b"", https.Disconnected, "before answering"),
    (b"HTTP/1.1 200 OK\r\nContent-", https.Disconnected, "head was cut"),
])
async def test_a_broken_answer_is_a_client_error_and_its_connection_is_not_kept(
        serve, answer: bytes, error: type[Exception], match: str) -> None:
    peer = await serve(raw(answer))
    with pytest.raises(error, match=match):
        await get(peer)
    assert peer.session._idle == []


async def test_interim_answers_are_skipped(serve) -> None:
    interim = b"HTTP/1.1 102 Processing\r\n\r\n" * 3
    peer = await serve(raw(interim + b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", then_close=False))
    assert await get(peer) == (200, {"content-length": "2"}, b"ok")


async def test_a_body_to_the_close_and_connection_close(serve) -> None:
    peer = await serve(raw(b"HTTP/1.1 200 OK\r\n\r\nuntil the end"))
    assert (await get(peer))[2] == b"until the end"
    peer = await serve(fixed(b"ok", b"Connection: close\r\n"))
    assert [(await get(peer))[2] for _ in range(2)] == [b"ok", b"ok"]
    assert peer.connections == 2  # not reused: the peer said it closes


async def test_a_connection_the_peer_closed_while_idle_is_not_reused(serve) -> None:
    peer = await serve(raw(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"))  # closes after each answer
    for _ in range(3):
        assert (await get(peer))[2] == b"ok"
        await asyncio.sleep(0.1)  # the close reaches the client
    assert peer.connections == 3


@pytest.mark.parametrize("when", ["head", "body"])
async def test_a_silent_peer_times_out(serve, when: str) -> None:
    async def answer(n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if when == "body":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
            await writer.drain()
        await asyncio.sleep(30)
    peer = await serve(answer)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(https.ReadTimeout):
        await get(peer)
    assert 0.4 < loop.time() - t0 < 5
    assert isinstance(https.ReadTimeout(), TimeoutError)


async def test_at_most_CONNECTIONS_requests_at_once(serve) -> None:
    release = asyncio.Event()

    async def answer(n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.wait_for(release.wait(), 0.3)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    peer = await serve(answer)
    peer.session.timeouts = https.Timeouts(connect=5, read=5)

    async def release_soon() -> None:
        await asyncio.sleep(0.2)
        release.set()
    results = await asyncio.gather(*(get(peer) for _ in range(https.CONNECTIONS + 3)), release_soon())
    assert [r[2] for r in results[:-1]] == [b"ok"] * (https.CONNECTIONS + 3)
    assert peer.most_open == peer.connections == https.CONNECTIONS


async def test_the_pin_is_checked_and_a_cancelled_request_frees_its_connection(serve, tmp_path: Path) -> None:
    peer = await serve(fixed(b"ok"))
    stranger = load_or_create_identity(tmp_path / "stranger")
    trust = TrustStore(tmp_path / "client-trust.json")
    trust.trust(stranger.node_id)
    me = load_or_create_identity(tmp_path / "client")
    wrong = https.Session("127.0.0.1", peer.session.port, client_context(me, trust, stranger.fingerprint),
                          https.Timeouts(5, 5))
    with pytest.raises(https.CertificateError, match="expected"):
        async with wrong.request("GET", "/"):
            pass
    await wrong.close()
    tasks = [asyncio.ensure_future(get(peer)) for _ in range(https.CONNECTIONS * 2)]
    await asyncio.sleep(0)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert await get(peer) == (200, {"content-length": "2"}, b"ok")  # no slot was lost


async def test_an_answer_not_read_waits_in_the_kernel(serve) -> None:
    """Past BUFFERED bytes received and not read, the connection stops reading its socket: the
    rest stays in the kernel, so that a read that waits for it measures the link (pace.py), and
    the memory a connection holds is bounded."""
    peer = await serve(fixed(b"x" * (8 << 20)))
    async with peer.session.request("GET", "/") as r:
        await asyncio.sleep(0.5)  # the peer has sent all it could
        held = r._conn._size
        body = b"".join([c async for c in r.chunks()])
    assert 0 < held <= https.BUFFERED + (256 << 10)  # and at most one more read of the transport's
    assert body == b"x" * (8 << 20)



async def test_a_connection_in_use_when_its_session_closes_is_closed_after_its_answer(serve) -> None:
    peer = await serve(fixed(b"ok"))
    async with peer.session.request("GET", "/") as r:
        await peer.session.close()
        assert b"".join([c async for c in r.chunks()]) == b"ok"
        transport = r._conn.transport
    assert transport is not None and transport.is_closing() and peer.session._idle == []
