"""The store service: an asyncio server speaking the frame protocol over a Unix socket.

A thin layer over the sans-IO codec (frames.py, messages.py).  Requests on one connection
are pipelined: each runs as soon as it arrives and its reply goes out when it is ready, so
replies may overtake each other.  Writes run in a thread pool, so that appends arriving on
many connections at once reach the engine together and share its group commit, except a
lone small append while the pool is idle, which runs on the event loop (see _run_writes);
reads are answered on the event loop, where a cache hit costs no thread hand-off.  Both ends read
straight into the frame decoder's buffer (asyncio.BufferedProtocol), and a reply of many
payloads is written in pieces, never joined into one big copy.

Limits (ServiceLimits) are announced in the HELLO reply.  Every request that is carried
out gets exactly one reply, whatever follows it on the stream: a request the server cannot
carry out but whose frame is intact gets an ERROR reply under its req_id and the connection
carries on; a violation that leaves no request to answer (lost framing, req_id 0 or one in
flight, a bad HELLO, a timeout) ends the connection, but only after every request received
before it has been answered (_Connection.end_after_answers).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import os
import signal
import socket
import stat
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from queue import SimpleQueue
from typing import Any, cast

from store.errors import (
    PayloadTooLarge,
    StoreError,
)
from store.service import messages as m
from store.service.errors import error_reply
from store.service.frames import (
    FLAG_REPLY,
    HEADER,
    BadRequest,
    BadSequence,
    Frame,
    FrameDecoder,
    IdleTimeout,
    MalformedFrame,
    ProtocolError,
    ReadTimeout,
    ReplyTooLarge,
    ServiceError,
    ShuttingDown,
    TooManyInFlight,
    UnsupportedVersion,
)
from store.types import Turn
from sysio import eventloop
from sysio.sockets import listener_at

log = logging.getLogger(__name__)

MiB = 1 << 20
LARGE = 64 * 1024
"""Replies this big are written without copying them behind their header."""
Reply = bytes | list[bytes]
"""A reply payload, whole or in pieces to be written one after another."""
PAYLOAD_BATCH = 32
"""Payloads read from the engine per call while building a reply."""
SEND_BUFFER = 2 * MiB
"""The kernel send buffer asked for each connection (Linux caps it at net.core.wmem_max)."""


@dataclass(frozen=True)
class ServiceLimits:
    """What one connection may cost the server; all but write_buffer are announced in HELLO."""

    max_payload: int = 256 * MiB
    """Largest turn payload or blob (the engine's own default limit)."""
    max_frame: int = 256 * MiB + 64 * 1024
    """Largest frame payload in either direction: one max_payload plus room for the headers."""
    max_in_flight: int = 128
    """Requests one connection may have unanswered; more get TOO_MANY_IN_FLIGHT."""
    max_turns: int = 65536
    """Largest `limit` of GET_LAST, GET_BEFORE and GET_RANGE_BY_DEPTH."""
    idle_timeout: float = 300.0
    """Seconds without a byte received and with nothing in flight before the server hangs up."""
    read_timeout: float = 30.0
    """Seconds a started frame may take to arrive completely."""
    write_buffer: int = 1 * MiB
    """Queued reply bytes above which the server stops reading from that connection."""
    drain_timeout: float = 30.0
    """Seconds a connection that is being ended waits for the replies of its requests still
    running before it closes without them (not announced)."""

    def __post_init__(self) -> None:
        announced = {
            "max_frame": self.max_frame, "max_payload": self.max_payload, "max_in_flight": self.max_in_flight,
            "max_turns": self.max_turns, "idle_timeout (ms)": self.idle_timeout * 1000,
            "read_timeout (ms)": self.read_timeout * 1000,
        }  # fmt: skip
        for name, value in announced.items():
            if not 0 < value <= 0xFFFF_FFFF:
                raise ValueError(
                    f"ServiceLimits.{name} = {value} is outside 1..{0xFFFF_FFFF} (a u32 in HELLO)"
                )
        for name, value in (("write_buffer", self.write_buffer), ("drain_timeout", self.drain_timeout)):
            if value <= 0:
                raise ValueError(f"ServiceLimits.{name} = {value} must be positive")

    def hello(self, version: int) -> m.HelloReply:
        return m.HelloReply(
            version, self.max_frame, self.max_payload, self.max_in_flight, self.max_turns,
            round(self.idle_timeout * 1000), round(self.read_timeout * 1000),
        )  # fmt: skip


# --- request handlers: engine call in, reply payload out ---------------------------------


def _older_than(turns: list[Turn]) -> int:
    """A TurnList's next_cursor: the oldest turn returned, which GET_BEFORE takes to page
    on to older turns; 0 when there are none (the root was reached, or nothing returned)."""
    return turns[0].turn_id if turns and turns[0].parent_turn_id else 0


class _Handlers:
    """One method per request type; each returns the reply payload or raises."""

    def __init__(self, store: Any, limits: ServiceLimits) -> None:
        self.store = store
        self.limits = limits

    def _payload_size(self, data: bytes) -> None:
        if len(data) > self.limits.max_payload:
            raise PayloadTooLarge(len(data), self.limits.max_payload)

    def _limit(self, limit: int) -> None:
        if limit > self.limits.max_turns:
            raise BadRequest(f"limit {limit} exceeds max_turns {self.limits.max_turns}", 0, limit)

    def _turn_list(self, turns: list[Turn], opts: int, next_cursor: int, head_depth: int) -> Reply:
        payloads = self._payloads(turns, bool(opts & m.READ_PATCHED)) if opts & m.READ_PAYLOADS else None
        return m.TurnList(turns, payloads, next_cursor, head_depth).encode_parts()

    def _payloads(self, turns: list[Turn], patched: bool) -> list[bytes | None]:
        """The turns' payloads, a few at a time, given up as soon as they cannot fit in a reply
        (so a GET_LAST of 65536 big turns does not load them all first)."""
        out: list[bytes | None] = []
        size = m.TURN_LIST.size + len(turns) * (m.TURN.size + m.U32.size)
        for i in range(0, len(turns), PAYLOAD_BATCH):
            batch = turns[i : i + PAYLOAD_BATCH]
            got = [self.store.payload_of(t) for t in batch] if patched else self.store.payloads(batch)
            size += sum(len(p) for p in got if p is not None)
            if size > self.limits.max_frame:
                raise ReplyTooLarge(
                    f"reply of at least {size} bytes exceeds max_frame {self.limits.max_frame}; "
                    "ask for fewer turns or without payloads",
                    0, size, self.limits.max_frame,
                )  # fmt: skip
            out += got
        return out

    def ctx_create(self, r: m.CtxCreate) -> bytes:
        return m.encode_context_head(self.store.create_context(r.base_turn_id))

    def ctx_fork(self, r: m.CtxFork) -> bytes:
        return m.encode_context_head(self.store.fork(r.turn_id))

    def get_head(self, r: m.GetHead) -> bytes:
        return m.encode_context_head(self.store.get_head(r.context_id))

    def ctx_delete(self, r: m.CtxDelete) -> bytes:
        self.store.delete_context(r.context_id)
        return b""

    def get_turn(self, r: m.GetTurn) -> bytes:
        return m.encode_turn(self.store.get_turn(r.turn_id))

    def append_turn(self, r: m.AppendTurn) -> bytes:
        self._payload_size(r.payload)
        expected = r.expected_parent if r.opts & m.EXPECT_PARENT else None
        turn = self.store.append_turn(r.context_id, r.payload, r.type_tag, r.codec, expected_parent=expected)
        return m.encode_turn(turn)

    def append_batch(self, r: m.AppendBatch) -> bytes:
        for t in r.turns:
            self._payload_size(t.payload)
        expected = r.expected_parent if r.opts & m.EXPECT_PARENT else None
        turns = self.store.append_turns(r.context_id, r.turns, expected_parent=expected)
        return m.TurnList(turns, None, 0, turns[-1].depth).encode()

    def get_last(self, r: m.GetLast) -> Reply:
        self._limit(r.limit)
        turns = self.store.get_last(r.context_id, r.limit)
        head_depth = turns[-1].depth if turns else self.store.get_head(r.context_id).head_depth
        return self._turn_list(turns, r.opts, _older_than(turns), head_depth)

    def get_before(self, r: m.GetBefore) -> Reply:
        self._limit(r.limit)
        head_depth = self.store.get_head(r.context_id).head_depth
        page = self.store.get_before(r.context_id, r.before_turn_id, r.limit)
        return self._turn_list(page.turns, r.opts, page.next_cursor, head_depth)

    def get_range_by_depth(self, r: m.GetRangeByDepth) -> Reply:
        self._limit(r.limit)
        head_depth = self.store.get_head(r.context_id).head_depth
        turns = self.store.range_by_depth(r.context_id, r.start_depth, r.limit)
        return self._turn_list(turns, r.opts, _older_than(turns), head_depth)

    def get_chain(self, r: m.GetChain) -> Reply:
        turns = self.store.chain(r.turn_id)
        return self._turn_list(turns, r.opts, 0, turns[-1].depth)

    def get_blob(self, r: m.GetBlob) -> bytes:
        data = self.store.get_blob(r.blob_hash, verify=bool(r.opts & m.VERIFY_HASH))
        return m.encode_maybe_payload(data)

    def put_blob(self, r: m.PutBlob) -> bytes:
        self._payload_size(r.data)
        return bytes(self.store.put_blob(r.data))

    def patch(self, r: m.PatchTurn) -> bytes:
        self._payload_size(r.payload)
        return m.encode_patch(self.store.patch(r.target_turn_id, r.payload))

    def tombstone(self, r: m.Tombstone) -> bytes:
        return m.encode_patch(self.store.tombstone(r.target_turn_id))

    def get_payload(self, r: m.GetPayload) -> bytes:
        as_of = r.as_of_seq if r.opts & m.AS_OF else None
        return m.encode_maybe_payload(self.store.payload_of(self.store.get_turn(r.turn_id), as_of_seq=as_of))

    def table(self) -> dict[type, tuple[Callable[[Any], Reply], bool]]:
        """Request type -> (handler, runs in the thread pool)."""
        return {
            m.CtxCreate: (self.ctx_create, True),
            m.CtxFork: (self.ctx_fork, True),
            m.CtxDelete: (self.ctx_delete, True),
            m.AppendTurn: (self.append_turn, True),
            m.AppendBatch: (self.append_batch, True),
            m.PutBlob: (self.put_blob, True),
            m.PatchTurn: (self.patch, True),
            m.Tombstone: (self.tombstone, True),
            m.GetHead: (self.get_head, False),
            m.GetTurn: (self.get_turn, False),
            m.GetLast: (self.get_last, False),
            m.GetBefore: (self.get_before, False),
            m.GetRangeByDepth: (self.get_range_by_depth, False),
            m.GetChain: (self.get_chain, False),
            m.GetBlob: (self.get_blob, False),
            m.GetPayload: (self.get_payload, False),
        }


# --- one connection -----------------------------------------------------------------------


class _Connection(asyncio.BufferedProtocol):
    def __init__(self, server: StoreServer) -> None:
        self.server = server
        self.limits = server.limits
        self.loop = asyncio.get_running_loop()
        self.decoder = FrameDecoder(self.limits.max_frame)
        self.transport: asyncio.Transport | None = None
        self.version = 0  # 0 until HELLO
        self.in_flight: set[int] = set()
        self.closing = False
        self.write_paused = False
        self.last_activity = self.loop.time()
        self.partial_since: float | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.drain_timer: asyncio.TimerHandle | None = None
        self.backlog: deque[Frame | ProtocolError] = deque()
        """Received and not yet handled, in stream order; a ProtocolError where the framing broke."""
        self.eof = False
        self.ending: tuple[ServiceError, int] | None = None
        """The ERROR (and its req_id) to send once every request received is answered, then close."""

    # transport callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self.transport.set_write_buffer_limits(high=self.limits.write_buffer)
        sock = transport.get_extra_info("socket")
        if sock is not None:  # a big reply leaves in one send instead of a ping-pong of wakeups
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        self.server.connections.add(self)
        self._arm_timer(min(self.limits.idle_timeout, self.limits.read_timeout))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        for timer in (self.timer, self.drain_timer):
            if timer is not None:
                timer.cancel()
        self.server.connections.discard(self)
        self.server.connection_gone.set()

    def pause_writing(self) -> None:
        """The client reads its replies slower than we produce them: stop reading requests."""
        self.write_paused = True
        if self.transport is not None and not self.closing:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        self.last_activity = self.loop.time()  # the client is reading
        self.run_backlog()
        reading = not (self.closing or self.write_paused or self.ending or self.decoder.error)
        if self.transport is not None and reading:
            self.transport.resume_reading()
            if self.partial_since is not None:
                self.partial_since = self.loop.time()

    def eof_received(self) -> bool:
        """The client sent all it will: answer what it asked, then close."""
        self.eof = True
        self.close_when_answered()
        return True  # keep the transport open for the replies

    def close_when_answered(self) -> None:
        """Once nothing received is unanswered: end with the pending ERROR, or close after EOF."""
        if self.closing or self.in_flight or self.backlog:
            return
        if self.ending is not None:
            exc, req_id = self.ending
            self.send_error(req_id, exc)
            self.close()
        elif self.eof:
            self.close()

    def get_buffer(self, sizehint: int) -> memoryview:
        try:
            return self.decoder.get_buffer()
        except ProtocolError:  # the stream broke and is being closed: drop what still comes
            return memoryview(bytearray(HEADER.size))

    def buffer_updated(self, nbytes: int) -> None:
        if self.closing or self.ending is not None or self.decoder.error is not None:
            return  # reading was paused; bytes still in the socket's last read are dropped
        now = self.last_activity = self.loop.time()
        frames = self.decoder.buffer_updated(nbytes)
        if frames or self.partial_since is None:
            self.partial_since = now if self.decoder.buffered else None
        self.backlog.extend(frames)
        if self.decoder.error is not None:  # the frames before the bad header come first
            self.backlog.append(self.decoder.error)
            self.partial_since = None
            if self.transport is not None:
                self.transport.pause_reading()
        self.run_backlog()

    def run_backlog(self) -> None:
        """Handle received frames until none are left or the reply buffer is full."""
        while self.backlog and not self.write_paused and not self.closing:
            item = self.backlog.popleft()
            if isinstance(item, ProtocolError):
                self.end_after_answers(item, item.req_id)
            else:
                self.on_frame(item)
        self.server.writes_ready(self)
        self.close_when_answered()

    # requests and replies

    def on_frame(self, frame: Frame) -> None:
        """Exactly one reply for the frame, or the end of the connection if it names no
        request that could be answered (req_id 0 or one in flight) or HELLO failed."""
        req_id = frame.req_id
        try:
            if not req_id:
                raise MalformedFrame("req_id 0 is reserved for the server's connection errors")
            if req_id in self.in_flight:
                raise MalformedFrame(f"req_id {req_id} is already in flight")
            if not self.version:
                self.hello(req_id, self.request(frame))
                return
        except ProtocolError as exc:
            self.end_after_answers(exc, req_id, drop_backlog=True)
            return
        try:
            req = self.request(frame)
            if isinstance(req, m.Hello):
                raise BadSequence("HELLO was already done on this connection")
        except BadSequence as exc:
            self.end_after_answers(exc, req_id, drop_backlog=True)
            return
        except ProtocolError as exc:  # the framing is intact: this request's reply is an ERROR
            self.send_error(req_id, exc)
            return
        if len(self.in_flight) >= self.limits.max_in_flight:
            limit = self.limits.max_in_flight
            self.send_error(req_id, TooManyInFlight(f"{limit} requests already in flight", 0, limit))
            return
        self.server.dispatch(self, req_id, req)

    @staticmethod
    def request(frame: Frame) -> m.Request:
        if frame.flags & FLAG_REPLY:
            raise MalformedFrame(f"request req_id={frame.req_id} has the reply flag set")
        return m.decode_request(frame.msg_type, frame.payload)

    def hello(self, req_id: int, req: m.Request) -> None:
        if not isinstance(req, m.Hello):
            raise BadSequence(f"the first request must be HELLO, not {req.MSG_TYPE.name}")
        version = req.negotiate()
        if version is None:
            raise UnsupportedVersion(
                f"client speaks versions {req.min_version}..{req.max_version}, "
                f"server speaks {m.MIN_VERSION}..{m.MAX_VERSION}",
                req_id, m.MIN_VERSION, m.MAX_VERSION,
            )  # fmt: skip
        self.version = version
        self.send(req_id, m.MsgType.HELLO, self.limits.hello(version).encode())

    def send(self, req_id: int, msg_type: int, reply: Reply) -> None:
        parts = [reply] if isinstance(reply, bytes) else reply
        size = sum(map(len, parts))
        if size > self.limits.max_frame:
            exc = ReplyTooLarge(
                f"reply of {size} bytes exceeds max_frame {self.limits.max_frame}; "
                "ask for fewer turns or without payloads",
                req_id, size, self.limits.max_frame,
            )  # fmt: skip
            self.send_error(req_id, exc)
            return
        if self.transport is not None and not self.transport.is_closing():
            header = HEADER.pack(size, msg_type, FLAG_REPLY, req_id)
            if size < LARGE:
                self.transport.write(b"".join([header, *parts]))
            else:  # no concatenated copy of a big reply (uvloop writes the pieces with one writev)
                self.transport.writelines([header, *parts])

    def send_error(self, req_id: int, exc: BaseException) -> None:
        self.send(req_id, m.MsgType.ERROR, error_reply(exc).encode())

    def end_after_answers(self, exc: ServiceError, req_id: int, drop_backlog: bool = False) -> None:
        """The connection broke the protocol or timed out: read nothing more, answer every
        request received before (waiting at most drain_timeout), then send exc as an ERROR
        and close.  The ERROR names req_id only if no other reply carries it, else 0.
        drop_backlog: the violation is a frame, and those after it are not requests."""
        if drop_backlog:
            self.backlog.clear()
        if self.ending is not None or self.closing:
            return
        log.info("ending store connection: %s", exc)
        self.ending = (exc, req_id if req_id and req_id not in self.in_flight else 0)
        self.partial_since = None
        if self.transport is not None:
            self.transport.pause_reading()
        self.drain_timer = self.loop.call_later(self.limits.drain_timeout, self._drain_expired)
        self.close_when_answered()

    def _drain_expired(self) -> None:
        if not self.closing:
            log.warning("store connection: %d replies still running after %s s; closing without them",
                        len(self.in_flight), self.limits.drain_timeout)
            self.in_flight.clear()
            self.backlog.clear()
            self.close_when_answered()

    def close(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.close()

    # timeouts

    def _arm_timer(self, delay: float) -> None:
        self.timer = self.loop.call_later(max(delay, 0.001), self._check_timeouts)

    def _check_timeouts(self) -> None:
        if self.closing or self.ending is not None:
            return
        now = self.loop.time()
        lim = self.limits
        started = self.partial_since
        if started is not None and not self.write_paused and now - started >= lim.read_timeout:
            self.end_after_answers(ReadTimeout(f"a frame took longer than {lim.read_timeout} s to arrive"), 0)
            return
        if not self.in_flight and now - self.last_activity >= lim.idle_timeout:
            self.end_after_answers(IdleTimeout(f"idle for {lim.idle_timeout} s"), 0)
            return
        deadline = self.last_activity + lim.idle_timeout if not self.in_flight else now + lim.idle_timeout
        if started is not None:
            deadline = min(deadline, started + lim.read_timeout)
        self._arm_timer(deadline - now)


# --- the write workers -------------------------------------------------------------------

Done = Callable[[Reply | None, BaseException | None], None]


class _Workers:
    """Threads that run blocking engine calls and hand each result back to the event loop.

    A bare SimpleQueue plus call_soon_threadsafe, not run_in_executor: its hand-off is the
    cheaper one, which counts next to a durable append (docs/BENCHMARKS.md).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, n: int) -> None:
        self.loop = loop
        self.queue: SimpleQueue[tuple[Callable[[Any], Reply], Any, Done] | None] = SimpleQueue()
        self.busy = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.threads = [
            threading.Thread(target=self._run, name=f"store-service-{i}", daemon=True) for i in range(n)
        ]
        for t in self.threads:
            t.start()

    def submit(self, fn: Callable[[Any], Reply], arg: Any, done: Done) -> None:
        self.busy += 1
        self.idle.clear()
        self.queue.put((fn, arg, done))

    def _run(self) -> None:
        while (job := self.queue.get()) is not None:
            fn, arg, done = job
            result, error = None, None
            try:
                result = fn(arg)
            except BaseException as exc:  # noqa: BLE001 - handed to the loop, which answers with it
                error = exc
            self.loop.call_soon_threadsafe(self._done, done, result, error)

    def _done(self, done: Done, result: Reply | None, error: BaseException | None) -> None:
        self.busy -= 1
        if not self.busy:
            self.idle.set()
        done(result, error)

    def stop(self) -> None:
        for _ in self.threads:
            self.queue.put(None)
        for t in self.threads:
            t.join()


# --- the server ---------------------------------------------------------------------------

INLINE_MAX = 64 << 10
"""The largest append run on the event loop (compressing it must not stall other clients)."""
QUIET = 0.002
"""Seconds without writes from other connections after which a connection counts as the
only writer (see StoreServer.writes_ready)."""


def _small_append(req: m.Request) -> bool:
    return isinstance(req, m.AppendTurn) and len(req.payload) <= INLINE_MAX


class StoreServer:
    """Serves a `Store` on a Unix socket (mode 0600) and optionally on TCP loopback.

    The caller opens and closes the store; `close()` lets requests in flight finish first.
    """

    def __init__(
        self,
        store: Any,
        socket_path: str | os.PathLike[str] | None,
        tcp: tuple[str, int] | None = None,
        limits: ServiceLimits | None = None,
        workers: int = 16,
    ) -> None:
        if socket_path is None and tcp is None:
            raise ValueError("StoreServer needs a socket path or a TCP address")
        if tcp is not None:
            _check_loopback(tcp[0])
        self.store = store
        self.socket_path = Path(socket_path) if socket_path is not None else None
        self.tcp = tcp
        self.limits = limits or ServiceLimits()
        self.connections: set[_Connection] = set()
        self.connection_gone = asyncio.Event()
        self._handlers = _Handlers(store, self.limits).table()
        self.workers = workers
        self._pool: _Workers | None = None
        self._writes: list[tuple[_Connection, int, m.Request]] = []
        """Writes decoded in this pass of the event loop, handed out by _run_writes."""
        self._gather: asyncio.Handle | None = None
        """The pass of the loop that will hand them out, when one is due."""
        self._last_writer: _Connection | None = None
        self._last_write = 0.0
        self._servers: list[asyncio.AbstractServer] = []
        self.tcp_address: tuple[str, int] | None = None
        self._bound_unix = False  # the socket file is ours to remove

    async def __aenter__(self) -> StoreServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._pool = _Workers(loop, self.workers)
        try:
            if self.socket_path is not None:
                sock = _bind_unix(self.socket_path)
                self._bound_unix = True
                self._servers.append(await loop.create_unix_server(lambda: _Connection(self), sock=sock))
            if self.tcp is not None:
                server = await loop.create_server(lambda: _Connection(self), self.tcp[0], self.tcp[1])
                self._servers.append(server)
                self.tcp_address = server.sockets[0].getsockname()[:2]
        except BaseException:
            await self.close()
            raise

    async def serve_forever(self) -> None:
        await asyncio.gather(*(s.serve_forever() for s in self._servers))

    def dispatch(self, conn: _Connection, req_id: int, req: m.Request) -> None:
        handler, in_pool = self._handlers[type(req)]
        if not in_pool:
            self._run_inline(conn, req_id, req, handler)
            return
        conn.in_flight.add(req_id)
        self._writes.append((conn, req_id, req))

    def writes_ready(self, conn: _Connection) -> None:
        """After conn's frames are handled: its writes run in the next pass of the event loop,
        so that writes other connections sent meanwhile join them in one group commit, unless
        conn alone has been writing lately (for QUIET seconds): then that pass would only add
        to the latency, and they run now."""
        if not self._writes or self._gather is not None:
            return  # nothing new, or a pass is already due
        loop = asyncio.get_running_loop()
        now = loop.time()
        alone = self._last_writer is conn or now - self._last_write > QUIET
        self._last_writer, self._last_write = conn, now
        if alone:
            self._run_writes()
        else:
            self._gather = loop.call_soon(self._run_writes)

    def _run_writes(self) -> None:
        """A lone small append with idle workers runs right here: a thread hand-off would cost
        more than the service's whole latency budget, and there is nobody to group-commit
        with.  Writes that arrive together go to the workers, whose syncs the engine groups."""
        writes, self._writes, self._gather = self._writes, [], None
        assert self._pool is not None
        if len(writes) == 1 and not self._pool.busy and _small_append(writes[0][2]):
            conn, req_id, req = writes[0]
            conn.in_flight.discard(req_id)
            self._run_inline(conn, req_id, req, self._handlers[type(req)][0])
            conn.close_when_answered()
            return
        for conn, req_id, req in writes:
            handler = self._handlers[type(req)][0]
            self._pool.submit(handler, req, functools.partial(self._finish, conn, req_id, req))

    def _run_inline(self, conn: _Connection, req_id: int, req: m.Request,
                    handler: Callable[[Any], Reply]) -> None:
        try:
            payload = handler(req)
        except Exception as exc:
            self._log_unexpected(exc, req)
            conn.send_error(req_id, exc)
        else:
            conn.send(req_id, req.MSG_TYPE, payload)

    def _finish(
        self,
        conn: _Connection,
        req_id: int,
        req: m.Request,
        result: Reply | None,
        error: BaseException | None,
    ) -> None:
        conn.in_flight.discard(req_id)
        if error is not None:
            self._log_unexpected(error, req)
            conn.send_error(req_id, error)
        elif result is not None:
            conn.send(req_id, req.MSG_TYPE, result)
        conn.close_when_answered()

    @staticmethod
    def _log_unexpected(exc: BaseException, req: m.Request) -> None:
        if not isinstance(exc, (StoreError, ValueError, TypeError)):
            log.error("store service: %s failed", req.MSG_TYPE.name, exc_info=exc)

    async def close(self, grace: float = 5.0) -> None:
        for s in self._servers:
            s.close()
        for conn in list(self.connections):
            conn.closing = True  # answer what is in flight, read nothing more
            if conn.transport is not None:
                conn.transport.pause_reading()
        if self._pool is not None:
            self._run_writes()  # writes decoded but not yet handed out are in flight too
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._pool.idle.wait(), grace)
        for conn in list(self.connections):
            conn.send_error(0, ShuttingDown("the store service is shutting down"))
            conn.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self.connections and loop.time() < deadline:
            self.connection_gone.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.connection_gone.wait(), deadline - loop.time())
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.abort()
        for s in self._servers:
            await s.wait_closed()
        self._servers.clear()
        if self._pool is not None:
            await asyncio.to_thread(self._pool.stop)  # waits for a job that outlived the grace time
            self._pool = None
        if self.socket_path is not None and self._bound_unix:
            self._bound_unix = False
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()


def _check_loopback(host: str) -> None:
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        raise ValueError(f"TCP address {host!r} is not an IP address (use 127.0.0.1 or ::1)") from None
    if not loopback:
        raise ValueError(f"TCP address {host} is not loopback; the service has no authentication")


def loopback_address(text: str) -> tuple[str, int]:
    """`HOST:PORT` (`[::1]:PORT` for IPv6) parsed and checked: a loopback IP and a port."""
    host, sep, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not port.isdigit() or int(port) > 0xFFFF:
        raise ValueError(f"{text!r} is not HOST:PORT with a port 0..65535")
    _check_loopback(host)
    return host, int(port)


def _bind_unix(path: Path) -> socket.socket:
    """A listening-ready Unix socket at path with mode 0600.

    chmod happens between bind and listen, so nobody can connect while the mode is wider.
    A stale socket file (nobody accepting) is replaced; a live one or a non-socket is not.
    """
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise FileExistsError(f"{path} exists and is not a socket")
        if listener_at(path):
            raise FileExistsError(f"{path}: a store service is already listening there")
        path.unlink(missing_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        os.chmod(path, 0o600)
    except BaseException:
        sock.close()
        raise
    return sock


def run_service(
    store_path: str | os.PathLike[str], socket_path: str | None = None, tcp: tuple[str, int] | None = None
) -> int:
    """`python -m store serve`: open the store, serve it until SIGINT/SIGTERM, close both.

    Prints one line `listening unix=<path> tcp=<host:port>` on stdout once it accepts.
    """
    from store.api import Store

    sock = Path(socket_path) if socket_path else Path(f"{os.fspath(store_path)}.sock")

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        async with StoreServer(store, sock, tcp) as server:
            tcp_text = ":".join(map(str, server.tcp_address)) if server.tcp_address else "-"
            print(f"listening unix={sock} tcp={tcp_text}", flush=True)
            await stop.wait()

    with Store.open(store_path) as store:
        eventloop.run(main())
    return 0
