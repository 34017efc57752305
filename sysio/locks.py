"""Inter-process locks: one writer per store, one read-modify-write per node state file.

Locks are `flock` (Linux, macOS, the BSDs).  Windows has no `fcntl`: it is not supported (see
docs/ARCHITECTURE.md), and taking a lock there raises `LockUnsupported` rather than running
a store that two processes could open at once.
"""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

from sysio.files import open_private

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]


class LockUnsupported(OSError):
    def __init__(self, path: Path) -> None:
        super().__init__(f"cannot lock {path}: this platform has no flock (Windows is not supported)")


@contextlib.contextmanager
def _flocked(lock_path: Path, operation: int) -> Iterator[bool]:
    """`flock(operation)` on `lock_path` (created if missing) for the block: True when taken,
    False when a non-blocking one was refused.  Closing the fd releases the lock."""
    if fcntl is None:
        raise LockUnsupported(lock_path)
    fd = open_private(lock_path, os.O_RDWR | os.O_CREAT)
    try:
        try:
            fcntl.flock(fd, operation)
        except BlockingIOError:
            yield False
        else:
            yield True
    finally:
        os.close(fd)


@contextlib.contextmanager
def locked(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive flock on `lock_path` (created if missing) for a read-modify-write."""
    with _flocked(lock_path, fcntl.LOCK_EX if fcntl else 0):
        yield


def lock_with_timeout(lock_path: Path, timeout: float, read_only: bool = False) -> int | None:
    """An fd holding an exclusive flock on `lock_path`, or None if another process kept it for
    `timeout` seconds.  Closing the fd releases the lock.  `read_only`: the file is opened for
    reading, not created (flock needs no write access: a reader where it may not write)."""
    if fcntl is None:
        raise LockUnsupported(lock_path)
    fd = os.open(lock_path, os.O_RDONLY) if read_only else open_private(lock_path, os.O_RDWR | os.O_CREAT)
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



@contextlib.contextmanager
def shared(lock_path: Path) -> Iterator[None]:
    """Hold a shared flock on `lock_path` (created if missing), waiting while another process
    holds it exclusively: many holders at once, none while `exclusive_if_free` has it."""
    with _flocked(lock_path, fcntl.LOCK_SH if fcntl else 0):
        yield


def exclusive_if_free(lock_path: Path) -> contextlib.AbstractContextManager[bool]:
    """True holding an exclusive flock on `lock_path`, or False at once when any process holds
    it (shared or not)."""
    return _flocked(lock_path, fcntl.LOCK_EX | fcntl.LOCK_NB if fcntl else 0)
