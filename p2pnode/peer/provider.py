"""The peer server: serves this node's offered branches to trusted peers over mutual TLS.

Over 400 lines on purpose: the server's bounds (handshake gate, head deadlines, per-peer
limits) are part of serving each request and are tested together with it.

Entry point for the LAN node and the tests:

    server = PeerServer(lib, identity, trust, limits)   # lib: a ServedLibrary (peer/interfaces.py)
    await server.start(host, port)                       # port 0 picks one; see server.port
    ...
    await server.close()

What is served is decided by `lib.offered_object(hash, peer)`, asked per request: only
sidecars, sessions and line blobs reachable from branches offered to that peer (shared, not
unshared, not expired, `--to` naming it or no one, secret scan clean or allowed).  Anything
else, even a hash the store holds, and any malformed hash, gets exactly the answer a hash
that does not exist gets (404, same body).  When that changes (unshare, expiry, a narrower
`--to`), responses in flight that carry what the peer may no longer have are aborted
(`lib.add_listener`; expiry is also checked every TRUST_POLL_SECONDS), and every answer
served is logged (`lib.record_served`: peer, branches, bytes), after the answer, by one
writer that puts the answers that came meanwhile in one flush (a connection's next request
never waits for the audit log's fsync).

Per peer: at most `limits.max_concurrent_requests` requests at once (more get 429),
`limits.max_connections_per_peer` connections, request bodies up to
`limits.max_batch_request` bytes, a head and its trailers `limits.max_request_fields` fields
of `limits.max_request_field` bytes at most (400, closed), and a peer that stops reading for
`limits.slow_reader_timeout` seconds is disconnected.  Before trust is known: pending TLS
handshakes are bounded per source and in all, each with a deadline (_HandshakeGate); after
it, a request head and a body each have `limits.request_timeout` (_HeadDeadline, slowloris),
and every answer waits for the socket before the next pipelined request is served.  Untrusting a peer aborts
its open connections at once; the trust file is re-read about every second so that
`p2pnode untrust` from another process takes effect too.

Library calls run on a few worker threads: they may block on the store, and the event loop
must keep serving other peers meanwhile.  A batch response is streamed in groups of about
GROUP_BYTES of stored bytes; the next group is read from the store while the previous one
is written to the peer.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import struct
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from aiohttp import web, web_protocol
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from p2pnode.errors import VerificationFailed
from p2pnode.library.api import BranchInfo, Catalog
from p2pnode.library.audit import ServedAnswer
from p2pnode.peer import wire
from p2pnode.peer.identity import Identity
from p2pnode.peer.interfaces import ServedLibrary
from p2pnode.peer.nodeid import format_node_id, parse_node_id
from p2pnode.peer.pace import LinkPace
from p2pnode.peer.spki import spki_sha256
from p2pnode.peer.tls import peer_fingerprint, server_context
from p2pnode.peer.trust import TrustStore
from p2pnode.pi.sidecar import is_hash_hex
from store.errors import CorruptRecord, UnknownBlob
from sysio.chunks import joined_runs

log = logging.getLogger(__name__)
T = TypeVar("T")
Bytes = bytes | memoryview
DAMAGED = (CorruptRecord, UnknownBlob, VerificationFailed)
"""What reading this node's own store raises when a record fails its checks or is lost
(FORMAT.md): a damaged copy, not served (and one line in the log, not a traceback)."""

CHUNK = 1 << 20
Group = tuple[list[bytes], list[str], int, int, float]
"""A group of a batch answer, as PeerServer._frames makes it."""
LINGER_RESET = struct.pack("ii", 1, 0)
"""struct linger {on, 0 s}: close() resets the connection (Linux, macOS)."""
SEND_PIECE = 1 << 20
"""Bytes handed to the response at a time (see `_send`)."""
GROUP_BYTES = 1 << 20
"""Stored bytes (about) read from the store per worker-thread call while streaming a batch."""
WORKERS = 4
WIDE_WINDOWS_BYTES = 48 << 20
"""The most window over 8 MiB the lanes' streams of all peers hold at once: one fetcher's three
lanes at 16 MiB fill it (with their tables, about 60 MiB of memory); more get 8 MiB.  A stream
with a window over 8 MiB is made at wire.STREAM_LEVEL (3), whatever level the link affords:
with long-distance matching over 16 MiB, level 6 carried 1.8 % fewer bytes of the benchmark
session for 1.8 times the CPU (docs/BENCHMARKS.md, 2026-11-29 (22))."""
TRUST_POLL_SECONDS = 1.0
LINGER_SECONDS = 1.0
"""After an answer given before its request's body was read (413, 408), the rest of the body
is read and dropped for at most this long before the connection closes: closed with bytes
unread, the kernel resets it and the peer loses the answer (aiohttp's default lingers 10 s)."""
WAIT_CHECK_SECONDS = 0.5
"""A catalog request waiting for a change looks this often whether its peer is still there:
aiohttp does not cancel a handler whose peer went, and a wait left behind would hold one of
the peer's max_waiting_per_peer slots until catalog_wait ran out."""
NOT_FOUND_BODY = b"not found\n"
DAMAGED_BODY = b"this node's copy is damaged\n"
DAMAGE_LOGGED = 1024
"""Damaged objects logged (one warning each per node run; later requests for one are DEBUG)."""


def _not_found() -> web.Response:
    return web.Response(status=404, body=NOT_FOUND_BODY, content_type="text/plain")


class PeerServer:
    def __init__(self, lib: ServedLibrary, identity: Identity, trust: TrustStore,
                 limits: wire.Limits = wire.DEFAULT_LIMITS) -> None:
        self.lib = lib
        self.identity = identity
        self.trust = trust
        self.limits = limits
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._executor = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="peer-lib")
        self._active: dict[bytes, int] = defaultdict(int)
        self._transports: dict[bytes, set[asyncio.BaseTransport]] = defaultdict(set)
        self._poller: asyncio.Task[None] | None = None
        self._head_timers: dict[asyncio.BaseTransport, asyncio.TimerHandle] = {}
        self._lanes: dict[tuple[str, int], wire.BatchStreamEncoder] = {}
        """Each peer's lanes of stream answers (wire.STREAM_LANE_HEADER): the zstd stream its
        next answer in that lane continues; dropped with the peer's last connection."""
        self._lanes_busy: set[tuple[str, int]] = set()
        self._busy: set[asyncio.BaseTransport] = set()
        """Connections whose request head arrived and whose handler runs (no head deadline)."""
        self._handshaking: dict[str, int] = defaultdict(int)
        """Connections per source address whose TLS handshake has not finished."""
        self._upgrades: set[asyncio.Future[None]] = set()
        self._unlogged: list[ServedAnswer] = []
        self._audit_writer: asyncio.Task[None] | None = None
        self._closing = False
        self._changed = asyncio.Event()
        """Set (and replaced) by notify_changed: wakes the catalog requests waiting for a change."""
        self._waiting: dict[bytes, int] = defaultdict(int)
        """Catalog requests per peer fingerprint waiting for a change."""
        self._connections: dict[bytes, set[asyncio.BaseTransport]] = defaultdict(set)
        """Authenticated connections per peer fingerprint (max_connections_per_peer)."""
        self.tls = server_context(identity, trust)
        self._serving: dict[asyncio.BaseTransport, tuple[str, list[str]]] = {}
        """Responses being written: the peer and the hashes each one carries."""
        self._served_at = float("-inf")
        """When the last of them ended (served_within)."""
        self._rechecks: set[asyncio.Task[None]] = set()
        self._pace: dict[str, LinkPace] = {}
        """Per peer: its link as batch responses saw it (which batch format it gets)."""
        self._damage_logged: set[str] = set()

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self, host: str = "0.0.0.0", port: int = 0) -> None:
        raise_open_files_limit()
        app = web.Application(middlewares=[self._guard], client_max_size=self.limits.max_batch_request)
        app.router.add_get(wire.PATH_CATALOG, self._catalog, allow_head=False)
        app.router.add_get(wire.PATH_OBJECT, self._object, allow_head=False)
        app.router.add_get(wire.PATH_LINES, self._lines, allow_head=False)
        app.router.add_post(wire.PATH_BATCH, self._batch)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, logger=_http_log(),
                                     lingering_time=LINGER_SECONDS,
                                     max_headers=self.limits.max_request_fields,  # trailers count too
                                     max_field_size=self.limits.max_request_field)
        await self._runner.setup()
        self._loop: asyncio.AbstractEventLoop = asyncio.get_running_loop()
        site = _DeadlineSite(self, host, port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self.trust.add_listener(self._on_untrusted)
        self.lib.add_listener(self._on_access_changed)
        self._poller = asyncio.create_task(self._poll_trust())
        log.info("peer server for %s listening on %s:%d", self.identity.node_id, host, self.port)

    async def close(self) -> None:
        self.trust.remove_listener(self._on_untrusted)
        self.lib.remove_listener(self._on_access_changed)
        for recheck in list(self._rechecks):
            recheck.cancel()
        self._closing = True  # handshakes that finish from now on find no HTTP server to join
        self.notify_changed()  # catalog requests waiting for a change are answered now
        for task in list(self._upgrades):
            task.cancel()
        if self._poller:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if self._runner:
            await self._runner.cleanup()
        if self._audit_writer is not None:  # the last answers' entries are written before the end
            await self._audit_writer
        self._executor.shutdown(wait=True)

    async def _poll_trust(self) -> None:
        while True:
            await asyncio.sleep(TRUST_POLL_SECONDS)
            try:
                self.trust.reload_if_changed()
            except Exception as exc:  # a corrupt trust file must not kill the server
                log.warning("cannot re-read the trust file: %s", exc)
            await self._call(self.lib.expire_due)  # calls _on_access_changed if one expired

    def _on_untrusted(self, removed: set[bytes]) -> None:
        """Trust-store listener; may run on any thread, so the aborts go to the event loop."""
        self._loop.call_soon_threadsafe(self._abort, removed)

    def _abort(self, removed: set[bytes]) -> None:
        """Every connection of each untrusted peer: those it made requests on, and idle ones
        that only completed their handshake."""
        for fp in removed:
            for transport in self._transports.pop(fp, set()) | set(self._connections.get(fp, ())):
                if not transport.is_closing():
                    log.info("closing a connection of untrusted peer %s", format_node_id(fp))
                    _reset(transport)

    def _on_access_changed(self) -> None:
        """Library listener (any thread): re-check the responses in flight on the event loop."""
        self._loop.call_soon_threadsafe(self._start_recheck)

    def _start_recheck(self) -> None:
        task = asyncio.ensure_future(self._recheck())
        self._rechecks.add(task)
        task.add_done_callback(self._rechecks.discard)

    async def _recheck(self) -> None:
        serving = list(self._serving.items())
        stale = await self._call(lambda: [t for t, (peer, hashes) in serving
                                          if any(self.lib.offered_object(h, peer) is None for h in hashes)])
        for transport in stale:
            log.info("stopping a transfer: what it carries is no longer offered to the peer")
            _reset(transport)

    @contextlib.contextmanager
    def _carrying(self, request: web.Request, peer: str, hashes: list[str]) -> Iterator[None]:
        """Mark the response as carrying `hashes` to `peer` while it is written (for _recheck)."""
        transport = request.transport
        assert transport is not None
        self._serving[transport] = (peer, hashes)
        try:
            yield
        finally:
            self._serving.pop(transport, None)
            self._served_at = time.monotonic()

    def _served(self, peer: str, kind: str, hashes: list[str], nbytes: int,
                complete: bool = True) -> None:
        """The audit log's entry for an answer sent, or cut off after `nbytes` (the peer's name
        as this node trusts it), queued for the writer."""
        trusted = self.trust.get(parse_node_id(peer))
        self._unlogged.append(ServedAnswer(peer, trusted.name if trusted else None, kind, tuple(hashes),
                                           nbytes, complete))
        if self._audit_writer is None or self._audit_writer.done():
            self._audit_writer = asyncio.ensure_future(self._write_audit())

    async def _write_audit(self) -> None:
        while self._unlogged:
            answers, self._unlogged = self._unlogged, []
            try:
                await self._call(self.lib.record_served, answers)
            except Exception as exc:  # a full disk must not stop serving; the log says so
                log.warning("the audit log could not record %d served answers: %s", len(answers), exc)

    # -- per-peer guard -----------------------------------------------------------------

    @web.middleware
    async def _guard(self, request: web.Request, handler: Callable[[web.Request], Awaitable[Any]]) -> Any:
        transport = request.transport
        fp = _fingerprint(transport)
        if fp is None or not self.trust.is_trusted(fp):  # the handshake pin already refused these
            raise web.HTTPForbidden(text="not trusted\n")
        resource = request.match_info.route.resource  # routed by the decoded path: the raw one is checked
        try:
            wire.check_request_target(request.raw_path, resource.canonical if resource is not None else None)
        except wire.WireError as exc:
            raise _closing(web.HTTPBadRequest(text=f"{exc}\n")) from None
        if self._active[fp] >= self.limits.max_concurrent_requests:
            raise web.HTTPTooManyRequests(text="too many concurrent requests\n")
        assert transport is not None
        live = self._transports[fp]
        live.difference_update([t for t in live if t.is_closing()])
        live.add(transport)
        self._active[fp] += 1
        self._busy.add(transport)
        self._disarm(transport)
        try:
            return await handler(request)
        except (web.HTTPNotFound, web.HTTPMethodNotAllowed):  # no such route, or not with this
            return _not_found()  # method: the same answer as a hash that does not exist
        except DAMAGED as exc:  # this node's copy fails its checks: not served, the peer asks others
            match = request.match_info
            self._log_damage(match.get("hash") or match.get("src") or request.path, exc)
            if request.writer.output_size:  # the answer began: cut it (the fetcher verifies what came)
                _reset(transport)
                return web.Response()  # never sent: the connection is gone
            # 503, not 404: the object is offered to this peer (it was checked first), so
            # saying why leaks nothing, and the fetcher can tell its user
            return web.Response(status=503, body=DAMAGED_BODY, content_type="text/plain")
        finally:
            self._busy.discard(transport)
            self._arm(transport)  # the next request's head has request_timeout to arrive
            self._active[fp] -= 1
            if transport.is_closing():
                self._transports[fp].discard(transport)

    def _log_damage(self, what: str, exc: BaseException) -> None:
        """One warning per damaged object (by its hash, however asked) per node run: a fetcher
        may ask again and again."""
        if what in self._damage_logged:
            log.debug("not serving %s: this node's copy is damaged: %s", what, exc)
            return
        if len(self._damage_logged) >= DAMAGE_LOGGED:
            self._damage_logged.clear()
        self._damage_logged.add(what)
        log.warning("not serving %s: this node's copy is damaged (`p2pnode fsck`): %s", what, exc)

    def served_within(self, seconds: float) -> bool:
        """Whether a peer is being served lines or objects, or was within the last `seconds`
        (the background GC waits for a quiet spell: node/upkeep.py)."""
        return bool(self._serving) or time.monotonic() - self._served_at < seconds

    # -- deadlines: request heads (slowloris) and bodies ---------------------------------

    def _arm(self, transport: asyncio.BaseTransport) -> None:
        """Start the head deadline unless one runs or a handler is busy with this connection."""
        if transport not in self._busy and transport not in self._head_timers and not transport.is_closing():
            self._head_timers[transport] = self._loop.call_later(
                self.limits.request_timeout, self._head_expired, transport)

    def _disarm(self, transport: asyncio.BaseTransport) -> None:
        timer = self._head_timers.pop(transport, None)
        if timer is not None:
            timer.cancel()

    def _head_expired(self, transport: asyncio.BaseTransport) -> None:
        self._head_timers.pop(transport, None)
        if transport in self._busy:
            return
        if transport.get_write_buffer_size():  # type: ignore[attr-defined]  # still sending an answer
            self._arm(transport)
            return
        log.info("closing a connection without a complete request in %.1f s", self.limits.request_timeout)
        _reset(transport)

    async def _read_body(self, request: web.Request) -> bytes:
        """The request body within request_timeout: a peer that declares a large Content-Length
        and sends a few bytes gets 408, one that declares more than max_batch_request gets 413
        at once; either way the connection is closed after the answer (what is left of the
        body is not waited for)."""
        if request.content_length is not None and request.content_length > self.limits.max_batch_request:
            raise _closing(web.HTTPRequestEntityTooLarge(
                max_size=self.limits.max_batch_request, actual_size=request.content_length))
        if request.headers.get("Content-Encoding", "identity").lower() != "identity":
            raise _closing(web.HTTPBadRequest(text="request bodies are not content-encoded\n"))
        try:
            return await asyncio.wait_for(request.read(), self.limits.request_timeout)
        except TimeoutError:
            late = web.HTTPRequestTimeout(text="request body not received in time\n")
            raise _closing(late) from None
        except web.HTTPRequestEntityTooLarge as too_big:  # a chunked body past the limit
            raise _closing(too_big) from None
        except RequestPayloadError as exc:  # a chunked body that breaks its framing
            raise _closing(web.HTTPBadRequest(text=f"request body unreadable ({exc})\n")) from None

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _offered(self, hash_hex: str, peer: str) -> str | None:
        if not is_hash_hex(hash_hex):
            return None
        return await self._call(self.lib.offered_object, hash_hex, peer)

    async def _send(self, request: web.Request, response: web.StreamResponse, parts: Sequence[Bytes]) -> None:
        """Write `parts` with the slow-reader timeout (a peer that stops reading is cut off),
        small ones joined, in pieces of at most SEND_PIECE bytes: a 256 MiB line is neither
        copied into a joined answer nor encrypted whole into the TLS buffer at once."""
        for run in joined_runs(parts, SEND_PIECE):
            with memoryview(run) as view:
                for at in range(0, len(view), SEND_PIECE):
                    await self._in_time(request, response.write(view[at : at + SEND_PIECE]))

    async def _finish(self, request: web.Request, response: web.StreamResponse, data: Bytes) -> None:
        """The last bytes of an answer, then wait until the socket took them (slow-reader
        timeout): the next pipelined request is not served while this answer sits in memory
        (aiohttp drains only after 64 KiB written, or on a non-empty write_eof)."""
        await self._in_time(request, response.write_eof(bytes(data)))

    async def _in_time(self, request: web.Request, write: Awaitable[None]) -> None:
        """`write` within slow_reader_timeout, else the connection is aborted and
        ConnectionResetError raised, as when the peer goes: a TLS close would first wait
        (asyncio's 30 s) for the peer that does not read to take what is buffered."""
        try:
            await asyncio.wait_for(write, self.limits.slow_reader_timeout)
        except TimeoutError:
            log.info("cutting off a peer that read nothing for %.0f s", self.limits.slow_reader_timeout)
            if request.transport is not None:
                _reset(request.transport)
            raise ConnectionResetError("the peer stopped reading") from None

    def connected_peers(self) -> set[str]:
        """The node ids of the peers with an authenticated connection to this server open now:
        online, whatever mDNS sees (off, or another subnet)."""
        return {format_node_id(fp) for fp, open_now in self._connections.items() if open_now}

    # -- handlers -----------------------------------------------------------------------

    def notify_changed(self) -> None:
        """The catalog may have changed (a share, unshare or fetch): answer every waiting
        `GET /v1/catalog?wait=` now.  Call on the event loop."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def _catalog(self, request: web.Request) -> web.Response:
        catalog = await self._call(self.lib.catalog, _peer(request))
        if "wait" in request.query:
            catalog = await self._wait_for_change(request, catalog)
        listed = {b.branch for b in catalog.branches}
        msg = wire.CatalogMessage(
            generation=catalog.generation,
            node_id=self.identity.node_id,
            branches=[_catalog_entry(b, listed) for b in catalog.branches],
        )
        body = wire.encode_catalog(msg)
        return web.Response(body=body, content_type="application/json")

    async def _object(self, request: web.Request) -> web.StreamResponse:
        h = request.match_info["hash"]
        peer = _peer(request)
        kind = await self._offered(h, peer)
        runs: Iterator[bytes]
        if kind == "session":  # read from the store as it is sent: never whole in memory
            size = (await self._call(self.lib.version, h)).size
            runs = self.lib.session_runs(h)
        elif kind in ("sidecar", "line"):
            data = await (self._call(self.lib.sidecar_bytes, h) if kind == "sidecar"
                          else self._call(self.lib.line, bytes.fromhex(h)))
            size, runs = len(data), iter([data])
        else:
            return _not_found()
        try:
            span = wire.parse_range(request.headers.get("Range"), size)
        except wire.RangeNotSatisfiable:
            return web.Response(status=416, headers={"Content-Range": f"bytes */{size}"})
        start, end = span or (0, size)
        response = web.StreamResponse(status=206 if span else 200, headers={
            "Content-Type": "application/octet-stream", "Accept-Ranges": "bytes",
            "ETag": f'"{h}"', "X-Object-Kind": kind,
        })
        if span:
            response.headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        response.content_length = end - start
        await response.prepare(request)
        pieces = _window(runs, start, end)
        sent = start
        try:
            with self._carrying(request, peer, [h]):
                piece = await self._call(next, pieces, None)
                while piece is not None:
                    after = await self._call(next, pieces, None)
                    if request.transport is None or request.transport.is_closing():
                        break  # cut off while the store was read (_recheck, or the peer went)
                    last = after is None
                    if last:
                        await self._finish(request, response, piece)
                    else:
                        await self._send(request, response, [piece])
                    sent += len(piece)
                    piece = after
                else:
                    if sent != end:  # the store gave fewer bytes than the version's size
                        raise VerificationFailed(f"session {h} read back from the store is "
                                                 f"{sent - start} bytes short of {end - start}")
        finally:
            self._served(peer, kind, [h], sent - start, complete=sent == end)
        return response

    async def _wait_for_change(self, request: web.Request, catalog: Catalog) -> Catalog:
        """Change notification (long poll): hold the request until the catalog's generation
        is not the one the peer has, or `limits.catalog_wait` seconds passed; at most
        `limits.max_waiting_per_peer` such requests of one peer wait at once (more: 429)."""
        try:
            seen = wire.parse_wait(request.query["wait"])
        except wire.WireError as exc:
            raise web.HTTPBadRequest(text=f"{exc}\n") from None
        if catalog.generation != seen:
            return catalog
        fp = _fingerprint(request.transport)
        assert fp is not None  # _guard let only trusted peers in
        if self._waiting[fp] >= self.limits.max_waiting_per_peer:
            raise web.HTTPTooManyRequests(text="too many catalog requests waiting\n")
        self._waiting[fp] += 1
        peer = _node_id(fp)  # now: once the peer has gone, _peer(request) finds no transport
        try:
            deadline = asyncio.get_running_loop().time() + self.limits.catalog_wait
            while (catalog.generation == seen and not self._closing and _connected(request)
                   and (left := deadline - asyncio.get_running_loop().time()) > 0):
                changed = self._changed
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), min(left, WAIT_CHECK_SECONDS))
                if changed.is_set() or asyncio.get_running_loop().time() >= deadline:
                    catalog = await self._call(self.lib.catalog, peer)
        finally:
            self._waiting[fp] -= 1
        return catalog

    async def _lines(self, request: web.Request) -> web.Response:
        src = request.match_info["src"]
        peer = _peer(request)
        if await self._offered(src, peer) != "session":
            return _not_found()
        found = None
        if "after" in request.query:  # only what follows a version the fetcher holds (version 2)
            try:
                held = wire.decode_after_query(request.query["after"])
            except wire.WireError as exc:
                raise web.HTTPBadRequest(text=f"{exc}\n") from None
            found = await self._call(self.lib.line_manifest_after, src, held, peer)
        refs = await self._call(self.lib.line_manifest, src)
        if found is not None:
            base, first = found
            body = wire.encode_line_manifest_after(bytes.fromhex(src), bytes.fromhex(base), first,
                                                   refs[first:])
        else:
            body = wire.encode_line_manifest(bytes.fromhex(src), refs)
        self._served(peer, "lines", [src], len(body))
        return web.Response(body=body, content_type="application/octet-stream")

    async def _batch(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_body(request)
        try:
            hashes = wire.decode_batch_request(body, self.limits)
        except wire.WireError as exc:
            raise web.HTTPBadRequest(text=f"{exc}\n") from None
        hashes = list(dict.fromkeys(hashes))  # each line once: a repeated hash is not 4096 copies of it
        response = web.StreamResponse(headers={"Content-Type": "application/x-p2pnode-batch"})
        peer = _peer(request)
        pace = self._pace.setdefault(peer, LinkPace())
        stream, lane = self._batch_format(request, pace, peer)
        if stream is not None:
            response.headers[wire.BATCH_FORMAT_HEADER] = wire.BATCH_FORMAT_STREAM
            response.headers[wire.STREAM_CONTINUE_HEADER] = str(stream.answers)
        await response.prepare(request)
        sent = nbytes = raw = 0
        cpu = 0.0  # the worker threads' CPU seconds making the frames (peer/pace.py prices the stream by it)
        served: list[str] = []
        reading: asyncio.Future[Group] | None
        reading = self._read_group(hashes, 0, peer, stream)
        complete = False
        try:
            with self._carrying(request, peer, served):
                while reading is not None:
                    frames, group, pos, group_raw, group_cpu = await reading
                    raw += group_raw
                    cpu += group_cpu
                    more = pos < len(hashes)
                    reading = self._read_group(hashes, pos, peer, stream) if more else None  # while we send
                    size = sum(map(len, frames))
                    sent += len(group)
                    nbytes += size
                    served += group
                    pace.link.waiting()
                    try:
                        await self._send(request, response, frames)
                    finally:
                        pace.link.moved(size)
                await self._finish(request, response, wire.encode_batch_end(sent))
                complete = True
                if stream is not None:
                    stream.answers += 1
        except ConnectionResetError:  # the fetcher let go (it got these lines elsewhere)
            log.debug("batch of %d lines: the peer closed the connection after %d", len(hashes), sent)
        finally:
            pace.sent(None if stream is None else stream.level, raw, cpu)
            if lane is not None:
                self._lanes_busy.discard(lane)
                if not complete:  # the fetcher's copy is lost too: the lane's next answer starts anew
                    self._lanes.pop(lane, None)
            if reading is not None:
                reading.cancel()
            if served:  # a batch of nothing this peer may have served nothing
                self._served(peer, "batch", served, nbytes, complete)
        return response

    def _batch_format(self, request: web.Request, pace: LinkPace,
                      peer: str) -> tuple[wire.BatchStreamEncoder | None, tuple[str, int] | None]:
        """(a zstd stream encoder, the lane it goes on in) where the fetcher offered the stream
        and peer/pace.py's rule calls for one (a small transfer, a slow link); else (None,
        None): the stored per-line frames.  On a slow link (the choice `continues`), the
        stream of the fetcher's lane goes on from the lane's last answer if the fetcher
        decoded exactly what it carried (STREAM_CONTINUE_HEADER), else a new one takes the
        lane; the other choices (a few MB) are a stream of their own."""
        if not self.limits.serve_stream_batches:
            return None, None
        if request.headers.get(wire.BATCH_FORMAT_HEADER) != wire.BATCH_FORMAT_STREAM:
            return None, None
        header = request.headers.get
        choice = pace.choose(self.limits, wire.parse_count_header(header(wire.FETCH_BYTES_HEADER)),
                             wire.parse_count_header(header(wire.LINK_RATE_HEADER)))
        number = wire.parse_count_header(header(wire.STREAM_LANE_HEADER))
        lane = (peer, number) if number is not None and number < wire.MAX_STREAM_LANES else None
        if choice.level is None or not choice.continues or lane is None or lane in self._lanes_busy:
            log.debug("batch format: %s (%s)",
                      "per-line" if choice.level is None else f"zstd-{choice.level} stream", choice.reason)
            return (None if choice.level is None else wire.BatchStreamEncoder(choice.level)), None
        going = self._lanes.get(lane)
        if (going is None or not pace.keeps(going.level)  # a new frame (at the chosen level)
                or going.answers != wire.parse_count_header(header(wire.STREAM_CONTINUE_HEADER))):
            window_log = self._lane_window(lane, header(wire.STREAM_WINDOW_HEADER))
            wide = window_log > wire.STREAM_CONTINUED_WINDOW_LOG  # level 3 there (WIDE_WINDOWS_BYTES)
            going = wire.BatchStreamEncoder(wire.STREAM_LEVEL if wide else choice.level, window_log)
            self._lanes[lane] = going
        self._lanes_busy.add(lane)
        log.debug("batch format: zstd-%d stream, lane %d after %d answers (%s)", going.level, number,
                  going.answers, choice.reason)
        return going, lane

    def _lane_window(self, lane: tuple[str, int], offered: str | None) -> int:
        """The window log of a new stream in `lane`: what the fetcher offered (wire.STREAM_WINDOW_HEADER),
        unless the windows over 8 MiB that the other lanes' streams hold leave no room for it
        in WIDE_WINDOWS_BYTES: 8 MiB then (every fetcher decodes that)."""
        want = wire.parse_window_header(offered)
        if want <= wire.STREAM_CONTINUED_WINDOW_LOG:
            return want
        wide = sum(1 << e.window_log for k, e in self._lanes.items()
                   if k != lane and e.window_log > wire.STREAM_CONTINUED_WINDOW_LOG)
        return want if wide + (1 << want) <= WIDE_WINDOWS_BYTES else wire.STREAM_CONTINUED_WINDOW_LOG

    def _drop_lanes(self, peer: str) -> None:
        """The peer's last connection closed: its lanes' streams go (and any lane an answer
        that never got going left marked busy)."""
        for lane in [k for k in self._lanes if k[0] == peer]:
            del self._lanes[lane]
        self._lanes_busy = {k for k in self._lanes_busy if k[0] != peer}

    def _read_group(self, hashes: list[bytes], pos: int, peer: str,
                    stream: wire.BatchStreamEncoder | None) -> asyncio.Future[Group]:
        """The next group on a worker thread; one at a time per response (the stream is sequential)."""
        return asyncio.get_running_loop().run_in_executor(self._executor, self._frames, hashes, pos, peer,
                                                          stream)

    def _frames(self, hashes: list[bytes], pos: int, peer: str,
                stream: wire.BatchStreamEncoder | None = None) -> Group:
        """(frames, the hashes they carry, where the next group starts, the raw bytes of their
        lines that went through the `stream` (all, without one), this worker thread's CPU
        seconds for them): the line blobs
        offered to `peer` among `hashes[pos:]`, about GROUP_BYTES of them.  The others are
        left out, exactly as if they did not exist.  Without a `stream`, stored bytes are sent
        as they are: the store's codec numbers (store/layout.py) are the wire's (0 raw, 1 zstd);
        with one, each line is decoded and goes on through the response's zstd stream."""
        cpu = time.thread_time()
        parts: list[bytes] = []
        carried: list[str] = []
        size = raw = 0
        while pos < len(hashes) and size < GROUP_BYTES:
            h = hashes[pos]
            pos += 1
            kind = self.lib.offered_object(h.hex(), peer)
            # a one-line session's line hashes to the session: offered as "session"
            if kind != "line" and not (kind == "session" and self.lib.has_line(h)):
                continue
            try:
                blob = self.lib.stored_line(h)
            except DAMAGED as exc:  # left out, as a line not served is: the fetcher asks other holders
                self._log_damage(h.hex(), exc)
                continue
            parts += (stream.frame_parts(blob) if stream is not None
                      else wire.batch_frame_parts(h, blob.codec, blob.raw_len, blob.stored))
            carried.append(h.hex())
            size += len(blob.stored)
            if stream is None or stream.streams(blob.raw_len):  # what the stream's CPU is priced by
                raw += blob.raw_len
        return parts, carried, pos, raw, time.thread_time() - cpu


OPEN_FILES_WANTED = 65536


def raise_open_files_limit() -> None:
    """Raise the soft RLIMIT_NOFILE towards the hard one (at most OPEN_FILES_WANTED), where the
    system allows it: a flood of half-open connections must not take the descriptors that
    trusted peers and the store need (macOS caps the soft limit lower: then its cap is kept)."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_WANTED)
    for limit in (want, 10240):
        if soft >= limit:
            return
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
            return
        except (ValueError, OSError):
            continue
    log.warning("cannot raise the open files limit above %d", soft)


class _HeadDeadline(asyncio.Protocol):
    """aiohttp's protocol for one connection, wrapped so that the server can put a deadline on
    request heads: armed when the TLS handshake completes and whenever bytes arrive while no
    handler is busy with the connection, disarmed when a complete head reaches the handler."""

    def __init__(self, server: PeerServer, inner: web_protocol.RequestHandler) -> None:
        self.server, self.inner = server, inner
        self.transport: asyncio.BaseTransport | None = None
        self.fingerprint: bytes | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.inner.connection_made(transport)
        self.server._arm(transport)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)
        if self.transport is not None:
            self.server._arm(self.transport)

    def eof_received(self) -> None:
        self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is not None:
            self.server._disarm(self.transport)
            self.server._busy.discard(self.transport)
            if self.fingerprint is not None:
                mine = self.server._connections.get(self.fingerprint, set())
                mine.discard(self.transport)
                if not mine:
                    self.server._connections.pop(self.fingerprint, None)
                    self.server._drop_lanes(format_node_id(self.fingerprint))
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class _HandshakeGate(asyncio.Protocol):
    """A plain TCP connection before TLS.  Before anything is allocated for TLS (asyncio keeps
    a 256 KiB buffer per TLS connection), the source's pending handshakes are counted: over
    `max_handshakes_per_source` or `max_handshakes` in all, the connection is closed at once.
    Otherwise the TLS handshake runs with its deadline, and only then is the connection handed
    to the HTTP server (wrapped in _HeadDeadline).

    Bytes that arrive before start_tls takes the connection over (the ClientHello: uvloop
    starts reading after connection_made whatever pause came before) are kept and handed to
    the TLS protocol once it is in place, through its public BufferedProtocol interface."""

    EARLY_LIMIT = 64 * 1024
    """More than a ClientHello before TLS started is not a TLS client."""

    def __init__(self, server: PeerServer, make_handler: Callable[[], web_protocol.RequestHandler]) -> None:
        self.server, self.make_handler = server, make_handler
        self.early = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        source = str(peer[0]) if peer else "?"
        pending, limits = self.server._handshaking, self.server.limits
        full = sum(pending.values()) >= limits.max_handshakes
        if full or pending.get(source, 0) >= limits.max_handshakes_per_source:
            log.info("refusing a connection from %s: too many TLS handshakes pending", source)
            _reset(transport)
            return
        pending[source] += 1
        task = asyncio.ensure_future(self._upgrade(transport, source))
        self.server._upgrades.add(task)
        task.add_done_callback(self.server._upgrades.discard)

    def data_received(self, data: bytes) -> None:
        self.early += data
        if len(self.early) > self.EARLY_LIMIT:
            log.debug("closing a connection: %d bytes before TLS started", len(self.early))
            _reset(self.transport)

    async def _upgrade(self, transport: asyncio.BaseTransport, source: str) -> None:
        server = self.server
        app = _HeadDeadline(server, self.make_handler())
        handshake = asyncio.ensure_future(asyncio.get_running_loop().start_tls(
            transport, app, server.tls, server_side=True,  # type: ignore[arg-type]
            ssl_handshake_timeout=server.limits.tls_handshake_timeout))
        try:
            while transport.get_protocol() is self and not handshake.done():
                await asyncio.sleep(0)  # until start_tls has put its TLS protocol in place
            if self.early and not handshake.done():
                _feed(transport.get_protocol(), bytes(self.early))
                self.early.clear()
            tls = await handshake
        except (OSError, TimeoutError, ConnectionError, asyncio.CancelledError) as exc:
            log.debug("TLS handshake from %s failed: %s", source, exc)
            handshake.cancel()
            _reset(transport)
            return
        finally:
            server._handshaking[source] -= 1
            if not server._handshaking[source]:
                del server._handshaking[source]
        if tls is None or tls.is_closing() or server._closing:
            # uvloop can hand back a transport whose handshake failed just after completing (our
            # pin check refused the client): it is closed already, and the app must not see it
            _reset(tls or transport)
            return
        fp = peer_fingerprint(tls.get_extra_info("ssl_object"))
        if fp is not None:
            mine = server._connections[fp]
            if len(mine) >= server.limits.max_connections_per_peer:
                log.info("closing a connection of %s: %d open already", format_node_id(fp), len(mine))
                _reset(tls)
                return
            mine.add(tls)
            app.fingerprint = fp
        app.connection_made(tls)


def _feed(protocol: asyncio.BaseProtocol, data: bytes) -> None:
    """Hand `data` to the TLS protocol as if the transport had read it (asyncio's and uvloop's
    SSLProtocol are both buffered protocols)."""
    view = memoryview(data)
    while view:
        buf = protocol.get_buffer(len(view))  # type: ignore[attr-defined]
        n = min(len(buf), len(view))
        buf[:n] = view[:n]
        protocol.buffer_updated(n)  # type: ignore[attr-defined]
        view = view[n:]


class _DeadlineSite(web.TCPSite):
    """TCPSite whose connections pass _HandshakeGate (pending-handshake bounds, handshake
    deadline) and then _HeadDeadline (request-head deadlines)."""

    def __init__(self, server: PeerServer, host: str, port: int) -> None:
        assert server._runner is not None
        super().__init__(server._runner, host, port)
        self.peer_server = server

    async def start(self) -> None:
        await web.BaseSite.start(self)
        handlers = self._runner.server
        assert handlers is not None
        ps = self.peer_server
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _HandshakeGate(ps, handlers), self._host, self._port, backlog=self._backlog)


class _PeerMistakes(logging.Filter):
    """aiohttp logs a malformed request (answered 400), or an answer cut off (the peer went,
    or this server cut it: a slow reader, a damaged copy), at ERROR with its traceback: any
    trusted peer could fill the log with them.  They become one INFO line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError | ConnectionError):
            record.msg, record.args = "%s: %s", (record.getMessage(), " ".join(str(exc).split()))
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
            record.exc_info = record.exc_text = None
            return logging.getLogger(record.name).isEnabledFor(logging.INFO)  # checked at ERROR before
        return True


def _http_log() -> logging.Logger:
    """The logger the server's HTTP layer reports to (aiohttp's own, filtered: _PeerMistakes)."""
    logger = logging.getLogger("p2pnode.peer.http")
    if not any(isinstance(f, _PeerMistakes) for f in logger.filters):
        logger.addFilter(_PeerMistakes())
    return logger


def _connected(request: web.Request) -> bool:
    return request.transport is not None and not request.transport.is_closing()


def _reset(transport: asyncio.BaseTransport) -> None:
    """Abort the connection with a TCP reset: what the kernel still queues for the peer (MBs
    of an answer whose peer reads slowly, or whose session was just unshared) is dropped, not
    sent before a FIN."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_RESET)
    transport.abort()  # type: ignore[attr-defined]


def _closing(answer: web.HTTPException) -> web.HTTPException:
    """`answer`, after which the connection closes (what is left of the body is read for
    LINGER_SECONDS at most, then dropped)."""
    answer.force_close()
    return answer


def _peer(request: web.Request) -> str:
    """The node id of the peer that sent the request (the guard let only trusted ones in)."""
    fp = _fingerprint(request.transport)
    assert fp is not None
    return _node_id(fp)


@functools.lru_cache(maxsize=256)
def _node_id(fingerprint: bytes) -> str:
    """format_node_id, remembered: a batch answer asks it several times (base32 and four Luhn
    checksums in Python: ~3 % of the server's GIL time serving a first fetch, py-spy)."""
    return format_node_id(fingerprint)


def _fingerprint(transport: asyncio.BaseTransport | None) -> bytes | None:
    """The SPKI SHA-256 of the certificate the connection's peer presented, if any."""
    ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    return _spki_sha256(der) if der else None


@functools.lru_cache(maxsize=256)
def _spki_sha256(cert_der: bytes) -> bytes:
    """spki.spki_sha256, remembered: every request asks it of its connection's certificate
    (twice or more), and parsing the certificate each time was some 6 % of the server's
    GIL-holding time serving a first fetch (py-spy).  Only certificates that passed the pin reach it."""
    return spki_sha256(cert_der)


def _window(runs: Iterator[bytes], start: int, end: int) -> Iterator[memoryview]:
    """The bytes [start, end) of what `runs` hands out in order, in pieces of at most CHUNK."""
    pos = 0
    for run in runs:
        lo, hi = max(start, pos), min(end, pos + len(run))
        view = memoryview(run)
        for at in range(lo, hi, CHUNK):
            yield view[at - pos:min(hi, at + CHUNK) - pos]
        pos += len(run)
        if pos >= end:
            return


def _catalog_entry(b: BranchInfo, listed: set[str]) -> wire.CatalogEntry:
    """`previous` only when that version is listed to this peer too: a version it may not have
    (shared `--to` another peer, unshared, expired) is not named to it."""
    header = b.header.as_dict() if hasattr(b.header, "as_dict") else dict(b.header)
    previous = b.previous if b.previous in listed else None
    return wire.CatalogEntry(branch=b.branch, src=b.src, parent=b.parent, size=b.size, lines=b.lines,
                             header=header, title=b.title, previous=previous, version=b.version)
