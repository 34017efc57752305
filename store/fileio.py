"""Crash-safe whole-file writes, directory fsyncs and inter-process locks.

Every small state file of the store and of the node goes through `atomic_write`: a reader
sees the old file or the new one, never a torn one, because the bytes go to a temp file in
the same directory that is fsynced and renamed over the target, then the directory fsynced.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

TMP_SUFFIX = ".tmp"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, *, mode: int = 0o600, durable: bool = True) -> None:
    """durable=False skips the fsyncs (for caches: a power loss may then leave the old file or
    an empty one, never a torn one on file systems that order rename after data).  The temp
    name carries the pid, so two processes writing the same file never share a temp file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)


@contextlib.contextmanager
def locked(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive flock on `lock_path` (created if missing) for a read-modify-write."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def lock_with_timeout(lock_path: Path, timeout: float) -> int | None:
    """An fd holding an exclusive flock on `lock_path`, or None if another process kept it for
    `timeout` seconds.  Closing the fd releases the lock."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                return None
            time.sleep(0.02)
