"""The node's shared sessions: the one API behind `share`/`ls`/`show`/`cat`/`unshare`, the
peer server and the fetcher (contract: docs/ARCHITECTURE.md, "The session library API").

Over 400 lines on purpose: the porcelain is one class, Library, one method per command, over
one lock; its pieces live in library/sessions.py, library/manifest.py and pi/.

Sharing a session hashes the file verbatim, stores it line by line (library/sessions.py),
shares its parentSession ancestors first (root to child, so each child's sidecar names its
parent's branch hash), and records branch -> path in manifest.json.  The stored copy is
what the node serves, never the live file that Pi keeps appending to.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

import blake3

from p2pnode.errors import InvalidInput, NotFound, P2PNodeError, VerificationFailed
from p2pnode.library import access, audit, rebuild, space
from p2pnode.library.audit import AuditLog, ServedAnswer
from p2pnode.library.lineindex import LineIndex
from p2pnode.library.manifest import Manifest, ManifestCorrupt, PlacedFiles
from p2pnode.library.sessions import (
    BranchRecord,
    ImportedLines,
    SessionStore,
    StateCorrupt,
    StateUnreadable,
    Version,
    read_state,
)
from p2pnode.library.versions import VersionIndex, build_index, previous_branch, unlinked_growths
from p2pnode.paths import NodePaths, PiDirs, session_dir
from p2pnode.paths import agent_dir as default_agent_dir
from p2pnode.pi import secrets
from p2pnode.pi import session as pisession
from p2pnode.pi.hashing import CHUNK, FileHasher, Prefix, Scan, Sink, hash_prefix, new_hasher
from p2pnode.pi.lines import LineRef, LineRefs, line_runs
from p2pnode.pi.session import HostileHeader, LineageCycle, is_session_id
from p2pnode.pi.sidecar import Sidecar, blake3_hex, is_hash_hex, parse_sidecar
from store import BlobMismatch, StoredBlob
from store.api import Store
from store.config import StoreConfig
from store.errors import (
    CorruptRecord,
    StoreError,
    StoreFailed,
    StoreLocked,
    StoreNeedsWrite,
    UnknownBlob,
    UnknownTurn,
)
from sysio.files import atomic_write, fsync_dir
from sysio.flush import flush_data
from sysio.locks import exclusive_if_free

log = logging.getLogger(__name__)

ZSTD_LEVEL = 1
"""Session lines (JSON, code, tool output) compress almost as well at zstd level 1 as at 3,
faster, and compression is most of the cost of a first share (docs/BENCHMARKS.md, Sharing)."""
LOCK_TRY = 0.5
"""Seconds one try for a store another process holds waits (`open_unless`), before a look
whether waiting is still worth it."""
SESSION_RUN = 2 << 20
"""Raw bytes of a session handed out at a time (`session_runs`) or read (`share --redact`):
runs big enough to be read and hashed as fast as the whole session (docs/BENCHMARKS.md),
small beside any session."""
TURNS_READ = 256
"""Lines read from the store per call (and per hold of the library's lock) by `session_runs`."""
IMPORTED_LINES_KEPT = 4
"""Imports whose lines (32 bytes and a length a line) are kept for their manifests
(`Library._imported`)."""


@dataclass(frozen=True)
class BranchInfo:
    branch: str
    src: str
    parent: str | None
    size: int
    lines: int
    header: dict[str, Any]
    """id, timestamp, cwd, parent_session (as Pi stored it), version."""
    title: str | None
    """The session's name (its last session_info) or else its first user message."""
    offered: bool
    shared_at: int
    """Unix milliseconds of the latest share or fetch."""
    path: str | None = None
    """The local session file (manifest.json), if there is one."""
    lineage_cut: str | None = None
    """The parentSession left out by `share --no-lineage` on this node (None: not cut here)."""
    secrets_allowed: bool = False
    """Shared with `--allow-secrets` although the secret scan found some in it."""
    expires_at: int | None = None
    """Unix milliseconds when it stops being served (`share --expires`; None: never)."""
    to: list[str] | None = None
    """The node ids it is offered to (`share --to`; None: every trusted peer)."""
    withdrawn: str | None = None
    """"unshared" or "expired" once no longer offered for that reason."""
    previous: str | None = None
    """The branch of the older version of the same Pi session this version grew from
    (library/versions.py), if this node holds it."""
    version: int = 1
    """This version's place among the versions of its session held here (1 = the first)."""
    versions: int = 1
    """How many versions of this session this node holds."""
    withheld: str | None = None
    """Why an offered branch is not served: the secret scan of a branch shared before scans
    were recorded (scan_unrecorded) found secrets in it."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ShareResult(BranchInfo):
    ancestors: list[BranchInfo] = field(default_factory=list)
    """The branch's ancestors, root first: those this node already held, then those shared on the way."""
    warnings: list[str] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    """What the user is told once per node (pi 1.5.2's system prompt travels with the session)."""
    redacted_from: str | None = None
    """`share --redact`: the original file, whose redacted copy (`path`) was shared instead."""
    secrets: list[dict[str, Any]] = field(default_factory=list)
    """`share --allow-secrets`: what the scan found in what was shared (masked), with its file."""


SYSTEM_PROMPT_NOTICE = (
    "this session starts with pi's whole system prompt (your working directory, pi's install path, "
    "AGENTS.md and skills), as pi 1.5.2 writes it: it travels with every session you share "
    "(said once per node)")


@dataclass(frozen=True, slots=True)
class Catalog:
    generation: int
    """Changes whenever the set of offered branches changes."""
    branches: list[BranchInfo]


@dataclass(frozen=True)
class Unshared:
    """What `unshare` did: the branch, the other versions of its session withdrawn with it, and
    the offered branches that descend from them (no longer served: their lineage is not).
    `was_offered` False: none of them was offered, nothing changed (nothing logged)."""

    branch: BranchInfo
    versions: list[str]
    withheld: list[BranchInfo]
    was_offered: bool = True

    def as_dict(self) -> dict[str, Any]:
        return {"branch": self.branch.branch, "offered": False, "was_offered": self.was_offered,
                "withdrawn": self.branch.withdrawn, "versions": self.versions,
                "withheld": [{"branch": i.branch, "title": i.title} for i in self.withheld]}


@dataclass(frozen=True, slots=True)
class _Visible:
    """What one peer may be served at a catalog generation (Library._visible): its sidecars
    and sessions by hash hex -> (kind, the branch that makes it visible), and `versions`: the
    versions whose lines it may have (the visible ones and those they grew from, in the line
    index) -> such a branch.  The lines themselves are in Library._lines, once for all peers."""

    generation: int
    objects: dict[str, tuple[str, str]]
    versions: dict[str, str]


@dataclass(frozen=True, slots=True)
class Dropped:
    """What `fsck --repair` forgot because the store cannot read its turns (Library.drop_unreadable):
    a branch, or a version no branch used (branch None)."""

    src: str
    why: str
    branch: str | None = None
    title: str | None = None
    path: str | None = None
    """Where the file was shared from or placed."""
    shared_here: bool = False
    """Shared from this node (share `path` again to get it back), not only fetched (fetch
    `branch` again: sharing the placed file would offer it, and it may hold a later version)."""


@dataclass(frozen=True)
class Damaged:
    """A branch `fsck --repair` keeps although some of its lines' records in the pack are
    damaged (its turns read; `cat` of it exits 5 until those lines are stored again)."""

    branch: str
    lines: int
    """How many of its distinct lines cannot be read back."""
    title: str | None
    path: str | None
    shared_here: bool
    """As Dropped's: share `path` again (shared here), else remove and fetch it again."""


@dataclass(frozen=True)
class Repair:
    """What `fsck --repair` did above the store (Library.repair)."""

    moved: list[tuple[Path, Path]]
    """Unreadable indexes of local files: (the file, where it was moved)."""
    rebuilt: tuple[str, rebuild.Rebuilt, Path | None] | None
    """sessions.json rebuilt: (what was wrong with it, what the store gave back, where the old
    file went); None when it was readable."""
    dropped: list[Dropped]
    damaged: list[Damaged] = field(default_factory=list)
    """Branches kept whose lines are in damaged pack records (what heals each)."""
    unchecked: str | None = None
    """Why the sessions could not be checked (a library that still does not open)."""


def _unreadable_indexes(paths: NodePaths) -> list[tuple[Path, str]]:
    """The JSON indexes of local files (manifest.json, placed.json) that do not load: (the
    file, why)."""
    found = []
    for index in (Manifest(paths.manifest), PlacedFiles(paths.placed)):
        try:
            index.load()
        except ManifestCorrupt as exc:
            found.append((index.path, str(exc)))
    return found


def _kept_aside(path: Path) -> Path:
    """Move an unreadable file to `<name>.damaged` (or `.damaged.N`: an earlier one is kept)."""
    kept = path.with_name(path.name + ".damaged")
    n = 1
    while kept.exists():
        kept, n = path.with_name(f"{path.name}.damaged.{n}"), n + 1
    os.replace(path, kept)
    return kept


def _check_placeable(path: Path, header: pisession.SessionHeader) -> None:
    """Refuse to offer what peers would refuse to place (the same id and name rules as fetch)."""
    try:
        pisession.placed_names(header)
    except HostileHeader as exc:
        raise HostileHeader(f"{path} cannot be shared, peers could not place it: {exc}") from None


def _new_session_id() -> str:
    """A UUIDv7, as Pi makes session ids (48-bit Unix milliseconds, then random bits)."""
    rand = int.from_bytes(os.urandom(10), "big") & ((1 << 76) - 1)
    value = (int(time.time() * 1000) << 80) | (0x7 << 76) | rand
    value = (value & ~(0x3 << 62)) | (0x2 << 62)  # the RFC 9562 variant
    return str(uuid.UUID(int=value))


def write_redacted_copy(path: Path) -> Path:
    """`share --redact`: the session with each secret replaced by its marker, as a new Pi
    session beside the original (a new id in its header and its name; every other byte as it
    was, so its lines are the original's lines and delta transfer still works).  A session with
    nothing to redact is shared as it is.  The file is read twice in runs, scanned and then
    copied, never whole in memory; the copy ends where the scan did (what Pi appends meanwhile
    is left for the next share), and the share scans the copy again as it imports it."""
    with open(path, "rb") as f:
        scanner = secrets.Scanner()
        size = 0
        while chunk := f.read(SESSION_RUN):
            scanner.feed(chunk)
            size += len(chunk)
        findings = scanner.finish()
        if not findings:
            return path
        header = pisession.read_header(path)
        f.seek(0)
        first_end = f.read(pisession.HEADER_SCAN_BYTES).find(b"\n") + 1
        first = b"".join(_redacted(f, path, findings, 0, first_end))
        old = b'"id":' + json.dumps(header.id).encode()
        if not first_end or first.count(old) != 1:
            raise InvalidInput(f"{path}: cannot give the redacted copy a new id (the header line is not "
                               "the first line or not as Pi writes it)")
        new_id = _new_session_id()
        copy = path.with_name(pisession.session_file_name(header.timestamp or "redacted", new_id))
        with open(copy, "xb") as out:  # never over an existing file
            out.write(first.replace(old, b'"id":' + json.dumps(new_id).encode()))
            for run in _redacted(f, path, findings, first_end, size):
                out.write(run)
            out.flush()
            os.fchmod(out.fileno(), path.stat().st_mode & 0o777)
            flush_data(out.fileno())
    fsync_dir(copy.parent)
    return copy


def _redacted(f: BinaryIO, path: Path, findings: list[secrets.Finding], start: int, end: int
              ) -> Iterator[bytes]:
    """The file's bytes [start, end) as --redact writes them (secrets.redaction), in runs."""
    for piece in secrets.redaction(findings, start, end):
        if isinstance(piece, bytes):
            yield piece
            continue
        at, stop = piece
        f.seek(at)
        while at < stop:
            run = f.read(min(SESSION_RUN, stop - at))
            if not run:
                raise InvalidInput(f"{path} was cut short while its redacted copy was written")
            yield run
            at += len(run)


class _ScanningSink:
    """The import's sink, with the secret scan of the same bytes as they pass: no second read,
    and the findings are of exactly the bytes imported.  The scan runs here, in the importing
    thread: its one pass (pi/secrets.py) costs ~0.1 CPU-s per 256 MB."""

    def __init__(self, progress: Callable[[int, int], object] | None = None, size: int = 0) -> None:
        self.inner: Sink | None = None
        self.start = 0
        """The file offset the fed bytes start at (where the version it grew from ends)."""
        self.progress, self.size = progress, size
        self._done = 0
        self.findings: list[secrets.Finding] = []
        self.vouched = False
        """After finish(): whether `findings` is the scan of the bytes fed (else nothing was fed
        through this sink and the caller scans the stored version)."""
        self._scanner: secrets.Scanner | None = None

    def begin(self, grown: Prefix | None) -> int:
        assert self.inner is not None
        self.start = self._done = self.inner.begin(grown)
        self._scanner = secrets.Scanner()
        return self.start

    def feed(self, data: bytes) -> None:
        assert self.inner is not None and self._scanner is not None
        # scanned in place (bytes), before the splitter: a line that ends here is joined by
        # each, and the scan's copy goes before the splitter's is made (a long line twice in
        # memory at most, not three times)
        self._scanner.feed(data)
        self.inner.feed(data)
        self._done += len(data)
        if self.progress is not None:
            self.progress(self._done, max(self.size, self._done))

    def finish(self) -> None:
        if self._scanner is not None:
            self.findings, self.vouched = self._scanner.finish(), True


def _scanned_prefix(path: Path, size: int, src: str) -> list[secrets.Finding] | None:
    """The secret scan of a file's first `size` bytes, if they hash to `src`: the version a
    shared file grew from, read where it is (from the store, every line would be decompressed);
    None if the file changed."""
    scanner, hasher = secrets.Scanner(), new_hasher()
    try:
        with open(path, "rb") as f:
            while size and (chunk := f.read(min(CHUNK, size))):
                hasher.update(chunk)
                scanner.feed(chunk)
                size -= len(chunk)
    except OSError:
        return None
    return scanner.finish() if not size and hasher.hexdigest() == src else None


class Library:
    def __init__(self, paths: NodePaths, store: Store, agent_dir: Path) -> None:
        self.paths = paths
        self.store = store
        """The node's Store (the peer server reads compressed blobs from it directly)."""
        self.agent_dir = agent_dir
        self.sessions = SessionStore(store, paths.home / "sessions.json")
        self.hasher = FileHasher(paths.home / "hashcache.json", complete_lines=True)
        self.manifest = Manifest(paths.manifest)
        self._lock = threading.RLock()
        self._imports = threading.Lock()
        """Held by a share while it reads and stores files without `_lock` (one share at a
        time) and by a fetch's commit while it writes its turns, and by `gc` and `remove`,
        which forget versions and delete every context the state does not name (an import's,
        until it is recorded).  Taken before `_lock`."""
        self._access: dict[str | None, _Visible] = {}
        """Per peer (None: any trusted peer): what it may be served at a generation."""
        self._lines = LineIndex()
        """The lines of the versions peers may be served, and which versions hold each."""
        self._served: tuple[tuple[int, int], frozenset[str], frozenset[str]] | None = None
        self._next_expiry: int | None = 0
        """When the next offered branch expires (0: not yet computed)."""
        self._listeners: list[Callable[[], None]] = []
        self.audit = AuditLog(paths.home / "audit.log")
        self.leases = TransferLeases()
        self._reclaimable: tuple[tuple[int, int, int], int] | None = None
        self._manifests: dict[str, LineRefs] = {}
        self._imported: dict[str, ImportedLines] = {}
        """The lines of the versions this process imported last, as the import met them: their
        manifests are made from these when first asked for (upkeep.warm_manifests, right
        after a share)."""
        self._versions: tuple[tuple[int, int], VersionIndex, dict[str, int]] | None = None
        self._fed: dict[str, tuple[_ScanningSink, Version | None, Path]] = {}
        """What the secret scan saw of each version the import just read (and the version it
        grew from), until `_findings` records it."""
        self._scan_record: dict[str, list[dict[str, Any]]] | None = None
        links = unlinked_growths(self.sessions.all_versions(), self.sessions.line_hashes)
        if links:  # versions stored before `previous` existed (library/versions.py)
            self.sessions.link_previous(links)

    @classmethod
    def open(cls, paths: NodePaths, agent_dir: Path | None = None,
             config: StoreConfig | None = None, *, read_only: bool = False) -> Library:
        """`read_only`: for a command that only reads (status, ls, show, cat): the store opened
        without writing a byte, also where this user may not write, unless it must be written
        first (recovery after a crash: then opened as for a write)."""
        paths.ensure()
        config = config or StoreConfig(zstd_level=ZSTD_LEVEL)
        store, needs = None, None
        if read_only:
            try:
                store = Store.open(paths.store, replace(config, read_only=True))
            except StoreNeedsWrite as exc:
                needs = exc.why
        if store is None:
            try:
                store = Store.open(paths.store, config=config)
            except StoreFailed as exc:
                if needs is None:
                    raise
                raise StoreFailed(exc.path, f"{exc.reason}; it {needs}", exc.errno) from None
        try:
            return cls(paths, store, agent_dir or default_agent_dir())
        except BaseException:
            store.close()
            raise

    @classmethod
    def repair(cls, paths: NodePaths) -> Repair:
        """`fsck --repair`'s steps above the store, each safe to run again after a crash: the
        unreadable indexes of local files moved aside (`_repair_indexes`), sessions.json
        rebuilt from the store if it is lost or unreadable (`_rebuild_state`), then the
        sessions whose turns cannot be read forgotten (`drop_unreadable`).  StoreLocked when
        another process holds the store."""
        moved = cls._repair_indexes(paths)
        rebuilt = None
        try:
            try:
                library = cls.open(paths)
            except StateUnreadable as exc:
                rebuilt = (exc.reason, *cls._rebuild_state(paths))
                library = cls.open(paths)
            with library:
                return Repair(moved, rebuilt, library.drop_unreadable(), library.damaged_lines())
        except StoreLocked:
            raise
        except (P2PNodeError, StoreError, OSError, ValueError) as exc:
            return Repair(moved, rebuilt, [], unchecked=str(exc))

    @staticmethod
    def _repair_indexes(paths: NodePaths) -> list[tuple[Path, Path]]:
        """Each unreadable JSON index of local files (manifest.json: where branches were shared
        from or placed; placed.json: what fetches placed) moved aside: (the file, where it
        went).  They start empty: `ls` shows no path for a branch until it is shared again, and
        a later version is not placed over a file this node no longer knows it placed (a
        conflict, exit 7, not an overwrite)."""
        return [(path, _kept_aside(path)) for path, _ in _unreadable_indexes(paths)]

    @staticmethod
    def unreadable_files(paths: NodePaths) -> list[str]:
        """What plain `fsck` reports above the store: sessions.json, manifest.json and
        placed.json each that cannot be used, with what repairs it (read without opening the
        store, whose open would mend what fsck is to report)."""
        problems = [why for _, why in _unreadable_indexes(paths)]
        try:
            read_state(paths.home / "sessions.json")
        except StateCorrupt as exc:
            problems.insert(0, str(exc))
        return problems

    @staticmethod
    def _rebuild_state(paths: NodePaths) -> tuple[rebuild.Rebuilt, Path | None]:
        """sessions.json's records made anew from the store (library/rebuild.py), the old file
        kept beside it (returned; None if there was none), a `dropped` event for each branch
        the store could not give back."""
        state = paths.home / "sessions.json"
        log = AuditLog(paths.home / "audit.log")
        with Store.open(paths.store, StoreConfig(zstd_level=ZSTD_LEVEL)) as store:
            found = rebuild.rebuild(store, audit.forgotten(log.read()))
            events = [("dropped", {"branch": b, "title": None, "why": why}) for b, why in found.lost if b]
            log.append_many(events)
            kept = _kept_aside(state) if state.exists() else None
            SessionStore.write_anew(state, found.versions, found.branches)
        return found, kept

    @classmethod
    def open_unless(cls, paths: NodePaths, agent_dir: Path | None = None, *, wait: float,
                    pointless: Callable[[], bool], read_only: bool = False) -> Library | None:
        """The library, waiting up to `wait` s for a store another process holds (then
        StoreLocked), in tries of LOCK_TRY s; None once `pointless()` says so between them (a
        node came up: it keeps the store for as long as it runs)."""
        deadline = time.monotonic() + wait
        while not pointless():
            try_for = min(LOCK_TRY, max(0.0, deadline - time.monotonic()))
            try:
                return cls.open(paths, agent_dir, StoreConfig(zstd_level=ZSTD_LEVEL, lock_timeout=try_for),
                                read_only=read_only)
            except StoreLocked:
                if time.monotonic() >= deadline:
                    raise
        return None

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> Library:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- sharing ---

    def pi_dirs(self, cwd: str) -> PiDirs:
        """Pi's dirs as seen by this process in `cwd` (a caller elsewhere sends its own)."""
        return PiDirs(self.agent_dir, session_dir(cwd, self.agent_dir))

    def resolve_target(self, target: str | None = None, *, latest: bool = False,
                       cwd: str | None = None, pi: PiDirs | None = None) -> Path:
        """A path, a header id or unique id prefix, or (None/latest) the newest session of cwd."""
        cwd = cwd or os.getcwd()
        pi = pi or self.pi_dirs(cwd)
        if target is None or latest:
            return pisession.latest_session(pi.agent, cwd, pi.sessions)
        path = Path(target).expanduser()
        if path.exists() or os.sep in target or target.endswith(".jsonl"):
            return path
        return pisession.find_by_id(pi.agent, target, pi.sessions)

    def share(self, target: str | None = None, *, latest: bool = False, no_lineage: bool = False,
              cwd: str | None = None, pi: PiDirs | None = None, allow_secrets: bool = False,
              redact: bool = False, expires: str | None = None,
              to: Sequence[str] | None = None, audience: access.Audience | None = None,
              progress: Callable[[int, int], object] | None = None) -> ShareResult:
        """Share a session with its lineage: the ancestors this node knows (shared or fetched)
        as they are, the ones it has never seen found through parentSession and shared first.

        The secret scan runs over all of it first and fails closed (SecretsFound, nothing
        offered) unless `allow_secrets`; `redact` shares a redacted copy of the session.
        `expires` ("7d", "never"; None: the node's default) and `to` (node ids; None: every
        trusted peer) say who may fetch it and until when (library/access.py); `audience`, in
        their place, gives both as fixed before (a live share's growth ends when its first
        share does).  `progress(done, total)` is called as each file imported is read (its
        bytes, of its size)."""
        if audience is None:
            audience = access.Audience(access.expires_at(expires, self.paths.home),
                                       sorted(set(to)) if to else None)
        cwd = cwd or os.getcwd()
        pi = pi or self.pi_dirs(cwd)
        path = self.resolve_target(target, latest=latest, cwd=cwd, pi=pi)
        original = path
        if redact:
            path = write_redacted_copy(path)
        with self._imports:
            with self._lock:
                chain, base, cut_above = self._lineage(path, pi, follow=not no_lineage)
                for file, header in chain:
                    _check_placeable(file, header)
                known = list(reversed(self.lineage(base))) if base is not None else []
                like = self.sessions.branch(base).src if base is not None else None
            # stored first (the store may keep bytes), scanned, and only then offered; the files
            # are read, stored and scanned without the library's lock: peers are served meanwhile
            stored: list[tuple[Path, Version, list[str]]] = []
            for file, header in reversed(chain):  # root first
                version, file_warnings = self._store_file(file, header, like, progress)
                stored.append((file, version, file_warnings))
                like = version.src
            found: list[tuple[str, str | None, secrets.Finding]] = [
                (i.path or f"branch {i.branch}", i.branch, f) for i in known for f in self._findings(i.src)]
            found += [(str(file), None, f) for file, v, _ in stored for f in self._findings(v.src)]
            with self._lock:
                if found and not allow_secrets:
                    raise secrets.SecretsFound([(where, f) for where, _, f in found], redacted=redact,
                                               copy=str(path) if path != original else None)
                for branch in {b for _, b, _ in found if b is not None}:
                    self.sessions.mark_secrets_allowed(branch)
                live = {r.branch: r for r in self.sessions.branches()
                        if r.offered and not access.expired(r.expires_at, access.now_ms())}
                for info in known:  # offered again with the new child, as the ancestors shared now are
                    self.sessions.set_offered(info.branch, True)
                infos: list[BranchInfo] = [self._info(self.sessions.branch(i.branch)) for i in known]
                warnings: list[str] = []
                parent = base
                for (file, header), (_, version, file_warnings) in zip(reversed(chain), stored, strict=True):
                    cut = header.parent_session if no_lineage and file == path else None
                    if file == chain[-1][0] and base is None:
                        cut = cut or cut_above
                    info = self._offer_file(file, version, parent, cut)
                    if any(where == str(file) for where, _, _ in found):
                        info = self._info(self.sessions.mark_secrets_allowed(info.branch), info.path)
                    infos.append(info)
                    warnings += file_warnings
                    parent = info.branch
                notices = self._notices(path)
                infos = self._grant(infos, audience, live)
        for warning in warnings:
            log.info("%s", warning)  # the caller shows ShareResult.warnings (the CLI on stderr)
        allowed = [dict(f.as_dict(), file=where) for where, _, f in found]
        redacted_from = str(original.absolute()) if path != original else None
        return ShareResult(**asdict(infos[-1]), ancestors=infos[:-1], warnings=warnings, notices=notices,
                           redacted_from=redacted_from, secrets=allowed)

    def _findings(self, src: str) -> list[secrets.Finding]:
        """The secret scan of a stored version, remembered per version (scanned.json).  Made
        without the library's lock (it reads a file or the store: seconds for the sessions
        users have, while peers are served), recorded with it."""
        recorded = self._scanned().get(src)
        if recorded is not None:
            return [secrets.Finding(**f) for f in recorded]
        found, also = self._scan(src)
        with self._lock:
            record = dict(self._scanned(), **also)
            record[src] = [f.as_dict() for f in found]
            atomic_write(self.paths.home / "scanned.json", json.dumps(record).encode())
            self._scan_record = record
        return found

    def _scan(self, src: str) -> tuple[list[secrets.Finding], dict[str, list[dict[str, Any]]]]:
        """(the findings of src, the scans made on the way of other versions): the scan the
        import ran on the bytes it read (a grown session: only what it grew by, with the
        findings of the version it grew from, scanned in the file if it never was), else of
        the stored bytes."""
        record = self._scanned()
        also: dict[str, list[dict[str, Any]]] = {}
        fed, base, path = self._fed.pop(src, (None, None, None))
        if fed is not None and base is not None and path is not None and fed.start and base.src not in record:
            prefix = _scanned_prefix(path, base.size, base.src)  # a fetched version, shared back grown
            if prefix is not None:
                also[base.src] = [f.as_dict() for f in prefix]
        if fed is not None and fed.start == 0:
            return fed.findings, also
        base_scan = None if fed is None or base is None else also.get(base.src, record.get(base.src))
        if fed is not None and base is not None and base_scan is not None:
            cut = fed.start
            lines_before = base.lines - (1 if cut < base.size else 0)
            found = [secrets.Finding(**f) for f in base_scan if f["end"] <= cut]
            found += [replace(f, line=f.line + lines_before, start=f.start + cut, end=f.end + cut)
                      for f in fed.findings]
            return found, also
        scanner = secrets.Scanner()  # held already (cached), or grown from a version never scanned
        for run in self.session_runs(src):  # as it is read back: never whole in memory
            scanner.feed(run)
        return scanner.finish(), also

    def _scanned(self) -> dict[str, list[dict[str, Any]]]:
        """Every version this node has scanned: its findings ([] when clean).  Read once (only
        the process holding the store writes it), then kept up to date by _findings."""
        if self._scan_record is None:
            try:
                record = json.loads((self.paths.home / "scanned.json").read_bytes())
            except (OSError, ValueError):
                record = {}
            self._scan_record = record if isinstance(record, dict) else {}
        return self._scan_record

    def _lineage(self, path: Path, pi: PiDirs, *, follow: bool
                 ) -> tuple[list[tuple[Path, pisession.SessionHeader]], str | None, str | None]:
        """(files to share, child first, each with its header; the known branch the last of
        them continues, or None for a root; the lineage cut recorded for that root, if any).

        Each file's parent is looked up in what this node knows first: the lineage of a version
        with the same header line (the same session grown, or a fetched session whose
        parentSession names a path on another machine), then the branch of the parent file's
        bytes (a placed fetched file); only a parent the node has never seen is shared from
        disk.  A file seen twice (device, inode) is a LineageCycle.
        """
        chain: list[tuple[Path, pisession.SessionHeader]] = []
        seen: set[tuple[int, int]] = set()
        current = path
        while True:
            header = pisession.read_header(current)
            st = current.stat()
            if (st.st_dev, st.st_ino) in seen:
                names = " -> ".join(str(p) for p, _ in chain) + f" -> {current}"
                raise LineageCycle(f"parentSession cycle: {names}")
            seen.add((st.st_dev, st.st_ino))
            chain.append((current, header))
            if not follow or not header.parent_session:
                return chain, None, None
            if len(chain) >= pisession.MAX_LINEAGE_DEPTH:
                raise InvalidInput(f"lineage of {path} is deeper than {pisession.MAX_LINEAGE_DEPTH} sessions")
            known = self._known_lineage(header)
            if known is not None:
                return chain, known.parent, known.lineage_cut
            parent_file, branch = self._find_parent(header, current, pi)
            if branch is not None:
                return chain, branch, None
            assert parent_file is not None
            current = parent_file

    def _known_lineage(self, header: pisession.SessionHeader) -> BranchRecord | None:
        """A branch of a known version with this very header (the parentSession string
        included): one with a parent first, newest first; None if no such version is held.
        (A fetched root whose sharer cut its lineage stays a root here too.)"""
        fields = header.as_dict()
        records = [r for v in self.sessions.versions_of(header.id) if v.header == fields
                   for r in self.sessions.branches_of(v.src)]
        return max(records, key=lambda r: (r.parent is not None, r.shared_at), default=None)

    def _find_parent(self, header: pisession.SessionHeader, child: Path,
                     pi: PiDirs) -> tuple[Path | None, str | None]:
        """(parent file to share, None) or (None, its known branch); NotFound says what to do."""
        candidates = pisession.parent_candidates(header, pi.agent, child, pi.sessions)
        for candidate in candidates:
            if candidate.is_file():
                branch = self._branch_of_file(candidate)
                return (None, branch) if branch is not None else (candidate, None)
        by_path: dict[str, list[str]] = {}
        for branch, where in self.manifest.load().items():
            by_path.setdefault(os.path.normpath(where), []).append(branch)
        for candidate in candidates:  # a placed or shared file that has gone since
            held = [b for b in by_path.get(os.path.normpath(candidate), []) if self.has_branch(b)]
            if held:
                return None, max(held, key=lambda b: self.sessions.branch(b).shared_at)
        assert header.parent_session is not None
        name = PurePosixPath(header.parent_session.replace("\\", "/")).name
        parent_id = name[:-len(".jsonl")].partition("_")[2] if name.endswith(".jsonl") else ""
        records = [r for v in self.sessions.versions_of(parent_id) for r in self.sessions.branches_of(v.src)]
        if records:  # Pi's <ts>_<id>.jsonl name of a session this node holds
            return None, max(records, key=lambda r: r.shared_at).branch
        looked = ", ".join(str(c) for c in candidates)
        raise NotFound(
            f"parent session {header.parent_session} of {child} is not on this machine (looked at {looked}) "
            "and not known to this node. If a peer has it, fetch it by its branch hash "
            "(`p2pnode fetch <branch>`) and share again; or share with --no-lineage to share it "
            "without its parent (recorded: `p2pnode show` then says the lineage was cut)"
        )

    def _branch_of_file(self, path: Path) -> str | None:
        """The branch of a file whose bytes this node knows (its manifest's branch for that
        path first), also when pi 1.5.2 has added the final newline a version lacked."""
        src = self.hasher.scan(path).prefix.blake3
        self.hasher.save()
        records = self.sessions.branches_of(src)
        if not records:
            records = self._branches_before_final_newline(path)
        if not records:
            return None
        mine = self.manifest.load()
        where = str(path.absolute())
        best = max(records, key=lambda r: (mine.get(r.branch) == where, r.parent is not None, r.shared_at))
        return best.branch

    def _branches_before_final_newline(self, path: Path) -> list[BranchRecord]:
        """Branches of a version that is this file without its last byte, a newline: pi 1.5.2
        appends one to any session it opens that lacks it, even a `--fork` source."""
        size = path.stat().st_size
        header = pisession.read_header(path)
        for version in self.sessions.versions_of(header.id):
            if version.size == size - 1 and version.last_line_start < version.size:
                with open(path, "rb") as f:
                    f.seek(version.size)
                    if f.read(1) == b"\n" and hash_prefix(path, version.size) == version.src:
                        return self.sessions.branches_of(version.src)
        return []

    def _notices(self, path: Path) -> list[str]:
        """Things the user is told once per node (remembered in notices.json)."""
        said = self.paths.home / "notices.json"
        try:
            seen = json.loads(said.read_bytes())
        except (OSError, ValueError):
            seen = {}
        if not isinstance(seen, dict) or seen.get("system_prompt") or not pisession.has_system_prompt(path):
            return []
        atomic_write(said, json.dumps(dict(seen, system_prompt=True)).encode())
        return [SYSTEM_PROMPT_NOTICE]

    def _store_file(self, path: Path, header: pisession.SessionHeader, like: str | None,
                    progress: Callable[[int, int], object] | None = None) -> tuple[Version, list[str]]:
        """The stored version of the file's complete lines (imported unless held already)."""
        warnings: list[str] = []
        cached = self.hasher.cached(path)
        if cached is not None and self.sessions.has_version(cached.blake3):
            version = self.sessions.version(cached.blake3)
            self._restore_lost(path, version)
        else:
            try:
                version, warnings, held = self._import(path, header, like, progress)
            except (CorruptRecord, UnknownBlob) as exc:  # the version it grew from lost lines here
                log.info("%s: the version it grew from cannot be read back (%s); stored in full", path, exc)
                version, warnings, held = self._import(path, header, like, progress, from_older=False)
            if held:  # hashed again (its stat changed), the same bytes: the lines the store lost
                self._restore_lost(path, version)
        left_out = path.stat().st_size - version.size
        if left_out > 0:
            warnings.append(f"{path}: shared its complete lines ({version.size} bytes); the {left_out} bytes "
                            "after the last newline (a line Pi is still writing) are left for the next share")
        return version, warnings

    def _restore_lost(self, path: Path, version: Version) -> None:
        """The lines of a held version that the store lost (a damaged record `fsck --repair`
        dropped, a pack cut short) put back from the file shared again, each checked against
        its hash: sharing the file again heals what fsck reported (README, "A damaged store").
        Costs the turn records and one index lookup a line when nothing was lost."""
        with self._lock:
            hashes = self.sessions.line_hashes(version.src)
            lost = {h for h, held in zip(hashes, self.store.has_blobs(hashes), strict=True) if not held}
        if not lost:
            return
        with open(path, "rb") as f:
            for run in line_runs(f, CHUNK, version.size):
                for line in run:
                    if (h := blake3.blake3(line).digest()) in lost:
                        self.store.put_blob(line)
                        lost.discard(h)
                if not lost:
                    break
        if lost:
            raise VerificationFailed(f"{path}: {len(lost)} line(s) of its stored version {version.src} are "
                                     "lost from the store and are not in the file either (`p2pnode fsck`)")

    def _offer_file(self, path: Path, version: Version, parent: str | None,
                    lineage_cut: str | None = None) -> BranchInfo:
        sidecar = Sidecar(version.src, parent)
        record = self.sessions.add_branch(sidecar.encode(), sidecar.branch, version.src, parent, lineage_cut)
        self.manifest.record(record.branch, path.absolute())
        return self._info(record, str(path.absolute()))

    def _import(self, path: Path, header: pisession.SessionHeader, like: str | None,
                progress: Callable[[int, int], object] | None,
                from_older: bool = True) -> tuple[Version, list[str], bool]:
        """Store the file, reusing an older version it grew from (unless not `from_older`:
        every line read and stored again, those the store has already not twice), or its
        parent's lines; whether the same bytes were held already."""
        size = path.stat().st_size
        known = self.hasher.known(path)
        with self._lock:
            older: list[Version] = []
            if from_older:
                older = self.sessions.older_versions_of(header.id, size)
                if known is not None and known.size <= size and self.sessions.has_version(known.blake3):
                    older.append(self.sessions.version(known.blake3))  # this path's last, whatever its header

        fed = _ScanningSink(progress, size)

        def scan(prefixes: Sequence[Prefix], sink: Sink) -> Scan:
            fed.inner = sink
            return self.hasher.scan(path, prefixes=prefixes, sink=fed)

        result = self.sessions.import_file(path, scan, header, older, like, guard=self._lock)
        if result.lines is not None:
            with self._lock:
                while len(self._imported) >= IMPORTED_LINES_KEPT:
                    self._imported.pop(next(iter(self._imported)))
                self._imported[result.version.src] = result.lines
        self.hasher.save()
        fed.finish()
        if result.scan.rewritten:
            log.info("%s was rewritten since the versions held of it; stored in full", path)
        if fed.vouched:
            self._fed[result.version.src] = (fed, result.grown, path)
        return result.version, result.warnings, result.held

    def unshare(self, branch_hex: str) -> Unshared:
        """Stop offering a branch to peers, at once (transfers of it stop: `add_listener`), with
        every other version of its Pi session (each holds this one's bytes, or this one theirs:
        `ls` shows the session as one row); its bytes stay in the store until `p2pnode gc`.
        Says which offered branches descend from it: no longer served (their lineage is not)."""
        with self._lock:
            record = self.sessions.branch(self.resolve_branch(branch_hex))
            versions, withheld = self._unshared_with(record)
            if not record.offered and not versions:  # unshared already, expired, or fetched
                return Unshared(self._info(record), [], [], was_offered=False)
            for r in [record, *versions]:
                if r.offered:  # one event per branch it withdraws
                    self.sessions.withdraw(r.branch, "unshared")
                    self.audit.append("unshared", branch=r.branch, title=self._info(r).title)
            self._changed()
            return Unshared(self._info(self.sessions.branch(record.branch)), [r.branch for r in versions],
                            [self._info(r) for r in withheld])

    def unsharing(self, branch_hex: str) -> list[str]:
        """The branches `unshare(branch_hex)` would withdraw or leave unserved now: the node
        stops the live shares of them first (one would offer them again at Pi's next line)."""
        with self._lock:
            record = self.sessions.branch(self.resolve_branch(branch_hex))
            versions, withheld = self._unshared_with(record)
            return [r.branch for r in [record, *versions, *withheld]]

    def _unshared_with(self, record: BranchRecord) -> tuple[list[BranchRecord], list[BranchRecord]]:
        """(the offered other versions of the branch's session, withdrawn with it; the offered
        branches descending from any of them, no longer served once they are)."""
        versions = [r for r in self._session_versions(record) if r.offered]
        gone = {record.branch, *(r.branch for r in versions)}
        withheld = [r for r in self.sessions.branches()
                    if r.offered and r.branch not in gone and gone & set(self._ancestors(r))]
        return versions, withheld

    def _session_versions(self, record: BranchRecord) -> list[BranchRecord]:
        """The other branches of the same Pi session held here (its versions: the same chain
        of versions and the same lineage parent)."""
        index, _ = self._version_index()
        return [r for r in self.sessions.branches() if r.branch != record.branch and r.parent == record.parent
                and index.same_session(r.src, record.src)]

    def _ancestors(self, record: BranchRecord) -> Iterator[str]:
        """The branch's ancestors held here, parent first."""
        seen = {record.branch}
        while record.parent is not None and record.parent not in seen and self.has_branch(record.parent):
            seen.add(record.parent)
            record = self.sessions.branch(record.parent)
            yield record.branch

    def record_path(self, branch_hex: str, path: Path | str) -> None:
        self.manifest.record(branch_hex, Path(path).absolute())

    # --- reads ---

    def resolve_branch(self, text: str) -> str:
        """A full branch hash, or a unique prefix of a known one (at least 4 hex characters)."""
        text = text.strip().lower()
        if is_hash_hex(text):
            return text
        if not 4 <= len(text) < 64 or any(c not in "0123456789abcdef" for c in text):
            raise InvalidInput(f"{text!r} is not a branch hash (64 hex characters) or a prefix of one "
                               "(at least 4)")
        matches = [r.branch for r in self.sessions.branches() if r.branch.startswith(text)]
        if len(matches) != 1:
            names = ", ".join(m[:16] for m in sorted(matches)[:8])
            which = f": {names}; give more of the hash" if matches else ""
            raise NotFound(f"branch prefix {text!r} matches {len(matches)} known branches{which}")
        return matches[0]

    def _info(self, record: BranchRecord, path: str | None = None, *, for_peers: bool = False) -> BranchInfo:
        """`for_peers`: without the local path (manifest.json's), which peers never see."""
        version = self.sessions.version(record.src)
        index, counts = self._version_index()
        older = index.previous.get(record.src)
        previous = previous_branch(record, index, self.sessions.branches_of(older)) if older else None
        return BranchInfo(
            branch=record.branch, src=record.src, parent=record.parent, size=version.size,
            lines=version.lines, header=dict(version.header), title=version.title, offered=record.offered,
            shared_at=record.shared_at,
            path=None if for_peers else path if path is not None else self.manifest.get(record.branch),
            lineage_cut=record.lineage_cut, secrets_allowed=record.secrets_allowed,
            expires_at=record.expires_at, to=record.to, withdrawn=record.withdrawn,
            previous=previous,
            version=index.number.get(record.src, 1),
            versions=counts.get(index.root.get(record.src, record.src), 1),
            withheld=self._withheld(record),
        )

    def _withheld(self, record: BranchRecord) -> str | None:
        """Why an offered branch is not served, or None: secrets found, or an ancestor that is not."""
        if not record.offered:
            return None
        found = None if record.secrets_allowed else self._scanned().get(record.src)
        if found is None and not record.secrets_allowed:  # offered before scans were recorded: scanned
            self.scan_unrecorded()  # now, once
            found = self._scanned().get(record.src)
        if found:
            return (f"not served: the secret scan found {len(found)} secret(s) in it (shared before scans "
                    "were recorded); share it again to see them, with --redact or --allow-secrets")
        servable, whole = self._servability(access.now_ms())
        if record.branch not in servable or record.branch in whole:
            return None  # expired: access_note says so
        gap = record
        while gap.branch in servable and gap.parent is not None:
            gap = self.sessions.branch(gap.parent)
        why = gap.withdrawn or ("not offered" if not gap.offered else "withheld")
        return (f"not served: its ancestor {gap.branch[:16]} is {why}, and a peer without it could not "
                "fetch this lineage; share that again to serve it")

    def scan_unrecorded(self) -> int:
        """Scan each offered version that has no scan record and record the result: branches
        offered before the scan existed are served again if clean, withheld (BranchInfo.withheld)
        if not.  The node runs it once at start, off its event loop, before it serves peers;
        without a node the first request waits for it (_visible).  Returns how many versions
        were scanned."""
        with self._lock:
            todo = sorted({r.src for r in self.sessions.branches()
                           if r.offered and not r.secrets_allowed} - self._scanned().keys())
            for src in todo:
                found = self._findings(src)
                log.info("scanned %s, offered before scans were recorded: %s", src[:16],
                         f"{len(found)} secret(s): withheld" if found else "clean")
            if todo:
                self._access.clear()
                self._served = None
        return len(todo)

    def _version_index(self) -> tuple[VersionIndex, dict[str, int]]:
        """The chains of versions (library/versions.py) and, per chain, how many of its versions
        have a branch; rebuilt when a version or branch is added."""
        key = (self.sessions.generation, len(self.sessions.all_versions()))
        if self._versions is None or self._versions[0] != key:
            index = build_index(self.sessions.all_versions())
            counts: dict[str, int] = {}
            for src in {r.src for r in self.sessions.branches()}:
                root = index.root.get(src, src)
                counts[root] = counts.get(root, 0) + 1
            self._versions = (key, index, counts)
        return self._versions[1], self._versions[2]

    def versions(self, branch_hex: str) -> list[BranchInfo]:
        """The versions of this branch's Pi session held here, oldest first: per version its
        branch with the same lineage parent as this one if there is one, else its newest."""
        with self._lock:
            mine = self.sessions.branch(self.resolve_branch(branch_hex))
            index, _ = self._version_index()
            paths = self.manifest.load()
            chosen: list[BranchRecord] = []
            for src in sorted((s for s in index.root if index.same_session(s, mine.src)),
                              key=lambda s: (index.number[s], self.sessions.version(s).size)):
                records = self.sessions.branches_of(src)
                if records:
                    chosen.append(max(records, key=lambda r: (
                        r.branch == mine.branch, r.parent == mine.parent, r.shared_at)))
            return [self._info(r, paths.get(r.branch)) for r in chosen]

    def sessions_latest(self, include_unshared: bool = False) -> list[BranchInfo]:
        """One row per Pi session (a chain of versions): its latest version's branch, with
        `versions` = how many of its versions are listed (offered ones unless include_unshared);
        newest share first."""
        with self._lock:
            index, _ = self._version_index()
            groups: dict[str, list[BranchRecord]] = {}
            for r in self.sessions.branches():
                if r.offered or include_unshared:
                    groups.setdefault(index.root.get(r.src, r.src), []).append(r)
            paths = self.manifest.load()
            rows = []
            for records in groups.values():
                latest = max(records, key=lambda r: (index.number.get(r.src, 1), r.shared_at))
                info = self._info(latest, paths.get(latest.branch))
                rows.append(replace(info, versions=len({r.src for r in records})))
        return sorted(rows, key=lambda i: i.shared_at, reverse=True)

    def branches(self, include_unshared: bool = False) -> list[BranchInfo]:
        """Known branches, newest share first."""
        with self._lock:
            paths = self.manifest.load()
            records = [r for r in self.sessions.branches() if r.offered or include_unshared]
            infos = [self._info(r, paths.get(r.branch)) for r in records]
        return sorted(infos, key=lambda i: i.shared_at, reverse=True)

    def branch(self, branch_hex: str) -> BranchInfo:
        with self._lock:
            return self._info(self.sessions.branch(self.resolve_branch(branch_hex)))

    def lineage(self, branch_hex: str) -> list[BranchInfo]:
        """The branch and its ancestors held here, child first (stops at one not held)."""
        chain = [self.branch(branch_hex)]
        seen = {chain[0].branch}
        while (parent := chain[-1].parent) is not None and parent not in seen and self.has_branch(parent):
            chain.append(self.branch(parent))
            seen.add(parent)
        return chain

    def children(self, branch_hex: str) -> list[BranchInfo]:
        branch = self.resolve_branch(branch_hex)
        return [i for i in self.branches(include_unshared=True) if i.parent == branch]

    def catalog(self, peer: str | None = None) -> Catalog:
        """The offered branches `peer` may fetch (None: those offered to every trusted peer),
        newest share first, without local paths: peers never see them, so a damaged
        manifest.json (each local command names it) does not stop the node serving."""
        with self._lock:
            visible = self._visible(peer).objects
            infos = [self._info(r, for_peers=True) for r in self.sessions.branches()
                     if r.offered and r.branch in visible]
        return Catalog(self.sessions.generation, sorted(infos, key=lambda i: i.shared_at, reverse=True))

    def sidecar_bytes(self, branch_hex: str) -> bytes:
        with self._lock:
            return self.sessions.sidecar_bytes(branch_hex)

    def session_bytes(self, src_hex: str) -> bytes:
        """The verbatim file, whole (session_runs joined: hashed to src before it is returned)."""
        return b"".join(self.session_runs(src_hex))

    def session_runs(self, src_hex: str, run_bytes: int = SESSION_RUN) -> Iterator[bytes]:
        """The verbatim file from the store in runs of about `run_bytes` (what `cat` writes:
        a session is never whole in memory), each line checked against its hash as it is
        read, the whole hashed to `src_hex` at the end: VerificationFailed then, once the runs
        before were handed out (a damaged store, whose every line was fine)."""
        with self._lock:
            turns = self.sessions.line_turns(src_hex)
        hasher = new_hasher()
        run: list[bytes] = []
        size = 0
        for at in range(0, len(turns), TURNS_READ):
            with self._lock:
                lines = self.sessions.payloads(src_hex, turns[at:at + TURNS_READ])
            for line in lines:
                run.append(line)
                size += len(line)
                if size >= run_bytes:
                    data = b"".join(run)
                    hasher.update(data)
                    yield data
                    run, size = [], 0
        if run:
            data = b"".join(run)
            hasher.update(data)
            yield data
        if (actual := hasher.hexdigest()) != src_hex:
            raise VerificationFailed(f"session {src_hex} read back from the store hashes to {actual}")

    def write_session(self, src_hex: str, write: Callable[[bytes], object]) -> int:
        """session_runs(src_hex) handed to `write`; the bytes written (the running node's
        NodeLibrary has the same method)."""
        size = 0
        for run in self.session_runs(src_hex):
            write(run)
            size += len(run)
        return size

    def line_manifest(self, src_hex: str) -> LineRefs:
        """The ordered line hashes and lengths of a stored session version."""
        with self._lock:
            refs = self._cached_manifest(src_hex)
            if refs is None:  # from the turn records and the blob index: no line is read
                hashes = self.sessions.line_hashes(src_hex)
                refs = self._keep_manifest(src_hex, LineRefs.packed(hashes, self.store.raw_lengths(hashes)))
            return refs

    def line_hashes(self, src_hex: str) -> list[bytes]:
        """The line hashes of a stored session version, in file order: `line_manifest`'s
        without the lengths, which cost an index lookup a line where it is not cached."""
        with self._lock:
            refs = self._cached_manifest(src_hex)
            return refs.hashes() if refs is not None else self.sessions.line_hashes(src_hex)

    def _cached_manifest(self, src_hex: str) -> LineRefs | None:
        """A manifest cached, or made (and cached) from its import's lines or its version's
        `previous`'s."""
        refs = self._manifests.get(src_hex)
        if refs is None and (imported := self._imported.pop(src_hex, None)) is not None:
            refs = self._keep_manifest(src_hex, imported.refs())
        if refs is None and (refs := self._grown_manifest(src_hex)) is not None:
            self._keep_manifest(src_hex, refs)
        return refs

    def _keep_manifest(self, src_hex: str, refs: LineRefs) -> LineRefs:
        if len(self._manifests) >= 64:
            self._manifests.pop(next(iter(self._manifests)))
        self._manifests[src_hex] = refs
        return refs

    def _line_hashes_after(self, src_hex: str, skip: int) -> Iterable[bytes]:
        """A version's line hashes after its first `skip`, for the line index (`_visible`): from
        the lines its import met, its cached manifest, or one made from its `previous`'s
        (cached: the provider asks for it next), else from its turns (not cached: many offered
        versions must not flush the manifests being served), walked back from its head when
        `skip` is not 0 (O(the rest)).
        None of a version whose turns cannot be read (a damaged record `fsck --repair` drops):
        its lines are not served, and the rest of the catalog is."""
        with self._lock:
            try:
                if (imported := self._imported.get(src_hex)) is not None:
                    return imported.hashes_after(skip)
                refs = self._cached_manifest(src_hex)
                if refs is not None:
                    return refs[skip:].hashes()
                version = self.sessions.version(src_hex)
                return (self.sessions.last_line_hashes(src_hex, version.lines - skip) if skip
                        else self.sessions.line_hashes(src_hex))
            except (CorruptRecord, UnknownTurn) as exc:
                log.warning("not serving the lines of version %s: its turns cannot be read (%s; "
                            "`p2pnode fsck`)", src_hex, exc)
                return ()

    def _grown_manifest(self, src_hex: str) -> LineRefs | None:
        """The manifest of a version whose `previous` (its bytes a prefix of this one's) ends
        with a newline and has its manifest cached: that (its lines are this one's first), plus
        the new lines' (O(new lines)); None otherwise."""
        version = self.sessions.version(src_hex)
        older = self._manifests.get(version.previous) if version.previous else None
        if (older is None or version.previous is None or len(older) > version.lines
                or (held := self.sessions.version(version.previous)).last_line_start != held.size):
            return None
        tail = self.sessions.last_line_hashes(src_hex, version.lines - len(older))
        return older + LineRefs.packed(tail, self.store.raw_lengths(tail))

    def line_manifest_after(self, src_hex: str, held: Sequence[str],
                            peer: str | None = None) -> tuple[str, int] | None:
        """(base, first): of the versions `held` that this node offers `peer`, the one of the same
        session whose lines up to its last newline (`first` of them) are the first lines of
        `src_hex`, the longest; None if there is none.  By turns where the two versions share
        them (O(new lines)), else by line hashes (turn records only)."""
        with self._lock:
            target = self.sessions.version(src_hex)
            hashes: list[bytes] = []
            best: tuple[str, int] | None = None
            for base in held:
                if base == src_hex or self.offered_object(base, peer) != "session":
                    continue
                version = self.sessions.version(base)
                first = version.lines - (version.last_line_start < version.size)
                if (version.session_id != target.session_id or not 1 <= first <= target.lines
                        or (best is not None and first <= best[1])):
                    continue
                if self._same_turns(src_hex, base, first):
                    best = (base, first)
                    continue
                hashes = hashes or self.sessions.line_hashes(src_hex)
                if self.sessions.line_hashes(base)[:first] == hashes[:first]:
                    best = (base, first)
            return best

    def _same_turns(self, src_hex: str, base: str, first: int) -> bool:
        """Whether the two versions' first `first` lines are the same turns (one import grown)."""
        head_of = self.store.get_turn
        return (self.sessions.line_turn(src_hex, first) == self.sessions.line_turn(base, first)
                and head_of(self.sessions.version(src_hex).head).payload_hash
                == head_of(self.sessions.version(base).head).payload_hash)

    def version(self, src_hex: str) -> Version:
        """The stored version (size, lines, where its last line starts, header, titles)."""
        return self.sessions.version(src_hex)

    def first_line(self, src_hex: str) -> bytes:
        """A stored version's first line (where Pi's header is, unless lines Pi skips come
        before it), without walking its other lines."""
        with self._lock:
            return self.sessions.first_line(src_hex)

    def line(self, line_hash: bytes) -> bytes:
        """One line's bytes from the store, re-hashed; VerificationFailed if the store lacks it
        or its copy is damaged (asked only for a line of a version held here: its loss is damage)."""
        return self.sessions.blob(line_hash, f"line {line_hash.hex()}")

    def lines(self, hashes: Sequence[bytes]) -> list[bytes]:
        """Many lines' bytes from the store at once, each checked against its hash once (a
        fetch's held lines: one call per run, not per line); NotFound if the store lacks one."""
        try:
            return self.sessions.blobs(hashes, "a line")
        except UnknownBlob as exc:
            raise NotFound(f"line {exc.blob_hash.hex()} is not in this node's store") from None

    def damaged_lines_of(self, src_hex: str) -> list[bytes]:
        """The lines of held version `src_hex` whose stored copy cannot be read back, each line
        read and checked once, alone (a failure path: the lines of a version a read found
        damaged).  This opening of the store names each one damaged from then on, so `has_lines`
        says it is not held: a fetch asks peers for it again, and storing its bytes heals the store."""
        with self._lock:
            hashes = dict.fromkeys(self.sessions.line_hashes(src_hex))
        damaged = []
        for h in hashes:
            try:
                self.store.get_blob(h)
            except StoreError:  # damaged (CRC, decoding, hash) or lost
                damaged.append(h)
        return damaged

    def stored_line(self, line_hash: bytes) -> StoredBlob:
        """One line as the store keeps it (compressed or raw), for serving it as it is."""
        return self.store.get_stored_blob(line_hash)

    def has_line(self, line_hash: bytes) -> bool:
        return self.store.has_blob(line_hash)

    def has_lines(self, hashes: Sequence[bytes]) -> list[bool]:
        return self.store.has_blobs(hashes)

    def has_branch(self, branch_hex: str) -> bool:
        try:
            self.sessions.branch(branch_hex)
        except NotFound:
            return False
        return True

    def has_session(self, src_hex: str) -> bool:
        return self.sessions.has_version(src_hex)

    def offered_object(self, hash_hex: str, peer: str | None = None) -> str | None:
        """"sidecar", "session" or "line" if `peer` (a node id; None: any trusted peer) may be
        served the hash now, else None: peers get nothing else.  The one check the provider
        makes per request (library/access.py has the rule)."""
        entry = self._reached(self._visible(peer), hash_hex)
        return entry[0] if entry else None

    def _reached(self, visible: _Visible, hash_hex: str) -> tuple[str, str] | None:
        """(kind, the branch that makes it visible) of a hash in `visible`, else None: a
        sidecar or session by its entry, a line by a version holding it (the line index).
        Without the lock: the index only ever says of a version what its bytes hold, so one
        changed meanwhile for a later generation can withhold a line from this one, never show one."""
        entry = visible.objects.get(hash_hex)
        if entry is not None or len(hash_hex) != 64:
            return entry
        try:
            digest = bytes.fromhex(hash_hex)
        except ValueError:
            return None
        holders = self._lines.holders(digest)
        if holders and digest.hex() == hash_hex:  # our text form only, as for the other entries
            for src in holders:
                if (branch := visible.versions.get(src)) is not None:
                    return "line", branch
        return None

    def _servability(self, now: int) -> tuple[frozenset[str], frozenset[str]]:
        """(servable, whole): the branches offered, unexpired and clean (or shared with
        --allow-secrets), and those of them whose every ancestor is so too.  Only those are
        served as what a share offered: a fork whose parent was unshared cannot be fetched by a
        peer that lacks the parent, so it is not listed either (BranchInfo.withheld says why)."""
        scanned = self._scanned()
        key = (self.sessions.generation, len(scanned))
        if self._served is not None and self._served[0] == key:
            return self._served[1], self._served[2]
        records = {r.branch: r for r in self.sessions.branches()}
        servable = {b for b, r in records.items() if r.offered and not access.expired(r.expires_at, now)
                    and (r.secrets_allowed or scanned.get(r.src) == [])}
        whole: set[str] = set()
        for branch in servable:
            chain = [branch]
            while (parent := records[chain[-1]].parent) is not None and parent in servable \
                    and parent not in whole and len(chain) <= len(records):
                chain.append(parent)
            if parent is None or parent in whole:
                whole.update(chain)
        self._served = (key, frozenset(servable), frozenset(whole))
        return self._served[1], self._served[2]

    def _visible(self, peer: str | None) -> _Visible:
        """What `peer` may be served: the branches offered to it whose whole lineage is servable
        (_servability), with their ancestors; the walk stops at a branch that is not servable
        itself (unshared, expired, or fetched and never shared here): a branch whose parent a
        peer chose cannot make an unshared one visible.  Made per peer from the branch records
        alone: the lines are looked up in the line index, which follows the versions of the
        whole lineages (`_lines.update`: a share walks its own new lines, once for all peers)."""
        with self._lock:
            now = access.now_ms()
            if self._next_expiry is not None and now >= self._next_expiry:
                self._expire_due(now)
            generation = self.sessions.generation
            cached = self._access.get(peer)
            if cached is not None and cached.generation == generation:
                return cached
            self.scan_unrecorded()  # branches offered before scans were recorded: once
            servable, whole = self._servability(now)
            self._lines.update({r.src: self.sessions.version(r.src) for r in self.sessions.branches()
                                if r.branch in whole}, self._line_hashes_after, self.sessions.has_version)
            objects: dict[str, tuple[str, str]] = {}
            versions: dict[str, str] = {}
            for root in self.sessions.branches():
                if root.branch not in whole or (root.to is not None and peer not in root.to):
                    continue
                branch: str | None = root.branch
                while branch is not None and branch not in objects and branch in servable:
                    record = self.sessions.branch(branch)
                    objects[branch] = ("sidecar", branch)
                    if record.src not in versions:
                        objects[record.src] = ("session", branch)
                        versions[record.src] = branch
                    branch = record.parent
            for src, branch in list(versions.items()):  # their lines are those they grew from too
                older = self._lines.grown_from.get(src)
                while older is not None and older not in versions:
                    versions[older] = branch
                    older = self._lines.grown_from.get(older)
            self._access[peer] = _Visible(generation, objects, versions)
            return self._access[peer]

    # --- fetched versions ---

    def add_fetched(self, sidecar: bytes, lines: Sequence[bytes],
                    stored: Iterable[StoredBlob] = ()) -> BranchInfo:
        """Store a fetched branch after verifying it all: sidecar valid, lines hash to src.

        `lines`: the session cut at its newlines.  `stored`: blobs of (some of) those lines
        as the peer sent them; they are kept as they are instead of being compressed again
        (each is taken for the line whose hash it carries, and the store decodes and re-hashes
        it before keeping it)."""
        branch = blake3_hex(sidecar)
        parsed = parse_sidecar(sidecar, expected_branch=branch)
        hasher = new_hasher()
        for line in lines:
            hasher.update(line)
        if (actual := hasher.hexdigest()) != parsed.src:
            raise VerificationFailed(f"fetched branch {branch}: session hashes to {actual}, not {parsed.src}")
        with self._lock:
            if not self.sessions.has_version(parsed.src):
                parent = parsed.parent
                like = self.sessions.branch(parent).src if parent and self.has_branch(parent) else None
                try:
                    self.sessions.import_lines(lines, parsed.src, f"fetched session {parsed.src}", like,
                                               {b.hash: b for b in stored})
                except BlobMismatch as exc:
                    raise VerificationFailed(f"fetched branch {branch}: {exc}") from None
            return self._record_fetched(sidecar, branch, parsed)

    def _record_fetched(self, sidecar: bytes, branch: str, parsed: Sidecar) -> BranchInfo:
        """Caller holds the lock; the branch's version is stored."""
        # a fetched branch is not offered on until this node's user shares it, and fetching
        # one the user unshared does not offer it again
        offered = self.has_branch(branch) and self.sessions.branch(branch).offered
        record = self.sessions.add_branch(sidecar, branch, parsed.src, parsed.parent, offered=offered)
        info = self._info(record)
        self.audit.append("fetched", branch=branch, src=info.src, bytes=info.size, title=info.title)
        return info

    def stage_lines(self, blobs: Sequence[StoredBlob]) -> None:
        """Keep lines a fetch verified on arrival in the store at once, durably, as they were
        sent (raw-codec ones compressed), without decoding and hashing them again.  They stay
        unreferenced until `add_staged` commits their version; a fetch that never does leaves
        them to the store's GC, and a fetch run again finds them held (resume)."""
        self.store.put_stored_blobs(blobs, verified=True)

    def add_staged(self, sidecar: bytes, refs: Sequence[LineRef], prefix: Prefix,
                   header: pisession.SessionHeader, titles: tuple[str | None, str | None]) -> BranchInfo:
        """Commit a fetched version whose lines are all in the store (staged or held before):
        the caller verified, line by line as they came, that they hash to `prefix.blake3`, are
        the file cut at its newlines and that `header` is its Pi header.  Turns reference the
        stored blobs (nothing is read back); the version continues the longest matching held
        version of the same session or the parent's; then the branch is recorded."""
        def store(parsed: Sidecar) -> None:
            with self._lock:
                like = [v.src for v in sorted(self.sessions.versions_of(header.id), key=lambda v: -v.size)]
                if parsed.parent and self.has_branch(parsed.parent):
                    like.append(self.sessions.branch(parsed.parent).src)
            version = self.sessions.import_refs(refs, prefix, header, titles, like, self._lock)
            with self._lock:  # what a fork of it fetched next, and a peer fetching it from here, ask for
                self._keep_manifest(version.src, LineRefs.of(refs))

        return self._add_fetched(sidecar, prefix, store)

    def _add_fetched(self, sidecar: bytes, prefix: Prefix, store: Callable[[Sidecar], None]) -> BranchInfo:
        """The sidecar checked against the verified session, `store` run unless the version
        is held already, the branch recorded.  The turns are written without the library's
        lock, as a share's are (a 2 GB session's commit took seconds in which the node served
        no one), under `_imports` (`gc` and `rm` wait)."""
        branch = blake3_hex(sidecar)
        parsed = parse_sidecar(sidecar, expected_branch=branch)
        if parsed.src != prefix.blake3:
            raise VerificationFailed(f"fetched branch {branch}: names session {parsed.src}, "
                                     f"not {prefix.blake3}")
        with self._imports:
            if not self.sessions.has_version(parsed.src):
                store(parsed)
            with self._lock:
                return self._record_fetched(sidecar, branch, parsed)

    def extend_staged(self, sidecar: bytes, base: str, first: int, new: Sequence[LineRef], prefix: Prefix,
                      header: pisession.SessionHeader, titles: tuple[str | None, str | None]) -> BranchInfo:
        """`add_staged` for a version fetched incrementally: the first `first` lines of the
        held version `base`, then `new` (the caller hashed the whole to `prefix.blake3`).
        Its turns continue `base`'s: O(new lines), no held line or turn list read."""
        def store(_: Sidecar) -> None:
            self.sessions.extend_refs(base, first, new, prefix, header, titles, self._lock)

        return self._add_fetched(sidecar, prefix, store)

    # --- who may fetch what, and until when (library/access.py) ---

    def _grant(self, infos: list[BranchInfo], audience: access.Audience,
               live: dict[str, BranchRecord]) -> list[BranchInfo]:
        """Give the branches a share offered their audience (the shared one exactly; ancestors
        that were offered already keep whom they had: access.Audience.widened) and log it, with
        each branch offered before whose audience this share changed."""
        granted = []
        changed: dict[str, BranchRecord] = {}

        def give(branch: str, to: access.Audience) -> BranchRecord:
            record = self.sessions.set_access(branch, to.expires_at, to.to)
            if (was := live.get(branch)) is not None and (was.expires_at, was.to) != (to.expires_at, to.to):
                changed[branch] = record
            return record

        for info in infos:
            mine = audience
            old = live.get(info.branch)
            if info is not infos[-1] and old is not None:
                mine = audience.widened(old.expires_at, old.to)
            granted.append(self._info(give(info.branch, mine), info.path))
        for other in self._session_versions(self.sessions.branch(granted[-1].branch)):
            if other.offered:  # its other versions go to whom the session now goes, until then
                give(other.branch, audience)
        last = granted[-1]
        changed.pop(last.branch, None)  # the event says whom it goes to
        self.audit.append("shared", branch=last.branch, src=last.src, bytes=last.size, title=last.title,
                          expires_at=last.expires_at, to=last.to, secrets_allowed=last.secrets_allowed,
                          lineage=[i.branch for i in granted[:-1]],
                          audience_changed=[{"branch": r.branch, "to": r.to, "expires_at": r.expires_at}
                                            for r in changed.values()])
        self._next_expiry = 0
        self._changed()
        return granted

    def expire_due(self) -> list[str]:
        """Withdraw the offered branches whose expiry has passed (each logged once, the catalog
        generation moves); the node's timer calls this, and so does every request."""
        with self._lock:
            return self._expire_due(access.now_ms())

    def _expire_due(self, now: int) -> list[str]:
        gone = [r for r in self.sessions.branches() if r.offered and access.expired(r.expires_at, now)]
        for record in gone:
            title = self._info(record).title
            self.sessions.withdraw(record.branch, "expired")
            self.audit.append("expired", branch=record.branch, title=title, expires_at=record.expires_at)
        self._next_expiry = min((r.expires_at for r in self.sessions.branches()
                                 if r.offered and r.expires_at is not None), default=None)
        if gone:
            self._changed()
        return [r.branch for r in gone]

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call `listener` (on any thread) whenever what peers may be served may have shrunk."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[], None]) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def _changed(self) -> None:
        for listener in list(self._listeners):
            listener()

    def record_served(self, answers: Sequence[ServedAnswer]) -> None:
        """Log what answers served to peers, one event each, in one flush: the branches each
        answer's hashes are visible through (for an answer cut off because they no longer are:
        the branch or session it carried), its bytes, and whether it was cut off."""
        events = []
        with self._lock:
            for a in answers:
                visible = self._visible(a.peer)
                reached = {h: entry for h in a.hashes if (entry := self._reached(visible, h)) is not None}
                branches = {entry[1] for entry in reached.values()}
                branches |= {r.branch for h in a.hashes if h not in reached for r in self.sessions.branches()
                             if h in (r.branch, r.src)}
                events.append(("served", {"peer": a.peer, "peer_name": a.name, "kind": a.kind,
                                          "branches": sorted(branches), "bytes": a.nbytes,
                                          "complete": a.complete}))
        self.audit.append_many(events)

    # --- space (library/space.py) ---

    def gc(self, on_phase: Callable[[str], None] | None = None) -> space.GCReport:
        """Forget withdrawn branches and superseded versions, then run the store's crash-safe
        GC; skipped (nothing changed) while a fetch holds a transfer lease.  `on_phase(name)`
        after each durable step: "records-saved", "contexts-deleted", then the store's."""
        phase = on_phase or (lambda _name: None)
        if not self.leases.begin_collecting():
            return space.GCReport([], [], 0, 0, 0, skipped="a fetch is in progress")
        try:
            with exclusive_if_free(space.fetching_lock(self.paths.home)) as alone, self._imports, self._lock:
                if not alone:
                    return space.GCReport([], [], 0, 0, 0, skipped="a fetch runs in another process")
                self.store.checkpoint()  # blobs left in the head WAL go to the pack now: counted before
                before = space.store_bytes(self.store)
                drop = space.garbage(self.sessions)
                self.sessions.forget(drop.branches, drop.versions, lambda: phase("records-saved"))
                # logged now: an interrupted store GC must not leave forgotten branches unlogged
                self.audit.append("gc", branches=drop.branches, versions=len(drop.versions))
                phase("contexts-deleted")
                for branch in drop.branches:
                    self.manifest.remove(branch)
                stats = self.store.gc(phase)
                staged = space.sweep_fetching(self.paths.fetching, self.store.config.gc_grace_seconds)
                report = space.GCReport(drop.branches, drop.versions, stats.bytes_freed, before,
                                        space.store_bytes(self.store), staging_bytes_freed=staged)
                if stats.bytes_freed:
                    self.audit.append("reclaimed", bytes=stats.bytes_freed)
                self._changed()
                return report
        finally:
            self.leases.end_collecting()

    def remove(self, target: str) -> list[BranchInfo]:
        """`p2pnode rm`: forget a branch (hash or prefix) or every branch of a Pi session id,
        with their versions unless a kept branch uses them; offered ones are unshared first.
        Their bytes go at the next `gc`.  A branch that is the parent of another held here is
        refused: remove the child first."""
        with self._imports, self._lock:
            records = self._removable(target)
            names = {r.branch for r in records}
            infos = [self._info(r) for r in records]
            used = {r.src for r in self.sessions.branches() if r.branch not in names}
            self.sessions.forget(sorted(names), sorted({r.src for r in records} - used))
            for info in infos:
                self.manifest.remove(info.branch)
                self.audit.append("removed", branch=info.branch, title=info.title, was_offered=info.offered)
            self._changed()
            return infos

    def drop_unreadable(self) -> list[Dropped]:
        """`fsck --repair`: forget the versions and branches whose turn chains the store can no
        longer read (a damaged `turns.log` record no WAL copy repaired), so that the rest of
        the store works again (`gc`, `share`), and sharing the file again (or fetching it)
        stores it anew."""
        with self._imports, self._lock:
            versions = self.sessions.all_versions()
            records = self.sessions.branches()
            unreadable = self.store.unreadable_chains([v.head for v in versions] + [r.head for r in records])
            bad = {head: f"its turns cannot be read ({exc})" for head, exc in unreadable.items()}
            lost = {v.src: bad[v.head] for v in versions if v.head in bad}
            # a branch's sidecar turn heads the context its version's turns are in (the first
            # branch of a version takes the version's context): the version goes with it
            contexts = {v.src: v.context for v in versions}
            lost |= {r.src: bad[r.head] for r in records
                     if r.head in bad and r.src not in lost and contexts[r.src] == r.context}
            why = {r.branch: lost.get(r.src) or bad[r.head]
                   for r in records if r.head in bad or r.src in lost}
            while more := {r.branch: f"its parent {r.parent} was dropped" for r in records
                           if r.branch not in why and r.parent in why}:
                why.update(more)  # a branch held here has its parent held (as `rm` keeps it)
            dropped = [Dropped(r.src, why[r.branch], r.branch, info.title, info.path,
                               shared_here=r.offered or r.withdrawn is not None)
                       for r in records if r.branch in why for info in [self._info(r)]]
            dropped += [Dropped(src, reason) for src, reason in lost.items()
                        if all(d.src != src for d in dropped)]
            if not dropped:
                return []
            # logged first: a repair killed after forgetting them must still have said what went
            self.audit.append_many([("dropped", {"branch": d.branch, "title": d.title, "why": d.why})
                                    for d in dropped if d.branch])
            self.sessions.forget(sorted(d.branch for d in dropped if d.branch), sorted(lost))
            for d in dropped:
                if d.branch:
                    self.manifest.remove(d.branch)
            self._changed()
            return dropped

    def damaged_lines(self) -> list[Damaged]:
        """`fsck --repair`: the branches whose lines (line hashes: turn records only) are in a
        damaged pack record.  They are kept, not forgotten: their turns read, the damaged
        record stays an error until the same bytes are stored again (docs/FORMAT.md,
        "Checking"), which sharing the file again does (`_restore_lost`)."""
        damaged = self.store.damaged_blobs()
        if not damaged:
            return []
        with self._lock:
            hit: dict[str, int] = {}
            for v in self.sessions.all_versions():
                if n := len(set(self.sessions.line_hashes(v.src)) & damaged.keys()):
                    hit[v.src] = n
            return [Damaged(r.branch, hit[r.src], info.title, info.path, r.offered or r.withdrawn is not None)
                    for r in self.sessions.branches() if r.src in hit for info in [self._info(r)]]

    def removal(self, target: str) -> list[str]:
        """The branches `remove(target)` would forget now, or its error: the node stops its
        follows of them first (a follow would fetch the session again, whole)."""
        with self._lock:
            return [r.branch for r in self._removable(target)]

    def _removable(self, target: str) -> list[BranchRecord]:
        """`_remove_targets`, refused when a branch held here has one of them as its parent."""
        records = self._remove_targets(target)
        names = {r.branch for r in records}
        children = [r.branch for r in self.sessions.branches() if r.parent in names and r.branch not in names]
        if children:
            raise InvalidInput(f"{target}: branch {children[0]} held here has it as its parent; "
                               f"remove that first (p2pnode rm {children[0][:16]})")
        return records

    def _remove_targets(self, target: str) -> list[BranchRecord]:
        """The branches `rm` means: of a Pi session id or a unique prefix of one held here (as
        `share` takes them), else a branch hash or unique prefix; a prefix of both is refused."""
        text, low = target.strip(), target.strip().lower()
        ids = sorted({v.session_id for v in self.sessions.all_versions()
                      if len(text) >= 4 and v.session_id.lower().startswith(low)})
        if text not in ids and ids and any(r.branch.startswith(low) for r in self.sessions.branches()):
            raise NotFound(f"{text!r} begins both a session id and a branch hash held here; give more of it")
        if text in ids or len(ids) == 1:
            return [r for v in self.sessions.versions_of(text if text in ids else ids[0])
                    for r in self.sessions.branches_of(v.src)]
        if ids:
            raise NotFound(f"session id prefix {text!r} matches {len(ids)} sessions held here: "
                           f"{', '.join(ids[:8])}; give more of it")
        if is_session_id(text):
            raise NotFound(f"no branch of Pi session {text} is held here")
        return [self.sessions.branch(self.resolve_branch(text))]

    def space(self) -> space.SpaceReport:
        """`status`: the store's bytes and what `gc` would reclaim now (an estimate, computed
        again only when the records or the turns changed: it walks every kept turn); both in
        the measures of `gc`'s report (space.GCReport).  A turn record that walk cannot read
        makes the estimate None and is said in `store_damage` (`status` shows it; `gc` refuses)."""
        with self._lock:  # a read: writes nothing (space.store_bytes counts blobs not packed yet)
            key = (self.sessions.generation, self.store.turn_count, len(self.sessions.all_versions()))
            damage = None
            if self._reclaimable is None or self._reclaimable[0] != key:
                try:
                    self._reclaimable = (key, space.reclaimable_bytes(self.sessions, self.store))
                except (CorruptRecord, UnknownTurn) as exc:
                    damage = str(exc)
            reclaimable = self._reclaimable[1] if self._reclaimable and not damage else None
            return {"store_bytes": space.store_bytes(self.store), "reclaimable_bytes": reclaimable,
                    "store_damage": damage}


class TransferLeases:
    """Fetches in progress hold a lease; GC runs only while none is held, and a fetch that
    starts while GC runs waits for it to end (try_acquire until it succeeds): lines a fetch
    has put into the store before their turns exist are never collected (docs/ARCHITECTURE.md,
    "Space")."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._held = 0
        self._collecting = False

    def try_acquire(self) -> bool:
        """Take a lease for a fetch, unless GC runs (False: try again shortly).  It never
        blocks, so a fetch cancelled while waiting cannot leave a lease behind."""
        with self._guard:
            if self._collecting:
                return False
            self._held += 1
            return True

    def release(self) -> None:
        with self._guard:
            self._held -= 1

    def begin_collecting(self) -> bool:
        """False while a fetch holds a lease (GC must not run); else no lease is given until
        end_collecting."""
        with self._guard:
            if self._held or self._collecting:
                return False
            self._collecting = True
            return True

    def end_collecting(self) -> None:
        with self._guard:
            self._collecting = False
