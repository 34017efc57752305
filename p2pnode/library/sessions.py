"""Session versions and branches as turn chains in the store, plus the node's sharing state.

Over 400 lines on purpose: the importer (lines into turn chains) and SessionStore share the
state file, its lock and the store's turns; apart they would pass that state back and forth.

A version of a session file is a chain of turns, one per JSONL line, each holding the exact
line bytes (newline included; the last line may lack one): the body lines in file order,
then the header line on top.  The header goes last because it is the one line a fork
never shares with its parent: a fork's copied lines are byte-identical to its parent's, so
its chain forks from the parent's turn where the copy ends and adds only its new lines
and header (and a grown version forks from the older version's last line the same way).
A branch is one more turn on top holding the sidecar, so the sidecar is a blob reachable
from a live head (the store's GC keeps it).

The mapping from hashes to store heads lives in `sessions.json` (format in docs/FORMAT.md),
replaced atomically after the store writes it refers to are durable: a crash in between
leaves at most an unreferenced context, never a reference to a missing turn.
"""
from __future__ import annotations

import contextlib
import functools
import json
import time
import types
import typing
from array import array
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import blake3
from ahocorasick_rs import BytesAhoCorasick

from p2pnode.errors import InvalidInput, NotFound, P2PNodeError, VerificationFailed
from p2pnode.library.versions import later_growths
from p2pnode.pi.hashing import Prefix, Scan, Sink, new_hasher
from p2pnode.pi.lines import LineRef, LineRefs, LineSplitter, is_split
from p2pnode.pi.session import (
    HEADER_SCAN_BYTES,
    InvalidHeader,
    SessionHeader,
    find_header,
    is_header_candidate,
    parse_header,
    titles_after,
)
from p2pnode.pi.sidecar import is_hash_hex
from store import Prepared
from store.api import Store
from store.errors import CorruptRecord, StoreError, UnknownBlob, UnknownTurn
from store.types import StoredBlob, Turn, TurnBlobRef, TurnInput
from sysio.files import atomic_write
from sysio.locks import locked

if TYPE_CHECKING:
    import simdjson

TAG_LINE = 0x5069_0001
"""type_tag of a turn that holds one session line (0x5069 is "Pi": tags other store users
are unlikely to pick, so a crash's leftovers can be told apart from their contexts)."""
TAG_SIDECAR = 0x5069_0002
"""type_tag of the turn on top of a version's header turn that holds a branch sidecar."""
TAG_HEADER = 0x5069_0003
"""type_tag of the turn that holds a version's header line, on top of its last body line."""
OUR_TAGS = frozenset({TAG_LINE, TAG_SIDECAR, TAG_HEADER})
BATCH_BYTES = 8 * 1024 * 1024
BATCH_LINES = 4096
JSON_CHECK_MAX = 4096
"""Lines up to this size are JSON-parsed to warn about broken ones (like the glued lines of
a half-copied file); longer ones only get a shape check ({...}): parsing every byte of a
large session would cost more than storing it."""
_SESSION_INFO = BytesAhoCorasick([b'"session_info"'])
"""Whether a chunk may name the session, in one pass without the GIL (ahocorasick-rs, ~4 GB/s)
instead of a search of each line holding it (`in`, ~1.8 GB/s): most chunks of a big session
hold no session_info, and once the first user message is known their lines need no title check."""
IN_FLIGHT = 3
"""Batches an import may have handed over and not yet appended (each up to BATCH_BYTES,
raw and compressed): what lets reading, compressing and writing overlap, within bounded memory."""
PREPARERS = 2
"""Batches prepared (hashed and compressed) at once: see _Importer._flush."""
STATE_VERSION = 1


class DamagedCopy(VerificationFailed):
    """The stored copy of a line or session cannot be read back (a record whose CRC or hash
    fails): the store names it damaged from then on, and the same bytes stored again heal it."""


class StateCorrupt(P2PNodeError):
    """sessions.json cannot be used; it is left untouched for inspection."""


class StateUnreadable(StateCorrupt):
    """sessions.json is missing beside a store with sessions, or not what it should be:
    `fsck --repair` may rebuild it from the store (not so a file of another state version)."""

    def __init__(self, path: Path, reason: str, advice: str = "") -> None:
        self.reason = reason
        super().__init__(f"{path} {reason}{advice}; `p2pnode fsck --repair` rebuilds it from the store (its "
                         "branches come back not offered: share them again)")


@dataclass(frozen=True, slots=True)
class Version:
    """One stored version of a session file."""

    src: str
    session_id: str
    header: dict[str, Any]
    size: int
    lines: int
    last_line_start: int
    context: int
    head: int
    """The header turn; store.chain(head) is the body lines in order, then the header."""
    name: str | None
    first_user: str | None
    previous: str | None = None
    """The older version of the same session (same header id) whose bytes this one extends,
    when it was stored as its growth; None for a first version (or one stored before this
    field existed)."""

    @property
    def prefix(self) -> Prefix:
        return Prefix(self.size, self.src, self.lines, self.last_line_start)

    @property
    def title(self) -> str | None:
        return self.name or self.first_user


@dataclass(frozen=True, slots=True)
class BranchRecord:
    branch: str
    src: str
    parent: str | None
    context: int
    head: int
    """The sidecar turn (its parent is the version's header turn)."""
    offered: bool
    shared_at: int
    """Unix milliseconds of the latest share (or fetch)."""
    lineage_cut: str | None = None
    """The header's parentSession that `share --no-lineage` did not follow (local only: the
    sidecar says `parent: null` like any root's)."""
    secrets_allowed: bool = False
    """Shared with `--allow-secrets` although the scan found secrets in it (local only)."""
    expires_at: int | None = None
    """Unix milliseconds after which the branch is no longer served (`share --expires`; None: never)."""
    to: list[str] | None = None
    """Node ids the branch is offered to (`share --to`); None: every trusted peer."""
    withdrawn: str | None = None
    """Why it is no longer offered: "unshared" or "expired" (None: offered, or fetched and never
    shared here).  A withdrawn branch is garbage for `p2pnode gc`."""


@dataclass(frozen=True, slots=True)
class ImportResult:
    version: Version
    warnings: list[str]
    """Lines that are not JSON (they are stored verbatim all the same)."""
    scan: Scan
    grown: Version | None
    """The held version the file was found to have grown from (its bytes were not read again)."""
    held: bool = False
    """The same bytes were held already (nothing recorded)."""
    lines: ImportedLines | None = None
    """The version's lines as the import met them: all of them, unless it grew from `grown`."""


@dataclass(frozen=True)
class ImportedLines:
    """An imported version's line hashes (BLAKE3, 32 bytes each, back to back, in file order)
    and lengths: its line manifest without a walk of its turns and a blob index lookup per
    line, which the node made right after a share while the fetch that follows waited for it
    (docs/BENCHMARKS.md, 2026-11-29 (19))."""

    hashes: bytes
    lengths: array[int]

    def refs(self) -> LineRefs:
        return LineRefs.packed((self.hashes[i:i + 32] for i in range(0, len(self.hashes), 32)), self.lengths)

    def hashes_after(self, skip: int) -> Iterator[bytes]:
        return (self.hashes[i:i + 32] for i in range(32 * skip, len(self.hashes), 32))


@dataclass
class _State:
    generation: int = 0
    sessions: dict[str, Version] = field(default_factory=dict)
    branches: dict[str, BranchRecord] = field(default_factory=dict)


def _largest_prefix(lines: Sequence[bytes], prefixes: Sequence[Prefix]) -> Prefix | None:
    """The largest of `prefixes` that the concatenated lines start with: one pass over them
    up to the largest, the digest compared at each one's size."""
    hasher, pos, found = new_hasher(), 0, None
    pending = sorted((p for p in prefixes if p.size > 0), key=lambda p: p.size)
    for line in lines:
        if not pending:
            break
        while pending and pos + len(line) >= pending[0].size:
            cut = pending[0].size - pos
            piece = hasher.copy()
            piece.update(line[:cut])
            if piece.hexdigest() == pending[0].blake3:
                found = pending[0]
            pending.pop(0)
        hasher.update(line)
        pos += len(line)
    return found


def _lines_from(lines: Sequence[bytes], offset: int) -> Sequence[bytes]:
    """The lines from byte `offset` on, which must be where a line starts."""
    pos = 0
    for i, line in enumerate(lines):
        if pos >= offset:
            return lines[i:]
        pos += len(line)
    if pos != offset:
        raise ValueError(f"offset {offset} is not at a line start")
    return lines[len(lines):]


def _line_hash(line: bytes) -> bytes:
    return blake3.blake3(line).digest()  # one thread: lines are small


def _json_parser() -> simdjson.Parser:
    """Imported here: a fetch, which checks no line's JSON, does not pay for it (~10 ms)."""
    import simdjson

    return simdjson.Parser()


def _is_json(line: bytes, parser: simdjson.Parser) -> bool:
    """simdjson validates a line without making Python objects (~12x json.loads on Pi's lines,
    which was a sixth of a share's CPU); what it refuses, json.loads decides (it takes what
    simdjson does not: integers over 64 bits, NaN).  `parser` is one importer's: not shared
    between threads, and what `parse` returns is dropped at once, so it may parse again."""
    if not (line.startswith(b"{") and line.endswith((b"}\n", b"}\r\n", b"}"))):  # CRLF: JSON too
        return False
    if len(line) > JSON_CHECK_MAX:
        return True
    try:
        parser.parse(line)
        return True
    except (ValueError, RuntimeError):  # RuntimeError: nested deeper than simdjson's 1024 levels
        pass
    try:
        json.loads(line)
    except ValueError:
        return False
    except RecursionError:
        return True  # JSON, too deep for Python's parser: kept verbatim like any line
    return True


class _Importer:
    """A FileHasher sink that turns bytes (`feed`), or lines already cut (`feed_lines`), into
    line turns.

    Body lines that match a known version's body, in order from the first, reuse its turns
    (a fork's copied lines); the rest are appended in batches; the header goes on top.
    A line whose blob is in `stored` (as a peer sent it) is stored from that blob as it is,
    not compressed again; the store decodes and re-hashes it against the line's own hash.
    """

    def __init__(self, store: Store, where: str, *, older: Sequence[Version] = (),
                 like: list[Turn] | None = None, check_json: bool = True,
                 stored: Mapping[bytes, StoredBlob] | None = None) -> None:
        self.store = store
        self.where = where
        self._json = _json_parser() if check_json else None
        self.stored = stored or {}
        self.older = {v.src: v for v in older}
        """The held versions the file may have grown from, by src (the scan says which)."""
        self.grown: Version | None = None
        """After begin(): the one it grew from, if any."""
        self.like = like or []
        self.context = 0
        self.head = 0
        """The last body turn so far (0: none yet); after finish(), the header turn."""
        self.header: bytes | None = None
        """The first line, stored as the chain's top turn (normally Pi's header)."""
        self.header_line: bytes | None = None
        """The header as pi 1.5.2 finds it: the first JSON line within the first 1 MiB."""
        self._offset = 0
        self.lines_seen = 0
        self._hashes = bytearray()
        """The body lines' hashes as their turns are appended (or reused), then the first
        line's (its turn is the top one): `lines()`."""
        self._lengths = array("Q")
        self.name: str | None = None
        self.first_user: str | None = None
        self.warnings: list[str] = []
        self._matched = 0
        self._matching = bool(self.like)
        self._splitter = LineSplitter()
        self._batch: list[TurnInput] = []
        self._batch_bytes = 0
        self._preparer = ThreadPoolExecutor(max_workers=PREPARERS, thread_name_prefix="import-prepare")
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="import")
        self._inflight: deque[Future[None]] = deque()
        """The batches handed over and not yet appended, oldest first (at most IN_FLIGHT)."""

    def begin(self, grown: Prefix | None) -> int:
        base = self.older.get(grown.blake3) if grown is not None else None
        if base is None or base.last_line_start == 0:
            return 0
        self.grown = base
        header_turn = self.store.get_turn(base.head)
        self.header = self.store.get_blob(header_turn.payload_hash)
        self.head = header_turn.parent_turn_id
        partial = base.last_line_start < base.size
        if partial:  # the old last line was incomplete: it is read again, whole
            self.head = self.store.get_turn(self.head).parent_turn_id
        self.lines_seen = base.lines - partial
        self.name, self.first_user = base.name, base.first_user
        self._offset = HEADER_SCAN_BYTES  # the header is the older version's
        self._matching = False
        return base.last_line_start

    def feed_lines(self, lines: Sequence[bytes]) -> None:
        for line in lines:
            self._line(line)

    def feed(self, chunk: bytes) -> None:
        # one copy per line (the turn's payload), none of the chunk (FileHasher reads it as bytes)
        straddling = self._splitter.pending  # the first line out began in an earlier chunk
        titled = self.first_user is None or bool(_SESSION_INFO.find_matches_as_indexes(chunk))
        for line in self._splitter.feed(chunk):
            self._line(line, titles=titled or straddling)
            straddling = False

    def _line(self, line: bytes, titles: bool = True) -> None:
        """`titles`: the line may change the session's name or first user message (false only
        when its chunk holds no session_info and the first user message is known)."""
        self.lines_seen += 1
        self._lengths.append(len(line))
        if len(line) > (limit := self.store.config.max_payload):  # one line is one turn payload
            raise InvalidInput(f"{self.where}: line {self.lines_seen} is {len(line)} bytes, over the store's "
                               f"limit of {limit} bytes per line")
        if self.header_line is None and self._offset < HEADER_SCAN_BYTES:
            if is_header_candidate(line):
                self.header_line = line
            self._offset += len(line)
        if self._json is not None and not _is_json(line, self._json):
            self.warnings.append(f"{self.where}: line {self.lines_seen} is not JSON (shared verbatim anyway)")
        if titles:
            self.name, self.first_user = titles_after(line, self.name, self.first_user)
        if self.header is None:
            self.header = line
            return
        if self._matching:
            known = self.like[self._matched] if self._matched < len(self.like) else None
            if known is not None and known.payload_hash == _line_hash(line):
                self.head = known.turn_id
                self._hashes += known.payload_hash
                self._matched += 1
                return
            self._matching = False
        self._batch.append(TurnInput(line, TAG_LINE))
        self._batch_bytes += len(line)
        if self._batch_bytes >= BATCH_BYTES or len(self._batch) >= BATCH_LINES:
            self._flush()

    def _context(self) -> int:
        if not self.context:
            ctx = self.store.fork(self.head) if self.head else self.store.create_context()
            self.context = ctx.context_id
        return self.context

    def _flush(self) -> None:
        """Hand the batch on, in three stages that overlap: this thread reads and splits the
        next batch while a preparer has the store hash and compress this one (zstd and
        BLAKE3 without the GIL) and the worker appends the one before, in order.  Two
        preparers: while one hashes its batch (Python, holding the GIL), zstd compresses the
        other's on both cores; with one, zstd waited for each batch's hashing."""
        if self._batch:
            batch, self._batch, self._batch_bytes = self._batch, [], 0
            if len(self._inflight) >= IN_FLIGHT:
                self._wait_oldest()
            ready = self._preparer.submit(self._prepare, batch)
            before = self._inflight[-1] if self._inflight else None
            self._inflight.append(self._worker.submit(self._append, ready, before))

    def _prepare(self, batch: list[TurnInput]) -> tuple[list[TurnInput | TurnBlobRef], list[Prepared]]:
        inputs = self._from_stored(batch)
        return inputs, self.store.prepare_turns(inputs)

    def _append(self, ready: Future[tuple[list[TurnInput | TurnBlobRef], list[Prepared]]],
                before: Future[None] | None) -> None:
        if before is not None:
            before.result()  # appended already (one worker, in order); if it failed, so does this one
        self._store(*ready.result())

    def _store(self, inputs: list[TurnInput | TurnBlobRef], prepared: list[Prepared] | None = None) -> None:
        turns = self.store.append_turns(self._context(), inputs, expected_parent=self.head, prepared=prepared)
        self.head = turns[-1].turn_id
        for turn in turns:
            self._hashes += turn.payload_hash

    def lines(self) -> ImportedLines | None:
        """After finish(): the version's lines as met here (None when it grew from a held
        version: only the new ones were)."""
        if self.grown is not None or len(self._hashes) != 32 * len(self._lengths):
            return None
        return ImportedLines(bytes(self._hashes[-32:] + self._hashes[:-32]), self._lengths)

    def _from_stored(self, batch: list[TurnInput]) -> list[TurnInput | TurnBlobRef]:
        """The batch with each line that has a stored blob turned into a reference to that
        blob, after storing the blobs (one commit for all of them)."""
        if not self.stored:
            return list(batch)
        turns: list[TurnInput | TurnBlobRef] = []
        blobs: list[StoredBlob] = []
        for turn in batch:
            h = _line_hash(turn.payload)
            blob = self.stored.get(h)
            if blob is None:
                turns.append(turn)
            else:
                blobs.append(blob)
                turns.append(TurnBlobRef(h, turn.type_tag))
        if blobs:
            self.store.put_stored_blobs(blobs)
        return turns

    def _wait_oldest(self) -> None:
        self._inflight.popleft().result()

    def _wait(self) -> None:
        """Until every batch handed over is appended; the first failure is raised (the
        batches after a failed one fail too, and nothing is appended after it)."""
        while self._inflight:
            self._wait_oldest()

    def _shutdown(self) -> None:
        self._preparer.shutdown()
        self._worker.shutdown()

    def finish(self) -> None:
        if (last := self._splitter.rest()) is not None:
            self._line(last)
        if self.header is None:
            self._shutdown()
            raise InvalidInput(f"{self.where} is empty")
        self._batch.append(TurnInput(self.header, TAG_HEADER))  # on top, in the last batch
        if self._inflight:
            self._flush()
            self._wait()
        else:  # the only batch (a re-share's new lines): appended here, no hand-off to wait for
            batch, self._batch = self._batch, []
            self._store(self._from_stored(batch))
        self._shutdown()

    def discard(self) -> None:
        while self._inflight:
            with contextlib.suppress(Exception):
                self._wait_oldest()
        self._shutdown()
        if self.context:
            self.store.delete_context(self.context)


def _stored_header(importer: _Importer, where: str) -> SessionHeader:
    """The header of the bytes an import stored: the line pi 1.5.2 would take, or the older
    version's when only new lines were read."""
    if importer.header_line is not None:
        return parse_header(importer.header_line.rstrip(b"\n"), where)
    if importer.grown is not None:
        return SessionHeader(**importer.grown.header)
    raise InvalidHeader(f"{where}: no Pi session header in its first {HEADER_SCAN_BYTES} bytes")


def _state_problem(raw: Any) -> str | None:
    """What makes a parsed state file unusable (a bit flipped in a key, a record of the wrong
    shape, a branch of a version not recorded), or None: every field of every record has its
    type, each record is filed under its own hash, and each branch's version is there."""
    if not (isinstance(raw, dict) and isinstance(raw.get("generation"), int)
            and isinstance(raw.get("sessions"), dict) and isinstance(raw.get("branches"), dict)):
        return "is not an object of a generation, sessions and branches"
    for kind, key, records in ((Version, "src", raw["sessions"]), (BranchRecord, "branch", raw["branches"])):
        what = "version" if kind is Version else "branch"
        typed = _field_types(kind)
        needed = {f.name for f in fields(kind) if f.default is MISSING}
        for name, record in records.items():
            if not isinstance(record, dict) or record.get(key) != name or not is_hash_hex(name):
                return f"has a {what} record that is not filed under its own {key}: {name!r}"
            if not needed <= record.keys() <= typed.keys():
                return f"has a {what} record {name} with fields {sorted(record)}"
            for f, value in record.items():
                allowed, of_str = typed[f]
                if type(value) not in allowed or (of_str and type(value) is list
                                                  and not all(type(v) is str for v in value)):
                    return f"has a {what} record {name} whose {f} is {value!r}"
    for name, branch in raw["branches"].items():
        if branch["src"] not in raw["sessions"]:
            return f"has branch {name} of version {branch['src']}, which it does not record"
    return None


@functools.cache
def _field_types(kind: type) -> dict[str, tuple[tuple[type, ...], bool]]:
    """Per field of a record class: the exact JSON types its value may have (from its
    annotation: str, int, bool, dict, list, None; a bool is no int here), and whether it is a
    list of str.  Exact types: every record is checked at each open (1,000 versions and their
    branches: 6 ms; with isinstance on each annotation, 85)."""
    out = {}
    for name, hint in typing.get_type_hints(kind).items():
        union = typing.get_origin(hint) in (types.UnionType, typing.Union)
        arms = typing.get_args(hint) if union else (hint,)
        out[name] = (tuple(typing.get_origin(a) or a for a in arms),
                     any(typing.get_origin(a) is list for a in arms))
    return out


def _write_state(path: Path, state: _State) -> None:
    doc = {
        "version": STATE_VERSION,
        "generation": state.generation,
        "sessions": {k: asdict(v) for k, v in state.sessions.items()},
        "branches": {k: asdict(v) for k, v in state.branches.items()},
    }
    with locked(path.with_name(path.name + ".lock")):
        atomic_write(path, json.dumps(doc, separators=(",", ":")).encode())


def read_state(state_path: Path) -> _State | None:
    """The state file's records; None when there is no file; StateCorrupt when it cannot be
    used (read without the store: what plain `fsck` checks too)."""
    try:
        raw = json.loads(state_path.read_bytes())
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise StateUnreadable(state_path, f"is not valid JSON ({exc})") from None
    if isinstance(raw, dict) and "version" in raw and raw["version"] != STATE_VERSION:
        raise StateCorrupt(f"{state_path} has version {raw['version']!r}, not {STATE_VERSION}")
    if (wrong := _state_problem(raw)) is not None:
        raise StateUnreadable(state_path, wrong)
    return _State(
        generation=raw["generation"],
        sessions={k: Version(**v) for k, v in raw["sessions"].items()},
        branches={k: BranchRecord(**v) for k, v in raw["branches"].items()},
    )


class SessionStore:
    """Versions, branches and the catalog generation, over a Store and a state file."""

    def __init__(self, store: Store, state_path: Path) -> None:
        self.store = store
        self.state_path = state_path
        loaded = read_state(state_path)
        if loaded is None:  # a new home: the file is written before any import can begin
            if ours := self._our_contexts(set()):
                raise StateUnreadable(state_path, "is missing", f", but the store beside it holds "
                                      f"{len(ours)} session record(s) it names: nothing was changed; put the "
                                      "file back (a backup of the node home)")
            self._state = _State()
            self._save()
        else:
            self._state = loaded
        for context in self._our_contexts(self._referenced()):
            self.store.delete_context(context)

    def _referenced(self) -> set[int]:
        state = self._state
        return {v.context for v in state.sessions.values()} | {b.context for b in state.branches.values()}

    def _our_contexts(self, referenced: set[int]) -> list[int]:
        """The store's contexts whose heads are our turns and that `referenced` does not name:
        with the state file, those of imports and branches a crash cut short (deleted at open;
        their blobs become garbage for GC); without it, every one (then nothing is deleted)."""
        return [head.context_id for head in self.store.list_contexts()
                if head.context_id not in referenced and head.head_turn_id != 0
                and self._tag(head.head_turn_id) in OUR_TAGS]

    def _tag(self, turn_id: int) -> int | None:
        """A turn's type tag; None when its record cannot be read (`fsck` reports it): such a
        head is left alone, not taken for ours."""
        try:
            return self.store.get_turn(turn_id).type_tag
        except (CorruptRecord, UnknownTurn):
            return None

    # --- state file ---

    def _save(self) -> None:
        _write_state(self.state_path, self._state)

    @staticmethod
    def write_anew(state_path: Path, versions: Sequence[Version], branches: Sequence[BranchRecord]) -> None:
        """A state file of these records alone, in place of whatever was there (`fsck --repair`
        rebuilding a lost or unreadable one from the store: library/rebuild.py)."""
        _write_state(state_path, _State(1, {v.src: v for v in versions}, {b.branch: b for b in branches}))

    # --- reads ---

    @property
    def generation(self) -> int:
        return self._state.generation

    def version(self, src: str) -> Version:
        try:
            return self._state.sessions[src]
        except KeyError:
            raise NotFound(f"session {src} is not in this node's store") from None

    def has_version(self, src: str) -> bool:
        return src in self._state.sessions

    def branch(self, branch: str) -> BranchRecord:
        try:
            return self._state.branches[branch]
        except KeyError:
            raise NotFound(f"branch {branch} is not known to this node") from None

    def branches(self) -> list[BranchRecord]:
        return list(self._state.branches.values())

    def all_versions(self) -> list[Version]:
        return list(self._state.sessions.values())

    def versions_of(self, session_id: str) -> list[Version]:
        return [v for v in self._state.sessions.values() if v.session_id == session_id]

    def branches_of(self, src: str) -> list[BranchRecord]:
        """The branches of one session version (one per parent it was shared with), newest first."""
        found = [b for b in self._state.branches.values() if b.src == src]
        return sorted(found, key=lambda b: b.shared_at, reverse=True)

    def older_versions_of(self, session_id: str, max_size: int) -> list[Version]:
        """The stored versions of a session id that could be a prefix of a file of max_size:
        which one is (the largest that is: two continuations of one version are both held,
        and the larger may not be this file's) is for the caller's hash check to say."""
        return [v for v in self._state.sessions.values() if v.session_id == session_id and v.size <= max_size]

    def body_turns(self, src: str) -> list[Turn]:
        """The turns of a version's lines after the header, in file order."""
        return self.store.chain(self.version(src).head)[:-1]

    def line_turns(self, src: str) -> list[Turn]:
        """The turns of a version's lines, in file order (the header, its chain's last, first)."""
        turns = self.store.chain(self.version(src).head)
        return [turns[-1], *turns[:-1]]

    def first_line(self, src: str) -> bytes:
        """A version's first line (its head turn's payload, checked against its hash): O(1)."""
        return self.payloads(src, [self.store.get_turn(self.version(src).head)])[0]

    def line_hashes(self, src: str) -> list[bytes]:
        """The BLAKE3 of each line of a version, in file order (the header first)."""
        return [t.payload_hash for t in self.line_turns(src)]

    def payloads(self, src: str, turns: Sequence[Turn]) -> list[bytes]:
        """The lines of `turns` of version `src`, each checked against its hash by the store."""
        try:
            return self.store.payloads(turns)
        except StoreError as exc:  # a CRC or decompression failure in the pack
            raise DamagedCopy(f"session {src} cannot be read back from the store: {exc}") from None

    def sidecar_bytes(self, branch: str) -> bytes:
        turn = self.store.get_turn(self.branch(branch).head)
        return self.blob(turn.payload_hash, f"sidecar of branch {branch}")

    def blobs(self, hashes: Sequence[bytes], what: str) -> list[bytes]:
        """Many blobs, each checked against its name as `blob`'s is (store.get_blobs: read in
        order, decoded and hashed on several threads); UnknownBlob when one is missing."""
        try:
            return self.store.get_blobs(hashes)
        except UnknownBlob:
            raise
        except StoreError as exc:
            raise DamagedCopy(f"{what} cannot be read back from the store: {exc}") from None

    def blob(self, h: bytes, what: str) -> bytes:
        """A blob re-hashed to its name; a damaged or missing one is a VerificationFailed naming
        `what` (which says which blob)."""
        try:
            return self.store.get_blob(h, verify=True)
        except UnknownBlob:
            raise VerificationFailed(f"{what} is missing from the store (see `p2pnode fsck`)") from None
        except StoreError as exc:
            raise DamagedCopy(f"{what} cannot be read back from the store: {exc}") from None

    # --- writes ---

    def import_file(
        self, path: Path, scan: Callable[[Sequence[Prefix], Sink], Scan], header: SessionHeader,
        older: Sequence[Version], like_src: str | None, guard: contextlib.AbstractContextManager[Any],
    ) -> ImportResult:
        """Store a version of `path`.  `scan(prefixes, sink)` hashes the file and feeds the sink.

        `older`: versions the file may have grown from (the scan finds the largest that it did);
        `like_src`: a version whose lines the file may start with after its header (its parent).
        `guard` is held while the version is recorded, not while the file is read and its
        lines stored: the caller's other readers go on meanwhile (no version may be forgotten
        meanwhile, which the caller sees to).
        """
        like = self.body_turns(like_src) if like_src and self.has_version(like_src) else None
        importer = _Importer(self.store, str(path), older=older, like=like)
        try:
            result = scan([v.prefix for v in older], importer)
            if importer.header_line is None and importer.grown is None and result.left_out:
                raise InvalidHeader(f"{path}: no Pi session header among its complete lines: its last "
                                    f"{result.left_out} bytes end without a newline (a line Pi is still "
                                    "writing: it is shared once it ends in one)")
            importer.finish()
        except BaseException:
            importer.discard()
            raise
        prefix = result.prefix
        with guard:
            if prefix.blake3 in self._state.sessions:  # the same bytes already held (e.g. a copy)
                importer.discard()
                return ImportResult(self._state.sessions[prefix.blake3], importer.warnings, result,
                                    importer.grown, held=True)
            try:
                header = _stored_header(importer, str(path))
            except InvalidHeader:
                importer.discard()
                raise
            version = self._add_version(prefix, header, importer)
        return ImportResult(version, importer.warnings, result, importer.grown, lines=importer.lines())

    def import_lines(self, lines: Sequence[bytes], src: str, where: str, like_src: str | None,
                     stored: Mapping[bytes, StoredBlob] | None = None) -> Version:
        """Store a version from its lines, which the caller has verified hash to `src` (a
        fetched session).  `stored`: blobs of some lines as a peer sent them, by hash.

        If older versions of the same session are a prefix, only the lines after the largest
        of them are added; else lines that continue `like_src`'s (its parent's) reuse those turns.
        """
        if src in self._state.sessions:
            return self._state.sessions[src]
        if not lines:
            raise InvalidInput(f"{where} is empty")
        if not is_split(lines):
            raise InvalidInput(f"{where}: the lines given are not the file cut at its newlines")
        header = find_header(lines, where)
        size = sum(map(len, lines))
        older = self.older_versions_of(header.id, size)
        like = self.body_turns(like_src) if like_src and self.has_version(like_src) else None
        importer = _Importer(self.store, where, older=older, like=like, check_json=False,  # nobody to warn
                             stored=stored)
        try:
            start = importer.begin(_largest_prefix(lines, [v.prefix for v in older]))
            importer.feed_lines(_lines_from(lines, start))
            importer.finish()
        except BaseException:
            importer.discard()
            raise
        last_line_start = size if lines[-1].endswith(b"\n") else size - len(lines[-1])
        prefix = Prefix(size, src, importer.lines_seen, last_line_start)
        return self._add_version(prefix, header, importer)

    def import_refs(self, refs: Sequence[LineRef], prefix: Prefix, header: SessionHeader,
                    titles: tuple[str | None, str | None], like_srcs: Sequence[str],
                    guard: contextlib.AbstractContextManager[Any]) -> Version:
        """Store a version whose lines are all in the store already (a fetch staged them as
        they were verified), by reference: no line is read, compressed or hashed again.  The
        caller has verified that they hash to `prefix.blake3` and are cut at their newlines.

        The body continues the held version among `like_srcs` (older versions of the same
        session, the parent's) that shares the longest run of first body lines with it; the
        largest older version of the same session whose lines all start this one is its
        `previous` (library/versions.py).  `guard`: as for `_add_refs`."""
        if prefix.blake3 in self._state.sessions:
            return self._state.sessions[prefix.blake3]
        body = [r.hash for r in refs[1:]]
        head, reused = 0, 0
        previous: Version | None = None
        for src in dict.fromkeys(like_srcs):
            if not self.has_version(src):
                continue
            turns = self.body_turns(src)
            n = 0
            for turn, h in zip(turns, body, strict=False):
                if turn.payload_hash != h:
                    break
                n += 1
            if n > reused:
                head, reused = turns[n - 1].turn_id, n
            older = self.version(src)
            if (older.session_id == header.id and n == len(turns) and older.last_line_start == older.size
                    and self.store.get_turn(older.head).payload_hash == refs[0].hash
                    and (previous is None or older.size > previous.size)):
                previous = older
        return self._add_refs(head, body[reused:], refs[0].hash, prefix, header, titles, previous, guard)

    def extend_refs(self, base: str, first: int, new: Sequence[LineRef], prefix: Prefix,
                    header: SessionHeader, titles: tuple[str | None, str | None],
                    guard: contextlib.AbstractContextManager[Any]) -> Version:
        """Store a fetched version made of the first `first` lines of the held version `base`
        (first >= 1: its header among them) and the lines `new`, all in the store already: it
        continues `base`'s turn of line `first` (found by walking back from its head, over the
        lines it does not share), so that the cost is that of the new lines, not of the
        version.  The caller has verified the whole (the held lines' hash state continued
        through the new ones to `prefix.blake3`) and that it is cut at its newlines.  `guard`:
        as for `_add_refs`."""
        if prefix.blake3 in self._state.sessions:
            return self._state.sessions[prefix.blake3]
        older = self.version(base)
        head = self.line_turn(base, first)
        previous = older if (older.session_id == header.id and first == older.lines
                             and older.last_line_start == older.size) else None
        header_hash = self.store.get_turn(older.head).payload_hash
        new_lines = [r.hash for r in new]
        return self._add_refs(head, new_lines, header_hash, prefix, header, titles, previous, guard)

    def line_turn(self, src: str, first: int) -> int:
        """The turn of a version's line `first - 1` (its first `first` lines end there; 0 when
        that is the header alone), walked back from its head over the lines after it: O(lines
        after).  Two versions with the same line turn and header share their first lines."""
        version = self.version(src)
        if not 1 <= first <= version.lines:
            raise ValueError(f"version {src} has {version.lines} lines, not {first}")
        turn = self.store.get_turn(version.head).parent_turn_id  # the header's turn is the head
        for _ in range(version.lines - first):
            turn = self.store.get_turn(turn).parent_turn_id
        return turn

    def last_line_hashes(self, src: str, n: int) -> list[bytes]:
        """The BLAKE3 of a version's last `n` lines after the header, in file order: O(n)."""
        out: list[bytes] = []
        turn = self.store.get_turn(self.version(src).head).parent_turn_id
        for _ in range(n):
            t = self.store.get_turn(turn)
            out.append(t.payload_hash)
            turn = t.parent_turn_id
        out.reverse()
        return out

    def _add_refs(self, head: int, body: Sequence[bytes], header_hash: bytes, prefix: Prefix,
                  header: SessionHeader, titles: tuple[str | None, str | None],
                  previous: Version | None, guard: contextlib.AbstractContextManager[Any]) -> Version:
        """The version's turns after `head` (0: a new context): `body` then the header.  The
        turns are written without `guard`, the version recorded with it (the caller's other
        readers go on meanwhile; no version may be forgotten meanwhile, which the caller sees
        to); a version recorded meanwhile by another commit wins, and these turns go."""
        ctx = (self.store.fork(head) if head else self.store.create_context()).context_id
        new = [TurnBlobRef(h, TAG_LINE) for h in body] + [TurnBlobRef(header_hash, TAG_HEADER)]
        try:
            for start in range(0, len(new), BATCH_LINES):
                turns = self.store.append_turns(ctx, new[start:start + BATCH_LINES], expected_parent=head)
                head = turns[-1].turn_id
        except BaseException:
            self.store.delete_context(ctx)
            raise
        name, first_user = titles
        version = Version(
            src=prefix.blake3, session_id=header.id, header=header.as_dict(), size=prefix.size,
            lines=prefix.lines, last_line_start=prefix.last_line_start, context=ctx, head=head,
            name=name, first_user=first_user, previous=previous.src if previous is not None else None)
        with guard:
            if (held := self._state.sessions.get(version.src)) is not None:
                self.store.delete_context(ctx)
                return held
            self._record_version(version)
        return version

    def _add_version(self, prefix: Prefix, header: SessionHeader, importer: _Importer) -> Version:
        version = Version(
            src=prefix.blake3, session_id=header.id, header=header.as_dict(), size=prefix.size,
            lines=prefix.lines, last_line_start=prefix.last_line_start, context=importer.context,
            head=importer.head, name=importer.name, first_user=importer.first_user,
            previous=importer.grown.src if importer.grown is not None else None,
        )
        self._record_version(version)
        return version

    def _record_version(self, version: Version) -> None:
        """Record a new version, and make it the `previous` of the versions held already that
        grew from it (they came first: versions.later_growths)."""
        self._state.sessions[version.src] = version
        later = later_growths(version, self._state.sessions.values(), self.line_hashes)
        for src in later:
            self._state.sessions[src] = replace(self._state.sessions[src], previous=version.src)
        if later:
            self._state.generation += 1  # the catalog's `previous` and `version` of those changed
        self._save()

    def add_branch(self, sidecar: bytes, branch: str, src: str, parent: str | None,
                   lineage_cut: str | None = None, offered: bool = True) -> BranchRecord:
        """Record (or re-offer) a branch whose version is stored; the sidecar bytes become a turn.
        `lineage_cut`: the parentSession a `--no-lineage` share left out (kept once recorded).
        `offered`: False records it without offering it (a fetched branch): one state write."""
        now = int(time.time() * 1000)
        existing = self._state.branches.get(branch)
        if existing is not None:
            if not self.store.has_blob(bytes.fromhex(branch)):  # its sidecar's bytes lost (fsck): put back
                self.store.put_blob(sidecar)
            cut = lineage_cut or existing.lineage_cut
            if existing.offered and offered:
                record = replace(existing, shared_at=now, lineage_cut=cut)
            else:
                record = replace(existing, offered=offered, shared_at=now, lineage_cut=cut, withdrawn=None)
                self._state.generation += 1
        else:
            version = self.version(src)
            ctx = version.context
            if self.store.get_head(ctx).head_turn_id != version.head:  # the context already has a branch
                ctx = self.store.fork(version.head).context_id
            turn = self.store.append_turn(ctx, sidecar, type_tag=TAG_SIDECAR, expected_parent=version.head)
            record = BranchRecord(branch, src, parent, ctx, turn.turn_id, offered, now, lineage_cut)
            self._state.generation += 1
        self._state.branches[branch] = record
        self._save()
        return record

    def link_previous(self, links: dict[str, str]) -> None:
        """Record `previous` (src -> the src it grew from) for versions stored without it."""
        for src, previous in links.items():
            self._state.sessions[src] = replace(self.version(src), previous=previous)
        self._state.generation += 1
        self._save()

    def mark_secrets_allowed(self, branch: str) -> BranchRecord:
        """Remember that this branch was shared with the secrets the scan found in it."""
        record = replace(self.branch(branch), secrets_allowed=True)
        self._state.branches[branch] = record
        self._save()
        return record

    def set_offered(self, branch: str, offered: bool) -> BranchRecord:
        record = self.branch(branch)
        if record.offered != offered:
            record = replace(record, offered=offered, withdrawn=None if offered else record.withdrawn)
            self._state.branches[branch] = record
            self._state.generation += 1
            self._save()
        return record

    def withdraw(self, branch: str, why: str) -> BranchRecord:
        """Stop offering a branch and remember why ("unshared" or "expired"); a branch that is
        not offered (fetched and never shared here, or withdrawn already) stays as it is."""
        record = self.branch(branch)
        if record.offered:
            record = replace(record, offered=False, withdrawn=why)
            self._state.branches[branch] = record
            self._state.generation += 1
            self._save()
        return record

    def set_access(self, branch: str, expires_at: int | None, to: list[str] | None) -> BranchRecord:
        """Who may fetch an offered branch and until when (`share --expires/--to`)."""
        record = self.branch(branch)
        if (record.expires_at, record.to) != (expires_at, to):
            record = replace(record, expires_at=expires_at, to=to)
            self._state.branches[branch] = record
            self._state.generation += 1
            self._save()
        return record

    def forget(self, branches: Sequence[str], versions: Sequence[str],
               on_saved: Callable[[], None] | None = None) -> list[int]:
        """Drop branch and version records (`p2pnode rm`, `gc`) and delete the store contexts
        no remaining record uses; the state file is saved before the contexts go, so a crash in
        between leaves unreferenced contexts (dropped as leftovers at the next open), never a
        record naming a deleted context.  Returns the contexts deleted."""
        state = self._state
        dropped = {r.context for b in branches if (r := state.branches.pop(b, None)) is not None}
        dropped |= {v.context for src in versions if (v := state.sessions.pop(src, None)) is not None}
        gone = sorted(dropped - self._referenced())
        state.generation += 1
        self._save()
        if on_saved is not None:
            on_saved()
        for ctx in gone:  # the records named them: no turn is read (a damaged one may head them)
            self.store.delete_context(ctx)
        return gone
