"""Fetching a branch and its lineage from peers, verifying every byte before it is kept.

Over 400 lines on purpose: the fetch's steps (lineage walk, manifests, batches, assembly, the
whole-blob fallback, the checks before commit) share one _Fetch state and read in order.

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
   (pi/placement.py), if `agent_dir` is given: a refused fetch leaves no file behind.

How missing lines are asked for and verified is batches.py's; which peer is asked and what its
failure means is the downloader's (downloader.py: a peer that lies or stalls is dropped for
the fetch, a broken link is retried a few times); one peer's HTTPS session is link.py's.
Verified lines and blob prefixes survive a broken link, so the next attempt, on the same or
another peer, continues where the last one stopped.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
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
    VerificationFailed,
)
from p2pnode.library.api import Library
from p2pnode.library.manifest import PlacedFiles
from p2pnode.paths import NodePaths
from p2pnode.peer import batches, wire
from p2pnode.peer.address import PeerAddress
from p2pnode.peer.downloader import PeerPool
from p2pnode.peer.identity import Identity
from p2pnode.peer.interfaces import FetchTarget
from p2pnode.peer.link import PeerLink
from p2pnode.peer.trust import TrustStore
from p2pnode.pi.lines import LineRef, is_split, split_lines
from p2pnode.pi.placement import Placement, PlacementConflict, place_session
from p2pnode.pi.session import find_header, placed_names
from p2pnode.pi.sidecar import Sidecar
from store import StoredBlob
from store.errors import StoreLocked

log = logging.getLogger(__name__)
T = TypeVar("T")

Progress = Callable[[int, int], None]
"""progress(bytes_done, bytes_total) while session bytes arrive."""


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
    served: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per peer not dropped or that delivered lines: {"lines": n, "bytes": raw bytes} first delivered."""
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


LibraryOpener = Callable[[], AbstractContextManager[FetchTarget]]


def _opener(lib: FetchTarget | OpenPerUse) -> LibraryOpener:
    """An open Library (the node's) is used as it is; OpenPerUse opens one per step."""
    return lib if isinstance(lib, OpenPerUse) else (lambda: contextlib.nullcontext(lib))


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
    def __init__(self, lib: FetchTarget | OpenPerUse, pool: PeerPool, limits: wire.Limits,
                 progress: Progress | None) -> None:
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

    async def _lib(self, fn: Callable[[FetchTarget], T]) -> T:
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
            get_sidecar = functools.partial(PeerLink.sidecar, branch=current)
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
                self._total = sum(r.length for r in missing)
                self._done = sum(r.length for r in missing if r.hash in self.lines)
                await batches.get_lines(self.pool, f"lines of session {src}", missing, self.limits,
                                        self.lines.__contains__, self._keep)
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

    async def _keep(self, blobs: list[wire.BatchBlob], raws: list[bytes]) -> None:
        """Keep verified blobs (batches.py checked them), raw and as sent."""
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
        def build(lib: FetchTarget) -> list[bytes] | None:
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

        async def attempt(peer: PeerLink) -> bytes:
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


async def _using(opener: LibraryOpener, fn: Callable[[FetchTarget], T]) -> T:
    def run() -> T:
        with opener() as lib:
            return fn(lib)

    return await asyncio.to_thread(run)


def _has_branch(lib: FetchTarget, branch: str) -> bool:
    return lib.has_branch(branch)


async def _with_peer(peer: PeerLink, coro: Awaitable[T]) -> tuple[PeerLink, T]:
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


async def fetch_branch(lib: FetchTarget | OpenPerUse, branch_hex: str, peers: list[PeerAddress],
                       identity: Identity, trust: TrustStore, *, agent_dir: Path | None = None,
                       progress: Progress | None = None, limits: wire.Limits = wire.DEFAULT_LIMITS,
                       session_dir: Path | None = None) -> FetchResult:
    """Fetch `branch_hex` and the ancestors this node lacks; see the module docstring.
    `lib`: an open Library, or OpenPerUse (a one-shot fetch that must not hold the store).
    `session_dir`: Pi's session-dir override, where the session is then placed (flat)."""
    wire.check_hex_hash(branch_hex, "branch hash")
    opener = _opener(lib)
    pool = PeerPool(peers, identity, trust, limits)
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
                             seconds_store=round(store, 4), served=pool.served())
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


def _add_fetched(lib: FetchTarget, sidecar: bytes, lines: list[bytes], blobs: list[StoredBlob]) -> None:
    lib.add_fetched(sidecar, lines, blobs)


def _place(agent_dir: Path, data: bytes | None, branch: str, src: str, lib: FetchTarget,
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
    pool = PeerPool([peer], identity, trust, limits)
    try:
        return await pool.run(f"catalog of {peer}", lambda p: p.catalog())
    finally:
        await pool.close()
