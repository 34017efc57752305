"""Fetching a branch and its lineage from peers, verifying every byte before it is kept.

Entry points (for the CLI and the LAN node):

    result = await fetch_branch(lib, branch_hex, [PeerAddress(node_id, host, port), ...],
                                identity, trust, agent_dir=..., progress=...)
    catalog = await get_catalog(PeerAddress(...), identity, trust)

The order of work, and why:
1. Walk the lineage by sidecars only: each sidecar must hash to the branch asked for and
   validate; follow `parent` until a branch this node already holds, with a depth limit and
   cycle detection.  Nothing is stored yet, so a lying chain costs nothing.
2. For each missing branch, oldest first: the session's line manifest, then only the lines
   this node lacks, in framed batches; every line is decompressed with an output limit equal
   to its declared length and checked against its hash.  The whole session is re-hashed to
   the sidecar's `src` and checked to be cut at its newlines (this is what proves the
   manifest honest) and only then handed to `lib.add_fetched`, with each line's zstd bytes
   as the peer sent them: the store keeps those (after decoding and re-hashing them itself)
   instead of compressing the line again.  A peer without line manifests gets the
   whole-blob fallback: a streamed GET with `Range` resume, hashed on the fly.
3. Only after the store committed it, the requested session is written where Pi finds it
   (placement.py), if `agent_dir` is given: a refused fetch leaves no file behind.

Peers are tried in turn, and never redirect us.  A peer that sends bytes failing
verification, or makes no progress for `Limits.progress_timeout` in any phase, is dropped for
the rest of this fetch; a peer whose link breaks is retried a few times.  Verified lines and
blob prefixes survive a broken link, so the next attempt, on the same or another peer,
continues where the last one stopped.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import blake3

from p2pnode.errors import (
    Conflict,
    InvalidInput,
    NotFound,
    P2PNodeError,
    PeerUnavailable,
    Refused,
    VerificationFailed,
)
from p2pnode.library.api import Library
from p2pnode.library.manifest import PlacedFiles
from p2pnode.paths import NodePaths
from p2pnode.peer import wire
from p2pnode.peer.identity import Identity, format_node_id, parse_node_id
from p2pnode.peer.tls import client_context
from p2pnode.peer.trust import TrustStore
from p2pnode.pi.lines import LineRef, is_split, split_lines
from p2pnode.pi.placement import Placement, PlacementConflict, place_session
from p2pnode.pi.session import find_header, placed_names
from p2pnode.pi.sidecar import InvalidSidecar, Sidecar, parse_sidecar
from store import StoredBlob
from store.errors import StoreLocked

log = logging.getLogger(__name__)
T = TypeVar("T")

Progress = Callable[[int, int], None]
"""progress(bytes_done, bytes_total) while session bytes arrive."""

MAX_NETWORK_ERRORS = 3
"""Broken links tolerated per peer per fetch before it is given up."""
RETRY_PAUSE = 0.2
BATCHES_IN_FLIGHT = 3
DECODE_RUN = 1 << 20
"""Raw bytes of received blobs handed to a worker thread at a time for decoding."""


@dataclass(frozen=True)
class PeerAddress:
    node_id: str | None
    """The node expected at this address; None accepts any trusted node (`--from HOST:PORT`)."""
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> PeerAddress:
        """`HOST:PORT`, `[V6]:PORT` or `NODEID@HOST:PORT`."""
        node_id, _, hostport = text.rpartition("@")
        m = re.fullmatch(r"\[([0-9a-fA-F:.]+)\]:(\d+)|([^:\[\]@]+):(\d+)", hostport)
        if not m or not 0 < int(m.group(2) or m.group(4)) <= 65535:
            raise InvalidInput(f"peer address {text!r} is not HOST:PORT or NODEID@HOST:PORT")
        host = m.group(1) or m.group(3)
        port = int(m.group(2) or m.group(4))
        return cls(format_node_id(parse_node_id(node_id)) if node_id else None, host, port)

    def __str__(self) -> str:
        """The form `parse` reads back: `[NODEID@]HOST:PORT`."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.node_id + '@' if self.node_id else ''}{host}:{self.port}"


@dataclass
class FetchResult:
    branch: str
    src: str
    parent: str | None
    fetched: list[str] = field(default_factory=list)
    """Branches fetched now, the requested one first; empty if it was already held."""
    bytes_received: int = 0
    """HTTP body bytes received from peers (sidecars, manifests, batches, blobs)."""
    lines_total: int = 0
    lines_fetched: int = 0
    dropped_peers: dict[str, str] = field(default_factory=dict)
    path: str | None = None
    written: bool = False
    conflict: str | None = None
    seconds_transfer: float = 0.0
    """Receiving and verifying the sessions' bytes (sidecars, manifests, lines, re-hash)."""
    seconds_store: float = 0.0
    """Storing the verified sessions (`Library.add_fetched`; the file is placed afterwards)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class LineageError(VerificationFailed):
    """A parent chain that loops or is deeper than the limit."""


class PeerStalled(PeerUnavailable):
    """A peer that made no progress for `Limits.progress_timeout` seconds: dropped at once."""


@dataclass(frozen=True)
class OpenPerUse:
    """The library of a one-shot fetch (no node running), opened for each local step (a
    look-up, the verified commit) and closed before the next wait on a peer: the store's
    lock is never held while a peer is slow, so other commands keep working meanwhile."""

    paths: NodePaths
    agent_dir: Path | None = None
    wait: float = 10.0
    """Seconds to wait for the store's lock when another command holds it."""

    def __call__(self) -> Library:
        deadline = time.monotonic() + self.wait
        while True:
            try:
                return Library.open(self.paths, self.agent_dir)
            except StoreLocked as exc:
                if time.monotonic() > deadline:
                    raise Conflict(f"{exc} for over {self.wait:g} s; the fetch's verified bytes were "
                                   "not stored") from None
                time.sleep(0.05)


LibraryOpener = Callable[[], AbstractContextManager[Any]]


def _opener(lib: Any) -> LibraryOpener:
    """An open Library (the node's) is used as it is; OpenPerUse opens one per step."""
    return lib if isinstance(lib, OpenPerUse) else (lambda: contextlib.nullcontext(lib))


class NotOffered(Exception):
    """The peer answered 404: it does not offer this object (or does not exist, same answer)."""


class _Peer:
    """One peer for the duration of a fetch: its HTTPS session and its standing."""

    def __init__(self, addr: PeerAddress, identity: Identity, trust: TrustStore, limits: wire.Limits) -> None:
        self.addr = addr
        self.limits = limits
        expected = parse_node_id(addr.node_id) if addr.node_id else None
        host = f"[{addr.host}]" if ":" in addr.host else addr.host
        self.base = f"https://{host}:{addr.port}"
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=client_context(identity, trust, expected, self._accepted),
                                           limit=4),
            timeout=aiohttp.ClientTimeout(total=None, connect=limits.connect_timeout,
                                          sock_connect=limits.connect_timeout,
                                          sock_read=limits.slow_reader_timeout),
            auto_decompress=False,
        )
        self.dropped: str | None = None
        """Why this peer was given up for this fetch (None: still in use)."""
        self.failure: type[P2PNodeError] = PeerUnavailable
        """What giving it up means: VerificationFailed (it lied), Refused (TLS/trust), PeerUnavailable."""
        self.network_errors = 0
        self.closed_after_handshake = 0
        """Network errors that were the peer hanging up on a TLS session we had accepted."""
        self.accepted: bytes | None = None
        """The fingerprint of the last server this side accepted in a handshake (tls.client_context)."""
        self.bytes_received = 0

    def _accepted(self, fingerprint: bytes) -> None:
        self.accepted = fingerprint

    async def close(self) -> None:
        await self.session.close()

    def request(self, method: str, path: str, **kw: Any) -> Any:
        """Every request to a peer: redirects are never followed (a 3xx could lead past the
        TLS pin, to plain http or to another host); `_check` refuses them."""
        return self.session.request(method, self.base + path, allow_redirects=False, **kw)

    def _check(self, resp: aiohttp.ClientResponse, what: str) -> None:
        if 300 <= resp.status < 400:
            raise wire.WireError(f"peer {self.addr} answered {resp.status} (a redirect) for {what}; "
                                 "peers must not redirect")
        if resp.status == 404:
            raise NotOffered(what)
        if resp.status == 403:
            raise Refused(f"peer {self.addr} refused the request for {what} (403)")
        if resp.status not in (200, 206):
            raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status,
                                              message=f"unexpected status for {what}")

    async def get_small(self, path: str, limit: int, what: str,
                        too_big: type[P2PNodeError] = wire.WireError) -> bytes:
        """A whole response body of at most `limit` bytes (larger is refused with `too_big`)."""
        async with self.request("GET", path) as resp:
            self._check(resp, what)
            if (resp.content_length or 0) > limit:
                raise too_big(f"{what}: peer announced {resp.content_length} bytes, limit {limit}")
            body = bytearray()
            async for chunk in resp.content.iter_any():
                body += chunk
                self.bytes_received += len(chunk)
                if len(body) > limit:
                    raise too_big(f"{what}: peer sent more than the limit of {limit} bytes")
            return bytes(body)

    async def sidecar(self, branch: str) -> tuple[bytes, Sidecar]:
        raw = await self.get_small(wire.PATH_OBJECT.format(hash=branch), self.limits.max_sidecar,
                                   f"sidecar {branch}", InvalidSidecar)
        return raw, parse_sidecar(raw, branch)

    async def line_manifest(self, src: str) -> list[LineRef]:
        limit = wire.LINE_MANIFEST_HEAD.size + self.limits.max_manifest_lines * wire.LINE_ENTRY.size
        body = await self.get_small(wire.PATH_LINES.format(src=src), limit, f"line manifest of {src}")
        return wire.decode_line_manifest(body, bytes.fromhex(src), self.limits)

    async def catalog(self) -> wire.CatalogMessage:
        body = await self.get_small(wire.PATH_CATALOG, self.limits.max_catalog_bytes, "catalog")
        return wire.decode_catalog(body, self.limits)


class _Pool:
    """The peers of one fetch, tried in turn for each step."""

    def __init__(self, peers: list[PeerAddress], identity: Identity, trust: TrustStore,
                 limits: wire.Limits) -> None:
        for p in peers:
            if p.node_id and not trust.is_trusted(parse_node_id(p.node_id)):
                raise Refused(f"node {p.node_id} is not trusted here; run `p2pnode trust {p.node_id}` first")
        self.peers = [_Peer(p, identity, trust, limits) for p in dict.fromkeys(peers)]
        self.me = identity.node_id
        self.limits = limits

    async def close(self) -> None:
        for p in self.peers:
            await p.close()

    @property
    def bytes_received(self) -> int:
        return sum(p.bytes_received for p in self.peers)

    def dropped(self) -> dict[str, str]:
        return {str(p.addr): p.dropped for p in self.peers if p.dropped}

    def drop(self, peer: _Peer, reason: str, failure: type[P2PNodeError]) -> None:
        peer.dropped, peer.failure = reason, failure
        log.warning("dropping peer %s for this fetch: %s", peer.addr, reason)

    async def run(self, what: str, op: Callable[[_Peer], Awaitable[T]]) -> T:
        """`op` on the first peer that does it; raises an error that says what each peer did."""
        not_offered: set[_Peer] = set()
        while True:
            active = [p for p in self.peers if not p.dropped and p not in not_offered]
            if not active:
                break
            for peer in active:
                peer.accepted = None  # set again if this attempt's handshake accepts the peer
                try:
                    return await self._watched(peer, op)
                except PeerStalled as exc:
                    self.drop(peer, str(exc), PeerUnavailable)
                except NotOffered:
                    not_offered.add(peer)
                except Refused as exc:
                    self.drop(peer, str(exc), Refused)
                except VerificationFailed as exc:  # lying bytes
                    self.drop(peer, f"sent data that failed verification: {exc}", VerificationFailed)
                except InvalidInput as exc:  # bytes that hash right but are not valid (a bad sidecar)
                    self.drop(peer, f"sent invalid data: {exc}", InvalidInput)
                except aiohttp.ClientConnectorCertificateError as exc:
                    self.drop(peer, f"TLS: {exc.certificate_error}", Refused)
                except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                    peer.network_errors += 1
                    # a peer that never answered a byte, though we accepted it in the handshake
                    peer.closed_after_handshake += (peer.accepted is not None and not peer.bytes_received
                                                    and _closed_by_peer(exc))
                    reason = _describe_network_error(exc, self.me)
                    log.info("peer %s: %s (attempt %d)", peer.addr, reason, peer.network_errors)
                    if peer.network_errors >= MAX_NETWORK_ERRORS:
                        if peer.closed_after_handshake == peer.network_errors:
                            self.drop(peer, self._one_sided(peer), Refused)
                        else:
                            self.drop(peer, reason, PeerUnavailable)
                    await asyncio.sleep(RETRY_PAUSE)
        raise self._failure(what, not_offered)

    def _one_sided(self, peer: _Peer) -> str:
        """We accepted the peer in the handshake and it hung up, unanswered, each time: it refused
        our certificate (a TLS 1.3 server checks the client's after the client is done)."""
        them = format_node_id(peer.accepted) if peer.accepted else peer.addr.node_id or "the peer"
        return (f"{them} closed every connection right after the TLS handshake: it does not trust this node "
                f"{self.me}; ask them to run: p2pnode trust {self.me}")

    async def _watched(self, peer: _Peer, op: Callable[[_Peer], Awaitable[T]]) -> T:
        """`op(peer)`, cancelled with PeerStalled when a `progress_timeout` window passes with
        fewer than `progress_bytes` received: the one deadline no phase of a request can dodge
        (a connect or TLS handshake that hangs, headers that never end, 1xx answers, a trickle)."""
        task = asyncio.ensure_future(op(peer))
        try:
            while True:
                mark = peer.bytes_received
                done, _ = await asyncio.wait([task], timeout=self.limits.progress_timeout)
                if done:
                    return task.result()
                moved = peer.bytes_received - mark
                if moved < self.limits.progress_bytes:
                    raise PeerStalled(f"no progress for {self.limits.progress_timeout:g} s ({moved} bytes, "
                                      f"fewer than {self.limits.progress_bytes}); peer dropped")
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    def _failure(self, what: str, not_offered: set[_Peer]) -> P2PNodeError:
        reasons = "; ".join(f"{p.addr}: {p.dropped or 'does not offer it'}" for p in self.peers)
        if not self.peers:
            return PeerUnavailable(f"{what}: no peer to fetch from (give --from HOST:PORT or a ticket)")
        if len(not_offered) == len(self.peers):
            return NotFound(f"{what}: not offered by any peer ({reasons})")
        failures = {p.failure for p in self.peers if p.dropped}
        if VerificationFailed in failures:
            return VerificationFailed(f"{what}: no peer sent verifiable data ({reasons})")
        if InvalidInput in failures:
            return InvalidInput(f"{what}: no peer sent valid data ({reasons})")
        if failures == {Refused}:
            return Refused(f"{what}: refused ({reasons})")
        return PeerUnavailable(f"{what}: no peer could deliver it ({reasons})")


def _closed_by_peer(exc: BaseException) -> bool:
    """Connected, then closed by the other side (not: could not connect).  A reset while TLS
    finishes is a ClientConnectorError without an errno: the peer hung up in the handshake."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        return not (isinstance(exc.os_error, OSError) and exc.os_error.errno)
    return isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError | ConnectionResetError)


def _describe_network_error(exc: BaseException, me: str) -> str:
    """One line for the user: no exception class names, no Python tuples (asyncio's texts have them)."""
    if _closed_by_peer(exc):
        return f"connection closed by the peer (cut link, or it does not trust this node {me})"
    if isinstance(exc, TimeoutError):
        return "timed out"
    os_error = exc.os_error if isinstance(exc, aiohttp.ClientConnectorError) else exc
    if isinstance(os_error, OSError) and os_error.errno:
        return f"cannot connect: {os.strerror(os_error.errno).lower()}"
    return str(exc) or "network error"


MAX_JSON_DEPTH = 512
"""Deepest JSON nesting accepted in a fetched line: well inside what Python's parser (used by
the store's title and JSON checks) recurses through, far beyond any real Pi entry."""
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def json_depth(line: bytes) -> int:
    """The deepest bracket nesting of a JSON line, strings left out (brackets inside strings
    are text); cheap for real lines, whose structural brackets are few."""
    depth = peak = 0
    for c in _JSON_STRING.sub(b"", line).translate(None, _NOT_BRACKETS):
        depth += 1 if c in b"[{" else -1
        peak = max(peak, depth)
    return peak


def check_nesting(lines: list[bytes], src: str) -> None:
    """InvalidInput for a line nested deeper than MAX_JSON_DEPTH, before anything is stored
    (only lines with more opening brackets than that are looked at)."""
    for number, line in enumerate(lines, 1):
        if line.count(b"[") + line.count(b"{") > MAX_JSON_DEPTH and json_depth(line) > MAX_JSON_DEPTH:
            raise InvalidInput(f"fetched session {src}: line {number} nests JSON deeper than "
                               f"{MAX_JSON_DEPTH} levels; refused")


def check_header(lines: list[bytes], src: str) -> None:
    """Refuse a session that is not a Pi session, or whose header fields would place it
    outside Pi's sessions dir or break Pi's id rule (InvalidHeader / HostileHeader), before
    anything is stored.  The header may follow blank or malformed lines, as pi 1.5.2 reads it."""
    placed_names(find_header(lines, f"fetched session {src}"))


class _Fetch:
    def __init__(self, lib: Any, pool: _Pool, limits: wire.Limits, progress: Progress | None) -> None:
        self.lib = _opener(lib)
        self.pool = pool
        self.limits = limits
        self.progress = progress
        self.lines: dict[bytes, bytes] = {}
        """Verified lines received in this fetch, kept across broken links and peers."""
        self.blobs: dict[bytes, StoredBlob] = {}
        """The same lines as the peer sent them (zstd), so that the store keeps those bytes."""
        self.lines_fetched = 0
        self.lines_total = 0
        self._done = self._total = 0

    async def _lib(self, fn: Callable[[Any], T]) -> T:
        """fn(library) on a worker thread, the library opened for this step only (OpenPerUse)."""
        return await _using(self.lib, fn)

    async def walk(self, branch: str) -> list[tuple[str, bytes, Sidecar]]:
        """The branches to fetch, requested first, up to the first one held locally."""
        chain: list[tuple[str, bytes, Sidecar]] = []
        seen: set[str] = set()
        current: str | None = branch
        while current is not None and not await self._lib(functools.partial(_has_branch, branch=current)):
            if current in seen:
                raise LineageError(f"lineage of {branch}: parent cycle at branch {current}")
            if len(chain) >= self.limits.max_chain_depth:
                raise LineageError(f"lineage of {branch} is deeper than {self.limits.max_chain_depth} "
                                   "generations; refused")
            seen.add(current)
            get_sidecar = functools.partial(_Peer.sidecar, branch=current)
            raw, sc = await self.pool.run(f"sidecar {current}", get_sidecar)
            chain.append((current, raw, sc))
            current = sc.parent
        return chain

    async def session(self, src: str) -> list[bytes]:
        """The verified lines of session `src` (by line manifest, else as one blob)."""
        while True:
            try:
                manifest_peer, manifest = await self.pool.run(
                    f"line manifest of {src}", lambda p: _with_peer(p, p.line_manifest(src)))
            except NotFound:
                return split_lines(await self._whole(src))
            missing = await self._missing(manifest)
            if missing:
                get_lines = functools.partial(self._batches, missing=missing)
                await self.pool.run(f"lines of session {src}", get_lines)
            lines = await self._assemble(manifest, src)
            if lines is not None:
                self.lines_total += len(manifest)
                return lines
            self.pool.drop(manifest_peer, f"sent a line manifest of {src} that does not hash to it, "
                                          "or does not cut it at its newlines (failed verification)",
                           VerificationFailed)

    async def _missing(self, manifest: list[LineRef]) -> list[LineRef]:
        unique = list({r.hash: r for r in manifest}.values())
        held = await self._lib(lambda lib: [lib.has_line(r.hash) for r in unique])
        return [r for r, h in zip(unique, held, strict=True) if not h]

    async def _batches(self, peer: _Peer, missing: list[LineRef]) -> None:
        """Ask `peer` for the missing lines not received yet, in batches of bounded size,
        BATCHES_IN_FLIGHT at a time so that the peer prepares one while we verify another."""
        self._total = sum(r.length for r in missing)
        todo = [r for r in missing if r.hash not in self.lines]
        self._done = self._total - sum(r.length for r in todo)
        groups: list[list[LineRef]] = [[]]
        size = 0
        for ref in todo:
            if len(groups[-1]) >= self.limits.max_batch_hashes or size >= self.limits.batch_target_bytes:
                groups.append([])
                size = 0
            groups[-1].append(ref)
            size += ref.length
        slots = asyncio.Semaphore(BATCHES_IN_FLIGHT)

        async def one(group: list[LineRef]) -> None:
            async with slots:
                await self._batch(peer, group)

        tasks = [asyncio.create_task(one(g)) for g in groups if g]
        try:
            await asyncio.gather(*tasks)
        finally:  # on the first failure, stop the others (what they verified is kept)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _batch(self, peer: _Peer, group: list[LineRef]) -> None:
        """One batch request.  Received blobs are decompressed and hashed on worker threads
        (both release the GIL) in runs of about DECODE_RUN bytes, while the next bytes are read."""
        decoder = wire.BatchDecoder([r.hash for r in group], self.limits)
        body = wire.encode_batch_request(r.hash for r in group)
        decoding: list[asyncio.Future[None]] = []
        run: list[wire.BatchBlob] = []
        run_bytes = 0
        try:
            async with peer.request("POST", wire.PATH_BATCH, data=body,
                                    headers={"Content-Type": "application/octet-stream"}) as resp:
                peer._check(resp, f"batch of {len(group)} lines")
                async for chunk in resp.content.iter_any():
                    peer.bytes_received += len(chunk)
                    for blob in decoder.feed(chunk):
                        run.append(blob)
                        run_bytes += blob.raw_len
                    if run_bytes >= DECODE_RUN:
                        decoding.append(asyncio.ensure_future(self._keep(run)))
                        run, run_bytes = [], 0
                decoder.finish()
            if run:
                decoding.append(asyncio.ensure_future(self._keep(run)))
            await asyncio.gather(*decoding)
        finally:  # a failure stops the rest; what was verified is kept
            for f in decoding:
                f.cancel()
            await asyncio.gather(*decoding, return_exceptions=True)
        if decoder.received != len(group):
            raise wire.WireError(f"peer sent {decoder.received} of the {len(group)} line blobs asked for")

    async def _keep(self, blobs: list[wire.BatchBlob]) -> None:
        """Verify received blobs (wire.decode_blob) and keep them, raw and as sent."""
        raws = await asyncio.to_thread(_decode_all, blobs)
        for blob, raw in zip(blobs, raws, strict=True):
            self.lines[blob.hash] = raw
            self.blobs[blob.hash] = blob
            self._done += blob.raw_len
        self.lines_fetched += len(blobs)
        if self.progress:
            self.progress(self._done, self._total)

    async def _assemble(self, manifest: list[LineRef], src: str) -> list[bytes] | None:
        """All lines in order, or None if the manifest lied: they do not hash to `src`, or
        they are not the file cut at its newlines."""
        def build(lib: Any) -> list[bytes] | None:
            lines = [self.lines.get(r.hash) or lib.line(r.hash) for r in manifest]
            hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
            for line in lines:
                hasher.update(line)
            return lines if hasher.hexdigest() == src and is_split(lines) else None

        return await self._lib(build)

    async def _whole(self, src: str) -> bytes:
        """Fallback: the session as one blob, resumed with Range after a broken link."""
        buf = bytearray()
        hasher = blake3.blake3()

        async def attempt(peer: _Peer) -> bytes:
            nonlocal hasher
            headers = {"Range": f"bytes={len(buf)}-"} if buf else {}
            async with peer.request("GET", wire.PATH_OBJECT.format(hash=src), headers=headers) as resp:
                peer._check(resp, f"session {src}")
                if resp.status == 200 and buf:  # the peer ignored Range: start over
                    buf.clear()
                    hasher = blake3.blake3()
                total = _total_size(resp, len(buf))
                if total > self.limits.max_session:
                    raise wire.WireError(f"session {src}: {total} bytes is over {self.limits.max_session}")
                async for chunk in resp.content.iter_any():
                    peer.bytes_received += len(chunk)
                    if len(buf) + len(chunk) > total:
                        raise wire.WireError(f"session {src}: more than the {total} bytes announced")
                    buf.extend(chunk)
                    hasher.update(chunk)
                    if self.progress:
                        self.progress(len(buf), total)
                if len(buf) != total:
                    raise aiohttp.ClientPayloadError(f"session {src}: cut at {len(buf)} of {total} bytes")
            got = hasher.hexdigest()
            if got != src:
                buf.clear()
                hasher = blake3.blake3()
                raise wire.HashMismatch(bytes.fromhex(src), bytes.fromhex(got), "session")
            return bytes(buf)

        return await self.pool.run(f"session {src}", attempt)


async def _using(opener: LibraryOpener, fn: Callable[[Any], T]) -> T:
    def run() -> T:
        with opener() as lib:
            return fn(lib)

    return await asyncio.to_thread(run)


def _has_branch(lib: Any, branch: str) -> bool:
    return bool(lib.has_branch(branch))


def _decode_all(blobs: list[wire.BatchBlob]) -> list[bytes]:
    return [wire.decode_blob(b) for b in blobs]


async def _with_peer(peer: _Peer, coro: Awaitable[T]) -> tuple[_Peer, T]:
    return peer, await coro


def _total_size(resp: aiohttp.ClientResponse, offset: int) -> int:
    if resp.status == 206:
        m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+)", resp.headers.get("Content-Range", ""))
        if not m or int(m.group(1)) != offset:
            raise wire.WireError(f"Content-Range {resp.headers.get('Content-Range')!r} for offset {offset}")
        return int(m.group(3))
    if resp.content_length is None:
        raise wire.WireError("whole-blob response without Content-Length")
    return resp.content_length


async def fetch_branch(lib: Any, branch_hex: str, peers: list[PeerAddress], identity: Identity,
                       trust: TrustStore, *, agent_dir: Path | None = None, progress: Progress | None = None,
                       limits: wire.Limits = wire.DEFAULT_LIMITS,
                       session_dir: Path | None = None) -> FetchResult:
    """Fetch `branch_hex` and the ancestors this node lacks; see the module docstring.
    `lib`: an open Library, or OpenPerUse (a one-shot fetch that must not hold the store).
    `session_dir`: Pi's session-dir override, where the session is then placed (flat)."""
    wire.check_hex_hash(branch_hex, "branch hash")
    opener = _opener(lib)
    pool = _Pool(peers, identity, trust, limits)
    requested: bytes | None = None
    try:
        job = _Fetch(lib, pool, limits, progress)
        t0 = time.perf_counter()
        chain = await job.walk(branch_hex)
        transfer = store = 0.0
        for branch, raw_sidecar, sc in reversed(chain):
            lines = await job.session(sc.src)
            check_header(lines, sc.src)
            await asyncio.to_thread(check_nesting, lines, sc.src)
            t1 = time.perf_counter()
            blobs = list(job.blobs.values())
            add = functools.partial(_add_fetched, sidecar=raw_sidecar, lines=lines, blobs=blobs)
            try:
                await _using(opener, add)
            except RecursionError:
                raise InvalidInput(f"fetched session {sc.src}: JSON nested too deeply; refused") from None
            if branch == branch_hex:
                requested = b"".join(lines)
            t2 = time.perf_counter()
            log.info("fetched branch %s: %d lines, transfer+verify %.3f s, store %.3f s",
                     branch, len(lines), t1 - t0, t2 - t1)
            transfer, store, t0 = transfer + t1 - t0, store + t2 - t1, t2
        info = await _using(opener, lambda lib: lib.branch(branch_hex))
        result = FetchResult(branch=branch_hex, src=info.src, parent=info.parent,
                             fetched=[b for b, _, _ in chain], bytes_received=pool.bytes_received,
                             lines_total=job.lines_total, lines_fetched=job.lines_fetched,
                             dropped_peers=pool.dropped(), seconds_transfer=round(transfer, 4),
                             seconds_store=round(store, 4))
    finally:
        await pool.close()
    if agent_dir is not None:  # only now, after the store committed the verified session
        placed = await _using(opener, lambda lib: _place(agent_dir, requested, branch_hex, info.src, lib,
                                                         session_dir))
        if isinstance(placed, PlacementConflict):
            result.path, result.conflict = str(placed.path), str(placed)
        else:
            result.path, result.written = str(placed.path), placed.written
    return result


def _add_fetched(lib: Any, sidecar: bytes, lines: list[bytes], blobs: list[StoredBlob]) -> None:
    lib.add_fetched(sidecar, lines, blobs)


def _place(agent_dir: Path, data: bytes | None, branch: str, src: str, lib: Any,
           session_dir: Path | None) -> Placement | PlacementConflict:
    """Place the fetched bytes (or, for a branch already held, the stored copy); record the path."""
    try:
        placed = place_session(agent_dir, data if data is not None else lib.session_bytes(src), src,
                               PlacedFiles(lib.paths.placed), session_dir)
    except PlacementConflict as exc:
        return exc
    lib.record_path(branch, placed.path)
    return placed


async def get_catalog(peer: PeerAddress, identity: Identity, trust: TrustStore,
                      limits: wire.Limits = wire.DEFAULT_LIMITS) -> wire.CatalogMessage:
    """The branches `peer` offers us (it must trust us, and we it)."""
    pool = _Pool([peer], identity, trust, limits)
    try:
        return await pool.run(f"catalog of {peer}", lambda p: p.catalog())
    finally:
        await pool.close()
