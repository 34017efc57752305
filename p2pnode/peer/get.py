"""Fetching a branch and its lineage from peers, verifying every byte once, before it is kept.

Over 400 lines on purpose: the fetch's steps (lineage walk, manifests, staging, the whole-blob
fallback, commit and placement) share one _Fetch state and read in order.

Entry points (for the CLI and the LAN node):

    result = await fetch_branch(lib, branch_hex, [PeerAddress(node_id, host, port), ...],
                                identity, trust, agent_dir=..., progress=...)
    catalog = await get_catalog(PeerAddress(...), identity, trust)

The order of work, and why (verify once, stream, commit last):
1. Walk the lineage by sidecars only: each sidecar must hash to the branch asked for and
   validate; follow `parent` until a branch this node already holds, with a depth limit and
   cycle detection.  Nothing is stored yet, so a lying chain costs nothing.
2. For each missing branch, oldest first: the session's line manifest, then only the lines
   the store lacks (lines staged by an earlier fetch that was killed count as held; its
   manifest, kept in `fetching/`, is not asked for again: KeptManifests), in framed batches
   (batches.py decodes and hashes each line once, on arrival).  Verified lines
   are staged in the store at once, as the peer sent them, in runs (STAGE_RUNS;
   `Library.stage_lines`: not decoded or hashed again), and handed to the getter
   (getter.py, sans-IO), which walks the manifest in order: it hashes the session, checks
   Pi's header (within the first 1 MiB) and each line's nesting and cut, and hands out the
   bytes, which go to a temp file in the node's home (`fetching/`, pi/placement.py).  Lines ahead
   of the cursor wait in a bounded buffer or are read back from the store.  A peer without
   line manifests gets the whole-blob fallback: a streamed GET with `Range` resume, hashed on
   the fly.
3. Only when the session hashes to the sidecar's `src` and is cut at its newlines is the
   version committed (`Library.add_staged`: turns referencing the staged blobs, a head
   moves, the branch recorded); then the temp file is fsynced and linked into Pi's folder
   (pi/placement.py), and the folder fsynced.  A refused or cancelled fetch removes its temp
   file and records nothing; its staged lines are unreferenced, garbage for the store's GC.
   A branch held already is placed from the stored copy; where that cannot be read back (a
   damaged record), it is fetched again as in 2, only the lines found damaged from peers,
   and storing them heals the store.

How missing lines are asked for and verified is batches.py's; which peer is asked and what
its failure means is the downloader's (downloader.py); one peer's HTTPS session is link.py's.
Staged lines and blob prefixes survive a broken link, so the next attempt, on the same or
another peer, continues where the last one stopped; staged lines survive a kill -9 too.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import struct
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import blake3

from p2pnode.errors import Conflict, NotFound, P2PNodeError, VerificationFailed, naming
from p2pnode.library.api import BranchInfo, Library
from p2pnode.library.manifest import PlacedFiles
from p2pnode.library.sessions import DamagedCopy
from p2pnode.paths import NodePaths
from p2pnode.peer import batches, https, wire
from p2pnode.peer.address import PeerAddress
from p2pnode.peer.downloader import PeerPool
from p2pnode.peer.getter import LIVE, READ_BACK, Assembled, Held, ManifestLied, SessionGetter
from p2pnode.peer.heldlines import PlacedLines, held_run, placed_lines, read_held
from p2pnode.peer.identity import Identity
from p2pnode.peer.interfaces import FetchTarget
from p2pnode.peer.link import Connections, PeerLink
from p2pnode.peer.pace import KEPT_BYTES, Measures
from p2pnode.peer.trust import TrustStore
from p2pnode.pi.hashing import Prefix, new_hasher, prefix_hasher
from p2pnode.pi.lines import LineRef, line_runs, ref_runs
from p2pnode.pi.placement import (
    Appendable,
    Content,
    Placement,
    PlacementConflict,
    SessionFile,
    appendable,
    header_moved,
    target_path,
)
from p2pnode.pi.session import SessionHeader
from p2pnode.pi.sidecar import Sidecar
from store import StoredBlob
from store.errors import StoreLocked
from store.layout import CODEC_RAW
from sysio.background import in_background
from sysio.files import atomic_write
from sysio.memory import give_back_freed

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
    """Receiving, verifying and staging the sessions' lines, hashing them in order and writing
    the temp file (sidecars, manifests and lines): until the last line was handed out."""
    seconds_store: float = 0.0
    """Committing the verified sessions (`Library.add_staged`) and publishing the file: what
    is left after the last byte arrived."""
    note: str | None = None
    """What the user is told when the branch fetched is not the one named (node/follow.py), or
    when its path holds a newer version of the session, which was kept (Placement.newer)."""
    healed: int = 0
    """Lines of a branch held already whose stored copy could not be read back (a damaged
    record): the branch was fetched again, those lines from peers, and storing them healed
    the store."""

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
    taken: Callable[[], bool] = lambda: False
    """Whether a process that keeps the store (a node) started meanwhile: then waiting for
    the lock is pointless (StoreTaken, and the fetch goes on through that node)."""

    def __call__(self) -> Library:
        try:
            lib = Library.open_unless(self.paths, self.agent_dir, wait=self.wait, pointless=self.taken)
        except StoreLocked as exc:
            raise Conflict(f"{exc} for over {self.wait:g} s; the fetch's verified bytes were "
                           "not stored") from None
        if lib is None:
            raise StoreTaken(f"a node started for {self.paths.home} while this fetch ran here, and holds "
                             "the store now")
        return lib


class StoreTaken(Conflict):
    """A one-shot fetch met a node that started meanwhile and keeps the store: the lines it
    stored already are the node's too (the node's fetch asks only for the others)."""


LINGER = 0.5
"""Seconds a one-shot fetch keeps the store open after a step, waiting for the next."""


class _Lingering:
    """The library a fetch's steps run on, one step at a time, each on a worker thread.  A
    one-shot fetch's (OpenPerUse) is opened at its first step and stays open from one step to
    the next while they come (an opening scans the store's unindexed tail: more than most
    steps cost, and a grown session's fetch took four), and is closed after LINGER seconds
    without one: a stalled peer never keeps the store from other commands.  An open Library
    (the node's) is used as it is."""

    def __init__(self, lib: FetchTarget | OpenPerUse) -> None:
        self._opener: Callable[[], AbstractContextManager[FetchTarget]] = (
            lib if isinstance(lib, OpenPerUse) else (lambda: contextlib.nullcontext(lib)))
        self._lock = asyncio.Lock()
        self._open: AbstractContextManager[FetchTarget] | None = None
        self._held: FetchTarget
        self._timer: asyncio.TimerHandle | None = None
        self._closing: set[asyncio.Future[None]] = set()

    async def __call__(self, fn: Callable[[FetchTarget], T]) -> T:
        """fn(library) on a worker thread, after the steps before it."""
        async with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

            def run() -> T:
                if self._open is None:
                    opened = self._opener()
                    self._held, self._open = opened.__enter__(), opened
                return fn(self._held)

            work = asyncio.ensure_future(asyncio.to_thread(run))
            try:
                try:
                    return await asyncio.shield(work)
                except asyncio.CancelledError:  # the thread goes on: nothing else may touch the library
                    while not work.done():      # or close it under it, however often we are cancelled
                        with contextlib.suppress(asyncio.CancelledError):
                            await asyncio.wait([work])
                    if not work.cancelled():
                        work.exception()  # seen (no "never retrieved" at GC): the cancellation goes on
                    raise
            finally:
                if self._open is not None:
                    self._timer = asyncio.get_running_loop().call_later(LINGER, self._idle)

    def _idle(self) -> None:
        self._timer = None
        closing = asyncio.ensure_future(self.release())
        self._closing.add(closing)  # a reference until it is done
        closing.add_done_callback(self._closing.discard)

    async def release(self) -> None:
        """Close the library if it is open (before anything else opens the store)."""
        async with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._open is not None:
                opened, self._open = self._open, None
                await asyncio.to_thread(opened.__exit__, None, None, None)


STAGE_MIN, STAGE_MAX = 256 << 10, 4 << 20
STAGE_RUNS = 128
"""Verified lines are staged in the store in runs of 1/STAGE_RUNS of what is missing, within
[STAGE_MIN, STAGE_MAX] raw bytes: one durable commit per run, and a kill -9 loses at most
about one run's worth of transfer."""


KEPT_HEAD = struct.Struct("<Q")
"""A kept manifest's file (`KeptManifests`): the raw bytes of the lines the fetch's first run
asked for, then the line manifest as the peer sent it (PROTOCOL.md's version 1)."""


@dataclass(frozen=True)
class KeptManifests:
    """Line manifests kept in the fetch's staging dir (`fetching/<src>.lines`) from the first
    run of a fetch until its version is verified: a fetch killed (or failed) and run again
    asks the peer only for the lines it still lacks, not for the manifest again (36 bytes a
    line: ~1 % of a session's wire bytes), and cuts its batches as the first run did.  Not
    trusted: decoded and checked as a peer's is, and its lines must hash to `src` as a peer's
    must; one that fails is removed and a peer asked.  Not durable (no fsync): a lost or torn
    one fails the decode and costs one manifest.  Beside it (`fetching/<src>.pace`), what the
    fetch measured of its batch formats (pace.Measures): a hint for the next run, decoded
    defensively, and one that does not decode is removed."""

    directory: Path

    def path(self, src: str) -> Path:
        return self.directory / f"{src}.lines"

    def pace_path(self, src: str) -> Path:
        return self.directory / f"{src}.pace"

    def load(self, src: str, limits: wire.Limits) -> tuple[list[LineRef], int] | None:
        """The kept manifest of `src` and the raw bytes its first run asked for, if any."""
        try:
            data = self.path(src).read_bytes()
        except FileNotFoundError:
            return None
        try:
            if len(data) < KEPT_HEAD.size:
                raise wire.WireError(f"kept line manifest of {src}: {len(data)} bytes")
            (sized,) = KEPT_HEAD.unpack_from(data)
            return wire.decode_line_manifest(data[KEPT_HEAD.size:], bytes.fromhex(src), limits), sized
        except wire.WireError as exc:
            log.info("%s; asking a peer", exc)
            self.drop(src)
            return None

    def save(self, src: str, body: bytes, sized: int) -> None:
        """Keep `body` (a version-1 manifest of `src`); a failure only costs the next run a manifest."""
        self._write(self.path(src), KEPT_HEAD.pack(sized) + body, f"line manifest of {src}")

    def load_pace(self, src: str) -> Measures | None:
        """What the last run of the fetch of `src` measured of its batch formats, if kept."""
        path = self.pace_path(src)
        try:
            with path.open("rb") as f:
                data = f.read(KEPT_BYTES + 1)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.info("batch format measures of %s not read: %s", src, exc)
            return None
        try:
            return Measures.decode(data)
        except ValueError as exc:
            log.info("kept batch format measures of %s: %s; measured anew", src, exc)
            path.unlink(missing_ok=True)
            return None

    def save_pace(self, src: str, measures: Measures) -> None:
        """Keep `measures` (a few hundred bytes, a few times a fetch: written where they are
        taken, on the event loop); a failure only costs the next run a try of each format."""
        self._write(self.pace_path(src), measures.encode(), f"batch format measures of {src}")

    def _write(self, path: Path, data: bytes, what: str) -> None:
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            atomic_write(path, data, durable=False)
        except OSError as exc:
            log.info("%s not kept: %s", what, exc)

    def drop(self, src: str) -> None:
        self.path(src).unlink(missing_ok=True)
        self.pace_path(src).unlink(missing_ok=True)


class _ManifestStop(Exception):
    """Raised out of the `received` callback when the manifest proved a lie: not the batch
    peer's fault (the downloader does not judge it), so it ends get_lines for session() to
    drop the manifest's peer."""

    def __init__(self, lie: ManifestLied) -> None:
        super().__init__(str(lie))
        self.lie = lie


@dataclass(frozen=True)
class Placing:
    """Where the requested session goes: Pi's agent dir (and its session-dir override), and the
    branch it forks (`parent`), whose placed file may give the lines they share (heldlines.py)."""

    agent_dir: Path
    session_dir: Path | None
    parent: str | None = None


@dataclass(frozen=True)
class _Prefix:
    """An incremental fetch's held part: the first `lines` lines (`size` bytes), those of
    version `base`.  Their refs are not read from the store: the getter's manifest has HELD
    in their places (its cursor starts after them) and the commit continues `base`'s turns."""

    base: str
    base_size: int
    lines: int
    size: int
    hashing: Future[blake3.blake3] | None = None
    """The placed file of `base` being hashed on a thread of its own while the new lines come
    (the getter's Held has no hasher then): checked against `base` when taken, `_Stream._held_hash`."""
    walked: Sequence[LineRef] | None = None
    """The held lines' refs when the getter walks them again, read back from the store (it
    has no Held then): `base` was placed with its header moved first (placement.header_moved),
    so the new version's placed bytes are not the held ones followed by the new ones, and
    their hash is not the session's; the file is written whole and replaces the placed one."""


HELD = LineRef(bytes(32), 0)
"""A held line's place in an incremental fetch's manifest (never asked for, taken or stored)."""


@dataclass
class Output:
    """The temp file a session went to, and how it is published: linked as a new file, or
    (`append`) appended from offset `start` to the older version placed at the target."""

    file: SessionFile
    append: Appendable | None = None
    start: int = 0


class _Stream:
    """One session version's lines as they come: staged in the store in runs of `stage_bytes`
    (sized from the `missing` raw bytes peers are asked for), handed to the getter, and its
    in-order output written to the temp file (if any).  All of it on a worker thread, one run
    at a time."""

    def __init__(self, job: _Fetch, getter: SessionGetter, missing: int, place: Placing | None,
                 prefix: _Prefix | None = None, check_each: bool = False) -> None:
        self.job = job
        self.getter = getter
        self.place = place
        self.prefix = prefix
        self.out: Output | None = None
        self._pending_hashes: set[bytes] = set()
        """The hashes of `_pending` (and of the run being taken): with the getter's
        `outstanding`, what was received already, in memory that shrinks as lines are taken."""
        self._pending: list[tuple[wire.BatchBlob, bytes]] = []
        self._pending_bytes = 0
        self._lock = asyncio.Lock()
        self._parent: PlacedLines | None = None
        """The fork's parent's placed file (heldlines.py), once `_looked_up`."""
        self._looked_up = False
        self.check_each = check_each
        """Each held line read from the parent's placed file is checked by its hash (a run
        taken on its ends' hashes proved wrong: heldlines.py)."""
        self.unchecked = False
        """Held lines came from the parent's placed file unchecked one by one: if the session
        does not hash to src, that file may be what was wrong, not the manifest."""
        self._held_cpu = 0.0
        self.stage_bytes = min(STAGE_MAX, max(STAGE_MIN, missing // STAGE_RUNS))

    async def received(self, blobs: list[wire.BatchBlob], raws: list[bytes]) -> None:
        """batches.py's callback: verified blobs (each decoded and hashed once, there)."""
        lines = size = 0
        for blob, raw in zip(blobs, raws, strict=True):
            if not self.have(blob.hash):
                self._pending_hashes.add(blob.hash)
                self._pending.append((blob, raw))
                lines += 1
                size += len(raw)
        if lines:
            self._pending_bytes += size
            self.job.note(size, lines)
        if self._pending_bytes >= self.stage_bytes:
            await self.flush(wait=False)

    def have(self, line_hash: bytes) -> bool:
        """True once a line was received (it is not asked for, nor taken, again)."""
        return line_hash in self._pending_hashes or line_hash not in self.getter.outstanding

    async def flush(self, wait: bool = True) -> None:
        """Stage what is pending and hand out what the cursor can reach (store reads included).
        Unless `wait`, the lines are only staged and handed to the getter while the placed file
        an incremental fetch continues is still being hashed: the next batches are not held up
        by it (they are, when the verification of one waits here)."""
        async with self._lock:
            run, self._pending, self._pending_bytes = self._pending, [], 0
            try:
                await self.job.lib(functools.partial(self._take, run, wait=wait))
            except ManifestLied as lie:
                raise _ManifestStop(lie) from None

    async def settle(self, fn: Callable[[FetchTarget], T]) -> T:
        """fn(library) once the version is verified (its commit and placing), after the last
        run is staged: a one-shot fetch does not close and reopen the store between its last
        line and its commit (the store's index of the new lines would be written at the
        close, and every line looked up in it again)."""
        async with self._lock:
            return await self.job.lib(fn)

    def _take(self, run: list[tuple[wire.BatchBlob, bytes]], lib: FetchTarget, wait: bool) -> None:
        if run:
            lib.stage_lines([blob for blob, _ in run])
        for blob, raw in run:
            self.getter.arrived(blob.hash, raw)
        self._pending_hashes.difference_update(blob.hash for blob, _ in run)
        if self.getter.held_hash_due:
            assert self.prefix is not None and self.prefix.hashing is not None
            if not wait and not self.prefix.hashing.done():
                return  # the lines wait in the getter (or staged, beyond its ahead_limit)
            self._held_hash(lib)
        while True:
            self._write(self.getter.ready(), lib)
            wanted = self.getter.from_store()
            if not wanted:
                if self.getter.done and self.out is None and self.getter.refused is None:
                    self._write([], lib, force=True)  # an incremental fetch with nothing new to write
                return
            cpu = time.process_time()
            at, parent = self.getter.cursor, self._parent_file(lib)
            refs = self.getter.refs[at:at + len(wanted)]
            block = None if self.check_each else held_run(parent, refs, at, self.getter.size)
            if block is not None:
                self.unchecked = True
                self._write(self.getter.take_run(block, len(refs)), lib)
            else:
                self.getter.read_back(wanted, read_held(lib, refs, self.getter.size, parent))
            self._write(self.getter.ready(), lib)  # their parts: written here, timed with them
            self._held_cpu += time.process_time() - cpu

    def _held_hash(self, lib: FetchTarget) -> None:
        """The held lines' hash state for the getter: the placed file's, hashed meanwhile, if
        it is still `base` (it changed under its unchanged stat, or went: the store's lines)."""
        assert self.prefix is not None and self.prefix.hashing is not None
        try:
            hasher: blake3.blake3 | None = self.prefix.hashing.result()
        except OSError as exc:
            log.info("held version %s not hashed from its placed file: %s", self.prefix.base, exc)
            hasher = None
        if hasher is None or hasher.hexdigest() != self.prefix.base:
            hasher = _store_hasher(lib, lib.line_manifest(self.prefix.base)[:self.prefix.lines])
        self.getter.hash_held(hasher)

    def held_cpu(self) -> float:
        """CPU seconds of the process while the worker read held lines back: work no received
        byte causes.  The whole process's clock, not the worker's: the store decodes and hashes
        the lines on its own threads (store.get_blobs), which the worker's clock does not see
        (a resumed 256 MB fetch: 0.58 s on the worker, 1.21 s in all).  What the receiving did
        meanwhile (a few MB of it) is counted in too."""
        return self._held_cpu

    def _parent_file(self, lib: FetchTarget) -> PlacedLines | None:
        """The placed file of the branch this one forks (looked up once), if it can give held lines."""
        if not self._looked_up:
            self._looked_up = True
            place = self.place
            self._parent = None if place is None or place.parent is None else placed_lines(
                lib, place.parent, place.agent_dir, place.session_dir, self.getter.refs)
        return self._parent

    def _write(self, parts: Iterable[bytes | memoryview], lib: FetchTarget, force: bool = False) -> None:
        """The getter's parts to the temp file (opened at the first one, or when `force`d);
        all of them consumed, also where nothing is placed."""
        for part in parts:
            if self.place is not None:
                if self.out is None:
                    self.out = self._open_out(lib)
                self.out.file.write(part)
        if force and self.place is not None and self.out is None:
            self.out = self._open_out(lib)

    def _open_out(self, lib: FetchTarget) -> Output:
        """The temp file, once the header is known.  An incremental fetch appends to the older
        version's file if that is still exactly what this node placed (only the new bytes go
        to the temp file); else the held lines are written first, from the store (unless the
        getter walks them: `_Prefix.walked`)."""
        assert self.place is not None and self.getter.header is not None
        place = self.place
        file = SessionFile.create(place.agent_dir, self.getter.header, self.getter.src, place.session_dir,
                                  staging=lib.paths.fetching)
        if self.prefix is None or self.prefix.walked is not None:
            return Output(file)
        prefix = self.prefix
        to = appendable(file.target, PlacedFiles(lib.paths.placed), prefix.base, prefix.base_size,
                        prefix.size == prefix.base_size)
        if to is not None:
            return Output(file, to, self.prefix.size)
        for run in _held_runs(lib, lib.line_manifest(prefix.base)[:prefix.lines]):
            file.write(run)
        return Output(file)

    def discard(self) -> None:
        if self.out is not None:
            self.out.file.discard()
            self.out = None

    async def abandon(self) -> None:
        """The manifest lied: the temp file goes, the verified lines pending are staged."""
        self.discard()
        async with self._lock:
            run, self._pending, self._pending_bytes = self._pending, [], 0
            if run:
                await self.job.lib(lambda lib: lib.stage_lines([blob for blob, _ in run]))


class _Fetch:
    def __init__(self, lib: FetchTarget | OpenPerUse, pool: PeerPool, limits: wire.Limits,
                 progress: Progress | None) -> None:
        self.lib = _Lingering(lib)
        self.kept = KeptManifests(lib.paths.fetching)
        self.pool = pool
        self.limits = limits
        self.progress = progress
        self.lines_fetched = 0
        self.lines_total = 0
        self._done = self._total = 0
        self.ahead: _HashAhead | None = None
        """Set by fetch_branch when it knows the session fetched and where it goes."""

    def note(self, raw_bytes: int, lines: int) -> None:
        """Lines received (a decoded run's at a time: progress is not redrawn per line)."""
        self._done += raw_bytes
        self.lines_fetched += lines
        if self.progress:
            self.progress(self._done, self._total)

    async def walk(self, branch: str) -> list[tuple[str, bytes, Sidecar]]:
        """The branches to fetch, requested first, up to the first one held locally."""
        chain: list[tuple[str, bytes, Sidecar]] = []
        seen: set[str] = set()
        current: str | None = branch
        ahead = self.ahead
        while current is not None and not await self.lib(functools.partial(_has_branch, branch=current,
                                                                            ahead=ahead)):
            ahead = None
            if current in seen:
                raise LineageError(f"lineage of {branch}: parent cycle at branch {current}")
            if len(chain) >= self.limits.max_chain_depth:
                raise LineageError(f"lineage of {branch} is deeper than {self.limits.max_chain_depth} "
                                   "generations; refused")
            seen.add(current)
            of = "" if current == branch else f" (an ancestor of branch {branch})"
            chain.append(await self.sidecar(current, of))
            current = chain[-1][2].parent
        return chain

    async def sidecar(self, branch: str, of: str = "") -> tuple[str, bytes, Sidecar]:
        """(branch, its sidecar's bytes, parsed) from a peer, verified to hash to `branch`;
        `of`: what the branch is to the one the user asked for, for the errors."""
        get_sidecar = functools.partial(PeerLink.sidecar, branch=branch)
        raw, sc = await self.pool.run(f"sidecar of branch {branch}{of}", get_sidecar)
        return branch, raw, sc

    async def session(self, src: str, place: Placing | None, held: list[str] | None = None,
                      starts_with: tuple[str, int] | None = None
                      ) -> tuple[Assembled, _Stream, _Prefix | None]:
        """Session `src` verified (by line manifest, else as one blob), its lines staged in the
        store, its bytes in a temp file for `place` (the stream's `out`, not yet published), and
        the held version it extends, if fetched incrementally.  `held`: versions this node
        holds that `src` may extend (asked for with `?after=`); `starts_with`: the getter's.
        The caller settles the version through the stream (`_Stream.settle`), then releases it."""
        after = held or []
        check_each = False
        while True:
            kept = await asyncio.to_thread(self.kept.load, src, self.limits)
            manifest_peer: PeerLink | None = None
            got: list[LineRef] | wire.ManifestAfter
            sized_as: int | None = None
            body = b""
            if kept is not None:
                got, sized_as = kept
            else:
                try:
                    manifest_peer, got, body = await self.pool.run(
                        f"line manifest of {src}", functools.partial(self._manifest, src=src, after=after))
                except NotFound:
                    return await self._from_whole(src, place)
            prefix: _Prefix | None = None
            held_start: Held | None = None
            manifest: Sequence[LineRef]
            if isinstance(got, wire.ManifestAfter):
                assert manifest_peer is not None  # only a peer's manifest continues a held version
                try:
                    held_start, found, missing = await self.lib(functools.partial(
                        _start_after, after=got, place=place, ahead=self.ahead))
                except ManifestLied as exc:
                    self.pool.drop(manifest_peer, str(exc), VerificationFailed)
                    continue
                prefix = found
                manifest = [*(found.walked if found.walked is not None else [HELD] * found.lines), *got.lines]
            else:
                manifest = got
                missing = await self._missing(manifest)
                if kept is None and missing:
                    await asyncio.to_thread(self.kept.save, src, body, sum(r.length for r in missing))
            getter = SessionGetter(src, manifest, (r.hash for r in missing), held=held_start,
                                   starts_with=starts_with)
            missing_bytes = sum(r.length for r in missing)
            stream = _Stream(self, getter, missing_bytes, place, prefix, check_each)
            try:
                try:
                    if missing:
                        self._total = missing_bytes
                        self._done = 0
                        hint = await asyncio.to_thread(self.kept.load_pace, src)
                        keep = functools.partial(self.kept.save_pace, src)
                        await batches.get_lines(self.pool, f"lines of session {src}", missing, self.limits,
                                                stream.have, stream.received, sized_as,
                                                stream.held_cpu, hint, keep)
                    await stream.flush()
                    assembled = stream.getter.finish()
                except BaseException:
                    await asyncio.shield(self.lib.release())
                    raise
            except _ManifestStop as stop:
                lie: ManifestLied = stop.lie
            except ManifestLied as exc:
                lie = exc
            except batches.ManifestLengthWrong as exc:
                lie = ManifestLied(f"line manifest of {src}: {exc}")
            except BaseException as exc:
                stream.discard()
                if stream.getter.done or isinstance(exc, VerificationFailed):
                    # refused whole (a rerun would be refused again), or holders dropped for what
                    # they sent: the manifest may be what lied (a length no frame could be read
                    # to check, wire.BatchDecoder), so the next run asks a peer for it
                    await asyncio.to_thread(self.kept.drop, src)
                raise
            else:
                await asyncio.to_thread(self.kept.drop, src)
                self.lines_total += len(manifest)
                return assembled, stream, prefix
            await stream.abandon()  # what was verified stays staged for the next manifest
            if stream.unchecked:
                log.info("%s: held lines taken from the placed file of its parent were not all its own "
                         "(%s); taken again, each one checked", src, lie)
                check_each = True
                continue
            await asyncio.to_thread(self.kept.drop, src)
            if manifest_peer is None:
                log.info("the kept line manifest of %s was wrong (%s); asking a peer", src, lie)
                continue
            self.pool.drop(manifest_peer, f"sent a line manifest of {src} that does not hash to it, "
                                          f"or does not cut it at its newlines (failed verification: {lie})",
                           VerificationFailed)

    async def _manifest(self, peer: PeerLink, src: str,
                        after: list[str]) -> tuple[PeerLink, list[LineRef] | wire.ManifestAfter, bytes]:
        """The peer's line manifest of `src`, decoded, and as it came (to be kept)."""
        path = wire.PATH_LINES.format(src=src)
        if after:
            path += f"?after={wire.encode_after_query(after)}"
        limit = wire.LINE_MANIFEST_AFTER_HEAD.size + self.limits.max_manifest_lines * wire.LINE_ENTRY.size
        body = await peer.get_small(path, limit, f"line manifest of {src}")
        return peer, wire.decode_any_line_manifest(body, bytes.fromhex(src), after, self.limits), body

    async def _missing(self, manifest: Sequence[LineRef]) -> list[LineRef]:
        return await self.lib(functools.partial(_missing_in, refs=manifest))

    async def _from_whole(self, src: str, place: Placing | None) -> tuple[Assembled, _Stream, None]:
        """A peer without line manifests: the whole blob, spooled to an unnamed temp file in
        `fetching/` and verified to `src` as it came, then cut into lines and staged as
        raw-codec blobs (the store compresses them), a run of READ_BACK bytes at a time: the
        session is never in memory whole, whatever size the peer announces."""
        await asyncio.to_thread(self.kept.directory.mkdir, mode=0o700, parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=self.kept.directory) as spool:
            size = await self._whole(src, spool)
            refs = await asyncio.to_thread(_spooled_refs, spool)
            stream = _Stream(self, SessionGetter(src, refs, {r.hash for r in refs}), size, place)
            try:
                try:
                    runs, at, end = _spooled_runs(spool), 0, list[bytes]()
                    while lines := await asyncio.to_thread(next, runs, end):
                        blobs = [StoredBlob(r.hash, CODEC_RAW, r.length, line)
                                 for r, line in zip(refs[at:at + len(lines)], lines, strict=True)]
                        at += len(lines)
                        await stream.received(blobs, lines)
                    await stream.flush()
                    assembled = stream.getter.finish()
                except BaseException:
                    await asyncio.shield(self.lib.release())
                    raise
            except BaseException:
                stream.discard()
                raise
        self.lines_total += len(refs)
        return assembled, stream, None

    async def _whole(self, src: str, spool: BinaryIO) -> int:
        """Fallback: the session as one blob into `spool`, hashed as it comes and resumed with
        Range after a broken link; its size once it hashes to `src`."""
        hasher = blake3.blake3()

        def restart() -> None:
            nonlocal hasher
            spool.seek(0)
            spool.truncate()
            hasher = blake3.blake3()

        async def attempt(peer: PeerLink) -> int:
            have = spool.tell()
            headers = {"Range": f"bytes={have}-"} if have else {}
            async with peer.request("GET", wire.PATH_OBJECT.format(hash=src), headers=headers) as resp:
                peer._check(resp, f"session {src}")
                if resp.status == 200 and have:  # the peer ignored Range: start over
                    restart()
                    have = 0
                total = _total_size(resp, have)
                if total > self.limits.max_session:
                    raise wire.WireError(f"session {src}: {total} bytes is over {self.limits.max_session}")
                async for chunk in resp.chunks():
                    peer.bytes_received += len(chunk)
                    if have + len(chunk) > total:
                        raise wire.WireError(f"session {src}: more than the {total} bytes announced")
                    spool.write(chunk)
                    hasher.update(chunk)
                    have += len(chunk)
                    if self.progress:
                        self.progress(have, total)
                if have != total:
                    raise https.PayloadError(f"session {src}: cut at {have} of {total} bytes")
            got = hasher.hexdigest()
            if got != src:
                restart()
                raise wire.HashMismatch(bytes.fromhex(src), bytes.fromhex(got), "session")
            return total

        return await self.pool.run(f"session {src}", attempt)


def _spooled_runs(spool: BinaryIO) -> Iterator[list[bytes]]:
    """The lines of a spooled session from its start, in runs of about READ_BACK bytes."""
    spool.seek(0)
    yield from line_runs(spool, READ_BACK)


def _spooled_refs(spool: BinaryIO) -> list[LineRef]:
    """The line manifest of a spooled session: each line's hash and length."""
    return [LineRef(blake3.blake3(line).digest(), len(line)) for run in _spooled_runs(spool) for line in run]


def _missing_in(lib: FetchTarget, refs: Sequence[LineRef]) -> list[LineRef]:
    """The lines the store lacks, once each (lines staged by an earlier, killed run count as held)."""
    unique = list({r.hash: r for r in refs}.values())
    return [r for r, held in zip(unique, lib.has_lines([r.hash for r in unique]), strict=True) if not held]


def _start_after(lib: FetchTarget, after: wire.ManifestAfter, place: Placing | None,
                 ahead: _HashAhead | None) -> tuple[Held | None, _Prefix, list[LineRef]]:
    """An incremental fetch's start and the new lines the store lacks: one step (_Lingering)."""
    return *_held_prefix(lib, after, place, ahead), _missing_in(lib, after.lines)


def _held_prefix(lib: FetchTarget, after: wire.ManifestAfter, place: Placing | None,
                 ahead: _HashAhead | None = None) -> tuple[Held | None, _Prefix]:
    """Where an incremental fetch starts: the held version's first lines (those the peer said
    the new version begins with: the hash of the whole proves it), their size (from the
    version's record when they are all its lines or all but its last: no turn is read) and
    their hash state: the node's live one; else (a one-shot process) the file this node
    placed, if its stat says it is still that version whole (hashed on a thread of its own
    while the new lines come: `_Prefix.hashing`; `ahead` may have started that already),
    else the lines re-read from the store (decompressed: the slowest).  No Held for a version
    placed with its header moved first: the getter walks its lines again (`_Prefix.walked`)."""
    base = after.base.hex()
    version = lib.version(base)
    if after.first > version.lines:
        raise ManifestLied(f"line manifest after {base}: starts after line {after.first} of a version of "
                           f"{version.lines} lines")
    if header_moved(lib.first_line(base)):
        walked = lib.line_manifest(base)[:after.first]
        return None, _Prefix(base, version.size, after.first, sum(r.length for r in walked), walked=walked)
    refs: Sequence[LineRef] | None = None
    if after.first == version.lines:
        size = version.size
    elif after.first == version.lines - 1:
        size = version.last_line_start
    else:
        refs = lib.line_manifest(base)[:after.first]
        size = sum(r.length for r in refs)
    header = SessionHeader(**version.header)
    hasher = LIVE.get(base, size)
    hashing = None
    if hasher is None and place is not None and size == version.size:
        hashing = ahead.take(base, size) if ahead is not None else None
        if hashing is None:
            hashing = _hash_placed(lib, place, header, base, size)
    if hasher is None and hashing is None:
        hasher = _store_hasher(lib, refs if refs is not None else lib.line_manifest(base)[:after.first])
    held = Held(after.first, size, hasher, header, version.name, version.first_user)
    return held, _Prefix(base, version.size, after.first, size, hashing)


def _store_hasher(lib: FetchTarget, refs: Sequence[LineRef]) -> blake3.blake3:
    """The hash state after held lines read back from the store (decompressed: the slowest way)."""
    hasher = new_hasher()
    for run in _held_runs(lib, refs):
        hasher.update(run)
    return hasher


def _hash_placed(lib: FetchTarget, place: Placing, header: SessionHeader, src: str,
                 size: int) -> Future[blake3.blake3] | None:
    """The file this node placed for version `src` (`size` bytes), hashed on a thread of its
    own, if its stat says it is still that version whole; else None."""
    target = target_path(place.agent_dir, header, place.session_dir)
    if appendable(target, PlacedFiles(lib.paths.placed), src, size, True) is None:
        return None
    return in_background(functools.partial(prefix_hasher, target, size), name="p2pnode-hash")


def _held_runs(lib: FetchTarget, refs: Sequence[LineRef]) -> Iterator[bytes]:
    """Held lines from the store, in order, joined in runs of about READ_BACK raw bytes: one
    store call per run (each line checked against its hash there), one write or update each."""
    for run in ref_runs(refs, READ_BACK):
        yield b"".join(lib.lines([r.hash for r in run]))


def _held_versions(lib: FetchTarget, parent: str | None, session_id: str | None) -> list[str]:
    """Versions the new one may extend, named to its holders (`?after=`): held versions of the
    same Pi session (`session_id`; None, not known: none, so that a holder learns nothing of
    the other sessions this node holds) with the same parent (a grown session keeps it), the
    largest first (the most the new one can continue from, within MAX_AFTER)."""
    if session_id is None:
        return []
    found = sorted((b for b in lib.branches(include_unshared=True)
                    if b.parent == parent and b.header.get("id") == session_id), key=lambda b: -b.size)
    return list(dict.fromkeys(b.src for b in found))[:wire.MAX_AFTER]


def _has_branch(lib: FetchTarget, branch: str, ahead: _HashAhead | None) -> bool:
    held = lib.has_branch(branch)
    if not held and ahead is not None:
        ahead.start(lib)
    return held


class _HashAhead:
    """The hash of the placed file of the largest held version of the session fetched, started
    in the fetch's first step, before the peers say which held version the new one extends
    (a grown session extends its largest): a one-shot process (no live state) starts hashing
    two round trips and two steps sooner than _held_prefix would.  When the new version turns
    out to extend another, the thread's work is lost."""

    def __init__(self, session_id: str, place: Placing) -> None:
        self.session_id, self.place = session_id, place
        self._started: tuple[str, int, Future[blake3.blake3]] | None = None

    def start(self, lib: FetchTarget) -> None:
        mine = (b for b in lib.branches(include_unshared=True) if b.header.get("id") == self.session_id)
        largest = max(mine, key=lambda b: b.size, default=None)
        if largest is None:
            return
        version = lib.version(largest.src)
        if LIVE.get(largest.src, version.size) is not None:
            return
        hashing = _hash_placed(lib, self.place, SessionHeader(**version.header), largest.src, version.size)
        if hashing is not None:
            self._started = (largest.src, version.size, hashing)

    def take(self, base: str, size: int) -> Future[blake3.blake3] | None:
        """The hash started, if it is of version `base`'s first `size` bytes (once)."""
        if self._started is None or self._started[:2] != (base, size):
            return None
        hashing, self._started = self._started[2], None
        return hashing


async def _with_peer(peer: PeerLink, coro: Awaitable[T]) -> tuple[PeerLink, T]:
    return peer, await coro


def _total_size(resp: https.Response, offset: int) -> int:
    if resp.status == 206:
        m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+)", resp.headers.get("Content-Range") or "")
        if not m or int(m.group(1)) != offset:
            raise wire.WireError(f"Content-Range {resp.headers.get('Content-Range')!r} for offset {offset}")
        return int(m.group(3))
    if resp.content_length is None:
        raise wire.WireError("whole-blob response without Content-Length")
    return resp.content_length


async def fetch_branch(lib: FetchTarget | OpenPerUse, branch_hex: str, peers: list[PeerAddress],
                       identity: Identity, trust: TrustStore, *, agent_dir: Path | None = None,
                       progress: Progress | None = None, limits: wire.Limits = wire.DEFAULT_LIMITS,
                       session_dir: Path | None = None,
                       check: Callable[[FetchTarget, str], None] | None = None,
                       starts_with: tuple[str, int] | None = None,
                       connections: Connections | None = None, session_id: str | None = None) -> FetchResult:
    """Fetch `branch_hex` and the ancestors this node lacks; see the module docstring.
    `lib`: an open Library, or OpenPerUse (a one-shot fetch that must not hold the store).
    `session_dir`: Pi's session-dir override, where the session is then placed (flat).
    `check(lib, branch_hex)`: run once the branch is held (committed now or before), before its
    file is placed; what it raises leaves nothing placed.
    `starts_with`: (src, size) of a version whose bytes the branch's session must start with
    (a newer version fetched in place of the one named): checked as the fetch hashes them
    (VerificationFailed, nothing committed), else before the file is placed
    (`check_starts_with`).
    `connections`: the peers' HTTPS sessions of the command, if its catalog step opened them
    (link.Connections: one TLS handshake per peer for both steps).
    `session_id`: the Pi session id of the branch (a catalog's): held versions of it are
    named to the peers, for a fetch of only what is new (`_held_versions`)."""
    wire.check_hex_hash(branch_hex, "branch hash")
    pool = PeerPool(peers, identity, trust, limits, connections)
    job = _Fetch(lib, pool, limits, progress)
    placed: Placement | PlacementConflict | None = None
    kept: Library | None = None
    healed = 0
    try:
        if session_id is not None and agent_dir is not None:
            job.ahead = _HashAhead(session_id, Placing(agent_dir, session_dir))
        t0 = time.perf_counter()
        chain = await job.walk(branch_hex)
        if not chain:
            held_checks = [] if check is None else [check]
            if starts_with is not None:
                held_checks.append(functools.partial(check_starts_with, starts_with=starts_with))
            try:
                placed = await job.lib(functools.partial(
                    _settle_held, branch=branch_hex, checks=held_checks, agent_dir=agent_dir,
                    session_dir=session_dir))
            except DamagedCopy as exc:  # fetched again: its damaged lines come from peers
                if isinstance(lib, OpenPerUse):
                    # the store knows what a read found damaged until it closes: one opening that
                    # stays for the rest, however long the peers take (a rare path)
                    await job.lib.release()
                    kept = await asyncio.to_thread(lib)
                    job = _Fetch(kept, pool, limits, progress)
                healed = len(await job.lib(lambda it: it.damaged_lines_of(it.branch(branch_hex).src)))
                log.warning("branch %s is held, but %d of its lines cannot be read back from the store "
                            "(%s): they are fetched again", branch_hex, healed, exc)
                chain = [await job.sidecar(branch_hex)]
        transfer = store = 0.0
        for branch, raw_sidecar, sc in reversed(chain):
            wanted = branch == branch_hex and agent_dir is not None
            place = Placing(agent_dir, session_dir, sc.parent) if wanted and agent_dir is not None else None
            named = branch == branch_hex
            held = [] if healed else await job.lib(functools.partial(
                _held_versions, parent=sc.parent, session_id=session_id if named else None))
            assembled, stream, extends = await job.session(sc.src, place, held,
                                                           starts_with if named else None)
            out = stream.out
            t1 = time.perf_counter()
            checks = [check] if named and check is not None else []
            if named and starts_with is not None and not assembled.start_checked:
                checks.append(functools.partial(check_starts_with, starts_with=starts_with))
            try:  # the commit, then (only then) the file published
                info, placed = await stream.settle(functools.partial(
                    _settle, sidecar=raw_sidecar, done=assembled, extends=extends, out=out, branch=branch,
                    checks=checks))
                LIVE.put(assembled.src, *assembled.complete)
            finally:
                if out is not None:
                    out.file.discard(keep_dir=isinstance(placed, Placement))
            t2 = time.perf_counter()
            log.info("fetched branch %s: %d lines, transfer+verify+stage %.3f s, commit+place %.3f s",
                     branch, len(assembled.refs), t1 - t0, t2 - t1)
            transfer, store, t0 = transfer + t1 - t0, store + t2 - t1, t2
        if not chain:
            info = await job.lib(lambda lib: lib.branch(branch_hex))
        result = FetchResult(branch=branch_hex, src=info.src, parent=info.parent,
                             fetched=[b for b, _, _ in chain], bytes_received=pool.bytes_received,
                             lines_total=job.lines_total, lines_fetched=job.lines_fetched,
                             dropped_peers=pool.dropped(), seconds_transfer=round(transfer, 4),
                             seconds_store=round(store, 4), served=pool.served(), healed=healed)
    except P2PNodeError as exc:
        if healed:  # what made it fetch a branch held here
            naming(exc, f"branch {branch_hex} is held, but {healed} of its lines cannot be read back from "
                        "this node's store (damaged), and fetching them again failed", "damaged")
        raise
    finally:
        await asyncio.shield(job.lib.release())
        await pool.close()
        if kept is not None:
            await asyncio.to_thread(kept.close)
    if isinstance(placed, PlacementConflict):
        result.path, result.conflict = str(placed.path), str(placed)
    elif placed is not None:
        result.path, result.written = str(placed.path), placed.written
        if placed.newer is not None:
            result.note = (f"{placed.path} holds a newer version of this session (blake3 {placed.newer})"
                           f" that starts with the one fetched, and was kept; `p2pnode cat {branch_hex}`"
                           " prints the one fetched")
    return result


def _settle(lib: FetchTarget, sidecar: bytes, done: Assembled, extends: _Prefix | None, out: Output | None,
            branch: str, checks: list[Callable[[FetchTarget, str], None]]) -> tuple[
                BranchInfo, Placement | PlacementConflict | None]:
    """The verified version committed, checked (fetch_branch's `check`, `starts_with`), then
    its file (if any) published: after the commit, in the same opening of the store (a
    one-shot fetch).  The file's last bytes are synced beside the commit."""
    if out is not None:
        out.file.flush_soon()
    info = _commit(lib, sidecar, done, extends)
    for check in checks:
        check(lib, branch)
    return info, _publish(lib, out, branch, done) if out is not None else None


def _settle_held(lib: FetchTarget, branch: str, checks: list[Callable[[FetchTarget, str], None]],
                 agent_dir: Path | None, session_dir: Path | None) -> Placement | PlacementConflict | None:
    """A branch held already: checked (fetch_branch's `check`, `starts_with`), then placed from
    the stored copy, if it is to be placed (DamagedCopy where that cannot be read back)."""
    for check in checks:
        check(lib, branch)
    return None if agent_dir is None else _place(agent_dir, branch, lib.branch(branch).src, lib, session_dir)


def check_starts_with(lib: FetchTarget, branch: str, starts_with: tuple[str, int]) -> None:
    """That held branch `branch`'s session starts with the bytes of version `starts_with`
    (src, size), where the fetch could not see it as they were hashed (the branch was held
    before, or the size falls in the lines it held or inside a line): known without reading
    when that version is its `previous` (the store found all its lines at its start), else
    read from the store, as far as that version's size."""
    src, size = starts_with
    info = lib.branch(branch)
    if lib.version(info.src).previous == src:
        return
    hasher, need = new_hasher(), size
    runs = lib.session_runs(info.src)
    while need and (run := next(runs, None)) is not None:
        hasher.update(run[:need])
        need -= min(need, len(run))
    if need or hasher.hexdigest() != src:
        raise VerificationFailed(f"branch {branch}, offered as a newer version of {src}, "
                                 "does not start with its bytes; not placed (fetch with --exact)")


def _commit(lib: FetchTarget, sidecar: bytes, done: Assembled, extends: _Prefix | None) -> BranchInfo:
    """The verified version committed: as the held lines of `extends` (HELD in `done.refs`)
    and the new ones, if it was fetched incrementally.  The memory the transfer's buffers
    freed is first given back to the OS (glibc keeps it in its arenas otherwise): the commit's
    own peak comes on top of what is resident then (on a 2 GB session: 250 MB peak RSS
    without, 215 MB with)."""
    give_back_freed()
    prefix = Prefix(done.size, done.src, len(done.refs), done.last_line_start)
    titles = (done.name, done.first_user)
    if extends is not None and extends.lines:
        new = done.refs[extends.lines:]
        return lib.extend_staged(sidecar, extends.base, extends.lines, new, prefix, done.header, titles)
    return lib.add_staged(sidecar, done.refs, prefix, done.header, titles)


def _publish(lib: FetchTarget, out: Output, branch: str, done: Assembled) -> Placement | PlacementConflict:
    """The temp file, fsynced, linked where Pi finds it (or appended to the older version
    there); the path recorded for the branch."""
    content = Content(done.src, done.placed_size, done.placed_hex, done.newline_hex)
    placed_files = PlacedFiles(lib.paths.placed)
    try:
        if out.append is not None:
            placed = out.file.append_to(out.append, out.start, content, placed_files)
        else:
            placed = out.file.publish(content, placed_files)
    except PlacementConflict as exc:
        return exc.naming(branch)
    lib.record_path(branch, placed.path)
    return placed


def _place(agent_dir: Path, branch: str, src: str, lib: FetchTarget,
           session_dir: Path | None) -> Placement | PlacementConflict:
    """Place a branch already held, from the stored copy (written in the node's `fetching/`
    first, as a fetch's file is: a kill leaves nothing in Pi's folder); record the path.
    Nothing is read when the file this node placed for it is still there, unchanged by its stat."""
    version = lib.version(src)
    header = SessionHeader(**version.header)
    placed_files = PlacedFiles(lib.paths.placed)
    target = target_path(agent_dir, header, session_dir)
    if appendable(target, placed_files, src, version.size, True) is not None:
        lib.record_path(branch, target)
        return Placement(target, written=False)
    out = SessionFile.create(agent_dir, header, src, session_dir, staging=lib.paths.fetching)
    try:
        done = _write_held(lib, src, out)
    except BaseException:
        out.discard()
        raise
    try:  # publish removes the temp file, whatever happens
        placed = out.publish(Content(src, done.placed_size, done.placed_hex, done.newline_hex), placed_files)
    except PlacementConflict as exc:
        return exc.naming(branch)
    lib.record_path(branch, placed.path)
    return placed


def _write_held(lib: FetchTarget, src: str, out: SessionFile) -> Assembled:
    """Held version `src` written to `out` from the store in runs of READ_BACK bytes (each
    line checked against its hash there), through a getter that verifies the whole to `src`
    and puts Pi's header first: the session is never whole in memory (a 2 GB one was)."""
    getter = SessionGetter(src, lib.line_manifest(src), ())
    while wanted := getter.from_store():
        getter.read_back(wanted, lib.lines(wanted))
        for part in getter.ready():
            out.write(part)
    return getter.finish()


async def get_catalog(peer: PeerAddress, identity: Identity, trust: TrustStore,
                      limits: wire.Limits = wire.DEFAULT_LIMITS,
                      connections: Connections | None = None) -> wire.CatalogMessage:
    """The branches `peer` offers us (it must trust us, and we it)."""
    pool = PeerPool([peer], identity, trust, limits, connections)
    try:
        return await pool.run(f"catalog of {peer}", lambda p: p.catalog())
    finally:
        await pool.close()
