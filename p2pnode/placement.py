"""Writing a fetched session where Pi finds it, without ever exposing a partial file.

The path is `<agent dir>/sessions/--<cwd encoded as Pi does>--/<ts>_<id>.jsonl`, rebuilt
from the session's own header by `pisession.session_relpath`, which refuses hostile fields
(`..`, separators, NUL, absurd lengths).  Never the agent dir's root: Pi moves `*.jsonl`
files found there.  The bytes go to a hidden temp file in the target directory, are
fsynced, then published with `link()` (which, unlike `rename()`, never replaces a file that
appeared meanwhile), and the directory is fsynced: Pi sees no file or the whole file.

If a file is already at the path: the same bytes mean nothing to do.  A file that a fetch
placed (recorded in `placed.json`, manifest.PlacedFiles) and that is still byte-identical to
what it placed may be replaced by a version whose bytes extend it (rename over it, after
checking that it did not change meanwhile): nothing in it is lost.  Any other file (the
user's own session, shared or not, grown or not; one that changed since a fetch placed it; a
symlink, dangling or not; a directory) is kept untouched and reported as `PlacementConflict`.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from p2pnode.errors import Conflict
from p2pnode.hashing import hash_file
from p2pnode.manifest import PlacedFile, PlacedFiles
from p2pnode.pisession import HostileHeader, parse_header, session_relpath
from store.fileio import fsync_dir

SESSION_FILE_MODE = 0o644


class PlacementConflict(Conflict):
    def __init__(self, path: Path, ours: str, what: str) -> None:
        super().__init__(
            f"{path} already exists {what}; it was kept, and the fetched session {ours} was not "
            f"written there: it is in the node's store (`p2pnode cat <branch>` prints it)"
        )
        self.path = path


@dataclass(frozen=True)
class Placement:
    path: Path
    written: bool
    """False when the same bytes were already there."""
    replaced: str | None = None
    """The hash of the older version that was replaced by its grown version."""


def _write_temp(directory: Path, name: str, data: bytes) -> Path:
    """The bytes, durably, in a hidden temp file beside the target (Pi only lists *.jsonl)."""
    tmp = directory / f".{name}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, SESSION_FILE_MODE)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    return tmp


def session_path(agent_dir: Path, data: bytes) -> Path:
    """Where Pi would keep this session; HostileHeader if the header would lead elsewhere."""
    end = data.find(b"\n")
    header = parse_header(data if end < 0 else data[:end], "fetched session")
    target = agent_dir / session_relpath(header)
    sessions = (agent_dir / "sessions").resolve()
    parent = target.parent.resolve()  # catches a symlinked project dir leading out
    if parent.parent != sessions or parent.name != target.parent.name:
        raise HostileHeader(f"session {header.id!r}: {target.parent} resolves outside {sessions}")
    return target


def place_session(agent_dir: Path, data: bytes, src_hex: str, placed: PlacedFiles | None = None) -> Placement:
    """Publish verified session bytes (BLAKE3 `src_hex`) at Pi's path for them, and record
    in `placed` what was written there."""
    (agent_dir / "sessions").mkdir(parents=True, exist_ok=True)
    target = session_path(agent_dir, data)
    target.parent.mkdir(exist_ok=True)
    target = session_path(agent_dir, data)  # re-check now that the directory exists
    if os.path.lexists(target):  # a dangling symlink too: never followed, never replaced
        return _existing(target, data, src_hex, placed)
    tmp = _write_temp(target.parent, target.name, data)
    try:
        os.link(tmp, target)
    except FileExistsError:
        return _existing(target, data, src_hex, placed)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(target.parent)
    if placed is not None:
        placed.record(target, PlacedFile(len(data), src_hex))
    return Placement(target, written=True)


def _existing(target: Path, data: bytes, src_hex: str, placed: PlacedFiles | None) -> Placement:
    before = os.lstat(target)
    if not stat.S_ISREG(before.st_mode):
        kind = "a symlink" if stat.S_ISLNK(before.st_mode) else "a directory" if stat.S_ISDIR(
            before.st_mode) else "a special file"
        raise PlacementConflict(target, src_hex, f"as {kind}, not a regular file")
    theirs = hash_file(target)
    if theirs == src_hex:
        return Placement(target, written=False)
    record = placed.get(target) if placed is not None else None
    if record != PlacedFile(before.st_size, theirs):
        raise PlacementConflict(target, src_hex, f"with different content (blake3 {theirs}) that no fetch "
                                                 "placed: it is this node's user's own file")
    if not (before.st_size < len(data) and _is_prefix(target, data)):
        raise PlacementConflict(target, src_hex, f"as a version a fetch placed (blake3 {theirs}) that the "
                                                 "fetched bytes do not extend")
    assert placed is not None
    tmp = _write_temp(target.parent, target.name, data)
    after = os.lstat(target)
    if _stamp(after) != _stamp(before):
        tmp.unlink()
        raise PlacementConflict(target, src_hex, "and changed while being replaced")
    os.replace(tmp, target)
    fsync_dir(target.parent)
    placed.record(target, PlacedFile(len(data), src_hex))
    return Placement(target, written=True, replaced=theirs)


def _stamp(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_size, st.st_mtime_ns, st.st_ino)


def _is_prefix(path: Path, data: bytes) -> bool:
    with open(path, "rb") as f:
        return data.startswith(f.read(len(data) + 1))
