"""The store service over real sockets: every message, errors, limits, concurrency, crashes.

The server runs on a real engine in a temp dir; raw-socket tests speak the frame protocol by
hand to check what a non-Python client would see.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from store import (
    ParentConflict,
    PayloadTooLarge,
    Store,
    Turn,
    TurnInput,
    TurnNotInContext,
    UnknownBlob,
    UnknownContext,
    UnknownTurn,
)
from store.service import messages as m
from store.service.client import StoreClient, SyncStoreClient
from store.service.frames import (
    FLAG_REPLY,
    HEADER,
    BadRequest,
    ErrorCode,
    Frame,
    FrameTooLarge,
    MalformedFrame,
    ReplyTooLarge,
    ShuttingDown,
    encode_frame,
)
from store.service.limits import ServiceLimits
from store.service.server import StoreServer

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store.open(tmp_path / "store") as s:
        yield s


def make(store: Store, tmp_path: Path, **limits: Any) -> StoreServer:
    """A server on tmp_path/store.sock and an ephemeral loopback port; `async with` starts it."""
    return StoreServer(store, tmp_path / "store.sock", tcp=("127.0.0.1", 0), limits=ServiceLimits(**limits))


@pytest.fixture
async def server(store: Store, tmp_path: Path) -> AsyncIterator[StoreServer]:
    async with make(store, tmp_path) as srv:
        yield srv


@pytest.fixture
async def client(server: StoreServer) -> AsyncIterator[StoreClient]:
    assert server.socket_path is not None
    c = await StoreClient.connect(server.socket_path)
    yield c
    await c.close()


class Raw:
    """A hand-driven connection: frames out, frames in, nothing checked for us."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, server: StoreServer, hello: bool = True) -> Raw:
        assert server.socket_path is not None
        raw = cls(*await asyncio.open_unix_connection(server.socket_path))
        if hello:
            raw.send(m.MsgType.HELLO, 1, m.Hello().encode())
            assert (await raw.recv()).msg_type == m.MsgType.HELLO
        return raw

    def send(self, msg_type: int, req_id: int, payload: bytes, flags: int = 0) -> None:
        self.writer.write(encode_frame(msg_type, req_id, payload, flags))

    async def recv(self, timeout: float = 10.0) -> Frame:
        header = await asyncio.wait_for(self.reader.readexactly(HEADER.size), timeout)
        length, msg_type, flags, req_id = HEADER.unpack(header)
        payload = await asyncio.wait_for(self.reader.readexactly(length), timeout)
        assert flags == FLAG_REPLY
        return Frame(msg_type, flags, req_id, payload)

    async def recv_error(self, timeout: float = 10.0) -> tuple[int, m.ErrorReply]:
        frame = await self.recv(timeout)
        assert frame.msg_type == m.MsgType.ERROR
        return frame.req_id, m.ErrorReply.decode(frame.payload)

    async def closed_by_server(self, timeout: float = 10.0) -> bool:
        return await asyncio.wait_for(self.reader.read(1), timeout) == b""

    def close(self) -> None:
        self.writer.close()


# --- every message ------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["unix", "tcp"])
async def test_every_message_round_trips_and_matches_the_engine(
    store: Store, server: StoreServer, transport: str
) -> None:
    if transport == "unix":
        c = await StoreClient.connect(server.socket_path)
    else:
        assert server.tcp_address is not None
        c = await StoreClient.connect(tcp=server.tcp_address)
    async with c:
        assert c.server_info == ServiceLimits().hello(1)
        head = await c.create_context()
        ctx = head.context_id
        assert head == store.get_head(ctx) and head.head_turn_id == 0
        t1 = await c.append_turn(ctx, b"first", type_tag=7, codec=2, expected_parent=0)
        t2 = await c.append_turn(ctx, b"second", expected_parent=t1.turn_id)
        batch = await c.append_turns(ctx, [TurnInput(b"third", 1, 0), TurnInput(b"fourth" * 1000, 2, 6)])
        assert [t.depth for t in [t1, t2, *batch]] == [0, 1, 2, 3]
        assert (t1.type_tag, t1.codec) == (7, 2)
        assert await c.get_turn(t2.turn_id) == store.get_turn(t2.turn_id) == t2
        assert await c.get_head(ctx) == store.get_head(ctx)

        last = await c.get_last(ctx, 3)
        assert last.turns == store.get_last(ctx, 3) and last.payloads is None
        assert last.next_cursor == last.turns[0].turn_id and last.head_depth == 3
        full = await c.get_last(ctx, 10, payloads=True)
        assert full.payloads == [b"first", b"second", b"third", b"fourth" * 1000] and full.next_cursor == 0

        pages: list[Turn] = []
        cursor = last.next_cursor  # page back to the root, one turn at a time
        while cursor:
            page = await c.get_before(ctx, cursor, 1, payloads=True)
            ref = store.get_before(ctx, cursor, 1)
            assert (page.turns, page.next_cursor, page.head_depth) == (ref.turns, ref.next_cursor, 3)
            assert page.payloads == store.payloads(ref.turns)
            pages = page.turns + pages
            cursor = page.next_cursor
        assert pages == [t1]

        window = await c.range_by_depth(ctx, 1, 2, payloads=True)
        assert window.turns == store.range_by_depth(ctx, 1, 2) and window.payloads == [b"second", b"third"]
        chain = await c.chain(batch[1].turn_id)
        assert chain.turns == store.chain(batch[1].turn_id) and chain.head_depth == 3

        fork = await c.fork(t2.turn_id)
        assert fork == store.get_head(fork.context_id) and fork.head_turn_id == t2.turn_id
        based = await c.create_context(t1.turn_id)
        assert (based.head_turn_id, based.head_depth) == (t1.turn_id, 0)

        blob = os.urandom(5000)
        h = await c.put_blob(blob)
        assert store.get_blob(h) == blob
        assert await c.get_blob(h, verify=True) == blob

        p1 = await c.patch(t2.turn_id, b"second, fixed")
        p2 = await c.tombstone(t1.turn_id)
        assert p2.seq > p1.seq and store.patches()[-2:] == [p1, p2]
        assert await c.payload_of(t2.turn_id) == b"second, fixed"
        assert await c.payload_of(t1.turn_id) is None
        assert await c.payload_of(t1.turn_id, as_of_seq=p1.seq) == b"first"
        patched = await c.get_last(ctx, 10, patched=True)
        assert patched.payloads == [None, b"second, fixed", b"third", b"fourth" * 1000]
        assert (await c.get_last(ctx, 10, payloads=True)).payloads == full.payloads  # originals unchanged

        await c.delete_context(fork.context_id)
        with pytest.raises(UnknownContext):
            store.get_head(fork.context_id)


async def test_errors_are_the_engines_exceptions_and_the_connection_carries_on(
    store: Store, tmp_path: Path
) -> None:
    srv = make(store, tmp_path, max_payload=1000, max_turns=100)
    async with srv, await StoreClient.connect(srv.socket_path) as c:
        ctx = (await c.create_context()).context_id
        t = await c.append_turn(ctx, b"a")
        with pytest.raises(UnknownContext) as e1:
            await c.get_last(424242, 5)
        assert e1.value.context_id == 424242
        with pytest.raises(UnknownTurn) as e2:
            await c.fork(999999)
        assert e2.value.turn_id == 999999
        with pytest.raises(UnknownBlob) as e3:
            await c.get_blob(b"\x01" * 32)
        assert e3.value.blob_hash == b"\x01" * 32
        with pytest.raises(ParentConflict) as e4:
            await c.append_turn(ctx, b"b", expected_parent=0)
        assert (e4.value.context_id, e4.value.expected, e4.value.actual) == (ctx, 0, t.turn_id)
        with pytest.raises(PayloadTooLarge) as e5:
            await c.append_turn(ctx, b"x" * 1001)
        assert (e5.value.size, e5.value.limit) == (1001, 1000)
        with pytest.raises(PayloadTooLarge):
            await c.put_blob(b"x" * 1001)
        other = (await c.create_context()).context_id
        with pytest.raises(TurnNotInContext):
            await c.get_before(other, t.turn_id, 5)
        with pytest.raises(BadRequest, match="limit 101 exceeds max_turns 100"):
            await c.get_last(ctx, 101)
        assert [x.turn_id for x in (await c.get_last(ctx, 100)).turns] == [t.turn_id]
        assert store.get_head(ctx).head_turn_id == t.turn_id  # nothing was appended by the failures


async def test_sync_client(server: StoreServer) -> None:
    def work() -> list[bytes | None]:
        with SyncStoreClient(server.socket_path) as c:
            ctx = c.create_context().context_id
            t = c.append_turn(ctx, b"sync")
            with pytest.raises(UnknownTurn):
                c.get_turn(10**9)
            with pytest.raises(AttributeError):
                c.not_a_method  # noqa: B018
            return c.get_last(ctx, 5, payloads=True).payloads + [c.payload_of(t.turn_id)]

    assert await asyncio.to_thread(work) == [b"sync", b"sync"]


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        (lambda req_id: encode_frame(m.MsgType.GET_HEAD, req_id, b"\0" * 31, FLAG_REPLY), "expected 32"),
        (lambda req_id: encode_frame(m.MsgType.GET_TURN, req_id, b"\0" * 32, FLAG_REPLY), "to a GET_HEAD"),
        (lambda req_id: encode_frame(m.MsgType.GET_HEAD, req_id + 1, b"\0" * 32, FLAG_REPLY), "not pending"),
        (lambda req_id: encode_frame(m.MsgType.GET_HEAD, req_id, b"\0" * 32), "lacks the reply flag"),
        (lambda req_id: encode_frame(m.MsgType.ERROR, req_id, b"\1\0", FLAG_REPLY), "truncated"),
    ],
)
async def test_client_verifies_what_a_server_sends(tmp_path: Path, reply: Any, error: str) -> None:
    """A fake server answers HELLO, then sends one bad reply: the call fails, it does not hang."""

    async def fake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):
            length, msg_type, _flags, req_id = HEADER.unpack(await reader.readexactly(HEADER.size))
            await reader.readexactly(length)
            if msg_type == m.MsgType.HELLO:
                writer.write(encode_frame(msg_type, req_id, ServiceLimits().hello(1).encode(), FLAG_REPLY))
            else:
                writer.write(reply(req_id))
        await reader.read()
        writer.close()

    path = tmp_path / "fake.sock"
    fake_server = await asyncio.start_unix_server(fake, path)
    async with fake_server, await StoreClient.connect(path) as c:
        with pytest.raises(MalformedFrame, match=error):
            await asyncio.wait_for(c.get_head(1), 10)
        with pytest.raises(MalformedFrame):  # the connection is unusable afterwards, and says why
            await c.get_head(1)


# --- the socket ---------------------------------------------------------------------------


async def test_socket_is_0600_replaced_only_when_stale_and_removed_on_close(
    store: Store, tmp_path: Path
) -> None:
    path = tmp_path / "store.sock"
    srv = make(store, tmp_path)
    await srv.start()
    assert (os.stat(path).st_mode & 0o777) == 0o600
    second = StoreServer(store, path)
    with pytest.raises(FileExistsError, match="already listening"):
        await second.start()
    await second.close()  # leaves the first server's socket alone
    async with await StoreClient.connect(path) as c:
        assert (await c.create_context()).head_turn_id == 0
    await srv.close()
    assert not path.exists()

    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()  # the file stays, nobody accepts
    async with StoreServer(store, path) as srv2, await StoreClient.connect(path) as c:
        assert srv2.socket_path == path and (await c.create_context()).context_id > 0

    path.write_text("not a socket")
    with pytest.raises(FileExistsError, match="not a socket"):
        await StoreServer(store, path).start()
    assert path.read_text() == "not a socket"


@pytest.mark.parametrize(
    "bad", [{"max_frame": 0}, {"max_in_flight": 2**32}, {"idle_timeout": 5e6}, {"write_buffer": 0}]
)
def test_limits_are_checked(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="ServiceLimits"):
        ServiceLimits(**bad)  # type: ignore[arg-type]


def test_tcp_must_be_loopback(store: Store, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not loopback"):
        StoreServer(store, None, tcp=("0.0.0.0", 0))


@pytest.mark.parametrize(
    ("address", "complaint"),
    [("10.1.2.3:5000", "not loopback"), ("[2001:db8::1]:1", "not loopback"),
     ("localhost:1", "not an IP address"), ("127.0.0.1:http", "not HOST:PORT"),
     ("127.0.0.1", "not HOST:PORT"), ("127.0.0.1:70000", "not HOST:PORT")],
)  # fmt: skip
def test_python_m_store_serve_refuses_a_bad_tcp_address_with_one_line(
    tmp_path: Path, address: str, complaint: str
) -> None:
    """A usage error (exit 2, one line, no traceback), before the store is even created."""
    done = subprocess.run(
        [sys.executable, "-m", "store", "serve", str(tmp_path / "store"), "--tcp", address],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and complaint in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "store").exists()


# --- protocol violations and limits ----------------------------------------------------------


async def test_oversized_frame_gets_an_error_and_a_close_others_carry_on(
    store: Store, tmp_path: Path
) -> None:
    srv = make(store, tmp_path, max_frame=4096)
    async with srv, await StoreClient.connect(srv.socket_path) as bystander:
        ctx = (await bystander.create_context()).context_id
        raw = await Raw.open(srv)
        raw.writer.write(HEADER.pack(4097, m.MsgType.PUT_BLOB, 0, 77))  # the payload never comes
        req_id, err = await raw.recv_error()
        assert (req_id, err.code, err.arg0, err.arg1) == (77, ErrorCode.FRAME_TOO_LARGE, 4097, 4096)
        assert await raw.closed_by_server()
        with pytest.raises(FrameTooLarge):  # the client refuses before sending
            await bystander.put_blob(b"x" * 5000)
        assert (await bystander.append_turn(ctx, b"still here")).depth == 0


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        ([(m.MsgType.GET_HEAD, 5, b"\0" * 8, 0)], ErrorCode.BAD_SEQUENCE),  # no HELLO first
        ([(m.MsgType.HELLO, 5, m.Hello(2, 3).encode(), 0)], ErrorCode.UNSUPPORTED_VERSION),
        ([(m.MsgType.HELLO, 5, b"\1\0", 0)], ErrorCode.MALFORMED),  # short payload
    ],
)
async def test_bad_hello(server: StoreServer, frames: list, code: ErrorCode) -> None:
    raw = await Raw.open(server, hello=False)
    for f in frames:
        raw.send(*f)
    req_id, err = await raw.recv_error()
    assert (req_id, err.code) == (5, code)
    if code == ErrorCode.UNSUPPORTED_VERSION:
        assert (err.arg0, err.arg1) == (m.MIN_VERSION, m.MAX_VERSION)
    assert await raw.closed_by_server()


@pytest.mark.parametrize(
    ("msg_type", "payload", "flags", "code", "closes"),
    [
        (m.MsgType.GET_HEAD, b"\0" * 9, 0, ErrorCode.MALFORMED, False),
        (m.MsgType.GET_LAST, m.GetLast(1, 1, 8).encode(), 0, ErrorCode.MALFORMED, False),
        (m.MsgType.GET_HEAD, b"\0" * 8, FLAG_REPLY, ErrorCode.MALFORMED, False),
        (4242, b"", 0, ErrorCode.UNKNOWN_MESSAGE, False),
        (m.MsgType.GET_HEAD, b"\0" * 8, 0x8000, ErrorCode.MALFORMED, True),  # the framing is lost
        (m.MsgType.HELLO, m.Hello().encode(), 0, ErrorCode.BAD_SEQUENCE, True),
    ],
)
async def test_protocol_violations_close_only_their_connection(
    server: StoreServer, client: StoreClient, msg_type: int, payload: bytes, flags: int, code: ErrorCode,
    closes: bool,
) -> None:
    """A bad request whose frame is intact gets its ERROR and the connection carries on; one
    that loses the framing or the sequence ends that connection alone."""
    raw = await Raw.open(server)
    raw.send(msg_type, 9, payload, flags)
    req_id, err = await raw.recv_error()
    assert (req_id, err.code) == (9, code) and err.message
    if closes:
        assert await raw.closed_by_server()
    else:
        ctx = (await client.create_context()).context_id
        raw.send(m.MsgType.GET_HEAD, 10, m.GetHead(ctx).encode())
        reply = await raw.recv()
        assert (reply.req_id, m.decode_context_head(reply.payload).context_id) == (10, ctx)
        raw.close()
    assert (await client.create_context()).head_turn_id == 0


async def test_too_many_in_flight_is_refused_and_the_connection_stays(store: Store, tmp_path: Path) -> None:
    async with make(store, tmp_path, max_in_flight=2) as srv:
        ctx = store.create_context().context_id
        raw = await Raw.open(srv)
        append = m.AppendTurn(ctx, b"x").encode()
        raw.writer.write(b"".join(encode_frame(m.MsgType.APPEND_TURN, i, append) for i in range(10, 16)))
        replies = {}
        for _ in range(6):
            f = await raw.recv()
            replies[f.req_id] = f
        turns = [r for r in replies.values() if r.msg_type == m.MsgType.APPEND_TURN]
        refused = [m.ErrorReply.decode(r.payload) for r in replies.values() if r.msg_type == m.MsgType.ERROR]
        assert len(turns) == 2 and sorted(replies) == list(range(10, 16))
        assert [(e.code, e.arg0) for e in refused] == [(ErrorCode.TOO_MANY_IN_FLIGHT, 2)] * 4
        assert store.get_head(ctx).head_depth == 1  # exactly the two accepted appends
        raw.send(m.MsgType.GET_HEAD, 20, m.GetHead(ctx).encode())
        assert m.decode_context_head((await raw.recv()).payload).head_depth == 1
        raw.close()


async def test_idle_and_read_timeouts(store: Store, tmp_path: Path) -> None:
    async with make(store, tmp_path, idle_timeout=0.3, read_timeout=0.3) as srv:
        idle = await Raw.open(srv)
        slow = await Raw.open(srv)
        slow.writer.write(encode_frame(m.MsgType.GET_HEAD, 3, b"\0" * 8)[:10])  # half a header
        for raw, code in ((idle, ErrorCode.IDLE_TIMEOUT), (slow, ErrorCode.READ_TIMEOUT)):
            req_id, err = await raw.recv_error(timeout=5)
            assert (req_id, err.code) == (0, code)
            assert await raw.closed_by_server()
        assert not srv.connections


async def test_reply_too_large(store: Store, tmp_path: Path) -> None:
    async with (
        make(store, tmp_path, max_frame=20_000) as srv,
        await StoreClient.connect(srv.socket_path) as c,
    ):
        ctx = (await c.create_context()).context_id
        store.append_turns(ctx, [TurnInput(os.urandom(8000)) for _ in range(100)])
        with pytest.raises(ReplyTooLarge) as info:
            await c.get_last(ctx, 3, payloads=True)
        assert info.value.arg1 == 20_000 and info.value.arg0 > 20_000
        with pytest.raises(ReplyTooLarge) as info:
            await c.get_last(ctx, 100, patched=True)
        assert 20_000 < info.value.arg0 < 100 * 8000  # gave up before reading all 100 payloads
        assert len((await c.get_last(ctx, 2, payloads=True)).turns) == 2
        assert len((await c.get_last(ctx, 100)).turns) == 100  # metadata fits


async def test_slow_reader_gets_backpressure_not_unbounded_buffering(store: Store, tmp_path: Path) -> None:
    blob = os.urandom(100_000)
    h = store.put_blob(blob)
    async with make(store, tmp_path, write_buffer=64 * 1024) as srv:
        raw = await Raw.open(srv)
        n = 300  # 30 MB of replies asked for, none read yet
        raw.writer.write(
            b"".join(encode_frame(m.MsgType.GET_BLOB, i + 1, m.GetBlob(h).encode()) for i in range(n))
        )
        await asyncio.sleep(0.5)
        (conn,) = srv.connections
        assert conn.transport is not None
        assert conn.write_paused and conn.backlog  # stopped handling requests, holds the rest unanswered
        assert conn.transport.get_write_buffer_size() <= 64 * 1024 + len(blob) + 100
        got = set()
        for _ in range(n):
            f = await raw.recv()
            assert m.decode_blob(f.payload) == blob
            got.add(f.req_id)
        assert got == set(range(1, n + 1))
        raw.close()


# --- concurrency ----------------------------------------------------------------------------


async def test_concurrent_clients_match_the_engine_called_directly(
    store: Store, server: StoreServer, tmp_path: Path
) -> None:
    rng = random.Random(3)
    boiler = os.urandom(3000)  # shared bytes: dedup across contexts
    async with await StoreClient.connect(server.socket_path) as setup:
        shared = [(await setup.create_context()).context_id for _ in range(4)]
        private = [(await setup.create_context()).context_id for _ in range(16)]

    async def worker(i: int) -> list[tuple[int, bytes, int]]:
        acked = []
        async with await StoreClient.connect(server.socket_path) as c:

            async def one(ctx: int, j: int) -> None:
                payload = boiler if j % 5 == 0 else f"client {i} turn {j} ".encode() * rng.randint(1, 300)
                t = await c.append_turn(ctx, payload)
                acked.append((t.turn_id, payload, ctx))

            await asyncio.gather(*(one(ctx, j) for j in range(25) for ctx in (private[i], shared[i % 4])))
            batch = await c.append_turns(private[i], [TurnInput(b"batch %d %d" % (i, k)) for k in range(5)])
            acked += [(t.turn_id, b"batch %d %d" % (i, k), private[i]) for k, t in enumerate(batch)]
        return acked

    acked = sorted(x for part in await asyncio.gather(*(worker(i) for i in range(16))) for x in part)
    assert len(acked) == 16 * 55

    # Replay the acknowledged appends, in commit (turn id) order, on a fresh engine.
    with Store.open(tmp_path / "replay") as ref:
        for _ in shared + private:
            ref.create_context()
        for turn_id, payload, ctx in acked:
            assert ref.append_turn(ctx, payload).turn_id == turn_id
        async with await StoreClient.connect(server.socket_path) as c:
            for ctx in shared + private:
                served = await c.get_last(ctx, 1000, payloads=True)
                expected = ref.get_last(ctx, 1000)
                strip = [(t.turn_id, t.parent_turn_id, t.depth, t.payload_hash) for t in served.turns]
                assert strip == [(t.turn_id, t.parent_turn_id, t.depth, t.payload_hash) for t in expected]
                assert served.payloads == ref.payloads(expected)
    assert len(shared) * 100 + len(private) * 30 == len(acked)


# --- shutdown and crashes ---------------------------------------------------------------------


async def test_close_answers_what_is_in_flight(store: Store, tmp_path: Path) -> None:
    srv = make(store, tmp_path)
    await srv.start()
    c = await StoreClient.connect(srv.socket_path)
    ctx = (await c.create_context()).context_id
    tasks = [asyncio.ensure_future(c.append_turn(ctx, b"%d" % i)) for i in range(100)]
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)  # some are done, more are running
    await srv.close()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    done = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, ShuttingDown)]
    assert done and len(done) + len(refused) == len(results)
    assert store.get_head(ctx).head_depth == len(done) - 1  # every append answered is in, no other
    await c.close()


def test_python_m_store_serve_and_sigkill_loses_no_acknowledged_append(tmp_path: Path) -> None:
    path = tmp_path / "store"
    proc = subprocess.Popen(
        [sys.executable, "-m", "store", "serve", str(path), "--tcp", "127.0.0.1:0"],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith(f"listening unix={path}.sock tcp=127.0.0.1:")
        assert (os.stat(f"{path}.sock").st_mode & 0o777) == 0o600
        host, port = line.split("tcp=")[1].strip().split(":")
        with SyncStoreClient(tcp=(host, int(port))) as c:
            ctx = c.create_context().context_id
            assert c.get_head(ctx).head_turn_id == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert not Path(f"{path}.sock").exists()
    finally:
        proc.kill()
        proc.wait()

    # Now kill -9 mid-stream: whatever the client saw acknowledged must be on disk.
    proc = subprocess.Popen(
        [sys.executable, "-m", "store", "serve", str(path)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    acked: list[tuple[int, bytes]] = []
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith("listening")
        stop = threading.Event()

        async def append_until_killed() -> None:
            async with await StoreClient.connect(f"{path}.sock") as c:
                while not stop.is_set():
                    reqs = [os.urandom(100 + i) for i in range(8)]
                    calls = (c.append_turns(ctx, [TurnInput(p)]) for p in reqs)
                    turns = await asyncio.gather(*calls, return_exceptions=True)
                    acked.extend(
                        (t[0].turn_id, p) for t, p in zip(turns, reqs, strict=True) if isinstance(t, list)
                    )
                    if any(isinstance(t, BaseException) for t in turns):
                        return

        def run() -> None:
            with contextlib.suppress(Exception):  # the kill ends the connection any way it likes
                asyncio.run(append_until_killed())

        worker = threading.Thread(target=run)
        worker.start()
        for _ in range(3000):
            if len(acked) >= 200 or not worker.is_alive():
                break
            threading.Event().wait(0.01)
        assert len(acked) >= 200
        proc.kill()
        stop.set()
        worker.join(20)
    finally:
        proc.kill()
        proc.wait()
    with Store.open(path) as s:
        on_chain = {t.turn_id for t in s.get_last(ctx, 10**6)}
        for turn_id, payload in acked:
            assert turn_id in on_chain
            assert s.payloads([s.get_turn(turn_id)]) == [payload]


# --- what PROTOCOL.md's vectors show, from the live server ---------------------------------


async def test_patch_replies_carry_the_flags_of_their_vectors(client: StoreClient) -> None:
    """PATCH answers flags 1 (replace), TOMBSTONE flags 2 and the zero hash (PROTOCOL.md)."""
    ctx = (await client.create_context()).context_id
    turn = await client.append_turn(ctx, b"typo")
    patched = await client.patch(turn.turn_id, b"fixed")
    assert (patched.target_turn_id, patched.flags) == (turn.turn_id, 1)
    gone = await client.tombstone(turn.turn_id)
    assert (gone.flags, gone.new_payload_hash, gone.seq) == (2, bytes(32), patched.seq + 1)


async def test_range_by_depth_gives_the_cursor_to_older_turns(client: StoreClient) -> None:
    """next_cursor is the oldest turn returned unless it is the root; GET_BEFORE takes it."""
    ctx = (await client.create_context()).context_id
    turns = [await client.append_turn(ctx, b"turn %d" % i) for i in range(6)]
    page = await client.range_by_depth(ctx, 3, 2)
    assert [t.depth for t in page.turns] == [3, 4] and page.head_depth == 5
    assert page.next_cursor == turns[3].turn_id
    older = await client.get_before(ctx, page.next_cursor, 10)
    assert older.turns == turns[:3] and older.next_cursor == 0
    assert (await client.range_by_depth(ctx, 0, 2)).next_cursor == 0  # the root: nothing older
    assert (await client.range_by_depth(ctx, 9, 2)).next_cursor == 0  # beyond the head: nothing
    last = await client.get_last(ctx, 2)
    assert last.next_cursor == turns[4].turn_id  # the same rule as GET_LAST
