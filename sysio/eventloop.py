"""The event loop that the store service, its blocking client, the node and a one-shot fetch
run on.

uvloop when it is installed (a dependency wherever it builds): its Unix socket transport
answers a round trip in about half the time of asyncio's own (docs/BENCHMARKS.md) and
writes a reply of many pieces with one writev; its TLS transport is not Python code (a
256 MB one-shot fetch: ~6 % less CPU than on asyncio's loop).  `P2PNODE_EVENT_LOOP=asyncio` picks
asyncio's loop instead, for debugging or where uvloop misbehaves.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    if os.environ.get("P2PNODE_EVENT_LOOP", "uvloop") != "asyncio":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop
    return asyncio.new_event_loop


def loop_name() -> str:
    """Which loop `run` uses, for logs and benchmark reports."""
    return "asyncio" if loop_factory() is asyncio.new_event_loop else "uvloop"


def new_event_loop() -> asyncio.AbstractEventLoop:
    return loop_factory()()


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on the chosen loop."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)
