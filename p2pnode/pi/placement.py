"""Writing a fetched session where Pi finds it, without ever exposing a partial file.

The path is `<agent dir>/sessions/--<cwd encoded as Pi does>--/<ts>_<id>.jsonl`, or
`<session dir>/<ts>_<id>.jsonl` when Pi's session-dir override is set (Pi keeps sessions
flat there and looks nowhere else), rebuilt from the session's own header by
`pisession.placed_names`, which refuses hostile fields (`..`, separators, NUL, ids outside
Pi's rule, names over 255 bytes).  Never the agent dir's root: Pi moves `*.jsonl` files found
there.  The header goes first: pi 1.5.2 finds it past blank or malformed lines, pi 0.73.1
only on the first line (and `pi -c` within its first 512 bytes).

The bytes go to a hidden temp file in the target directory, are fsynced, then published
with `link()` (which, unlike `rename()`, never replaces a file that appeared meanwhile), and
the directory is fsynced: Pi sees no file or the whole file.

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

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from p2pnode.errors import Conflict
from p2pnode.library.manifest import PlacedFile, PlacedFiles
from p2pnode.pi.hashing import hash_file, hash_prefix, new_hasher
from p2pnode.pi.session import HostileHeader, header_index, parse_header, placed_names
from sysio.files import fsync_dir
from sysio.flush import flush_data

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


def _write_temp(directory: Path, src_hex: str, data: bytes) -> Path:
    """The bytes, durably, in a hidden temp file beside the target (Pi only lists *.jsonl;
    a short name: the target's own may already use all 255 bytes)."""
    tmp = directory / f".p2pnode-{src_hex[:16]}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, SESSION_FILE_MODE)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        flush_data(fd)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    return tmp


def pi_readable(data: bytes) -> bytes:
    """The session with its header as the first line, as every Pi version reads it (the
    blank or malformed lines pi 1.5.2 skipped before it follow it instead)."""
    lines = data.splitlines(keepends=True)
    first = header_index(lines, "fetched session")
    if first == 0:
        return data
    header = lines[first] if lines[first].endswith(b"\n") else lines[first] + b"\n"
    return header + b"".join(lines[:first] + lines[first + 1:])


def session_path(agent_dir: Path, data: bytes, session_dir: Path | None = None) -> Path:
    """Where Pi would keep this session; HostileHeader if the header would lead elsewhere."""
    end = data.find(b"\n")
    header = parse_header(data if end < 0 else data[:end], "fetched session")
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
    in `placed` what was written there."""
    readable = pi_readable(data)
    placed_hex = src_hex if readable is data else hash_bytes(readable)
    data = readable
    (session_dir or agent_dir / "sessions").mkdir(parents=True, exist_ok=True)
    target = session_path(agent_dir, data, session_dir)
    target.parent.mkdir(exist_ok=True)
    target = session_path(agent_dir, data, session_dir)  # re-check now that the directory exists
    if os.path.lexists(target):  # a dangling symlink too: never followed, never replaced
        return _existing(target, data, src_hex, placed_hex, placed)
    tmp = _write_temp(target.parent, src_hex, data)
    try:
        os.link(tmp, target)
    except FileExistsError:
        return _existing(target, data, src_hex, placed_hex, placed)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(target.parent)
    if placed is not None:
        placed.record(target, PlacedFile(len(data), placed_hex))
    return Placement(target, written=True)


def _existing(target: Path, data: bytes, src_hex: str, placed_hex: str,
              placed: PlacedFiles | None) -> Placement:
    before = os.lstat(target)
    if not stat.S_ISREG(before.st_mode):
        kind = "a symlink" if stat.S_ISLNK(before.st_mode) else "a directory" if stat.S_ISDIR(
            before.st_mode) else "a special file"
        raise PlacementConflict(target, src_hex, f"as {kind}, not a regular file")
    theirs = hash_file(target)
    if theirs == placed_hex or (not data.endswith(b"\n") and theirs == hash_bytes(data + b"\n")):
        return Placement(target, written=False)  # the same version (pi 1.5.2 may have added a final \n)
    record = placed.get(target) if placed is not None else None
    as_placed = record == PlacedFile(before.st_size, theirs)
    newline_added = not as_placed and record is not None and record.size == before.st_size - 1 and (
        record == PlacedFile(before.st_size - 1, hash_prefix(target, before.st_size - 1)))
    if not (as_placed or newline_added):
        raise PlacementConflict(target, src_hex, f"with different content (blake3 {theirs}) that no fetch "
                                                 "placed: it is this node's user's own file")
    if not (before.st_size < len(data) and _is_prefix(target, data, newline_added=newline_added)):
        raise PlacementConflict(target, src_hex, f"as a version a fetch placed (blake3 {theirs}) that the "
                                                 "fetched bytes do not extend")
    assert placed is not None
    tmp = _write_temp(target.parent, src_hex, data)
    after = os.lstat(target)
    if _stamp(after) != _stamp(before):
        tmp.unlink()
        raise PlacementConflict(target, src_hex, "and changed while being replaced")
    os.replace(tmp, target)
    fsync_dir(target.parent)
    placed.record(target, PlacedFile(len(data), placed_hex))
    return Placement(target, written=True, replaced=theirs)


def hash_bytes(data: bytes) -> str:
    return new_hasher().update(data).hexdigest()


def _stamp(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_size, st.st_mtime_ns, st.st_ino)


def _is_prefix(path: Path, data: bytes, *, newline_added: bool = False) -> bool:
    """Whether the file is a prefix of `data`; `newline_added`: the file but its last byte, a
    newline (pi 1.5.2 closed an incomplete last line)."""
    with open(path, "rb") as f:
        mine = f.read(len(data) + 1)
    if newline_added:
        return mine.endswith(b"\n") and data.startswith(mine[:-1])
    return data.startswith(mine)
