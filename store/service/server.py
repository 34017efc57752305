"""The store service: an asyncio server speaking the frame protocol over a Unix socket
(and TCP loopback), and `python -m store serve`.

Requests on one connection (store/service/connection.py) are pipelined: each runs as soon
as it arrives and its reply goes out when it is ready, so replies may overtake each other.
This module decides where a request runs.  Writes run in a thread pool (`_Workers`), so that
appends arriving on many connections at once reach the engine together and share its group
commit, except a lone small append while the pool is idle, which runs on the event loop (see
_run_writes); reads are answered on the event loop, where a cache hit costs no thread
hand-off.  Limits (store/service/limits.py) are announced in the HELLO reply.
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
from collections.abc import Callable
from pathlib import Path
from queue import SimpleQueue
from typing import Any

from store.errors import (
    StoreError,
)
from store.service import messages as m
from store.service.connection import Connection
from store.service.frames import (
    ShuttingDown,
)
from store.service.handlers import Handlers, Reply
from store.service.limits import ServiceLimits
from sysio import eventloop
from sysio.sockets import listener_at

log = logging.getLogger(__name__)

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
        self.connections: set[Connection] = set()
        self.connection_gone = asyncio.Event()
        self._handlers = Handlers(store, self.limits).table()
        self.workers = workers
        self._pool: _Workers | None = None
        self._writes: list[tuple[Connection, int, m.Request]] = []
        """Writes decoded in this pass of the event loop, handed out by _run_writes."""
        self._gather: asyncio.Handle | None = None
        """The pass of the loop that will hand them out, when one is due."""
        self._last_writer: Connection | None = None
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
                self._servers.append(await loop.create_unix_server(lambda: Connection(self), sock=sock))
            if self.tcp is not None:
                server = await loop.create_server(lambda: Connection(self), self.tcp[0], self.tcp[1])
                self._servers.append(server)
                self.tcp_address = server.sockets[0].getsockname()[:2]
        except BaseException:
            await self.close()
            raise

    async def serve_forever(self) -> None:
        await asyncio.gather(*(s.serve_forever() for s in self._servers))

    def dispatch(self, conn: Connection, req_id: int, req: m.Request) -> None:
        handler, in_pool = self._handlers[type(req)]
        if not in_pool:
            self._run_inline(conn, req_id, req, handler)
            return
        conn.in_flight.add(req_id)
        self._writes.append((conn, req_id, req))

    def writes_ready(self, conn: Connection) -> None:
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

    def _run_inline(self, conn: Connection, req_id: int, req: m.Request,
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
        conn: Connection,
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
    if not sep or not (port.isascii() and port.isdigit()) or int(port) > 0xFFFF:
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
