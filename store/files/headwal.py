"""The head WAL (`heads.wal.<generation>`): every head change is one record, appended to a
pre-zeroed file.

A new turn's record carries the whole TurnRecordV1 and, when the turn brought a new blob of
at most EMBED_MAX bytes, a copy of its BlobRecord.  So a commit fdatasyncs the WAL alone (the
pack only for big blobs); turns.log and blobs.pack are synced at checkpoints and repaired
from the WAL on open (store/recovery.py).  The file is zero-filled ahead of time so that a
commit's fdatasync has no file size to update.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from store.durability.commit import zero_extend
from store.layout import (
    WalRecord,
    scan_wal,
)
from store.types import RecoveryNotes
from sysio.files import open_private
from sysio.flush import disk_full, flush_data, write_at

WAL_BYTES = 1 << 20  # one pre-zeroed WAL generation; a full WAL triggers a checkpoint
EMBED_MAX = 64 << 10  # blob records up to this size travel in the WAL record
NEXT = "heads.wal-next"  # the next generation, zero-filled ahead of time
_WAL_RE = re.compile(r"^heads\.wal\.(\d{8})$")


def wal_name(gen: int) -> str:
    return f"heads.wal.{gen:08d}"


def is_wal_file(name: str) -> bool:
    """A head WAL generation or the next one made ahead: fixed-size journal files that
    checkpoints create and remove (their number changes with them, not with the data)."""
    return name == NEXT or _WAL_RE.match(name) is not None


def wal_generations(root: Path) -> list[int]:
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _WAL_RE.match(p.name)))


def prepare_next(root: Path) -> int:
    """Zero-fill and sync the next WAL generation under a temporary name, off the append path
    (see HeadWal); returns its file descriptor.  A leftover from a crash is never read."""
    fd = open_private(root / NEXT, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        zero_extend(fd, 0, WAL_BYTES)
        flush_data(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclass
class WalScan:
    records: list[WalRecord] = field(default_factory=list)
    end: int = 0
    """Where valid records stop: the next record goes here."""
    damaged: bool = False
    """A damaged region with valid records after it was skipped."""


def read_wal(path: Path, problems: RecoveryNotes) -> WalScan:
    """Valid records in order.  A damaged region with valid records after it is reported and
    skipped; anything but zeros after the last valid record is a torn tail."""
    data = path.read_bytes()
    records, damaged, end = scan_wal(data, path.name)
    for off in damaged:
        problems.add(f"{path.name} at offset {off}: damaged head WAL record skipped", damage=True)
    for off, r in records:
        if r.damaged_copy and r.turn is not None:
            tid = r.turn.turn_id
            problems.add(f"{path.name} at offset {off}: the blob copy of turn {tid} failed its CRC",
                         damage=True)
    if data[end:].count(b"\0") != len(data) - end:
        problems.append(f"{path.name}: torn record at offset {end} dropped")
    return WalScan([r for _, r in records], end, bool(damaged))


class HeadWal:
    """The WAL generation being written: records back to back in a pre-zeroed file.

    prepared: the fd of a prepare_next() file, renamed to this generation's name (unless
    that exists).  The rename is made durable by the first commit's sync (name_durable).
    at_open: the store is being opened, and a full disk leaves the WAL unextended (reads go
    on; the first append meets the full disk) instead of failing the open.
    read_only: opened for reading only, neither made nor zero-filled (a read-only store)."""

    def __init__(self, root: Path, gen: int, durable: bool, prepared: int | None = None,
                 at_open: bool = False, read_only: bool = False) -> None:
        self.gen = gen
        self.path = root / wal_name(gen)
        self.name_durable = True
        self.reach = 0
        """How far writes may have reached: pos, or beyond it after a failed write."""
        if prepared is not None and not self.path.exists():
            os.rename(root / NEXT, self.path)
            self._fd, self.pos, self.name_durable = prepared, 0, False
            return
        if prepared is not None:
            os.close(prepared)
        if read_only:
            self._fd = os.open(self.path, os.O_RDONLY)
            self.pos = read_wal(self.path, RecoveryNotes()).end
            return
        made = not self.path.exists()
        self._fd = open_private(self.path, os.O_RDWR | os.O_CREAT)
        try:
            self.pos = read_wal(self.path, RecoveryNotes()).end
            size = os.fstat(self._fd).st_size
            if durable and size < WAL_BYTES:
                try:
                    zero_extend(self._fd, size, WAL_BYTES)
                except OSError as exc:  # `at_open`, a full disk: the store opens, reads go on, and
                    if not at_open or not disk_full(exc):  # appends grow the file (and meet the
                        raise  # full disk: the failed state)
                    os.ftruncate(self._fd, size)
        except BaseException:
            os.close(self._fd)
            if made:  # a new generation that could not be zero-filled gives its room back
                self.path.unlink(missing_ok=True)
            raise

    def has_room(self, n: int) -> bool:
        """A record of n bytes fits (an empty WAL takes any record; it grows past WAL_BYTES)."""
        return self.pos == 0 or self.pos + n <= WAL_BYTES

    def append(self, rec: bytes) -> None:
        self.reach = max(self.reach, self.pos + len(rec))  # a failed write may have written part
        write_at(self._fd, rec, self.pos)
        self.pos += len(rec)

    def sync(self) -> None:
        flush_data(self._fd)

    def erase_from(self, pos: int) -> None:
        """Zero the records from pos on, as far as any write reached, and flush (the rollback
        of a failed store's unflushed records: replay stops at the first zero)."""
        zero_extend(self._fd, pos, self.reach)
        flush_data(self._fd)
        self.pos = self.reach = pos

    def close(self, trim: bool = True) -> None:
        if trim and self.pos == 0:  # an empty generation gives its zeros back; opening zero-fills it again
            os.ftruncate(self._fd, 0)
        os.close(self._fd)
