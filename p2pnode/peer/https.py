"""The fetcher's side of the peer protocol's HTTPS: HTTP/1.1 requests over mutual TLS on asyncio,
connections kept alive and reused (at most CONNECTIONS per peer at once), bodies read as they come.

Not aiohttp's client: importing aiohttp costs 0.16 s, a third of a one-shot fetch of a grown
session (docs/BENCHMARKS.md).  It speaks what a peer server needs: bodies framed by
Content-Length, chunked or by the close; no compression, cookies, proxies, and no redirect is
followed (link.py refuses them).  Every way a peer can break an exchange is a ClientError; the
downloader decides what each means.  Bounds: MAX_HEAD bytes of a response head, MAX_INTERIM
`1xx` answers before it, `read_timeout` for each read (and write), `connect_timeout` for the
TCP connect and the TLS handshake."""
from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from types import TracebackType

CONNECTIONS = 4
"""Requests to one peer at once (more wait for a connection): 3 batches in flight and a small GET."""
MAX_HEAD = 64 << 10
"""A response's status line and headers, in bytes."""
MAX_INTERIM = 16
"""`1xx` answers skipped before a response (a peer's endless `102 Processing` is refused)."""
MAX_CHUNK_LINE = 1024
"""A chunked body's size line (hex digits and extensions)."""
READ_SIZE = 1 << 20
"""The most a read takes from the connection's buffer at once."""


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
        super().__init__(str(certificate_error), certificate_error)
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
    """Nothing came (or could be written) for `read_timeout` seconds."""


class Headers(dict[str, str]):
    """A response's headers by lower-case name (a repeated header: its last value)."""

    def get(self, name: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return super().get(name.lower(), default)


@dataclass(frozen=True)
class Timeouts:
    connect: float
    read: float


class _Connection:
    """One kept-alive TLS connection to the peer."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def reusable(self) -> bool:
        return not (self.reader.at_eof() or self.writer.is_closing() or self.reader.exception() is not None)

    def close(self) -> None:
        self.writer.close()


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
            self._left = -1  # the first chunk's size line is next
        elif length is not None:
            if not length.isdigit() or len(length) > 19:
                raise ResponseError(f"bad Content-Length {length!r}")
            self.content_length = self._left = int(length)
            self.done = self._left == 0
        else:  # the body ends when the peer closes
            self._to_close = True
            self._left = -1

    async def _read(self, op: Awaitable[bytes]) -> bytes:
        try:
            async with asyncio.timeout(self._timeouts.read):
                return await op
        except TimeoutError:
            raise ReadTimeout(f"nothing came for {self._timeouts.read:g} s") from None
        except asyncio.IncompleteReadError as exc:
            raise PayloadError(f"the body was cut after {len(exc.partial)} more bytes") from None
        except asyncio.LimitOverrunError:
            raise PayloadError("a chunk size line too long") from None
        except OSError as exc:
            raise Disconnected(f"connection lost in the body: {exc}") from exc

    async def read_some(self) -> bytes:
        """The next bytes of the body (as many as are there, at most READ_SIZE); b"" at its end."""
        if self.done:
            return b""
        reader = self._conn.reader
        if self._chunked:
            if self._left <= 0:
                await self._next_chunk()
                if self.done:
                    return b""
            data = await self._read(reader.read(min(self._left, READ_SIZE)))
            if not data:
                raise PayloadError("the body was cut in a chunk")
            self._left -= len(data)
            if self._left == 0 and await self._read(reader.readexactly(2)) != b"\r\n":
                raise PayloadError("a chunk not followed by CRLF")
            return data
        if self.content_length is None:  # to the close
            data = await self._read(reader.read(READ_SIZE))
            self.done = not data
            return data
        data = await self._read(reader.read(min(self._left, READ_SIZE)))
        if not data:
            raise PayloadError(f"the body was cut with {self._left} of {self.content_length} bytes to come")
        self._left -= len(data)
        self.done = self._left == 0
        return data

    async def _next_chunk(self) -> None:
        line = await self._read(self._conn.reader.readuntil(b"\r\n"))
        if len(line) > MAX_CHUNK_LINE:
            raise PayloadError("a chunk size line too long")
        digits = line[:-2].split(b";", 1)[0].strip()
        try:
            size = int(digits, 16) if digits and len(digits) <= 16 else -1
        except ValueError:
            size = -1
        if size < 0:
            raise PayloadError(f"bad chunk size line {line[:40]!r}")
        if size == 0:
            await self._trailers()
            self.done = True
        self._left = size

    async def _trailers(self) -> None:
        read = 0
        while (line := await self._read(self._conn.reader.readuntil(b"\r\n"))) != b"\r\n":
            read += len(line)
            if read > MAX_HEAD:
                raise PayloadError("trailers too long")

    async def chunks(self) -> AsyncIterator[bytes]:
        while data := await self.read_some():
            yield data

    def release(self) -> _Connection | None:
        """The connection, if another request may use it (the body was read whole)."""
        if self.done and not self._to_close and self._conn.reusable():
            return self._conn
        self._conn.close()
        return None


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
                headers: dict[str, str] | None = None) -> _Exchange:
        """`async with session.request(...) as response:` (redirects are answers like any other)."""
        return _Exchange(self, method, path, data, headers or {})

    async def _connect(self) -> _Connection:
        while self._idle:
            conn = self._idle.pop()
            if conn.reusable():
                return conn
            conn.close()
        try:
            async with asyncio.timeout(self.timeouts.connect):
                reader, writer = await asyncio.open_connection(
                    self.host, self.port, ssl=self.context, server_hostname="", limit=READ_SIZE,
                    ssl_handshake_timeout=self.timeouts.connect)  # no SNI: the peer's key is pinned
        except TimeoutError:
            raise ConnectError(f"no TLS connection within {self.timeouts.connect:g} s",
                               TimeoutError()) from None
        except ssl.SSLCertVerificationError as exc:
            raise CertificateError(exc) from exc
        except OSError as exc:
            raise ConnectError(f"cannot connect: {exc}", exc) from exc
        sock = writer.get_extra_info("socket")
        if sock is not None:  # a request goes out at once, not after the last one's ACK
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _Connection(reader, writer)

    async def close(self) -> None:
        self.closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


class _Exchange:
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
        if conn is None and self._conn is not None:
            self._conn.close()
        elif conn is not None and not s.closed:
            s._idle.append(conn)
        s._slots.release()

    async def _exchange(self, conn: _Connection) -> Response:
        s = self.session
        head = [f"{self.method} {self.path} HTTP/1.1\r\n", s._host_header]
        head += [f"{k}: {v}\r\n" for k, v in self.headers.items()]
        if self.data or self.method in ("POST", "PUT"):
            head.append(f"Content-Length: {len(self.data)}\r\n")
        head.append("\r\n")
        try:
            async with asyncio.timeout(s.timeouts.read):
                conn.writer.write("".join(head).encode("latin-1") + self.data)
                await conn.writer.drain()
                for _ in range(MAX_INTERIM + 1):
                    status, headers = _parse_head(await conn.reader.readuntil(b"\r\n\r\n"))
                    if not 100 <= status < 200:
                        return Response(conn, status, headers, s.timeouts, self.method)
        except TimeoutError:
            raise ReadTimeout(f"no answer within {s.timeouts.read:g} s") from None
        except asyncio.IncompleteReadError as exc:
            raise Disconnected("the peer closed the connection before answering"
                               if not exc.partial else "the answer's head was cut") from None
        except asyncio.LimitOverrunError:
            raise ResponseError(f"an answer's head over {MAX_HEAD} bytes") from None
        except OSError as exc:
            raise Disconnected(f"connection lost before the answer: {exc}") from exc
        raise ResponseError(f"more than {MAX_INTERIM} interim (1xx) answers")


def _parse_head(raw: bytes) -> tuple[int, Headers]:
    if len(raw) > MAX_HEAD:
        raise ResponseError(f"an answer's head over {MAX_HEAD} bytes")
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
