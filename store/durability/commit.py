"""Durability: group commit (one fdatasync for many concurrent writers).

Writers write their records (no sync), take a ticket, then wait.  The first waiter becomes
the leader: it runs `sync()` once for every ticket issued so far and wakes the others, who
find their ticket covered.  Writers that arrive during a sync form the next group.  A leader
first waits (at most max_delay) for writers that are between `writing()` and their ticket:
with many concurrent writers one sync then covers them all; a lone writer never waits.

A failed sync fails closed: it fails every ticket not yet synced (the ones it covered and
any issued since, whose bytes sit in the same pages) and every later wait, until the store
is reopened.  Retrying the sync would be wrong: after a failed fsync the kernel may have
dropped the dirty pages and report success the next time ("fsyncgate").
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

from sysio.flush import write_at


class GroupCommit:
    def __init__(self, sync: Callable[[], None], durable: bool,
                 failure: Callable[[BaseException], BaseException], max_delay: float = 0.001) -> None:
        """failure(cause): the exception each failed writer raises (a new one per writer)."""
        self._sync = sync
        self._failure = failure
        self._failed: BaseException | None = None
        self._durable = durable
        self._max_delay = max_delay
        self._pending = 0  # writers inside writing()
        self._cond = threading.Condition(threading.Lock())
        self._written = 0  # last ticket issued
        self._written_turn = 0  # highest turn id among issued tickets
        self._synced = 0
        self._synced_turn = 0
        self._leader = False

    def writing(self) -> GroupCommit:
        """`with commit.writing():` around the work between starting an append and its ticket."""
        return self

    def __enter__(self) -> None:
        with self._cond:
            self._pending += 1

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._pending -= 1
            if not self._pending and self._leader:
                self._cond.notify_all()

    @property
    def writers(self) -> int:
        """Writers inside writing() now (a hint: read without the lock)."""
        return self._pending

    def note_write(self, turn_id: int = 0) -> int:
        """Call right after a write (under the caller's write lock): the ticket that covers it."""
        with self._cond:
            self._written += 1
            if turn_id > self._written_turn:
                self._written_turn = turn_id
            return self._written

    @property
    def durable_turn_id(self) -> int:
        """Every turn up to this id is durable (in non-durable mode: written)."""
        return self._synced_turn

    def set_durable_turn_id(self, turn_id: int) -> None:
        """After recovery: what is on disk already counts as synced."""
        with self._cond:
            self._written_turn = max(self._written_turn, turn_id)
            self._synced_turn = max(self._synced_turn, turn_id)

    def fail(self, cause: BaseException) -> None:
        """Something else failed a write (a checkpoint, GC): no unsynced ticket is ever good."""
        with self._cond:
            if self._failed is None:
                self._failed = cause
            self._cond.notify_all()

    def wait(self, ticket: int) -> None:
        """Return once ticket is durable.  After a failed sync, every unsynced ticket raises."""
        with self._cond:
            while self._synced < ticket:
                if self._failed is not None:
                    raise self._failure(self._failed) from self._failed
                if self._leader:
                    self._cond.wait()
                    continue
                self._leader = True
                if self._durable and self._pending:
                    deadline = time.monotonic() + self._max_delay
                    while self._pending and (left := deadline - time.monotonic()) > 0:
                        self._cond.wait(left)
                target, target_turn = self._written, self._written_turn
                self._cond.release()
                error: BaseException | None = None
                try:
                    if self._durable:
                        self._sync()
                except BaseException as exc:  # noqa: BLE001 - handed to every waiter below
                    error = exc
                finally:
                    self._cond.acquire()
                    self._leader = False
                if error is not None:
                    if self._failed is None:
                        self._failed = error
                    self._cond.notify_all()
                    raise self._failure(error) from error
                self._synced = target
                self._synced_turn = max(self._synced_turn, target_turn)
                self._cond.notify_all()


ZERO_CHUNK = bytes(1 << 20)


def zero_extend(fd: int, size: int, new_size: int) -> None:
    """Write zeros from size to new_size.  Later fdatasyncs inside that region skip the
    metadata update that growing a file costs (docs/BENCHMARKS.md, design measurements)."""
    while size < new_size:
        n = min(len(ZERO_CHUNK), new_size - size)
        write_at(fd, ZERO_CHUNK[:n], size)
        size += n
