"""One client connection of the store service: framing, HELLO, pipelining, timeouts, and the
rule that every request received gets exactly one reply before a broken connection closes.

The socket reads straight into the frame decoder's buffer (asyncio.BufferedProtocol); a
reply of many payloads is written in pieces, never joined into one big copy.
"""
from __future__ import annotations

import asyncio
import logging
import socket
from collections import deque
from typing import TYPE_CHECKING, cast

from store.service import messages as m
from store.service.errors import error_reply
from store.service.frames import (
    FLAG_REPLY,
    HEADER,
    BadSequence,
    Frame,
    FrameDecoder,
    IdleTimeout,
    MalformedFrame,
    ProtocolError,
    ReadTimeout,
    ReplyTooLarge,
    ServiceError,
    TooManyInFlight,
    UnsupportedVersion,
)
from store.service.handlers import Reply
from store.service.limits import MiB

if TYPE_CHECKING:
    from store.service.server import StoreServer

log = logging.getLogger(__name__)

LARGE = 64 * 1024
"""Replies this big are written without copying them behind their header."""
SEND_BUFFER = 2 * MiB
"""The kernel send buffer asked for each connection (Linux caps it at net.core.wmem_max)."""

class Connection(asyncio.BufferedProtocol):
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
