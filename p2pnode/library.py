"""The node's shared sessions: the one API behind `share`/`ls`/`show`/`cat`/`unshare`, the
peer server and the fetcher (contract: docs/ARCHITECTURE.md, "The session library API").

Sharing a session hashes the file verbatim, stores it line by line (sessionstore.py),
shares its parentSession ancestors first (root to child, so each child's sidecar names its
parent's branch hash), and records branch -> path in manifest.json.  The stored copy is
what the node serves, never the live file that Pi keeps appending to.
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from p2pnode import pisession
from p2pnode.errors import InvalidInput, NotFound, VerificationFailed
from p2pnode.hashing import FileHasher, Prefix, Scan, Sink, new_hasher
from p2pnode.manifest import Manifest
from p2pnode.paths import NodePaths
from p2pnode.paths import agent_dir as default_agent_dir
from p2pnode.sessionstore import BranchRecord, SessionStore, Version
from p2pnode.sidecar import Sidecar, blake3_hex, is_hash_hex, parse_sidecar
from store import BlobMismatch, StoredBlob
from store.engine import Store, StoreConfig

log = logging.getLogger(__name__)

ZSTD_LEVEL = 1
"""Session lines (JSON, code, tool output) compress almost as well at zstd level 1 as at 3
(2.57x against 2.64x on the benchmark's sessions) at ~1.25x the speed, and compression is
most of the cost of a first share."""


@dataclass(frozen=True, slots=True)
class LineRef:
    hash: bytes
    """32-byte BLAKE3 of the line's bytes (newline included)."""
    length: int


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

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ShareResult(BranchInfo):
    ancestors: list[BranchInfo] = field(default_factory=list)
    """Ancestors shared on the way, root first."""
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Catalog:
    generation: int
    """Changes whenever the set of offered branches changes."""
    branches: list[BranchInfo]


class Library:
    def __init__(self, paths: NodePaths, store: Store, agent_dir: Path) -> None:
        self.paths = paths
        self.store = store
        """The node's Store (the peer server reads compressed blobs from it directly)."""
        self.agent_dir = agent_dir
        self.sessions = SessionStore(store, paths.home / "sessions.json")
        self.hasher = FileHasher(paths.home / "hashcache.json")
        self.manifest = Manifest(paths.manifest)
        self._lock = threading.RLock()
        self._offered: tuple[int, dict[str, str]] | None = None
        self._manifests: dict[str, list[LineRef]] = {}

    @classmethod
    def open(cls, paths: NodePaths, agent_dir: Path | None = None,
             config: StoreConfig | None = None) -> Library:
        paths.ensure()
        store = Store.open(paths.store, config=config or StoreConfig(zstd_level=ZSTD_LEVEL))
        try:
            return cls(paths, store, agent_dir or default_agent_dir())
        except BaseException:
            store.close()
            raise

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> Library:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- sharing ---

    def resolve_target(self, target: str | None = None, *, latest: bool = False,
                       cwd: str | None = None) -> Path:
        """A path, a header id or unique id prefix, or (None/latest) the newest session of cwd."""
        if target is None or latest:
            return pisession.latest_session(self.agent_dir, cwd or os.getcwd())
        path = Path(target).expanduser()
        if path.exists() or os.sep in target or target.endswith(".jsonl"):
            return path
        return pisession.find_by_id(self.agent_dir, target)

    def share(self, target: str | None = None, *, latest: bool = False, no_lineage: bool = False,
              cwd: str | None = None) -> ShareResult:
        path = self.resolve_target(target, latest=latest, cwd=cwd)
        chain = pisession.lineage(path, self.agent_dir, follow=not no_lineage)
        infos: list[BranchInfo] = []
        warnings: list[str] = []
        parent: str | None = None
        with self._lock:
            for file, header in reversed(chain):  # root first
                info, file_warnings = self._share_file(file, header, parent)
                infos.append(info)
                warnings += file_warnings
                parent = info.branch
        for warning in warnings:
            log.info("%s", warning)  # the caller shows ShareResult.warnings (the CLI on stderr)
        return ShareResult(**asdict(infos[-1]), ancestors=infos[:-1], warnings=warnings)

    def _share_file(self, path: Path, header: pisession.SessionHeader,
                    parent: str | None) -> tuple[BranchInfo, list[str]]:
        warnings: list[str] = []
        cached = self.hasher.cached(path)
        if cached is not None and self.sessions.has_version(cached.blake3):
            version = self.sessions.version(cached.blake3)
        else:
            version, warnings = self._import(path, header, parent)
        sidecar = Sidecar(version.src, parent)
        record = self.sessions.add_branch(sidecar.encode(), sidecar.branch, version.src, parent)
        self.manifest.record(record.branch, path.absolute())
        return self._info(record, str(path.absolute())), warnings

    def _import(self, path: Path, header: pisession.SessionHeader,
                parent: str | None) -> tuple[Version, list[str]]:
        """Store the file, reusing an older version it grew from, or its parent's lines."""
        size = path.stat().st_size
        known = self.hasher.known(path)
        if known is not None and known.size <= size and self.sessions.has_version(known.blake3):
            base: Version | None = self.sessions.version(known.blake3)
        else:
            base = self.sessions.latest_version_of(header.id, size)
        like = self.sessions.branch(parent).src if parent is not None else None

        def scan(prefix: Prefix | None, sink: Sink) -> Scan:
            return self.hasher.scan(path, prefix=prefix, sink=sink)

        result = self.sessions.import_file(path, scan, header, base, like)
        self.hasher.save()
        if result.scan.rewritten:
            log.info("%s was rewritten since version %s; stored in full", path, base.src if base else "?")
        return result.version, result.warnings

    def unshare(self, branch_hex: str) -> BranchInfo:
        """Stop offering a branch to peers; its bytes stay in the store."""
        with self._lock:
            return self._info(self.sessions.set_offered(self.resolve_branch(branch_hex), False))

    def record_path(self, branch_hex: str, path: Path | str) -> None:
        self.manifest.record(branch_hex, Path(path).absolute())

    # --- reads ---

    def resolve_branch(self, text: str) -> str:
        """A full branch hash, or a unique prefix of a known one (at least 4 hex characters)."""
        text = text.strip().lower()
        if is_hash_hex(text):
            return text
        if len(text) < 4 or any(c not in "0123456789abcdef" for c in text):
            raise InvalidInput(f"{text!r} is not a branch hash (64 hex characters) or a prefix of one")
        matches = [r.branch for r in self.sessions.branches() if r.branch.startswith(text)]
        if len(matches) != 1:
            raise NotFound(f"branch prefix {text!r} matches {len(matches)} known branches")
        return matches[0]

    def _info(self, record: BranchRecord, path: str | None = None) -> BranchInfo:
        version = self.sessions.version(record.src)
        return BranchInfo(
            branch=record.branch, src=record.src, parent=record.parent, size=version.size,
            lines=version.lines, header=dict(version.header), title=version.title, offered=record.offered,
            shared_at=record.shared_at, path=path if path is not None else self.manifest.get(record.branch),
        )

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

    def catalog(self) -> Catalog:
        with self._lock:
            return Catalog(self.sessions.generation, self.branches())

    def sidecar_bytes(self, branch_hex: str) -> bytes:
        with self._lock:
            return self.sessions.sidecar_bytes(branch_hex)

    def session_bytes(self, src_hex: str) -> bytes:
        with self._lock:
            return self.sessions.session_bytes(src_hex)

    def line_manifest(self, src_hex: str) -> list[LineRef]:
        """The ordered line hashes and lengths of a stored session version."""
        with self._lock:
            refs = self._manifests.get(src_hex)
            if refs is None:
                blobs = (self.store.get_stored_blob(h) for h in self.sessions.line_hashes(src_hex))
                refs = [LineRef(b.hash, b.raw_len) for b in blobs]
                if len(self._manifests) >= 64:
                    self._manifests.pop(next(iter(self._manifests)))
                self._manifests[src_hex] = refs
            return refs

    def line(self, line_hash: bytes) -> bytes:
        """One line's bytes from the store, re-hashed (NotFound if the store lacks it)."""
        if not self.store.has_blob(line_hash):
            raise NotFound(f"line {line_hash.hex()} is not in this node's store")
        return self.sessions.blob(line_hash, "line")

    def has_line(self, line_hash: bytes) -> bool:
        return self.store.has_blob(line_hash)

    def has_branch(self, branch_hex: str) -> bool:
        try:
            self.sessions.branch(branch_hex)
        except NotFound:
            return False
        return True

    def has_session(self, src_hex: str) -> bool:
        return self.sessions.has_version(src_hex)

    def offered_object(self, hash_hex: str) -> str | None:
        """"sidecar", "session" or "line" if the hash is reachable from an offered branch
        (its offered ancestors included), else None: peers get nothing else."""
        with self._lock:
            generation = self.sessions.generation
            if self._offered is None or self._offered[0] != generation:
                self._offered = (generation, self._reachable())
            return self._offered[1].get(hash_hex)

    def _reachable(self) -> dict[str, str]:
        """What this node's user chose to offer: offered branches and their ancestors, except
        that the walk stops at a branch that is not offered (unshared, or fetched and never
        shared here): a branch whose parent a peer chose cannot make an unshared one visible."""
        kinds: dict[str, str] = {}
        for info in self.branches():
            branch: str | None = info.branch
            while branch is not None and branch not in kinds and self.has_branch(branch):
                record = self.sessions.branch(branch)
                if not record.offered:
                    break
                kinds[branch] = "sidecar"
                if record.src not in kinds:
                    for line_hash in self.sessions.line_hashes(record.src):
                        kinds.setdefault(line_hash.hex(), "line")
                    kinds[record.src] = "session"
                branch = record.parent
        return kinds

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
            # a fetched branch is not offered on until this node's user shares it, and fetching
            # one the user unshared does not offer it again
            offered = self.has_branch(branch) and self.sessions.branch(branch).offered
            record = self.sessions.add_branch(sidecar, branch, parsed.src, parsed.parent)
            if record.offered != offered:
                record = self.sessions.set_offered(branch, offered)
            return self._info(record)
