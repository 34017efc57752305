"""Mark-and-sweep GC: which blobs are live, and the gate that holds every other store call off
while GC runs.  The sweep (copy live blobs into a new pack and swap it in crash-safely) is
BlobPack.compact; Store.gc runs both behind the gate."""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from store.layout import PATCH_REPLACE
from store.types import NO_TURN, ContextHead, Patch, Turn


def mark(heads: Iterable[ContextHead], read_turn: Callable[[int], Turn], turn_count: int,
         patches: Iterable[Patch], pinned: Iterable[bytes]) -> set[bytes]:
    """Payload hashes of every turn reachable from a head, every patch's new payload and
    every pinned (put but not yet referenced) blob.  Shared history is walked once."""
    live: set[bytes] = set(pinned)
    seen = bytearray(turn_count + 1)
    for head in heads:
        tid = head.head_turn_id
        while tid != NO_TURN and not seen[tid]:
            seen[tid] = 1
            t = read_turn(tid)
            live.add(t.payload_hash)
            tid = t.parent_turn_id
    live.update(p.new_payload_hash for p in patches if p.flags == PATCH_REPLACE)
    return live


class Gate:
    """Many holders in shared mode, or GC alone.  A waiting GC blocks new shared holders."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._shared = 0
        self._exclusive = False
        self._waiting = 0

    def shared(self) -> Gate:
        """`with gate.shared():` (the gate is its own context manager for the shared mode)."""
        return self

    def __enter__(self) -> None:
        with self._cond:
            while self._exclusive or self._waiting:
                self._cond.wait()
            self._shared += 1

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._shared -= 1
            if not self._shared and self._waiting:
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            while self._exclusive or self._shared:
                self._cond.wait()
            self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()
