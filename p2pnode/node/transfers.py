"""The node's fetches as transfers the CLI can watch, cancel or leave running, and `browse`:
the control endpoints behind `p2pnode fetch` and `p2pnode browse` when a node runs.

    /v1/fetch {"branch", "peers", "pi"}                 -> FetchResult.as_dict() (one reply)
    /v1/fetch {..., "stream": true}                     -> NDJSON events, one per line:
        {"event": "started", "id", "branch"}, {"event": "progress", **TransferProgress},
        then {"event": "result", "result": FetchResult} or {"event": "error", "message", "exit_code"}
    /v1/fetch {..., "background": true}                 -> {"id", "branch", "background": true} at once
    /v1/cancel {"id"}                                   -> {"id", "state"}
    /v1/browse {"peers": ["[ID@]HOST:PORT"]}            -> {"branches": [...], "peers": [...]}

`branch` may be a unique hash prefix: it is resolved (peer/offers.py) against the catalogs of
the peers given, else of every trusted peer online, before the transfer starts, so that an
unknown or ambiguous one is an error at once, also with --background.  A Pi session id (or an
older version's hash) becomes its newest version inside the transfer (node/follow.py).

A transfer that a command waits for (stream or one reply) is cancelled when that command goes
away (its control connection closes, as on Ctrl-C) or asks /v1/cancel; a background one runs
until it ends or is cancelled.  Finished background transfers stay in `status` for
RECENT_SECONDS (at most MAX_RECENT of them), so that their outcome can be seen.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from p2pnode.errors import InvalidInput, NotFound, P2PNodeError, PeerUnavailable
from p2pnode.peer import offers
from p2pnode.peer.address import PeerAddress
from p2pnode.peer.identity import Identity
from p2pnode.peer.progress import ProgressMeter
from p2pnode.peer.trust import TrustStore

log = logging.getLogger(__name__)

RECENT_SECONDS = 60.0
MAX_RECENT = 8
EVENT_INTERVAL = 0.2
"""Seconds between progress events to a waiting command (a terminal bar needs no more than
five a second); the end is sent as soon as it comes."""

Route = Callable[[dict[str, Any]], Awaitable[Any]]


class FetchingNode(Protocol):
    """What transfers need from the node: who to ask, and its fetch."""

    identity: Identity
    trust: TrustStore

    def trusted_online(self) -> list[PeerAddress]: ...

    async def _c_fetch(self, body: dict[str, Any],
                       progress: ProgressMeter | None = None) -> dict[str, Any]: ...


@dataclass
class Transfer:
    id: str
    branch: str
    background: bool
    meter: ProgressMeter
    started: float = field(default_factory=time.time)
    state: str = "running"
    """running, done, conflict (fetched and stored, not placed: the result's `conflict` says
    why, as a waiting `fetch` exits 7), failed or cancelled."""
    result: dict[str, Any] | None = None
    error: P2PNodeError | None = None
    finished: float | None = None
    """time.monotonic() when it ended."""
    task: asyncio.Task[dict[str, Any]] | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    """Set at each progress report and at the end."""
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    def as_dict(self) -> dict[str, Any]:
        """As `status` lists it (branch, bytes_done, bytes_total, peers, as before, and more)."""
        result = self.result or {}
        return dict(self.meter.current.as_dict(), id=self.id, branch=self.branch, state=self.state,
                    background=self.background, started=self.started,
                    error=str(self.error) if self.error else None,
                    fetched=result.get("branch"), path=result.get("path"), conflict=result.get("conflict"))

    def event(self) -> dict[str, Any]:
        if self.result is not None:
            return {"event": "result", "result": self.result}
        if self.error is not None:
            return {"event": "error", "message": str(self.error), "exit_code": self.error.exit_code}
        return dict(self.meter.current.as_dict(), event="progress")


class Transfers:
    def __init__(self, node: FetchingNode) -> None:
        self.node = node
        self.running: dict[str, Transfer] = {}
        self._stopping = False

    def routes(self) -> dict[str, Route]:
        return {"fetch": self.fetch, "cancel": self.cancel, "browse": self.browse}

    def listed(self) -> list[dict[str, Any]]:
        """Running transfers, and background ones that ended within RECENT_SECONDS."""
        now = time.monotonic()
        ended = sorted((t for t in self.running.values() if t.finished is not None),
                       key=lambda t: t.finished or 0.0, reverse=True)
        for old in [t for t in ended if now - (t.finished or now) > RECENT_SECONDS] + ended[MAX_RECENT:]:
            self.running.pop(old.id, None)
        return [t.as_dict() for t in self.running.values()]

    async def fetch(self, body: dict[str, Any]) -> Any:
        transfer = await self._start(body)
        if transfer.background:
            return {"id": transfer.id, "branch": transfer.branch, "background": True}
        if body.get("stream") is True:
            return self._events(transfer)
        assert transfer.task is not None
        try:
            return await asyncio.shield(transfer.task)
        finally:
            self._end_attached(transfer)

    async def cancel(self, body: dict[str, Any]) -> dict[str, Any]:
        transfer = self.running.get(str(body.get("id")))
        if transfer is None:
            raise NotFound(f"no transfer {body.get('id')!r} on this node")
        if transfer.task is not None and not transfer.task.done():
            transfer.task.cancel()
            with contextlib.suppress(BaseException):
                await transfer.task
        return {"id": transfer.id, "state": transfer.state}

    async def browse(self, body: dict[str, Any]) -> dict[str, Any]:
        given = _peers(body)
        nodes = offers.by_node(given + [a for a in self.node.trusted_online() if a not in given])
        answers = await offers.ask_catalogs(nodes, self.node.identity, self.node.trust)
        return offers.offered_rows(answers, {p.node_id: p.name for p in self.node.trust.peers()})

    async def _start(self, body: dict[str, Any]) -> Transfer:
        _peers(body)  # checked before anything iterates it: InvalidInput (400), never a 500
        branch = str(body.get("branch") or "")
        if offers.is_prefix(branch):  # which branch, from whom (a session id: node/follow.py)
            asked = _peers(body) or self.node.trusted_online()
            branch, holders = await offers.resolve_prefix(branch, asked, self.node.identity, self.node.trust)
            body = dict(body, branch=branch, peers=[str(p) for p in holders])
        changed = asyncio.Event()
        meter = ProgressMeter([str(p) for p in body.get("peers") or []], on_change=lambda _: changed.set())
        transfer = Transfer(id=secrets.token_hex(4), branch=branch, background=body.get("background") is True,
                            meter=meter, changed=changed)
        self.running[transfer.id] = transfer
        transfer.task = asyncio.ensure_future(self._run(transfer, body))
        transfer.task.add_done_callback(_retrieved)
        return transfer

    async def close(self) -> None:
        """The node stops: every transfer still running is cancelled (nothing is committed half)."""
        self._stopping = True
        tasks = [t.task for t in self.running.values() if t.task is not None and not t.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, transfer: Transfer, body: dict[str, Any]) -> dict[str, Any]:
        try:
            transfer.result = await self.node._c_fetch(body, transfer.meter)
            transfer.state = "conflict" if transfer.result.get("conflict") else "done"
            return transfer.result
        except asyncio.CancelledError:
            transfer.state = "cancelled"
            transfer.error = PeerUnavailable("the node stopped before the fetch ended: nothing was placed; "
                                             "run it again") if self._stopping else P2PNodeError("cancelled")
            raise
        except P2PNodeError as exc:
            transfer.state, transfer.error = "failed", exc
            raise
        except Exception as exc:  # named as other control calls name it (a placed path too long:
            from p2pnode.node.answers import known_error  # exit 4); else the node's failure

            transfer.state, transfer.error = "failed", known_error(exc)
            if transfer.error is None:
                log.error("fetch %s (transfer %s) failed", transfer.branch, transfer.id, exc_info=exc)
                transfer.error = P2PNodeError(f"the node failed: {exc or 'no details'} (see its log)")
            raise
        finally:
            transfer.finished = time.monotonic()
            transfer.changed.set()
            transfer.ended.set()

    def _end_attached(self, transfer: Transfer) -> None:
        """The command waiting for `transfer` got its answer or went away: a transfer still
        running is cancelled, and it leaves the list (the command saw, or chose not to see, the end)."""
        if transfer.task is not None and not transfer.task.done():
            transfer.task.cancel()
        self.running.pop(transfer.id, None)

    async def _events(self, transfer: Transfer) -> AsyncGenerator[dict[str, Any], None]:
        """The stream a waiting command reads; closing it early (the command went away) cancels."""
        try:
            yield {"event": "started", "id": transfer.id, "branch": transfer.branch}
            while transfer.finished is None:
                await transfer.changed.wait()
                transfer.changed.clear()
                if transfer.finished is None:
                    yield transfer.event()
                    with contextlib.suppress(TimeoutError):  # progress at most every EVENT_INTERVAL,
                        async with asyncio.timeout(EVENT_INTERVAL):  # the end at once
                            await transfer.ended.wait()
            if transfer.task is not None:  # its exception was reported as an event
                with contextlib.suppress(BaseException):
                    transfer.task.result()
            yield transfer.event()
        finally:
            self._end_attached(transfer)


def _peers(body: dict[str, Any]) -> list[PeerAddress]:
    """The request's "peers" (a list of `[ID@]HOST:PORT`); InvalidInput for anything else."""
    peers = body.get("peers") or []
    if not isinstance(peers, list) or not all(isinstance(p, str) for p in peers):
        raise InvalidInput("control: 'peers' must be a list of str")
    return [PeerAddress.parse(p) for p in peers]


def _retrieved(task: asyncio.Task[Any]) -> None:
    """A background transfer's failure is in its Transfer (status shows it), not a loop warning."""
    if not task.cancelled():
        task.exception()
