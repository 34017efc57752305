"""Control answers that take a while (`share`, `gc`, `rm` through the running node): the work on
a thread, answered as NDJSON events while it runs, so that the command's timeout bounds the
silence between events, not the work.  As one silent reply, a share of a big session, or a `gc`
waiting for one, failed in the command after its 30 s while the node went on.

    {"event": "progress", ...}   every EVENT_INTERVAL while the work runs (its progress, if any)
    {"event": "result", "result": {...}}   or   {"event": "error", "message", "exit_code"}

A command that goes away does not stop the work (a thread cannot be): it is told when it ends.
Also the mapping of a failure to the CLI's message and exit code, for one reply and for events.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

from p2pnode.errors import CALLERS_PATH_ERRNOS, InvalidInput, P2PNodeError, from_store
from p2pnode.node.transfers import EVENT_INTERVAL

log = logging.getLogger("p2pnode.node")
T = TypeVar("T")

def callers_path_error(exc: OSError) -> InvalidInput | None:
    """A path the caller named that the system refuses (CALLERS_PATH_ERRNOS): answered 400
    with exit 4 and the path, as the CLI reports it without a node (the node runs as the same
    user)."""
    if exc.errno not in CALLERS_PATH_ERRNOS:
        return None
    names = " -> ".join(str(n) for n in (exc.filename, exc.filename2) if n is not None)
    return InvalidInput(f"{(exc.strerror or 'system error').lower()}: {names[:300] or '(no file named)'}")


def known_error(exc: BaseException) -> P2PNodeError | None:
    """What a failure the node can name means for the command that asked (no traceback): a
    path the caller named, the store refusing writes after a failed write (a full disk), a
    damaged record."""
    if isinstance(exc, P2PNodeError):
        return exc
    if (known := from_store(exc, "the node's store", "restart the node (`p2pnode serve`): it refuses "
                            "writes until then")) is not None:
        return known
    return callers_path_error(exc) if isinstance(exc, OSError) else None


def error_event(exc: Exception) -> dict[str, Any]:
    """A failure after an NDJSON answer began, as its last event: the message and exit code a
    one-reply answer gives (daemon._errors_as_json)."""
    error = known_error(exc)
    if error is not None:
        return {"event": "error", "message": str(error), "exit_code": error.exit_code}
    log.error("control request failed", exc_info=exc)
    return {"event": "error", "exit_code": 1,
            "message": f"the node failed: {exc or 'no details'} (its log has the traceback)"}


def streamed(work: Callable[[], T], answer: Callable[[T], Awaitable[dict[str, Any]]],
             progress: Callable[[], dict[str, Any]] = dict,
             unattended: Callable[[T], None] | None = None) -> AsyncGenerator[dict[str, Any], None]:
    """`work()` on a thread, answered as events: `progress()`'s fields every EVENT_INTERVAL, then
    `answer(result)` or the error.  Started at once; if the command goes away first, the work
    goes on and `unattended(result)` is called when it ends (a failure is logged)."""
    task = asyncio.ensure_future(asyncio.to_thread(work))
    gone = False

    def ended(done: asyncio.Future[T]) -> None:
        if done.cancelled():
            return
        exc = done.exception()  # retrieved in any case (no "never retrieved" at exit)
        if not gone:
            return
        if exc is not None:
            log.warning("control work whose command went away failed: %s", exc)
        elif unattended is not None:
            unattended(done.result())

    task.add_done_callback(ended)

    async def events() -> AsyncGenerator[dict[str, Any], None]:
        nonlocal gone
        try:
            while not (await asyncio.wait([task], timeout=EVENT_INTERVAL))[0]:
                yield dict(progress(), event="progress")
            try:
                result = task.result()
            except Exception as exc:
                yield error_event(exc)
                return
            yield {"event": "result", "result": await answer(result)}
        finally:
            gone = not task.done()

    return events()
