"""Exceptions raised by the store.  Each says what was wrong and with which object."""
from __future__ import annotations

import errno as errno_mod


class StoreError(Exception):
    """Base class of every store error."""


class StoreClosed(StoreError):
    def __init__(self) -> None:
        super().__init__("the store is closed")


class StoreLocked(StoreError):
    def __init__(self, path: str) -> None:
        super().__init__(f"store {path} is locked by another process")
        self.path = path


class StoreNeedsWrite(StoreError):
    """A read-only open (StoreConfig.read_only) found that the store must be written before it
    can be read (recovery after a crash, a store not made yet), or a write was asked of it."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"store {path} {why}")
        self.path = path
        self.why = why


class UnknownContext(StoreError):
    def __init__(self, context_id: int) -> None:
        super().__init__(f"unknown context {context_id}")
        self.context_id = context_id


class UnknownTurn(StoreError):
    def __init__(self, turn_id: int) -> None:
        super().__init__(f"unknown turn {turn_id}")
        self.turn_id = turn_id


class UnknownBlob(StoreError):
    def __init__(self, blob_hash: bytes) -> None:
        super().__init__(f"unknown blob {blob_hash.hex()}")
        self.blob_hash = blob_hash


class ParentConflict(StoreError):
    """An append named an expected parent that is not the context's head."""

    def __init__(self, context_id: int, expected: int, actual: int) -> None:
        super().__init__(
            f"context {context_id}: expected parent turn {expected}, but the head is turn {actual}"
        )
        self.context_id = context_id
        self.expected = expected
        self.actual = actual


class PayloadTooLarge(StoreError):
    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"payload of {size} bytes exceeds the limit of {limit} bytes")
        self.size = size
        self.limit = limit


class CorruptRecord(StoreError):
    """A record failed its CRC or hash check; the bytes are never returned as good data."""

    def __init__(self, file: str, offset: int, reason: str) -> None:
        super().__init__(f"{file} at offset {offset}: {reason}")
        self.file = file
        self.offset = offset
        self.reason = reason


class DamagedPayload(CorruptRecord):
    """A turn's payload blob is damaged (its record failed its CRC, decoding or BLAKE3) or lost
    (nowhere, though a live head reaches the turn or the head WAL covers it).  The turn itself is
    kept and readable; its payload is never returned.  fsck and damage.log report it."""

    def __init__(self, turn_id: int, blob_hash: bytes, reason: str, file: str = "blobs.pack",
                 offset: int = -1) -> None:
        super().__init__(file, offset, reason)
        self.args = (f"turn {turn_id}: payload blob {blob_hash.hex()} is damaged: {reason}",)
        self.turn_id = turn_id
        self.blob_hash = blob_hash


class TurnNotInContext(StoreError):
    """A cursor or turn named for a context is not on that context's chain."""

    def __init__(self, context_id: int, turn_id: int) -> None:
        super().__init__(f"turn {turn_id} is not on the chain of context {context_id}")
        self.context_id = context_id
        self.turn_id = turn_id


class BlobMismatch(StoreError):
    """A blob handed over in stored form is not what its hash says."""

    def __init__(self, blob_hash: bytes, reason: str) -> None:
        super().__init__(f"blob {blob_hash.hex()} rejected: {reason}")
        self.blob_hash = blob_hash
        self.reason = reason


class StoreFailed(StoreError):
    """A write or flush of the store's files failed (EIO, ENOSPC, ...).  The store refuses
    every later write until it is closed and reopened: after a failed flush the kernel may
    have dropped the dirty pages, so nothing written since the last good flush is trusted
    (fail closed).  No write the failure covered was acknowledged."""

    def __init__(self, path: str, reason: str, errno: int = 0) -> None:
        super().__init__(f"store {path} failed ({reason}): no writes until it is reopened")
        self.path = path
        self.reason = reason
        self.errno = errno

    @staticmethod
    def of(path: str, cause: BaseException) -> StoreFailed:
        """The error for `cause`: StoreFull when the disk was full.  `path` is the store's;
        the file the cause names, when it names one, is more precise."""
        reason = getattr(cause, "strerror", None) or str(cause) or type(cause).__name__
        named = getattr(cause, "filename", None)
        return StoreFailed.make(str(named) if named else path, reason, getattr(cause, "errno", None) or 0)

    @staticmethod
    def make(path: str, reason: str, errno: int) -> StoreFailed:
        return (StoreFull if errno == errno_mod.ENOSPC else StoreFailed)(path, reason, errno)


class StoreFull(StoreFailed):
    """The disk was full (ENOSPC) during a write: the store failed as for any write error."""
