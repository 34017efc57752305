"""The fetcher's side of the peer protocol's HTTPS: HTTP/1.1 requests over mutual TLS on asyncio,
connections kept alive and reused (at most CONNECTIONS per peer at once), bodies read as they come.

Not aiohttp's client: importing aiohttp costs 0.16 s, a third of a one-shot fetch of a grown
session (docs/BENCHMARKS.md).  It speaks what a peer server needs: bodies framed by
Content-Length, chunked or by the close; no compression, cookies, proxies, and no redirect is
followed (link.py refuses them).  Every way a peer can break an exchange is a ClientError; the
downloader decides what each means.  Bounds: MAX_HEAD bytes of a response head, MAX_INTERIM
`1xx` answers before it, MAX_CHUNK_LINE, MAX_TRAILERS, the `read` timeout for each wait for
bytes, the `connect` timeout for the TCP connect and the TLS handshake."""
from __future__ import annotations

import asyncio
import re
import socket
import ssl
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import cast

CONNECTIONS = 4
"""Requests to one peer at once (more wait for a connection): 3 batches in flight and a small GET."""
MAX_HEAD = 64 << 10
"""A response's status line and headers, in bytes."""
MAX_INTERIM = 16
"""`1xx` answers skipped before a response (a peer's endless `102 Processing` is refused)."""
MAX_CHUNK_LINE = 1024
"""A chunked body's size line (hex digits and extensions)."""
MAX_TRAILERS = 8 << 10
"""A chunked body's trailer section in all: its lines, their CRLFs and the empty line that ends
it (a peer server sends none; bounded per line only, endless short lines were read for ever)."""
_DIGITS = re.compile(r"[0-9]{1,19}")
BUFFERED = 128 << 10
"""Bytes received and not yet read at which the connection stops reading from its socket
(aiohttp's client stops at the same): the rest waits in the kernel, where it counts as not yet
delivered (pace.py's link rate counts the bytes a read got without waiting as free, and a
bigger buffer here made a 100 Mbit/s link look fast enough for per-line frames)."""


class ClientError(Exception):
    """A peer's HTTPS exchange failed (the network, or the peer)."""


class ConnectError(ClientError):
    """Could not connect: `os_error` is what the connect or the TLS handshake raised."""

    def __init__(self, message: str, os_error: OSError | None = None) -> None:
        super().__init__(message)
        self.os_error = os_error


class CertificateError(ConnectError):
    """The TLS handshake refused the peer's certificate (tls.py's pin check): `certificate_error`."""

    def __init__(self, certificate_error: ssl.SSLCertVerificationError) -> None:
        reason: object = certificate_error.args
        while isinstance(reason, tuple) and len(reason) == 1:  # the pin check's message, however wrapped
            reason = reason[0]
        self.reason = str(certificate_error) if isinstance(reason, tuple) else str(reason)
        super().__init__(self.reason, certificate_error)
        self.certificate_error = certificate_error


class Disconnected(ClientError):
    """The connection was closed or reset before the answer was whole."""


class PayloadError(ClientError):
    """An answer's body cut short, or framed wrongly."""


class ResponseError(ClientError):
    """An answer that is not HTTP/1.1 as this client reads it (or an unexpected status, link.py)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ReadTimeout(ClientError, TimeoutError):
    """Nothing came for the `read` timeout's seconds."""


class Headers(dict[str, str]):
    """A response's headers by lower-case name (a repeated header: its last value)."""

    def get(self, name: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return super().get(name.lower(), default)


@dataclass(frozen=True)
class Timeouts:
    connect: float
    read: float


class _Connection(asyncio.Protocol):
    """One kept-alive TLS connection to the peer: what it received, as the chunks the transport
    handed over (read without copying them again), and a timer only while a read waits."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._paused = False
        self._eof = False
        self._lost: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size > BUFFERED and not self._paused and self.transport is not None:
            self.transport.pause_reading()
            self._paused = True
        self._wake()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = True
        self._lost = exc
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def reusable(self) -> bool:
        return not (self._eof or self._chunks or self.transport is None or self.transport.is_closing())

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    async def read(self, timeout: float, what: str) -> bytes:
        """The next bytes received (a chunk as it came); b"" once the peer closed."""
        if not self._chunks:
            if self._eof:
                if self._lost is not None:
                    raise Disconnected(f"connection lost {what}: {self._lost}") from self._lost
                return b""
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()

            def expire() -> None:
                if not waiter.done():
                    waiter.set_exception(ReadTimeout(f"nothing came for {timeout:g} s {what}"))

            timer = loop.call_later(timeout, expire)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
            return await self.read(timeout, what)
        data = self._chunks.popleft()
        self._size -= len(data)
        if self._paused and self._size <= BUFFERED // 2 and self.transport is not None:
            self.transport.resume_reading()
            self._paused = False
        return data

    def unread(self, data: bytes) -> None:
        """Bytes read past what was wanted, to be read first next time."""
        if data:
            self._chunks.appendleft(data)
            self._size += len(data)


class Response:
    """A response whose head was read; its body is read with `read_some` or `chunks`."""

    def __init__(self, conn: _Connection, status: int, headers: Headers, timeouts: Timeouts,
                 method: str) -> None:
        self._conn, self.status, self.headers, self._timeouts = conn, status, headers, timeouts
        self.content_length: int | None = None
        self._left = 0
        """Bytes left of the body (Content-Length), or of the current chunk."""
        self._chunked = False
        self._to_close = False
        self.done = False
        """The body was read to its end (the connection can serve another request)."""
        self._frame(method)

    def _frame(self, method: str) -> None:
        coding = self.headers.get("transfer-encoding")
        length = self.headers.get("content-length")
        connection = (self.headers.get("connection") or "").lower()
        self._to_close = "close" in connection
        if method == "HEAD" or self.status in (204, 304):
            self.done = True
        elif coding is not None:
            if coding.strip().lower() != "chunked" or length is not None:
                raise ResponseError(f"unexpected framing: Transfer-Encoding {coding!r}"
                                    + (f" with Content-Length {length!r}" if length is not None else ""))
            self._chunked = True
        elif length is not None:
            if not _DIGITS.fullmatch(length):  # ASCII only: str.isdigit() takes "²", which int() refuses
                raise ResponseError(f"bad Content-Length {length!r}")
            self.content_length = self._left = int(length)
            self.done = self._left == 0
        else:  # the body ends when the peer closes
            self._to_close = True

    async def _more(self) -> bytes:
        return await self._conn.read(self._timeouts.read, "in the body")

    async def read_some(self) -> bytes:
        """The next bytes of the body (as they came, at most a received chunk); b"" at its end."""
        if self.done:
            return b""
        if self._chunked:
            return await self._read_chunked()
        data = await self._more()
        if self.content_length is None:  # to the close
            self.done = not data
            return data
        if not data:
            raise PayloadError(f"the body was cut with {self._left} of {self.content_length} bytes to come")
        if len(data) > self._left:
            raise PayloadError(f"more than the {self.content_length} bytes announced")
        self._left -= len(data)
        self.done = self._left == 0
        return data

    async def _read_chunked(self) -> bytes:
        if self._left == 0:  # a size line is next
            line = await self._line(MAX_CHUNK_LINE, "a chunk size line")
            digits = line.split(b";", 1)[0].strip()
            if not 0 < len(digits) <= 16 or digits.strip(b"0123456789abcdefABCDEF"):
                raise PayloadError(f"bad chunk size line {line[:40]!r}")
            self._left = int(digits, 16)
            if self._left == 0:
                await self._skip_trailers()
                self.done = True
                return b""
        data = await self._more()
        if not data:
            raise PayloadError("the body was cut in a chunk")
        if len(data) > self._left:
            self._conn.unread(data[self._left:])
            data = data[: self._left]
        self._left -= len(data)
        if self._left == 0:
            await _read_until(self._conn, b"\r\n", 2, self._timeouts.read,
                              lambda: PayloadError("a chunk not followed by CRLF"),
                              lambda partial: PayloadError("the body was cut after a chunk"))
        return data

    async def _skip_trailers(self) -> None:
        """The trailer section, read and dropped: at most MAX_TRAILERS bytes in all, else PayloadError."""
        left = MAX_TRAILERS
        while line := await self._line(left - 2, f"the trailer section (at most {MAX_TRAILERS} bytes)"):
            left -= len(line) + 2

    async def _line(self, limit: int, what: str) -> bytes:
        """A CRLF-ended line of the body's framing (at most `limit` bytes before it), without it."""
        line = await _read_until(self._conn, b"\r\n", limit + 2, self._timeouts.read,
                                 lambda: PayloadError(f"{what} too long"),
                                 lambda partial: PayloadError(f"the body was cut in {what}"))
        return line[:-2]

    async def chunks(self) -> AsyncIterator[bytes]:
        while data := await self.read_some():
            yield data

    def release(self) -> _Connection | None:
        """The connection, if another request may use it (the body was read whole)."""
        if self.done and not self._to_close and self._conn.reusable():
            return self._conn
        self._conn.close()
        return None


async def _read_until(conn: _Connection, end: bytes, limit: int, timeout: float,
                      too_long: Callable[[], Exception], cut: Callable[[bytes], Exception]) -> bytes:
    """Bytes up to and with `end`, at most `limit` of them (the rest stays unread)."""
    buf = b""
    while (at := buf.find(end)) < 0:
        if len(buf) >= limit:
            raise too_long()
        data = await conn.read(timeout, "before the answer")
        if not data:
            raise cut(buf)
        buf += data
    if at + len(end) > limit:
        raise too_long()
    conn.unread(buf[at + len(end):])
    return buf[: at + len(end)]


class Session:
    """One peer's HTTPS client: its connections (at most CONNECTIONS in use), its TLS context."""

    def __init__(self, host: str, port: int, context: ssl.SSLContext, timeouts: Timeouts) -> None:
        self.host, self.port, self.context, self.timeouts = host, port, context, timeouts
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(CONNECTIONS)
        self.closed = False
        hostport = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._host_header = f"Host: {hostport}\r\n"

    def request(self, method: str, path: str, data: bytes = b"",
                headers: dict[str, str] | None = None) -> Exchange:
        """`async with session.request(...) as response:` (redirects are answers like any other)."""
        return Exchange(self, method, path, data, headers or {})

    async def _connect(self) -> _Connection:
        while self._idle:
            conn = self._idle.pop()
            if conn.reusable():
                return conn
            conn.close()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.timeouts.connect):
                transport, conn = await loop.create_connection(
                    _Connection, self.host, self.port, ssl=self.context, server_hostname="",
                    ssl_handshake_timeout=self.timeouts.connect)  # no SNI: the peer's key is pinned
        except TimeoutError:
            raise ConnectError(f"no TLS connection within {self.timeouts.connect:g} s",
                               TimeoutError()) from None
        except ssl.SSLCertVerificationError as exc:
            raise CertificateError(exc) from exc
        except OSError as exc:
            raise ConnectError(f"cannot connect: {exc}", exc) from exc
        sock = transport.get_extra_info("socket")
        if sock is not None:  # a request goes out at once, not after the last one's ACK
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    async def close(self) -> None:
        self.closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


class Exchange:
    """One request and its response, as an async context manager: the connection goes back to
    the session's idle ones if the body was read whole, else it is closed."""

    def __init__(self, session: Session, method: str, path: str, data: bytes,
                 headers: dict[str, str]) -> None:
        self.session, self.method, self.path, self.data, self.headers = session, method, path, data, headers
        self._response: Response | None = None
        self._conn: _Connection | None = None

    async def __aenter__(self) -> Response:
        s = self.session
        if s.closed:
            raise ClientError("the session is closed")
        await s._slots.acquire()
        try:
            self._conn = await s._connect()
            self._response = await self._exchange(self._conn)
        except BaseException:
            if self._conn is not None:
                self._conn.close()
            s._slots.release()
            raise
        return self._response

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        s = self.session
        assert self._response is not None
        conn = self._response.release() if exc is None else None
        if conn is not None and not s.closed:
            s._idle.append(conn)
        elif self._conn is not None:
            self._conn.close()
        s._slots.release()

    async def _exchange(self, conn: _Connection) -> Response:
        s = self.session
        head = [f"{self.method} {self.path} HTTP/1.1\r\n", s._host_header]
        head += [f"{k}: {v}\r\n" for k, v in self.headers.items()]
        if self.data or self.method in ("POST", "PUT"):
            head.append(f"Content-Length: {len(self.data)}\r\n")
        head.append("\r\n")
        assert conn.transport is not None
        conn.transport.write("".join(head).encode("latin-1") + self.data)  # small: the transport buffers it
        for _ in range(MAX_INTERIM + 1):
            raw = await _read_until(conn, b"\r\n\r\n", MAX_HEAD, s.timeouts.read, _head_too_long, _head_cut)
            status, headers = _parse_head(raw)
            if not 100 <= status < 200:
                return Response(conn, status, headers, s.timeouts, self.method)
        raise ResponseError(f"more than {MAX_INTERIM} interim (1xx) answers")


def _head_too_long() -> ResponseError:
    return ResponseError(f"an answer's head over {MAX_HEAD} bytes")


def _head_cut(partial: bytes) -> Disconnected:
    return Disconnected("the answer's head was cut" if partial
                        else "the peer closed the connection before answering")


def _parse_head(raw: bytes) -> tuple[int, Headers]:
    lines = raw[:-4].split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or parts[0] not in (b"HTTP/1.1", b"HTTP/1.0") or not (len(parts[1]) == 3
                                                                           and parts[1].isdigit()):
        raise ResponseError(f"not an HTTP/1.1 status line: {lines[0][:60]!r}")
    headers = Headers()
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip():
            raise ResponseError(f"a malformed header line {line[:60]!r}")
        key, text = name.decode("latin-1").lower(), value.strip().decode("latin-1")
        if key in ("content-length", "transfer-encoding") and key in headers and headers[key] != text:
            raise ResponseError(f"two different {key} headers")
        headers[key] = text
    if parts[0] == b"HTTP/1.0" and "keep-alive" not in (headers.get("connection") or "").lower():
        headers["connection"] = "close"
    return int(parts[1]), headers
