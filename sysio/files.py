"""Crash-safe whole-file writes, private files and directories.

Every small state file of the store and of the node goes through `atomic_write`: a reader
sees the old file or the new one, never a torn one, because the bytes go to a temp file in
the same directory that is fsynced and renamed over the target, then the directory fsynced.

Every file the store creates is 0600 and its directory 0700, whatever the umask and whatever
was there before: `open_private` and `private_dir` set the mode explicitly (a umask can only
narrow what os.open asks for, and an existing file keeps its old mode).
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
from pathlib import Path
from typing import BinaryIO

from sysio.flush import flush_data, flush_dir

log = logging.getLogger(__name__)

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

TMP_SUFFIX = ".tmp"
FILE_MODE = 0o600
DIR_MODE = 0o700


def fsync_dir(path: Path) -> None:
    """The directory's names, durably (see sysio.flush.flush_dir)."""
    flush_dir(path)


def private_dir(path: Path) -> None:
    """Create `path` (and parents) if missing (0700, files 0600), and take group's and
    others' bits off it and the files in it if they existed wider (a store made under another
    umask or by an older version); the owner's bits stay as they are (a file the user made
    read-only is not made writable).  What cannot be tightened (another user's file) is logged,
    not fatal: the node's `status` names it, and a store that can still be used keeps working."""
    path.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    _tighten(path, os.stat(path).st_mode)
    with os.scandir(path) as entries:
        for e in entries:
            try:  # another process holding the store may rename a temp file away meanwhile
                if e.is_file(follow_symlinks=False):
                    _tighten(Path(e.path), e.stat(follow_symlinks=False).st_mode)
            except FileNotFoundError:
                continue


def _tighten(path: Path, mode: int) -> None:
    if not mode & 0o077:
        return
    try:
        os.chmod(path, stat.S_IMODE(mode) & 0o700)
    except PermissionError as exc:
        log.warning("cannot make %s private (mode %04o): %s", path, stat.S_IMODE(mode), exc.strerror)


def open_private(path: Path, flags: int) -> int:
    """os.open for a store file: created 0600, and an existing file opened for writing loses
    group's and others' bits (a read-only open changes nothing: fsck may run as another user)."""
    fd = os.open(path, flags, FILE_MODE)
    try:
        if flags & (os.O_WRONLY | os.O_RDWR) and (mode := os.fstat(fd).st_mode) & 0o077:
            os.fchmod(fd, stat.S_IMODE(mode) & 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(path: Path) -> BinaryIO | None:
    """`path` opened for reading if it is a regular file, else None: a FIFO is opened without
    waiting for a writer (a plain open would block until one comes, forever if none does), a
    socket cannot be opened at all (ENXIO, EOPNOTSUPP)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno in (errno.ENXIO, errno.EOPNOTSUPP):
            return None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def atomic_write(path: Path, data: bytes, *, mode: int = 0o600, durable: bool = True) -> None:
    """durable=False skips the fsyncs (for caches: a power loss may then leave the old file or
    an empty one, never a torn one on file systems that order rename after data).  The temp
    name carries the pid and a random part, so two writers of the same file (processes, or
    threads of one) never share a temp file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        try:
            os.fchmod(fd, mode)  # the umask does not decide the mode
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if durable:
                flush_data(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:  # a full disk, EIO: no temp file left behind
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if durable:
        fsync_dir(path.parent)
