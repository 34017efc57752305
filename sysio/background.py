"""One call on a thread of its own, its result (or exception) taken later: work that releases
the GIL (hashing a file, an fdatasync) runs beside the caller's instead of before it."""
from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


def in_background(fn: Callable[[], T], name: str = "p2pnode-background") -> Future[T]:
    """fn() started on a daemon thread; its Future's result() waits for it and raises what it
    raised."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # handed to whoever takes the result
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
