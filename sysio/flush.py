"""The one place that asks the OS to make bytes durable, on every platform the store runs on.

- Linux (and other systems with `os.fdatasync`): fdatasync, which skips the inode's
  timestamps when the size did not change.
- macOS: CPython has no `os.fdatasync`, and `fsync` there only hands the data to the drive,
  whose cache may lose it on power loss; `fcntl(F_FULLFSYNC)` asks the drive to flush.  Some
  file systems (network and FUSE mounts) refuse F_FULLFSYNC: then plain fsync is the best
  there is.
- Otherwise: `os.fsync`.

Directory entries (a create, a rename) are made durable by fsyncing the directory where the
platform lets a directory be opened (POSIX).  Where it cannot be opened (Windows, which is
not supported: see docs/ARCHITECTURE.md) `flush_dir` does nothing: NTFS journals metadata.

Nothing else in store/ or p2pnode/ calls fsync or fdatasync, so a fault-injection test that
wraps these two functions (or the os calls beneath them) sees every flush.

`write_at` is how the store writes into its files: a disk that fills up in the middle of a
record makes pwrite return a short count, not an error; taken for a whole record, that once
lost an acknowledged blob (the pack record was torn, its WAL copy dropped by the checkpoint).
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no fcntl; fsync is the flush there
    fcntl = None  # type: ignore[assignment]


def disk_full(exc: BaseException) -> bool:
    """The write failed for want of room (a full file system, or the user's quota): the
    store's work that only saves time, not data, is then left for later."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def write_at(fd: int, data: bytes | memoryview, offset: int) -> None:
    """pwrite all of data at offset, or raise (ENOSPC when the file system takes no more)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view, offset = view[n:], offset + n


def flush_data(fd: int) -> None:
    """Make the file's data (and its size) durable: fdatasync, else F_FULLFSYNC or fsync."""
    fdatasync = getattr(os, "fdatasync", None)
    if fdatasync is not None:
        fdatasync(fd)
    else:
        flush_all(fd)


def flush_all(fd: int) -> None:
    """Make the file's data and metadata durable: F_FULLFSYNC where it exists, else fsync."""
    full = getattr(fcntl, "F_FULLFSYNC", None) if fcntl is not None else None
    if full is not None:
        try:
            fcntl.fcntl(fd, full)
            return
        except OSError:
            pass  # refused by this file system (ENOTSUP, EINVAL): plain fsync below
    os.fsync(fd)


_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


def flush_dir(path: Path) -> None:
    """Make the names in directory `path` durable (after a create, rename or unlink)."""
    if os.name == "nt":
        return  # a directory cannot be opened for fsync on Windows
    fd = os.open(path, os.O_RDONLY | _O_DIRECTORY)
    try:
        flush_all(fd)
    finally:
        os.close(fd)
