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
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Any

from p2pnode.errors import InvalidInput, NotFound, VerificationFailed
from p2pnode.library.manifest import Manifest
from p2pnode.library.sessions import BranchRecord, SessionStore, Version
from p2pnode.paths import NodePaths, PiDirs, session_dir
from p2pnode.paths import agent_dir as default_agent_dir
from p2pnode.pi import secrets
from p2pnode.pi import session as pisession
from p2pnode.pi.hashing import FileHasher, Prefix, Scan, Sink, hash_prefix, new_hasher
from p2pnode.pi.lines import LineRef
from p2pnode.pi.session import HostileHeader, LineageCycle
from p2pnode.pi.sidecar import Sidecar, blake3_hex, is_hash_hex, parse_sidecar
from store import BlobMismatch, StoredBlob
from store.api import Store
from store.config import StoreConfig
from sysio.files import atomic_write

log = logging.getLogger(__name__)

ZSTD_LEVEL = 1
"""Session lines (JSON, code, tool output) compress almost as well at zstd level 1 as at 3,
faster, and compression is most of the cost of a first share (docs/BENCHMARKS.md, Sharing)."""


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
    nothing to redact is shared as it is."""
    data = path.read_bytes()
    findings = secrets.scan(data)
    if not findings:
        return path
    header = pisession.read_header(path)
    new_id = _new_session_id()
    redacted = secrets.redact(data, findings)
    end = redacted.find(b"\n")
    first, rest = (redacted, b"") if end < 0 else (redacted[:end], redacted[end:])
    old = b'"id":' + json.dumps(header.id).encode()
    if first.count(old) != 1:
        raise InvalidInput(f"{path}: cannot give the redacted copy a new id (the header line is not "
                           "the first line or not as Pi writes it)")
    copy = path.with_name(pisession.session_file_name(header.timestamp or "redacted", new_id))
    with open(copy, "xb") as f:  # never over an existing file
        f.write(first.replace(old, b'"id":' + json.dumps(new_id).encode()) + rest)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(copy, path.stat().st_mode & 0o777)
    return copy


class _ScanningSink:
    """The import's sink, with the secret scan of the same bytes as they pass: no second read,
    and the scan runs while the import worker compresses the lines fed before."""

    def __init__(self) -> None:
        self.inner: Sink | None = None
        self.start = 0
        """The file offset the fed bytes start at (where the version it grew from ends)."""
        self.findings: list[secrets.Finding] = []
        self._pending = b""
        self._offset = 0
        self._lines = 0

    def begin(self, appended: bool) -> int:
        assert self.inner is not None
        self.start = self.inner.begin(appended)
        return self.start

    def feed(self, data: memoryview) -> None:
        assert self.inner is not None
        self.inner.feed(data)
        chunk = self._pending + bytes(data)
        cut = chunk.rfind(b"\n") + 1  # whole lines only: a key is never cut in two
        self._scan(chunk[:cut])
        self._pending = chunk[cut:]

    def finish(self) -> None:
        self._scan(self._pending)
        self._pending = b""

    def _scan(self, data: bytes) -> None:
        self.findings += [replace(f, line=f.line + self._lines, start=f.start + self._offset,
                                  end=f.end + self._offset) for f in secrets.scan(data)]
        self._offset += len(data)
        self._lines += data.count(b"\n")


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
        self._offered: tuple[int, dict[str, str]] | None = None
        self._manifests: dict[str, list[LineRef]] = {}
        self._fed: dict[str, tuple[_ScanningSink, Version | None]] = {}
        """What the secret scan saw of each version the import just read (and the version it
        grew from), until `_findings` records it."""

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
              redact: bool = False) -> ShareResult:
        """Share a session with its lineage: the ancestors this node knows (shared or fetched)
        as they are, the ones it has never seen found through parentSession and shared first.

        The secret scan runs over all of it first and fails closed (SecretsFound, nothing
        offered) unless `allow_secrets`; `redact` shares a redacted copy of the session."""
        cwd = cwd or os.getcwd()
        pi = pi or self.pi_dirs(cwd)
        path = self.resolve_target(target, latest=latest, cwd=cwd, pi=pi)
        original = path
        if redact:
            path = write_redacted_copy(path)
        with self._lock:
            chain, base, cut_above = self._lineage(path, pi, follow=not no_lineage)
            for file, header in chain:
                _check_placeable(file, header)
            known = list(reversed(self.lineage(base))) if base is not None else []
            # stored first (the store may keep bytes), scanned, and only then offered
            stored: list[tuple[Path, Version, list[str]]] = []
            like = self.sessions.branch(base).src if base is not None else None
            for file, header in reversed(chain):  # root first
                version, file_warnings = self._store_file(file, header, like)
                stored.append((file, version, file_warnings))
                like = version.src
            found: list[tuple[str, str | None, secrets.Finding]] = [
                (i.path or f"branch {i.branch}", i.branch, f)
                for i in known for f in self._findings(i.src)]
            found += [(str(file), None, f) for file, v, _ in stored for f in self._findings(v.src)]
            if found and not allow_secrets:
                raise secrets.SecretsFound([(where, f) for where, _, f in found])
            for branch in {b for _, b, _ in found if b is not None}:
                self.sessions.mark_secrets_allowed(branch)
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
        for warning in warnings:
            log.info("%s", warning)  # the caller shows ShareResult.warnings (the CLI on stderr)
        allowed = [dict(f.as_dict(), file=where) for where, _, f in found]
        redacted_from = str(original.absolute()) if path != original else None
        return ShareResult(**asdict(infos[-1]), ancestors=infos[:-1], warnings=warnings, notices=notices,
                           redacted_from=redacted_from, secrets=allowed)

    def _findings(self, src: str) -> list[secrets.Finding]:
        """The secret scan of a stored version, remembered per version (scanned.json): the scan
        the import ran on the bytes it read (a grown session: only what it grew by, with the
        findings of the version it grew from), else of the stored bytes."""
        record = self._scanned()
        if src in record:
            return [secrets.Finding(**f) for f in record[src]]
        fed, base = self._fed.pop(src, (None, None))
        if fed is not None and fed.start == 0:
            found = fed.findings
        elif fed is not None and base is not None and base.src in record:
            cut = fed.start
            lines_before = base.lines - (1 if cut < base.size else 0)
            found = [secrets.Finding(**f) for f in record[base.src] if f["end"] <= cut]
            found += [replace(f, line=f.line + lines_before, start=f.start + cut, end=f.end + cut)
                      for f in fed.findings]
        else:  # held already (cached), or grown from a version never scanned: scan it whole
            found = secrets.scan(self.sessions.session_bytes(src))
        record[src] = [f.as_dict() for f in found]
        atomic_write(self.paths.home / "scanned.json", json.dumps(record).encode())
        return found

    def _scanned(self) -> dict[str, list[dict[str, Any]]]:
        """Every version this node has scanned: its findings ([] when clean)."""
        try:
            record = json.loads((self.paths.home / "scanned.json").read_bytes())
        except (OSError, ValueError):
            return {}
        return record if isinstance(record, dict) else {}

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

    def _store_file(self, path: Path, header: pisession.SessionHeader,
                    like: str | None) -> tuple[Version, list[str]]:
        """The stored version of the file's complete lines (imported unless held already)."""
        warnings: list[str] = []
        cached = self.hasher.cached(path)
        if cached is not None and self.sessions.has_version(cached.blake3):
            version = self.sessions.version(cached.blake3)
        else:
            version, warnings = self._import(path, header, like)
        left_out = path.stat().st_size - version.size
        if left_out > 0:
            warnings.append(f"{path}: shared its complete lines ({version.size} bytes); the {left_out} bytes "
                            "after the last newline (a line Pi is still writing) are left for the next share")
        return version, warnings

    def _offer_file(self, path: Path, version: Version, parent: str | None,
                    lineage_cut: str | None = None) -> BranchInfo:
        sidecar = Sidecar(version.src, parent)
        record = self.sessions.add_branch(sidecar.encode(), sidecar.branch, version.src, parent, lineage_cut)
        self.manifest.record(record.branch, path.absolute())
        return self._info(record, str(path.absolute()))

    def _import(self, path: Path, header: pisession.SessionHeader,
                like: str | None) -> tuple[Version, list[str]]:
        """Store the file, reusing an older version it grew from, or its parent's lines."""
        size = path.stat().st_size
        known = self.hasher.known(path)
        if known is not None and known.size <= size and self.sessions.has_version(known.blake3):
            base: Version | None = self.sessions.version(known.blake3)
        else:
            base = self.sessions.latest_version_of(header.id, size)

        fed = _ScanningSink()

        def scan(prefix: Prefix | None, sink: Sink) -> Scan:
            fed.inner = sink
            return self.hasher.scan(path, prefix=prefix, sink=fed)

        result = self.sessions.import_file(path, scan, header, base, like)
        self.hasher.save()
        fed.finish()
        if result.scan.rewritten:
            log.info("%s was rewritten since version %s; stored in full", path, base.src if base else "?")
        self._fed[result.version.src] = (fed, base)
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
            lineage_cut=record.lineage_cut, secrets_allowed=record.secrets_allowed,
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
            if refs is None:  # from the turn records and the blob index: no line is read
                hashes = self.sessions.line_hashes(src_hex)
                refs = [LineRef(h, n) for h, n in zip(hashes, self.store.raw_lengths(hashes), strict=True)]
                if len(self._manifests) >= 64:
                    self._manifests.pop(next(iter(self._manifests)))
                self._manifests[src_hex] = refs
            return refs

    def line_manifest_after(self, src_hex: str, held: Sequence[str]) -> tuple[str, int] | None:
        """(base, first): of the versions `held` that this node offers, the one of the same
        session whose lines up to its last newline (`first` of them) are the first lines of
        `src_hex`, the longest; None if there is none.  By line hashes (turn records only)."""
        with self._lock:
            target = self.sessions.version(src_hex)
            hashes = self.sessions.line_hashes(src_hex)
            best: tuple[str, int] | None = None
            for base in held:
                if base == src_hex or self.offered_object(base) != "session":
                    continue
                version = self.sessions.version(base)
                first = version.lines - (version.last_line_start < version.size)
                if (version.session_id != target.session_id or first > len(hashes)
                        or (best is not None and first <= best[1])):
                    continue
                if self.sessions.line_hashes(base)[:first] == hashes[:first]:
                    best = (base, first)
            return best

    def version(self, src_hex: str) -> Version:
        """The stored version (size, lines, where its last line starts, header, titles)."""
        return self.sessions.version(src_hex)

    def line(self, line_hash: bytes) -> bytes:
        """One line's bytes from the store, re-hashed (NotFound if the store lacks it)."""
        if not self.store.has_blob(line_hash):
            raise NotFound(f"line {line_hash.hex()} is not in this node's store")
        return self.sessions.blob(line_hash, "line")

    def stored_line(self, line_hash: bytes) -> StoredBlob:
        """One line as the store keeps it (compressed or raw), for serving it as it is."""
        return self.store.get_stored_blob(line_hash)

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
            return self._record_fetched(sidecar, branch, parsed)

    def _record_fetched(self, sidecar: bytes, branch: str, parsed: Sidecar) -> BranchInfo:
        """Caller holds the lock; the branch's version is stored."""
        # a fetched branch is not offered on until this node's user shares it, and fetching
        # one the user unshared does not offer it again
        offered = self.has_branch(branch) and self.sessions.branch(branch).offered
        record = self.sessions.add_branch(sidecar, branch, parsed.src, parsed.parent)
        if record.offered != offered:
            record = self.sessions.set_offered(branch, offered)
        return self._info(record)

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
        branch = blake3_hex(sidecar)
        parsed = parse_sidecar(sidecar, expected_branch=branch)
        if parsed.src != prefix.blake3:
            raise VerificationFailed(f"fetched branch {branch}: names session {parsed.src}, "
                                     f"not {prefix.blake3}")
        with self._lock:
            if not self.sessions.has_version(parsed.src):
                like = [v.src for v in sorted(self.sessions.versions_of(header.id), key=lambda v: -v.size)]
                if parsed.parent and self.has_branch(parsed.parent):
                    like.append(self.sessions.branch(parsed.parent).src)
                self.sessions.import_refs(refs, prefix, header, titles, like)
            return self._record_fetched(sidecar, branch, parsed)
