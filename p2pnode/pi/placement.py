"""Writing a fetched session where Pi finds it, without ever exposing a partial file.

The path is `<agent dir>/sessions/--<cwd encoded as Pi does>--/<ts>_<id>.jsonl`, or
`<session dir>/<ts>_<id>.jsonl` when Pi's session-dir override is set (Pi keeps sessions
flat there and looks nowhere else), rebuilt from the session's own header by
`pisession.placed_names`, which refuses hostile fields (`..`, separators, NUL, ids outside
Pi's rule, names over 255 bytes).  Never the agent dir's root: Pi moves `*.jsonl` files found
there.  The header goes first: pi 1.5.2 finds it past blank or malformed lines, pi 0.73.1
only on the first line (and `pi -c` within its first 512 bytes).

The bytes go to a hidden temp file in the target directory (`SessionFile`, written as a fetch
verifies them), are fsynced, then published with `link()` (which, unlike `rename()`, never
replaces a file that appeared meanwhile), and the directory is fsynced: Pi sees no file or
the whole file.  An incremental fetch appends the new bytes to the older version a fetch
placed instead (`appendable`, `SessionFile.append_to`), if that file's stat says it is
unchanged: its old bytes are not read again.

If a file is already at the path: the same bytes mean nothing to do, and so does a file that
is the same bytes plus the final newline pi 1.5.2 adds to a session it opens.  A file that a
fetch placed (recorded in `placed.json`, manifest.PlacedFiles) and that is still byte-identical
to what it placed (or that plus pi 1.5.2's final newline) may be replaced by a version whose
bytes extend it (rename over it, after checking that it did not change meanwhile): nothing in
it is lost.  Any other file (the user's own session, shared or not, grown or not; one that
changed since a fetch placed it; a symlink, dangling or not; a directory) is kept untouched and
reported as `PlacementConflict`.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import os
import secrets
import stat
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from p2pnode.errors import Conflict, P2PNodeError
from p2pnode.library.manifest import PlacedFile, PlacedFiles
from p2pnode.pi.hashing import CHUNK, hash_file, hash_prefix, new_hasher
from p2pnode.pi.session import (
    HostileHeader,
    SessionHeader,
    header_index,
    is_header_candidate,
    parse_header,
    placed_names,
)
from sysio.background import in_background
from sysio.files import fsync_dir
from sysio.flush import disk_full, flush_data, write_at

SESSION_FILE_MODE = 0o644
FLUSH_EVERY = 32 << 20


class PiFolderFull(P2PNodeError):
    """Pi's session folder had no room for the fetched file (exit 1, as a full disk is).  The
    store has committed the session and nothing partial is left there: once there is room,
    the same fetch places it without asking a peer again."""

    def __init__(self, directory: Path, reason: str | None) -> None:
        super().__init__(f"Pi's session folder {directory} is full ({reason or 'no space left'}): the "
                         "session is stored in this node and nothing partial was left there; make room "
                         "there, then run the fetch again (nothing is downloaded again)")


@contextlib.contextmanager
def _room_in(directory: Path) -> Iterator[None]:
    """A full disk met while writing in Pi's folder is PiFolderFull naming it (not an OSError
    with no file, which was blamed on the node's home)."""
    try:
        yield
    except OSError as exc:
        if not disk_full(exc):
            raise
        raise PiFolderFull(directory, exc.strerror) from exc


class PlacementConflict(Conflict):
    def __init__(self, path: Path, ours: str, what: str, branch: str | None = None) -> None:
        fetched = f"branch {branch}" if branch else f"session {ours}"
        super().__init__(
            f"{path} already exists {what}; it was kept, and the fetched {fetched} was not "
            f"written there: it is in the node's store (`p2pnode cat {branch or '<branch>'}` prints it)"
        )
        self.path, self.ours, self.what = path, ours, what

    def naming(self, branch: str) -> PlacementConflict:
        """The same conflict, told with the branch fetched (what `cat` takes)."""
        return PlacementConflict(self.path, self.ours, self.what, branch)


@dataclass(frozen=True)
class Placement:
    path: Path
    written: bool
    """False when the same bytes were already there, or a newer version a fetch placed there,
    which starts with them (a follow placed it meanwhile)."""
    replaced: str | None = None
    """The hash of the older version that was replaced by its grown version."""
    newer: str | None = None
    """The BLAKE3 of the newer version's bytes the file holds, which start with this one's (not
    written): the path holds more than was asked for."""


def pi_readable(data: bytes) -> bytes:
    """The session with its header as the first line, as every Pi version reads it (the
    blank or malformed lines pi 1.5.2 skipped before it follow it instead)."""
    lines = data.splitlines(keepends=True)
    first = header_index(lines, "fetched session")
    if first == 0:
        return data
    header = lines[first] if lines[first].endswith(b"\n") else lines[first] + b"\n"
    return header + b"".join(lines[:first] + lines[first + 1:])


def header_moved(first_line: bytes) -> bool:
    """Whether a session whose first line is `first_line` is placed with its header moved
    first (pi_readable): then its placed bytes are not its own, and a later version's
    placed bytes (which extend them) are not its held bytes followed by the new ones."""
    return not is_header_candidate(first_line)


def session_path(agent_dir: Path, data: bytes, session_dir: Path | None = None) -> Path:
    """Where Pi would keep this session; HostileHeader if the header would lead elsewhere."""
    end = data.find(b"\n")
    return target_path(agent_dir, parse_header(data if end < 0 else data[:end], "fetched session"),
                       session_dir)


def target_path(agent_dir: Path, header: SessionHeader, session_dir: Path | None = None) -> Path:
    """Where Pi would keep the session with this header; HostileHeader if it would lead elsewhere."""
    dir_name, file_name = placed_names(header)
    if session_dir is not None:
        target, home = session_dir / file_name, session_dir.resolve()
        if target.parent.resolve() != home:
            raise HostileHeader(f"session {header.id!r}: {target} resolves outside {home}")
        return target
    target = agent_dir / "sessions" / dir_name / file_name
    sessions = (agent_dir / "sessions").resolve()
    parent = target.parent.resolve()  # catches a symlinked project dir leading out
    if parent.parent != sessions or parent.name != target.parent.name:
        raise HostileHeader(f"session {header.id!r}: {target.parent} resolves outside {sessions}")
    return target


def place_session(agent_dir: Path, data: bytes, src_hex: str, placed: PlacedFiles | None = None,
                  session_dir: Path | None = None) -> Placement:
    """Publish verified session bytes (BLAKE3 `src_hex`) at Pi's path for them, and record
    in `placed` what was written there (a SessionFile written at once)."""
    readable = pi_readable(data)
    placed_hex = src_hex if readable is data else hash_bytes(readable)
    end = readable.find(b"\n")
    header = parse_header(readable if end < 0 else readable[:end], "fetched session")
    out = SessionFile.create(agent_dir, header, src_hex, session_dir)
    try:
        out.write(readable)
        newline = None if readable.endswith(b"\n") else hash_bytes(readable + b"\n")
        return out.publish(Content(src_hex, len(readable), placed_hex, newline), placed)
    except BaseException:
        out.discard()
        raise


@dataclass(frozen=True)
class Content:
    """What is being placed, known by its hashes: its bytes are in a temp file already."""

    src: str
    """The fetched session's BLAKE3 (for messages)."""
    size: int
    blake3: str
    """BLAKE3 of the placed bytes (`src` unless the header was moved first, pi_readable)."""
    newline_blake3: str | None
    """BLAKE3 of the bytes plus the final newline pi 1.5.2 adds, when they lack one."""


def _existing(target: Path, tmp: Path, content: Content, placed: PlacedFiles | None) -> Placement:
    """A file is at the target already: the same version, or a newer one a fetch placed that
    starts with it (nothing to do), an older version a fetch placed that this one extends
    (replaced), or anything else (PlacementConflict).
    `tmp` holds the new bytes, fsynced; it is renamed over the target or left to the caller."""
    src_hex = content.src
    before = os.lstat(target)
    if not stat.S_ISREG(before.st_mode):
        kind = "a symlink" if stat.S_ISLNK(before.st_mode) else "a directory" if stat.S_ISDIR(
            before.st_mode) else "a special file"
        raise PlacementConflict(target, src_hex, f"as {kind}, not a regular file")
    theirs = hash_file(target)
    if theirs in (content.blake3, content.newline_blake3):
        return Placement(target, written=False)  # the same version (pi 1.5.2 may have added a final \n)
    record = placed.get(target) if placed is not None else None
    as_placed = record == PlacedFile(before.st_size, theirs)
    newline_added = not as_placed and record is not None and record.size == before.st_size - 1 and (
        record == PlacedFile(before.st_size - 1, hash_prefix(target, before.st_size - 1)))
    torn = not (as_placed or newline_added) and record is not None and _torn_append(
        target, tmp, record, placed.appended_to(target) if placed is not None else None, before.st_size)
    if not (as_placed or newline_added or torn):
        raise PlacementConflict(target, src_hex, f"with different content (blake3 {theirs}) that no fetch "
                                                 "placed: it is this node's user's own file")
    assert record is not None and placed is not None
    if (held := _holding(target, content, placed)) is not None:
        return held
    # the new bytes extend the placed version: their prefix of its size hashes to it
    if not (record.size < content.size and hash_prefix(tmp, record.size) == record.blake3):
        raise PlacementConflict(target, src_hex, f"as a version a fetch placed (blake3 {theirs}) that the "
                                                 "fetched bytes do not extend")
    after = os.lstat(target)
    if _stamp(after) != _stamp(before):
        raise PlacementConflict(target, src_hex, "and changed while being replaced")
    _replace(tmp, target)
    fsync_dir(target.parent)
    placed.record(target, PlacedFile(content.size, content.blake3), stamp_of(target))
    return Placement(target, written=True, replaced=theirs)


def _torn_append(target: Path, tmp: Path, record: PlacedFile, appending: PlacedFile | None,
                 size: int) -> bool:
    """Whether the file is the version a fetch placed followed by the first bytes of the one an
    append to it was writing when it was killed (`appending`), which `tmp` starts with too: the
    next fetch of the session finishes it.  A file the user (Pi) appended to is not that."""
    if (appending is None or not record.size < size < appending.size or size > os.path.getsize(tmp)
            or hash_prefix(target, record.size) != record.blake3):
        return False
    with open(target, "rb") as placed, open(tmp, "rb") as new:
        placed.seek(record.size)
        new.seek(record.size)
        left = size - record.size
        while left > 0:
            n = min(CHUNK, left)
            if placed.read(n) != new.read(n):
                return False
            left -= n
    return True


class SessionFile:
    """A fetched session written as it is verified, then published by `publish` once the
    store has committed it, or removed by `discard` (a refused or cancelled fetch).

    With `staging` (a directory of the node's, what a streaming fetch uses) the temp file is
    there, so nothing appears in Pi's folder before the commit, not even after a kill -9; it
    is linked into place when published (copied first if Pi's folder is on another file
    system).  Without, it is a hidden temp file (0600, a name Pi never lists) in the directory
    Pi will find it in (placing bytes already verified and stored).  A temp file left by a
    killed fetch of the same session is removed by the next one's `create`."""

    def __init__(self, target: Path, tmp: Path, fd: int, made_dir: bool,
                 where: tuple[Path, SessionHeader, Path | None]) -> None:
        self.target = target
        self.tmp = tmp
        self._fd: int | None = fd
        self._made_dir = made_dir
        self._where = where
        self.written = 0
        self._unflushed = 0
        self._writer: ThreadPoolExecutor | None = None
        self._writing: Future[None] | None = None
        """The write in flight on the writer thread, if any (`write`)."""
        self._flushing: Future[None] | None = None
        """The write-behind fdatasync in flight, if any (`_write`)."""

    @classmethod
    def create(cls, agent_dir: Path, header: SessionHeader, src_hex: str,
               session_dir: Path | None = None, staging: Path | None = None) -> SessionFile:
        where = (agent_dir, header, session_dir)
        if staging is not None:
            target = target_path(agent_dir, header, session_dir)  # refused early: HostileHeader
            staging.mkdir(mode=0o700, parents=True, exist_ok=True)  # in the node's private home
            made_dir = False
        else:
            target, made_dir = _prepare_dir(*where)
            staging = target.parent
        _remove_stale(staging, src_hex)
        # the pid (what _remove_stale reads) and a random part: a node's fetches and follows of
        # one version at once (one pid, one staging dir) each write their own file
        tmp = staging / f".p2pnode-{src_hex[:16]}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o600)
        return cls(target, tmp, fd, made_dir, where)

    def write(self, data: bytes | memoryview) -> None:
        """Append bytes (not changed until written: bytes, or a view of them).  They are
        written behind, on the file's writer thread, one write in flight: the caller is a
        fetch's step, which hashes the next lines meanwhile.  What a write raised is raised
        by the next one, or by publishing."""
        assert self._fd is not None
        self._written()
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="p2pnode-write")
        self._writing = self._writer.submit(self._write, memoryview(data))
        self.written += len(data)

    def _write(self, view: memoryview) -> None:
        """On the writer thread.  Every FLUSH_EVERY bytes they are flushed on the way, so that
        publishing, after the last byte, syncs only the tail.  The flush runs behind the
        writes, on a thread of its own (one at a time): waiting on the disk here held up the
        next write, and the fetch's step that waits for it.  What such a flush raised is
        raised by the next write that would start one, or by publishing."""
        assert self._fd is not None
        with self._room():
            size = len(view)
            while view:
                view = view[os.write(self._fd, view):]
            self._unflushed += size
            if self._unflushed >= FLUSH_EVERY and (self._flushing is None or self._flushing.done()):
                self._flush_behind()

    def flush_soon(self) -> None:
        """Start syncing what was written and not flushed yet, behind the caller: a fetch calls
        it after its last byte, so that this sync runs beside the store's commit, which must
        come before publishing, and publishing finds the bytes durable.  What the sync
        raises, publishing raises."""
        self._written()
        if self._unflushed:
            self._flush_behind()

    def _flush_behind(self) -> None:
        """A flush of every byte written so far started on the flush's own thread, once the
        one before it ended (what that one raised is raised here)."""
        assert self._fd is not None
        self._flushed()
        self._flushing = in_background(functools.partial(flush_data, self._fd), name="p2pnode-flush")
        self._unflushed = 0

    def _synced(self) -> None:
        """Every byte written made durable: the flush behind the writes waited for, the rest
        (written since it began) flushed here."""
        assert self._fd is not None
        self._written()
        with self._room():
            self._flushed()
            if self._unflushed:
                flush_data(self._fd)
                self._unflushed = 0

    def _written(self) -> None:
        """Wait for the write in flight, if any; raise what it raised."""
        writing, self._writing = self._writing, None
        if writing is not None:
            writing.result()

    def _flushed(self) -> None:
        """Wait for the write-behind flush in flight, if any; raise what it raised."""
        flushing, self._flushing = self._flushing, None
        if flushing is not None:
            flushing.result()

    def _room(self) -> contextlib.AbstractContextManager[None]:
        """Writes to the temp file: PiFolderFull when it is in Pi's folder (else the node's
        staging dir is full: the node's home, as any other write of the node's)."""
        staged = self.tmp.parent != self.target.parent
        return contextlib.nullcontext() if staged else _room_in(self.target.parent)

    def _close(self) -> None:
        if self._fd is not None:
            # not closed under its write or flush (the fd's number could be another file's by
            # then); what they raised was raised by publishing already, or the file is discarded
            with contextlib.suppress(OSError, PiFolderFull):
                self._written()
            with contextlib.suppress(OSError):
                self._flushed()
            if self._writer is not None:
                self._writer.shutdown()
            fd, self._fd = self._fd, None
            os.close(fd)

    def publish(self, content: Content, placed: PlacedFiles | None) -> Placement:
        """fsync the bytes, link them at the target (never over a file that appeared
        meanwhile: then `_existing` decides), fsync the directory; record them in `placed`."""
        assert self._fd is not None and self.written == content.size
        try:
            os.fchmod(self._fd, SESSION_FILE_MODE)
            self._synced()
            self._close()
            if self.tmp.parent != self.target.parent:  # staged: Pi's folder is made only now
                with _room_in(self.target.parent):
                    self.target, _ = _prepare_dir(*self._where)
            with _placing(self.target):
                if os.path.lexists(self.target):  # a dangling symlink too: never followed, never replaced
                    return _existing(self.target, self.tmp, content, placed)
                try:
                    with _room_in(self.target.parent):
                        _link(self.tmp, self.target)
                except FileExistsError:
                    return _existing(self.target, self.tmp, content, placed)
                with _room_in(self.target.parent):
                    fsync_dir(self.target.parent)
                if placed is not None:
                    record = PlacedFile(content.size, content.blake3)
                    placed.record(self.target, record, stamp_of(self.target))
                return Placement(self.target, written=True)
        finally:
            self.discard(keep_dir=True)

    def append_to(self, to: Appendable, start: int, content: Content, placed: PlacedFiles) -> Placement:
        """Publish by appending: this temp file holds the new version's bytes from offset
        `start` (where the held lines end) and `to.target` is the old version (checked by
        `appendable`, unchanged since: else PlacementConflict).  What the file has beyond
        `start` (an old partial last line, pi's newline) must be what the new bytes begin
        with; the rest is written after it, then the file is fsynced.  The old bytes before
        `start` are never read."""
        assert self._fd is not None and self.written == content.size - start
        try:
            self._synced()
            self._close()
            with _placing(to.target):
                return self._append(to, start, content, placed)
        finally:
            self.discard(keep_dir=True)

    def _append(self, to: Appendable, start: int, content: Content, placed: PlacedFiles) -> Placement:
        """append_to's work, the target's placement lock held: checked, then written."""
        if stamp_of(to.target) != to.stamp:
            if (held := _holding(to.target, content, placed)) is not None:
                return held
            why = f"and changed since this node placed version {to.base} there"
            raise PlacementConflict(to.target, content.src, why)
        have = to.stamp[1] - start
        with open(self.tmp, "rb") as new, open(to.target, "r+b") as old:
            old.seek(start)
            if have < 0 or old.read(have) != new.read(have):
                why = f"as version {to.base}, which the fetched bytes do not extend"
                raise PlacementConflict(to.target, content.src, why)
            offset = to.stamp[1]
            placed.appending(to.target, PlacedFile(content.size, content.blake3))
            try:
                with _room_in(to.target.parent):
                    while chunk := new.read(CHUNK):
                        write_at(old.fileno(), chunk, offset)
                        offset += len(chunk)
                    flush_data(old.fileno())
            except BaseException:  # a full disk, EIO, Ctrl-C: the old version back (a kill -9
                with contextlib.suppress(OSError):  # leaves the tail: `_torn_append` then)
                    os.ftruncate(old.fileno(), to.stamp[1])
                    placed.record(to.target, PlacedFile(to.size, to.base), stamp_of(to.target))
                raise
        placed.record(to.target, PlacedFile(content.size, content.blake3), stamp_of(to.target))
        return Placement(to.target, written=True, replaced=to.base)

    def discard(self, keep_dir: bool = False) -> None:
        """Remove the temp file (and the project directory if this fetch made it, now empty)."""
        self._close()
        self.tmp.unlink(missing_ok=True)
        if self._made_dir and not keep_dir:
            with contextlib.suppress(OSError):
                self.target.parent.rmdir()


def _holding(target: Path, content: Content, placed: PlacedFiles) -> Placement | None:
    """Nothing to write (not written) if the file is, unchanged since a fetch placed it, this
    version or a newer one that starts with it (another fetch or a follow placed it meanwhile:
    `newer`); else None."""
    record = placed.get(target)
    if record is None or record.size < content.size or placed.stamp(target) != stamp_of(target):
        return None
    if record.size == content.size:
        return Placement(target, written=False) if record.blake3 == content.blake3 else None
    if hash_prefix(target, content.size) != content.blake3:
        return None
    return Placement(target, written=False, newer=record.blake3)


_PLACING: dict[Path, threading.Lock] = {}
_PLACING_GUARD = threading.Lock()


@contextlib.contextmanager
def _placing(target: Path) -> Iterator[None]:
    """One placement of a file at a time in this process: the node fetches and follows several
    sessions at once, and an append to a placed file and its replacement (or two appends) must
    not interleave between the check of what the file is and the write.  (Two processes cannot
    place for one node home at once: the store's lock keeps one of them out.)  A lock per file
    placed since the process started: a few bytes each."""
    with _PLACING_GUARD:
        lock = _PLACING.setdefault(target, threading.Lock())
    with lock:
        yield


def stamp_of(path: Path) -> list[int]:
    st = os.lstat(path)
    return [st.st_ino, st.st_size, st.st_mtime_ns]


@dataclass(frozen=True)
class Appendable:
    """A placed file that an incremental fetch may append to: the version `base` this node
    placed there (`size` bytes, or those plus pi 1.5.2's final newline), as `stamp` says."""

    target: Path
    base: str
    size: int
    stamp: list[int]


def appendable(target: Path, placed: PlacedFiles, base: str, base_size: int,
               base_ends_line: bool) -> Appendable | None:
    """Whether the file at `target` is still exactly the version `base` a fetch placed there:
    by placed.json's record and the file's unchanged stat, without reading it; or, for a
    version without a final newline, that plus the one pi 1.5.2 adds (then its stat changed:
    its first `base_size` bytes are hashed to be sure, the one case that reads the old bytes)."""
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode) or placed.get(target) != PlacedFile(base_size, base):
        return None
    now = [st.st_ino, st.st_size, st.st_mtime_ns]
    if placed.stamp(target) == now and st.st_size == base_size:
        return Appendable(target, base, base_size, now)
    if not base_ends_line and st.st_size == base_size + 1 and hash_prefix(target, base_size) == base:
        with open(target, "rb") as f:
            f.seek(base_size)
            if f.read(1) == b"\n":
                return Appendable(target, base, base_size, now)
    return None


def _prepare_dir(agent_dir: Path, header: SessionHeader, session_dir: Path | None) -> tuple[Path, bool]:
    """Pi's folder for the session made (if missing), and the target path checked again now
    that it exists; whether this call made the project directory."""
    (session_dir or agent_dir / "sessions").mkdir(parents=True, exist_ok=True)
    target = target_path(agent_dir, header, session_dir)
    made_dir = not target.parent.exists()
    target.parent.mkdir(exist_ok=True)
    return target_path(agent_dir, header, session_dir), made_dir  # a symlink swapped in meanwhile


NO_LINKS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS})
"""What os.link raises on a file system without hard links (FAT and exFAT drives, some SMB
shares: EPERM on Linux, ENOTSUP on macOS)."""


def _link(tmp: Path, target: Path) -> None:
    """Hard-link `tmp` at `target` (FileExistsError if something is there); from another file
    system, or to one without hard links, by way of a hidden copy beside the target (fsynced)."""
    try:
        os.link(tmp, target)
        return
    except OSError as exc:
        if exc.errno != errno.EXDEV and exc.errno not in NO_LINKS:
            raise
    with _copied_beside(tmp, target) as near:
        _link_or_rename(near, target)


def _replace(tmp: Path, target: Path) -> None:
    """os.replace(tmp, target), by way of a hidden copy beside the target (fsynced) when `tmp`
    is on another file system (a node's staging dir, Pi's folder on another drive)."""
    try:
        os.replace(tmp, target)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        with _copied_beside(tmp, target) as near:
            os.replace(near, target)


@contextlib.contextmanager
def _copied_beside(tmp: Path, target: Path) -> Iterator[Path]:
    """A copy of `tmp` in the target's directory, fsynced; removed after (if still there)."""
    near = target.parent / tmp.name
    try:
        with _room_in(target.parent), open(tmp, "rb") as src, open(near, "xb") as dst:
            while chunk := src.read(CHUNK):
                dst.write(chunk)
            dst.flush()
            os.fchmod(dst.fileno(), SESSION_FILE_MODE)
            flush_data(dst.fileno())
        yield near
    finally:
        near.unlink(missing_ok=True)


def _link_or_rename(near: Path, target: Path) -> None:
    """`near` linked at `target`; where the file system has no hard links, renamed there once
    nothing is (not atomic against another process making the target in between: Pi does not
    make a file of a session it did not start, and this process places a file once at a time)."""
    try:
        os.link(near, target)
    except OSError as exc:
        if exc.errno not in NO_LINKS:
            raise
        if os.path.lexists(target):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(target)) from None
        os.rename(near, target)


def _remove_stale(directory: Path, src_hex: str) -> None:
    """Temp files of this session left by a fetch whose process is gone (kill -9)."""
    for old in directory.glob(f".p2pnode-{src_hex[:16]}.*.tmp"):
        pid = old.name.split(".")[2]
        if pid.isascii() and pid.isdigit() and not _alive(int(pid)):
            old.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def hash_bytes(data: bytes) -> str:
    return new_hasher().update(data).hexdigest()


def _stamp(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_size, st.st_mtime_ns, st.st_ino)
