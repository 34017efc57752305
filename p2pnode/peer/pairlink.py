"""Pairing over TCP (asyncio): the waiter's listener and the joiner's connection, around the
sans-IO state machines of pairing.py.

The listener is plain TCP on a port of its own, open only while a code waits, and is not the
peer server: the peer server still refuses every untrusted key in the TLS handshake.  What
travels here needs no TLS: SPAKE2 messages reveal nothing about the code, and node ids are
public (they are announced over mDNS).  Bounds: a connection takes the exchange only with its
first complete message line (within FIRST_MESSAGE_TIMEOUT), so idle or trickling connections
cannot hold the listener against the real joiner; at most MAX_PENDING_PER_SOURCE such connections
per address and MAX_PENDING in all wait for that line (more are closed at once); one exchange at
a time (a first message that arrives while one runs is turned away), each message within
STEP_TIMEOUT seconds and MAX_MESSAGE bytes, the whole wait within the code's lifetime.  A
connection that ends before its SPAKE2 message was answered (a port scan, garbage) does not
count; one that got an answer spends the code.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable

from p2pnode.errors import P2PNodeError, PeerUnavailable
from p2pnode.logquota import LogQuota
from p2pnode.peer.pairing import (
    MAX_MESSAGE,
    CodeExpired,
    Joiner,
    PairingProtocolError,
    Party,
    State,
    Waiter,
    encode_error,
)

log = logging.getLogger(__name__)

STEP_TIMEOUT = 10.0
"""Seconds for each message of an exchange to arrive (the peer is on the LAN)."""
CONNECT_TIMEOUT = 5.0
FIRST_MESSAGE_TIMEOUT = 5.0
"""Seconds a new connection has to send its first message line (the joiner sends it at once)."""
MAX_PENDING_PER_SOURCE = 4
MAX_PENDING = 64
"""Connections waiting for their first message line: per source address, and in all."""


async def _read(reader: asyncio.StreamReader, timeout: float | None = None) -> bytes:
    timeout = STEP_TIMEOUT if timeout is None else timeout
    try:
        line = await asyncio.wait_for(reader.readline(), timeout)
    except TimeoutError:
        raise PeerUnavailable(f"pairing: no answer within {timeout:g} s") from None
    except ValueError:  # the stream's limit: a line longer than MAX_MESSAGE
        raise PairingProtocolError(f"pairing: a message over {MAX_MESSAGE} bytes") from None
    if not line:
        raise PeerUnavailable("pairing: the other node closed the connection without answering (it turned "
                              "the connection away, or the exchange failed there)")
    return line


async def _send(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(data)
    await asyncio.wait_for(writer.drain(), STEP_TIMEOUT)


class PairingListener:
    """Serves one code's one exchange; `on_paired(peer)` runs once the joiner confirmed."""

    def __init__(self, waiter: Waiter, on_paired: Callable[[Party], None]) -> None:
        self.waiter = waiter
        self.on_paired = on_paired
        self.port = 0
        self.result: asyncio.Future[Party] = asyncio.get_running_loop().create_future()
        self._server: asyncio.Server | None = None
        self._busy = False
        self._pending: Counter[str] = Counter()
        self._turned_away = LogQuota(log, logging.INFO, "connections turned away")
        """A host reconnecting as fast as it is closed must not fill the log."""
        """Connections per source address still waiting for their first message line."""
        self._open: set[asyncio.StreamWriter] = set()

    async def start(self, host: str = "0.0.0.0", port: int = 0) -> None:
        self._server = await asyncio.start_server(self._serve, host, port, limit=MAX_MESSAGE)
        self.port = self._server.sockets[0].getsockname()[1]

    async def wait(self) -> Party:
        """The paired peer; the error that burned the code; CodeExpired at the deadline."""
        left = self.waiter.expires_at - time.monotonic()
        try:
            return await asyncio.wait_for(asyncio.shield(self.result), max(0.0, left))
        except TimeoutError:
            self.waiter.state = State.BURNED
            raise CodeExpired("the pairing code expired: nobody paired with it in time; "
                              "run `p2pnode pair` again") from None

    async def close(self) -> None:
        for writer in list(self._open):  # connections still waiting for their first line
            writer.close()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
        if not self.result.done():
            self.result.cancel()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        source = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        if (self.result.done() or self._pending[source] >= MAX_PENDING_PER_SOURCE
                or self._pending.total() >= MAX_PENDING):
            self._turned_away.log("pairing: closing a connection from %s: the exchange is over, or too "
                                  "many wait", peer)
            writer.close()
            return
        try:
            first = await self._first_line(source, reader, writer)
        except (P2PNodeError, OSError) as exc:
            log.info("pairing: a connection from %s sent no message: %s", peer, exc)
            await self._refuse(writer, exc)
            return
        if self._busy or self.result.done():
            log.info("pairing: turning away a connection from %s: an exchange is running or over", peer)
            await self._refuse(writer, PeerUnavailable("another pairing exchange is running on this code"))
            return
        self._busy = True
        try:
            line = first
            while True:
                step = self.waiter.receive(line, time.monotonic())
                if step.send:
                    await _send(writer, step.send)
                if step.peer is not None:
                    self.on_paired(step.peer)
                    self.result.set_result(step.peer)
                    return
                line = await _read(reader)
        except (P2PNodeError, OSError) as exc:
            log.info("pairing: the exchange with %s failed: %s", peer, exc)
            if isinstance(exc, P2PNodeError):
                with contextlib.suppress(OSError, TimeoutError):
                    await _send(writer, encode_error(str(exc)))
            if self.waiter.attempted and not self.result.done():
                self.result.set_exception(exc if isinstance(exc, P2PNodeError) else PeerUnavailable(
                    f"pairing: the connection from {peer} broke mid-exchange ({exc}); the code is burned"))
        finally:
            self._busy = False
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            if self.result.done() and self._server is not None:
                self._server.close()  # one code, one exchange

    async def _first_line(self, source: str, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> bytes:
        """The connection's first message line: only a connection that sent one can take the
        exchange, so idle or trickling ones never keep the real joiner out."""
        self._pending[source] += 1
        self._open.add(writer)
        try:
            return await _read(reader, FIRST_MESSAGE_TIMEOUT)
        finally:
            self._open.discard(writer)
            self._pending[source] -= 1
            if self._pending[source] <= 0:
                del self._pending[source]

    @staticmethod
    async def _refuse(writer: asyncio.StreamWriter, exc: BaseException) -> None:
        """Tell a connection that did not take the exchange why (best effort), and close it."""
        if isinstance(exc, P2PNodeError):
            with contextlib.suppress(OSError, TimeoutError):
                await _send(writer, encode_error(str(exc)))
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def join(joiner: Joiner, addresses: list[tuple[str, int]]) -> Party:
    """Run the joiner's side against the first address that accepts a connection; a failed
    connect is not an attempt, a failed exchange is (the code is then spent)."""
    problems = []
    for host, port in addresses:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, limit=MAX_MESSAGE), CONNECT_TIMEOUT)
        except (OSError, TimeoutError) as exc:
            problems.append(f"{host}:{port}: {exc or type(exc).__name__}")
            continue
        try:
            await _send(writer, joiner.start())
            while True:
                step = joiner.receive(await _read(reader))
                if step.send:
                    await _send(writer, step.send)
                if step.peer is not None:
                    return step.peer
        except P2PNodeError as exc:
            with contextlib.suppress(OSError, TimeoutError):
                await _send(writer, encode_error(str(exc)))
            raise
        except OSError as exc:
            raise PeerUnavailable(f"pairing: the connection to {host}:{port} broke: {exc}") from None
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
    raise PeerUnavailable("pairing: could not connect to the waiting node (" + "; ".join(problems) + ")")
