"""The assembly of one fetched session version, sans-IO: verified lines in (in any order),
the session's bytes out in file order, every check of the whole done on the way.

get.py drives it (`received` blobs from batches.py, lines read back from the store, the temp
file beside Pi's); this module only decides.  Its states, in order:

    manifest (the line refs)  ->  lines (the cursor walks the manifest; each line at the cursor
    is checked and hashed once)  ->  verified (`finish`: the hash is `src`, the lines are the
    file cut at its newlines)  ->  committed (get.py's, through the library)

Lines that arrive ahead of the cursor wait in a bounded buffer (`ahead_limit` bytes); beyond
it they are left to the store, where the driver reads them back when the cursor reaches them
(`from_store`), unless they are next in file order.  Nothing here holds the whole session: at
most the buffer and one line beyond it, the lines before
Pi's header (under HEADER_SCAN_BYTES, see `_HeaderScan`) and the one line being handed out.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import blake3

from p2pnode.errors import InvalidInput, VerificationFailed
from p2pnode.pi.lines import LineRef
from p2pnode.pi.session import (
    HEADER_SCAN_BYTES,
    SessionHeader,
    header_index,
    is_header_candidate,
    parse_header,
    placed_names,
    titles_after,
)

AHEAD_LIMIT = 16 << 20
"""Raw bytes of verified lines kept in memory ahead of the in-order cursor."""
READ_BACK = 8 << 20
"""Raw bytes of consecutive held lines read back from the store in one call (`from_store`)."""
READY_PART = 1 << 20
"""Bytes of consecutive lines handed out (and hashed into the session) as one part."""


def session_hasher() -> blake3.blake3:
    """The fetched session's hash, on one thread: it is updated in the fetch's staging step,
    beside the decoding threads and the event loop, where blake3's own threads only contended
    for the cores (docs/BENCHMARKS.md, 2026-11-29 (17))."""
    return blake3.blake3(max_threads=1)


class ManifestLied(VerificationFailed):
    """The lines of a manifest do not hash to its session, or are not the file cut at its
    newlines: the manifest's sender lied (its lines themselves were each verified)."""


@dataclass(frozen=True)
class Held:
    """What a fetch continues from: the first `lines` lines of the version (a version this
    node holds, of the same session), hashed already (`hasher`: the live state after them), or
    being hashed (None: given with `SessionGetter.hash_held` before the first line goes out, so
    the driver can hash the held file while the new lines come)."""

    lines: int
    size: int
    hasher: blake3.blake3 | None
    header: SessionHeader
    name: str | None
    first_user: str | None


@dataclass(frozen=True)
class Assembled:
    """A verified session version, ready to be committed (library) and placed (placement)."""

    src: str
    refs: Sequence[LineRef]
    size: int
    last_line_start: int
    header: SessionHeader
    name: str | None
    first_user: str | None
    placed_hex: str
    """BLAKE3 of the bytes handed out (the file Pi gets): `src`, unless the header was moved first."""
    newline_hex: str | None
    """BLAKE3 of those bytes plus the final newline pi 1.5.2 adds, when they lack one."""
    placed_size: int
    complete: tuple[int, blake3.blake3]
    """(size, hasher state) where the version's complete lines end: what a later version of the
    same session continues from (LiveStates)."""
    start_checked: bool = False
    """Whether its start was checked against the getter's `starts_with`."""


class LiveStates:
    """Hasher states at the end of versions' complete lines, kept by a running process (the
    node), so that an incremental fetch continues the hash without reading the held prefix:
    blake3's Python API cannot save a state, so a one-shot process has none (it re-hashes)."""

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self._states: dict[str, tuple[int, blake3.blake3]] = {}

    def put(self, src: str, size: int, hasher: blake3.blake3) -> None:
        self._states.pop(src, None)
        self._states[src] = (size, hasher.copy())
        while len(self._states) > self.limit:
            self._states.pop(next(iter(self._states)))

    def clear(self) -> None:
        self._states.clear()

    def get(self, src: str, size: int) -> blake3.blake3 | None:
        found = self._states.get(src)
        return found[1].copy() if found is not None and found[0] == size else None


LIVE = LiveStates()


class _HeaderScan:
    """Pi's header as pi 1.5.2 finds it: the first JSON line within HEADER_SCAN_BYTES.  The
    lines before it are held (under HEADER_SCAN_BYTES) so that the header can be handed out
    first, as every Pi version reads it (placement.pi_readable)."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.before: list[bytes] = []
        self.offset = 0

    def feed(self, line: bytes) -> SessionHeader | None:
        if self.offset < HEADER_SCAN_BYTES and is_header_candidate(line):
            header = parse_header(line.rstrip(b"\n"), self.where)
            placed_names(header)  # HostileHeader: a header that would place it outside Pi's dir
            return header
        self.before.append(line)
        self.offset += len(line)
        if self.offset >= HEADER_SCAN_BYTES:
            self.end()
        return None

    def end(self) -> None:
        """No header where pi 1.5.2 looks: InvalidHeader, saying what is wrong."""
        header_index(self.before, self.where)
        raise AssertionError("header_index found a header that feed() passed over")


class SessionGetter:
    """One session version's assembly (see the module docstring).

    `outstanding`: the hashes still to come from peers (the rest are in the store);
    `held`: the prefix this node holds already (an incremental fetch: the manifest is the
    whole version's, the cursor starts after the held lines)."""

    def __init__(self, src: str, refs: Sequence[LineRef], outstanding: Iterable[bytes], *,
                 held: Held | None = None, ahead_limit: int = AHEAD_LIMIT,
                 starts_with: tuple[str, int] | None = None) -> None:
        if not refs:
            raise ManifestLied(f"line manifest of {src} lists no lines")
        self.src = src
        self.refs = list(refs)  # looked up line by line: a packed LineRefs makes a LineRef per look
        self.where = f"fetched session {src}"
        self.outstanding = set(outstanding)
        self.ahead: dict[bytes, bytes] = {}
        self.ahead_bytes = 0
        self.ahead_limit = ahead_limit
        self.cursor = held.lines if held else 0
        self._next = self.cursor
        """The first line from the cursor on that `ahead` lacks: a line arriving there is next in
        file order (the driver's `ready` takes it with the run it came in), kept whatever its
        size while the buffer is within its limit (a big line after its predecessor in one run
        was left to the store and read back, decoded and hashed again)."""
        self.size = held.size if held else 0
        self.hasher = held.hasher.copy() if held and held.hasher else session_hasher()
        self.held_hash_due = held is not None and held.hasher is None
        self.header = held.header if held else None
        self.name = held.name if held else None
        self.first_user = held.first_user if held else None
        self._scan = None if held else _HeaderScan(self.where)
        self._placed: blake3.blake3 | None = None
        """The hash of the handed-out bytes, when they differ from the session's (header moved)."""
        self._placed_size = self.size
        self.refused: InvalidInput | None = None
        """Why the session is refused, once a check failed: the rest is only hashed, so that
        `finish` can tell a refused session (it hashes to `src`) from a lying manifest."""
        self._last_line_start = self.size
        self._ends_with_newline = True
        self._before_last = self.hasher
        self._starts_with = starts_with if starts_with is not None and starts_with[1] > self.size else None
        """(src, size) of the version this one must start with (a newer version fetched in place
        of the one named, fetch_branch's `starts_with`): checked as the hash passes that size,
        if it is at a line's end; else (in the held prefix, or mid-line) left to the caller."""
        self.start_checked = False

    @property
    def done(self) -> bool:
        return self.cursor == len(self.refs)

    def hash_held(self, hasher: blake3.blake3) -> None:
        """The held lines' hash state, when Held came without it (due before `ready`)."""
        if not self.held_hash_due:
            raise ValueError(f"{self.where}: the held lines' hash is given already")
        self.hasher = self._before_last = hasher.copy()
        self.held_hash_due = False

    def arrived(self, line_hash: bytes, raw: bytes) -> None:
        """A verified line from a peer (it is staged in the store by the driver already)."""
        self.outstanding.discard(line_hash)
        at = max(self._next, self.cursor)
        if (at < len(self.refs) and self.refs[at].hash == line_hash
                and (at == self.cursor or self.ahead_bytes <= self.ahead_limit)):
            self.ahead[line_hash] = raw  # taken by the next ready() at once, whatever its size
            self.ahead_bytes += len(raw)
            while at < len(self.refs) and self.refs[at].hash in self.ahead:
                at += 1
            self._next = at
        elif line_hash not in self.ahead and self.ahead_bytes + len(raw) <= self.ahead_limit:
            self.ahead[line_hash] = raw
            self.ahead_bytes += len(raw)

    def from_store(self, limit: int = READ_BACK) -> list[bytes]:
        """The hashes the cursor waits for that only the store can give (held before the fetch,
        or let go from the buffer): the run of them at the cursor, each once, up to about
        `limit` raw bytes, for one read of the store; empty when the cursor waits on a peer
        (or the buffer has the line)."""
        wanted: dict[bytes, None] = {}
        size = 0
        at = self.cursor
        while at < len(self.refs) and size < limit:
            h = self.refs[at].hash
            if h in self.ahead or h in self.outstanding or h in wanted:
                break  # a line repeated within the run is read again at its turn (ahead holds one copy)
            wanted[h] = None
            size += self.refs[at].length
            at += 1
        return list(wanted)

    def read_back(self, hashes: list[bytes], raws: list[bytes]) -> None:
        """The lines `from_store` asked for (the store checked each against its hash)."""
        for line_hash, raw in zip(hashes, raws, strict=True):
            self.ahead[line_hash] = raw
            self.ahead_bytes += len(raw)

    def ready(self) -> Iterator[bytes]:
        """The bytes that can be handed out now, in file order (nothing while the cursor
        waits), in parts of about READY_PART bytes: whole lines joined, each part hashed into
        the session as one update and written by the driver as one write (not one per line).
        Made as they are consumed (consume them all): one part in memory at a time."""
        if self.held_hash_due:
            raise ValueError(f"{self.where}: the held lines' hash is due before their successors go out")
        while taken_parts := self._take(READY_PART):
            yield from self._hashed(*taken_parts)
            if self._starts_with is not None and self.size == self._starts_with[1] and not self.start_checked:
                self._check_start(*self._starts_with)

    def _check_start(self, src: str, size: int) -> None:
        if self.hasher.hexdigest() != src:
            raise VerificationFailed(f"{self.where}, offered as a newer version of {src}, does not start "
                                     f"with its bytes (its first {size}); not stored or placed (fetch "
                                     "with --exact)")
        self.start_checked = True

    def _take(self, limit: int) -> tuple[list[bytes], list[bytes]] | None:
        """Lines at the cursor, checked, up to about `limit` bytes, and what of them is handed
        out; None when the cursor waits."""
        taken: list[bytes] = []
        parts: list[bytes] = []
        size = 0
        stop = self._starts_with[1] if self._starts_with is not None and not self.start_checked else -1
        while size < limit and not self.done and self.size != stop and (
                (raw := self.ahead.pop(self.refs[self.cursor].hash, None)) is not None):
            self.ahead_bytes -= len(raw)
            taken.append(raw)
            size += len(raw)
            parts += self._line(raw)
        return (taken, parts) if taken else None

    def _hashed(self, taken: list[bytes], parts: list[bytes]) -> list[bytes]:
        """`taken` hashed into the session (the state before the session's last line kept);
        `parts` as they go out: joined, when they are the taken lines themselves (the rule;
        not around a moved header or in a refused session)."""
        same = len(parts) == len(taken) and all(p is t for p, t in zip(parts, taken, strict=True))
        if self.done:
            *head, last = taken
            joined = b"".join(head)
            self.hasher.update(joined)
            self._before_last = self.hasher.copy()
            self.hasher.update(last)
            return [part for part in (joined, last) if part] if same else parts
        joined = b"".join(taken)
        self.hasher.update(joined)
        return [joined] if same else parts

    def take_run(self, data: bytes, count: int) -> list[bytes | memoryview]:
        """The `count` lines at the cursor as one block (a fork's run read whole from its
        parent's placed file: heldlines.held_run), each checked as `ready` checks a line, all
        hashed into the session in one update and handed out as the block itself: not cut into
        lines and joined again.  Where a line is handed out otherwise (before the header, in a
        refused session, around a header moved), or is the session's last, the lines go to
        the buffer for `ready` instead."""
        refs = self.refs[self.cursor:self.cursor + count]
        if sum(r.length for r in refs) != len(data):
            raise ValueError(f"{self.where}: a run of {len(data)} bytes is not its {count} lines")
        whole = count - (self.cursor + count == len(self.refs))
        if (self._scan is not None or self._placed is not None or self.refused is not None
                or self.held_hash_due or (self._starts_with is not None and not self.start_checked)):
            whole = 0
        pos = 0
        for ref in refs[:whole]:
            self._cut(data, pos, pos + ref.length)
            self.name, self.first_user = titles_after(data, self.name, self.first_user, pos, pos + ref.length)
            pos += ref.length
        view, at = memoryview(data), pos
        for ref in refs[whole:]:
            self.read_back([ref.hash], [bytes(view[at:at + ref.length])])
            at += ref.length
        if not pos:
            return []
        self.hasher.update(view[:pos])
        self._placed_size += pos
        return [view[:pos]]

    def _cut(self, buf: bytes, start: int, end: int) -> None:
        """buf[start:end] taken as the line at the cursor: it must be the manifest's length and
        the file cut at its newlines (only the session's last line may lack one)."""
        ref = self.refs[self.cursor]
        self.cursor += 1
        newline = buf.find(b"\n", start, end)
        if end - start != ref.length or not (newline == end - 1 or (newline < 0 and self.done)):
            raise ManifestLied(f"{self.where}: line {self.cursor} of its manifest is not the file cut at its "
                               "newlines (or its length is not the line's)")
        self._last_line_start = self.size
        self._ends_with_newline = newline >= 0
        self.size += end - start

    def _line(self, line: bytes) -> list[bytes]:
        """The checks of the line at the cursor, and what of it can be handed out now (its
        hash into the session's is `_hashed`'s, a run of lines at a time)."""
        self._cut(line, 0, len(line))
        if self.refused is not None:
            return []
        try:
            return self._check(line)
        except InvalidInput as exc:  # InvalidHeader, HostileHeader
            self.refused = exc
            return []

    def _check(self, line: bytes) -> list[bytes]:
        """The checks of a line at the cursor (Pi's header first) and what of it can be handed
        out now.  A line's JSON is not parsed: it is kept verbatim, and what reads it here (the
        title search, the secret scan) takes JSON too deep for Python's parser as no JSON."""
        parts = [line]
        if self._scan is not None:
            header = self._scan.feed(line)
            if header is None:
                if self.done:
                    self._scan.end()
                parts = []
            else:
                self.header = header
                before, self._scan = self._scan.before, None
                if before:  # the header first, as every Pi version reads it (pi_readable)
                    self._placed = session_hasher()
                    parts = [line if line.endswith(b"\n") else line + b"\n", *before]
        self.name, self.first_user = titles_after(line, self.name, self.first_user)
        return self._out(parts)

    def _out(self, parts: list[bytes]) -> list[bytes]:
        for part in parts:
            self._placed_size += len(part)
            if self._placed is not None:
                self._placed.update(part)
        return parts

    def finish(self) -> Assembled:
        """The verified version, or ManifestLied when its lines do not hash to `src`."""
        if not self.done:
            raise ManifestLied(f"{self.where}: line {self.cursor + 1} never arrived")
        if self.held_hash_due:
            raise ValueError(f"{self.where}: the held lines' hash was never given")
        if (got := self.hasher.hexdigest()) != self.src:
            raise ManifestLied(f"{self.where}: its manifest's lines hash to {got}")
        if self.refused is not None:
            raise self.refused
        assert self.header is not None
        placed = self._placed or self.hasher
        complete = self._ends_with_newline
        return Assembled(
            src=self.src, refs=self.refs, size=self.size,
            last_line_start=self.size if complete else self._last_line_start, header=self.header,
            name=self.name, first_user=self.first_user, placed_hex=placed.hexdigest(),
            newline_hex=None if complete else placed.copy().update(b"\n").hexdigest(),
            placed_size=self._placed_size, start_checked=self.start_checked,
            complete=(self.size, self.hasher) if complete else (self._last_line_start, self._before_last))
