"""The running node's upkeep of what it shares: the `gc` and `rm` control endpoints, GC in the
background when garbage passes library/space.py's threshold, and the mDNS re-announce when
what is offered shrinks (unshare, expiry, rm: peers following the catalog see its generation
move).

Control endpoints (POST, JSON; see daemon.py; with "stream": true, NDJSON: node/answers.py, as
the CLI asks: a GC of a big store, or one waiting for a share, takes longer than one reply's 30 s):
    /v1/gc {}                  -> GCReport.as_dict()   (skipped while a fetch holds a lease)
    /v1/rm {"target"}          -> {"removed": [BranchInfo.as_dict()...], "unfollowed": [key...],
                                   "live_stopped": [path...], "gc": GCReport.as_dict()}
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from p2pnode.errors import InvalidInput, P2PNodeError
from p2pnode.library import space
from p2pnode.library.api import Library
from p2pnode.node.answers import streamed
from store.errors import StoreError

if TYPE_CHECKING:
    from p2pnode.node.daemon import Node

log = logging.getLogger("p2pnode.node")

Route = Callable[[dict[str, Any]], Awaitable[Any]]


def routes(node: Node) -> dict[str, Route]:
    async def gc(body: dict[str, Any]) -> Any:
        return await _answer(body, lambda: node.lib.gc().as_dict())

    async def rm(body: dict[str, Any]) -> Any:
        target = body.get("target")
        if not isinstance(target, str) or not target:
            raise InvalidInput("control: 'target' must be a branch hash, prefix or session id")
        loop = asyncio.get_running_loop()

        def unfollow(branches: list[str]) -> list[str]:  # from rm's thread: the follows run on the loop
            return asyncio.run_coroutine_threadsafe(node.follows.stop_holding(branches), loop).result()

        def unlive(branches: list[str]) -> list[str]:  # so do the live shares
            return asyncio.run_coroutine_threadsafe(node.live.stop_offering(branches), loop).result()

        return await _answer(body, lambda: remove_and_collect(node.lib, target, unfollow, unlive))

    return {"gc": gc, "rm": rm}


async def _answer(body: dict[str, Any], work: Callable[[], dict[str, Any]]) -> Any:
    """work()'s answer: one reply, or NDJSON events if the command asked for a stream."""
    if body.get("stream") is not True:
        return await asyncio.to_thread(work)
    return streamed(work, _as_is)


async def _as_is(result: dict[str, Any]) -> dict[str, Any]:
    return result


def remove_and_collect(lib: Library, target: str, unfollow: Callable[[list[str]], list[str]],
                       unlive: Callable[[list[str]], list[str]]) -> dict[str, Any]:
    """`p2pnode rm`: end the follows of what goes (`unfollow(branches)`, the keys of those
    ended: node/follow.py) and its live shares (`unlive(branches)`, their paths: node/live.py),
    forget the target, then run GC for its bytes (skipped during a fetch: the background GC
    gets them later)."""
    gone = lib.removal(target)
    unfollowed, stopped = unfollow(gone), unlive(gone)
    removed = lib.remove(target)
    return {"removed": [i.as_dict() for i in removed], "unfollowed": unfollowed, "live_stopped": stopped,
            "gc": lib.gc().as_dict()}


def announce_on_change(node: Node) -> None:
    """Re-announce the catalog (its new generation) whenever what is offered may have shrunk."""
    loop = asyncio.get_running_loop()

    def changed() -> None:
        if not loop.is_closed():  # a GC thread may finish after the node stopped
            loop.call_soon_threadsafe(node.announce_soon)

    node.lib.add_listener(changed)


WARM_MANIFESTS = 16
"""Offered versions, newest first, whose line manifests the node builds as it starts."""


def warm_manifests(lib: Library, srcs: Sequence[str] | None = None) -> None:
    """Build the line manifests of these versions (None: the WARM_MANIFESTS newest offered) before
    a peer asks; the library caches them.  One is made from the turn records and the blob index,
    a few µs a line, and the first request for a session of 500,000 lines took longer than a
    fetcher waits for progress (5 s: exit 6, where its second try, from the cache, worked)."""
    if srcs is None:
        srcs = [b.src for b in lib.branches()[:WARM_MANIFESTS]]
    for src in srcs:
        try:
            lib.line_manifest(src)
        except (P2PNodeError, StoreError) as exc:  # the request that needs it will say why
            log.debug("line manifest of %s not built ahead: %s", src[:16], exc)


async def background_gc(lib: Library, serving: Callable[[float], bool] = lambda quiet: False,
                        every: float = space.GC_CHECK_SECONDS, quiet: float = space.GC_QUIET_SECONDS) -> None:
    """Estimate the garbage every `every` seconds and collect it past the threshold; never
    while a fetch holds a transfer lease (Library.gc skips then), nor while peers are being
    served (`serving(quiet)`: served within the last `quiet` seconds), looking again after
    `quiet` seconds then."""
    wait = every
    while True:
        await asyncio.sleep(wait)
        wait = every
        try:
            sizes = await asyncio.to_thread(lib.space)
            reclaimable = sizes["reclaimable_bytes"]
            if reclaimable is None or not space.worth_collecting(reclaimable, sizes["store_bytes"]):
                continue  # nothing worth it, or a damaged store (`status` says so; gc would refuse)
            if serving(quiet):
                log.debug("background gc: put off while peers are served")
                wait = min(every, quiet)
                continue
            report = await asyncio.to_thread(lib.gc)
            log.info("background gc: %s", report.skipped or f"freed {report.bytes_freed} bytes")
        except Exception:  # the node keeps serving; the next round tries again
            log.exception("background gc failed")
