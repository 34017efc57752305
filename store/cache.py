"""LRU caches of turn records (by count) and decoded blobs (by bytes).  Thread-safe."""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRU(Generic[K, V]):
    """Evicts least recently used entries once the summed `weigh(value)` exceeds capacity."""

    def __init__(self, capacity: int, weigh: Callable[[V], int] = lambda _v: 1) -> None:
        self.capacity = capacity
        self._weigh = weigh
        self._data: OrderedDict[K, V] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            value = self._data.get(key)
            if value is not None:
                self._data.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._put(key, value)

    def put_many(self, items: Iterable[tuple[K, V]]) -> None:
        """put of each, the lock taken once (a batch of thousands of new turns)."""
        with self._lock:
            for key, value in items:
                self._put(key, value)

    def _put(self, key: K, value: V) -> None:
        w = self._weigh(value)
        if w > self.capacity:
            return
        old = self._data.pop(key, None)
        if old is not None:
            self._size -= self._weigh(old)
        self._data[key] = value
        self._size += w
        while self._size > self.capacity:
            _, evicted = self._data.popitem(last=False)
            self._size -= self._weigh(evicted)

    def discard_if(self, pred: Callable[[K], bool]) -> None:
        with self._lock:
            for key in [k for k in self._data if pred(k)]:
                self._size -= self._weigh(self._data.pop(key))
