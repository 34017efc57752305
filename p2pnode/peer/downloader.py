"""The multi-peer policy of a fetch: the peers are tried in turn for each step, and what a
failure means decides what happens to the peer that failed (FailureAction): asked no more for
this object, dropped for the rest of the fetch, or retried after a broken link.  A step that
no peer could do fails with the error that says what each peer did.

The lines of a session are shared out instead (`Share`): every holder pulls groups of lines
from one queue, at the end an idle holder re-asks the group that would take longest from the
other end (the first verified copy of a line wins), a holder without verified progress for
`Limits.hedge_timeout` has its groups asked of the others too, and one without it for
`Limits.stall_timeout` is dropped, its groups going back to the queue."""
from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from p2pnode.errors import InvalidInput, NotFound, P2PNodeError, PeerUnavailable, Refused, VerificationFailed
from p2pnode.peer import https, wire
from p2pnode.peer.address import PeerAddress
from p2pnode.peer.identity import Identity
from p2pnode.peer.link import Connections, CopyDamaged, NotOffered, PeerLink
from p2pnode.peer.nodeid import format_node_id, parse_node_id
from p2pnode.peer.trust import TrustStore
from p2pnode.pi.lines import LineRef

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_NETWORK_ERRORS = 3
"""Broken links tolerated per peer per fetch before it is given up."""
RETRY_PAUSE = 0.2


class PeerStalled(PeerUnavailable):
    """A peer that made no progress for `Limits.progress_timeout` seconds: dropped at once."""


class FailureAction(enum.Enum):
    NOT_OFFERED = "not offered"
    """The peer does not offer this object: the others are asked; it stays in the fetch."""
    DROP = "drop"
    """The peer lied, refused, sent invalid data or stalled: given up for the rest of the fetch."""
    RETRY = "retry"
    """The link broke: the peer is asked again, up to MAX_NETWORK_ERRORS times."""


@dataclass(frozen=True)
class Failure:
    action: FailureAction
    reason: str = ""
    means: type[P2PNodeError] = PeerUnavailable
    """What a drop means for the fetch's own error: VerificationFailed (it lied), Refused
    (TLS/trust), InvalidInput or PeerUnavailable."""


def judge(exc: BaseException) -> Failure | None:
    """What a step's failure on one peer means; None for an error that is not the peer's
    (it propagates)."""
    if isinstance(exc, PeerStalled):
        return Failure(FailureAction.DROP, str(exc), PeerUnavailable)
    if isinstance(exc, NotOffered):
        return Failure(FailureAction.NOT_OFFERED)
    if isinstance(exc, CopyDamaged):
        return Failure(FailureAction.DROP, "its copy is damaged (its user should run `p2pnode fsck`)")
    if isinstance(exc, Refused):
        return Failure(FailureAction.DROP, str(exc), Refused)
    if isinstance(exc, VerificationFailed):  # lying bytes
        return Failure(FailureAction.DROP, f"sent data that failed verification: {exc}", VerificationFailed)
    if isinstance(exc, InvalidInput):  # bytes that hash right but are not valid (a bad sidecar)
        return Failure(FailureAction.DROP, f"sent invalid data: {exc}", InvalidInput)
    if isinstance(exc, https.CertificateError):
        return Failure(FailureAction.DROP, f"TLS: {exc.reason}", Refused)
    if isinstance(exc, TimeoutError | https.ClientError | OSError):
        return Failure(FailureAction.RETRY)
    return None


class PeerPool:
    """The peers of one fetch, tried in turn for each step."""

    def __init__(self, peers: list[PeerAddress], identity: Identity, trust: TrustStore,
                 limits: wire.Limits, connections: Connections | None = None) -> None:
        """`connections`: HTTPS sessions kept across a command's steps (link.Connections)."""
        for p in peers:
            if p.node_id and p.node_id == identity.node_id:
                raise InvalidInput(f"{p.node_id} is this node's own id: name the peer's (it prints it with "
                                   "`p2pnode id`)")
            if p.node_id and not trust.is_trusted(parse_node_id(p.node_id)):
                raise Refused(f"node {p.node_id} is not trusted here; run `p2pnode trust {p.node_id}` first")
        self.peers = [PeerLink(p, identity, trust, limits, connections) for p in dict.fromkeys(peers)]
        self.me = identity.node_id
        self.limits = limits

    async def close(self) -> None:
        for p in self.peers:
            await p.close()

    @property
    def bytes_received(self) -> int:
        return sum(p.bytes_received for p in self.peers)

    def dropped(self) -> dict[str, str]:
        return {str(p.addr): p.dropped for p in self.peers if p.dropped}

    def drop(self, peer: PeerLink, reason: str, failure: type[P2PNodeError]) -> None:
        peer.dropped, peer.failure = reason, failure
        log.info("dropping peer %s for this fetch: %s", peer.addr, reason)  # the result or error says it too

    async def run(self, what: str, op: Callable[[PeerLink], Awaitable[T]]) -> T:
        """`op` on the first peer that does it; raises an error that says what each peer did."""
        not_offered: set[PeerLink] = set()
        while True:
            active = [p for p in self.peers if not p.dropped and p not in not_offered]
            if not active:
                break
            for peer in active:
                peer.accepted = None  # set again if this attempt's handshake accepts the peer
                try:
                    return await self._watched(peer, op)
                except Exception as exc:
                    failure = judge(exc)
                    if failure is None:
                        raise
                    error = exc
                if failure.action is FailureAction.NOT_OFFERED:
                    not_offered.add(peer)
                elif failure.action is FailureAction.DROP:
                    self.drop(peer, failure.reason, failure.means)
                else:
                    await self._network_error(peer, error)
        raise self.failure(what, not_offered)

    def holders(self) -> list[PeerLink]:
        """The peers a session's lines are shared out among: of a node announced at several
        addresses (some stale, or forged by another host on the LAN), only the one that proved
        itself in this fetch (its TLS handshake accepted it as that node); each of the others
        would cost the fetch its connect or stall deadline.  Every address of a node not
        reached yet, and every address given without a node id, stays."""
        live = [p for p in self.peers if not p.dropped]
        proven = {p.addr.node_id for p in live if p.addr.node_id and p.proven}
        out: list[PeerLink] = []
        taken: set[str] = set()
        for p in live:
            node = p.addr.node_id
            if node in proven:
                if not p.proven or node in taken:
                    continue
                taken.add(node)
            out.append(p)
        return out

    def served(self) -> dict[str, dict[str, int]]:
        """Per peer not dropped, and per dropped peer that delivered lines before: how many
        lines it delivered first, and their raw bytes (with dropped(): every peer's fate)."""
        return {str(p.addr): {"lines": p.lines_served, "bytes": p.bytes_served}
                for p in self.peers if p.lines_served or not p.dropped}

    async def _network_error(self, peer: PeerLink, exc: BaseException) -> None:
        """A broken link: retried, until MAX_NETWORK_ERRORS of them give the peer up."""
        self.network_error(peer, exc)
        await asyncio.sleep(RETRY_PAUSE)

    def network_error(self, peer: PeerLink, exc: BaseException) -> None:
        """Count a broken link against `peer`; the MAX_NETWORK_ERRORS-th drops it."""
        peer.network_errors += 1
        # a peer that never answered a byte, though we accepted it in the handshake
        peer.closed_after_handshake += (peer.accepted is not None and not peer.bytes_received
                                        and _closed_by_peer(exc))
        reason = _describe_network_error(exc, self.me)
        log.info("peer %s: %s (attempt %d)", peer.addr, reason, peer.network_errors)
        if peer.network_errors >= MAX_NETWORK_ERRORS:
            if peer.closed_after_handshake == peer.network_errors:
                self.drop(peer, self._one_sided(peer), Refused)
            else:
                self.drop(peer, reason, PeerUnavailable)

    def _one_sided(self, peer: PeerLink) -> str:
        """We accepted the peer in the handshake and it hung up, unanswered, each time: it refused
        our certificate (a TLS 1.3 server checks the client's after the client is done)."""
        them = format_node_id(peer.accepted) if peer.accepted else peer.addr.node_id or "the peer"
        return (f"{them} closed every connection right after the TLS handshake: it does not trust this node "
                f"{self.me}; ask them to run: p2pnode trust {self.me}")

    async def _watched(self, peer: PeerLink, op: Callable[[PeerLink], Awaitable[T]]) -> T:
        """`op(peer)`, cancelled with PeerStalled when a `progress_timeout` window passes with
        fewer than `progress_bytes` received: the one deadline no phase of a request can dodge
        (a connect or TLS handshake that hangs, headers that never end, 1xx answers, a trickle)."""
        task = asyncio.ensure_future(op(peer))
        try:
            while True:
                mark = peer.bytes_received
                done, _ = await asyncio.wait([task], timeout=self.limits.progress_timeout)
                if done:
                    return task.result()
                moved = peer.bytes_received - mark
                if moved < self.limits.progress_bytes:
                    raise PeerStalled(f"no progress for {self.limits.progress_timeout:g} s ({moved} bytes, "
                                      f"fewer than {self.limits.progress_bytes}); peer dropped")
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    def failure(self, what: str, not_offered: set[PeerLink],
                lacking: str = "does not offer it") -> P2PNodeError:
        """The fetch's error once no peer is left for `what`: each peer's part in one line
        (`lacking`: what a peer in `not_offered` did)."""
        reasons = "; ".join(f"{p.addr}: {p.dropped or lacking}" for p in self.peers)
        if not self.peers:
            return PeerUnavailable(f"{what}: no peer to fetch from (give --from HOST:PORT or a ticket)")
        if len(not_offered) == len(self.peers):
            return NotFound(f"{what}: not offered by any peer ({reasons})")
        failures = {p.failure for p in self.peers if p.dropped}
        if VerificationFailed in failures:
            return VerificationFailed(f"{what}: no peer sent verifiable data ({reasons})")
        if InvalidInput in failures:
            return InvalidInput(f"{what}: no peer sent valid data ({reasons})")
        if failures == {Refused}:
            return Refused(f"{what}: refused ({reasons})")
        return PeerUnavailable(f"{what}: no peer could deliver it ({reasons})")


Op = Callable[[PeerLink, list[LineRef]], Awaitable[None]]
"""op(peer, lines): ask `peer` for these lines, reporting each verified run to Share.verified;
lines it leaves out (not served there) are not asked of that peer again."""


@dataclass(eq=False)
class Group:
    """Lines asked for in one request: those not verified yet, and who is asked for them."""

    left: dict[bytes, LineRef]
    running: dict[Holder, asyncio.Future[None]] = field(default_factory=dict)


@dataclass(eq=False)
class Holder:
    """One peer's part in a Share: its requests in flight and how fast it delivers."""

    peer: PeerLink
    tasks: dict[asyncio.Future[None], tuple[Group, list[LineRef]]] = field(default_factory=dict)
    lacks: set[bytes] = field(default_factory=set)
    """Lines it left out of an answer (it does not serve them): not asked of it again."""
    served: int = 0
    busy: float = 0.0
    since: float = 0.0
    """Seconds with requests outstanding before the current busy period, and when that began."""
    progress_at: float = 0.0
    progress_mark: int = 0
    """When it last made progress (a line verified, or `progress_bytes` moved), and its
    `bytes_received` then: the stall clock."""
    hedged: bool = False
    """Stalled for `hedge_timeout`: its groups are asked of the others, and its stall clock
    runs on through a new busy period (its requests cancelled as the others win them are no
    progress), until it progresses."""
    retry_at: float = 0.0

    def progressed(self, now: float) -> None:
        self.progress_at, self.progress_mark, self.hedged = now, self.peer.bytes_received, False

    def rate(self, now: float) -> float:
        """Verified raw bytes per second with requests outstanding (0: none verified yet)."""
        busy = self.busy + (now - self.since if self.tasks else 0.0)
        return self.served / busy if busy > 0 else 0.0

    def can_serve(self, group: Group) -> bool:
        return self not in group.running and any(h not in self.lacks for h in group.left)


class Share:
    """The missing lines of one session shared out among the pool's live peers.

    Each holder keeps up to `in_flight` groups asked for.  An idle holder takes the next group
    nobody is serving; once there is none (the end of the fetch), it re-asks the group whose
    holder should take longest to finish it, from its last line backwards, so that the two
    meet in the middle.  A holder that is not stalled takes, before any of those, the groups
    of one stalled for `hedge_timeout` (a cut link: the fetch goes on in order meanwhile).
    The first verified copy of a line wins and a group done cancels the other request for
    it.  A holder's failure is judged as in PeerPool.run: dropped (lying,
    refusing, stalled), retried after a pause (a broken link), or not asked again for lines
    it does not serve; its unfinished groups go back to the queue either way.  A holder with
    requests outstanding that, for `stall_timeout` seconds, had no line verified and moved
    fewer than `progress_bytes` bytes is dropped (the last holder left: `progress_timeout`)."""

    def __init__(self, pool: PeerPool, what: str, groups: list[list[LineRef]], in_flight: int) -> None:
        self.pool, self.what, self.in_flight = pool, what, in_flight
        self.groups = [Group({r.hash: r for r in g}) for g in groups if g]
        self.where = {h: g for g in self.groups for h in g.left}
        self.holders = {p: Holder(p) for p in pool.holders()}
        self._cancelled: set[asyncio.Future[None]] = set()
        """Requests cancelled on purpose (a group won elsewhere, a holder dropped): no failure."""

    def verified(self, peer: PeerLink, blobs: list[wire.BatchBlob]) -> list[bool]:
        """Record lines verified from `peer`; True for each line verified here first (hand it
        on), False for one already delivered by another holder."""
        holder = self.holders[peer]
        holder.progressed(time.monotonic())
        first = []
        for blob in blobs:
            group = self.where.get(blob.hash)
            ref = group.left.pop(blob.hash, None) if group is not None else None
            first.append(ref is not None)
            if group is None or ref is None:
                continue
            holder.served += blob.raw_len
            peer.lines_served += 1
            peer.bytes_served += blob.raw_len
            if not group.left:  # won: the other requests for this group are of no use now
                for other, task in group.running.items():
                    if other is not holder:
                        self._cancel(task)
        return first

    def delivering(self, peer: object) -> bool:
        """Whether `peer` is a holder neither dropped nor stalled (`hedge_timeout`): one whose
        link the fetch's pace counts on (peer/pace.py, FetchPace.live)."""
        holder = self.holders.get(peer) if isinstance(peer, PeerLink) else None
        return holder is not None and not holder.peer.dropped and not holder.hedged

    async def run(self, op: Op) -> None:
        try:
            while any(g.left for g in self.groups):
                now = time.monotonic()
                self._assign(op, now)
                running = [t for h in self.holders.values() for t in h.tasks]
                pauses = [h.retry_at - now for h in self._live() if h.retry_at > now]
                if not running and not pauses:
                    raise self.pool.failure(self.what, {h.peer for h in self._live()},
                                            "does not serve some of them (no longer offered there, or "
                                            "its copy of them is damaged: its log says which)")
                tick = min([self.pool.limits.stall_timeout / 4, self.pool.limits.hedge_timeout / 2, *pauses])
                if not running:
                    await asyncio.sleep(tick)
                    continue
                done, _ = await asyncio.wait(running, timeout=tick, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    self._settle(task)
                self._check_stalls(time.monotonic())
        finally:
            tasks = [t for h in self.holders.values() for t in h.tasks]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _live(self) -> list[Holder]:
        return [h for h in self.holders.values() if not h.peer.dropped]

    def _assign(self, op: Op, now: float) -> None:
        self._hedge(now)
        for holder in self._live():
            while holder.retry_at <= now and len(holder.tasks) < self.in_flight:
                group = self._stalled_group(holder) or self._fresh(holder)
                again = group is None
                if again and (group := self._duplicate(holder, now)) is not None:
                    owner = next(iter(group.running))
                    log.info("re-asking %s for %d lines that %s is serving", holder.peer.addr,
                             len(group.left), owner.peer.addr)
                if group is None:
                    break
                if not holder.tasks:  # a new busy period: the stall clock starts now
                    holder.since = now
                    if not holder.hedged:
                        holder.progressed(now)
                    holder.peer.accepted = None
                asked = [r for r in group.left.values() if r.hash not in holder.lacks]
                if again:  # from the other end: the two requests meet in the middle
                    asked.reverse()
                task = asyncio.ensure_future(op(holder.peer, asked))
                holder.tasks[task] = (group, asked)
                group.running[holder] = task

    def _hedge(self, now: float) -> None:
        """Mark the holders stalled for `hedge_timeout`, while one that is not is left to
        take their groups."""
        live = self._live()
        stalled = [h for h in live if h.tasks and now - h.progress_at > self.pool.limits.hedge_timeout]
        if len(stalled) < len(live):
            for h in stalled:
                if not h.hedged:
                    log.info("%s has not delivered for %g s: its groups are asked of the others too",
                             h.peer.addr, self.pool.limits.hedge_timeout)
                h.hedged = True

    def _stalled_group(self, holder: Holder) -> Group | None:
        """For a holder not stalled itself: the first group that only stalled holders are
        serving (the one the in-order cursor waits for first)."""
        if holder.hedged:
            return None
        return next((g for g in self.groups if g.left and g.running and holder.can_serve(g)
                     and all(h.hedged for h in g.running)), None)

    def _fresh(self, holder: Holder) -> Group | None:
        """The first group nobody is serving that `holder` may have."""
        return next((g for g in self.groups if g.left and not g.running and holder.can_serve(g)), None)

    def _duplicate(self, holder: Holder, now: float) -> Group | None:
        """The end of the fetch: of the groups one other holder is serving, the one it should
        take longest to finish (its lines left over its rate per request in flight; a holder
        that verified nothing yet comes first).  A group of one line is re-asked only from a
        holder without a rate: two requests cannot split it."""
        def finish(g: Group) -> float:
            owner = next(iter(g.running))
            rate = owner.rate(now) / len(owner.tasks)
            return sum(r.length for r in g.left.values()) / rate if rate else math.inf

        open_ = [(finish(g), i) for i, g in enumerate(self.groups)
                 if g.left and len(g.running) == 1 and holder not in g.running and holder.can_serve(g)]
        open_ = [(t, i) for t, i in open_ if len(self.groups[i].left) > 1 or t == math.inf]
        return self.groups[max(open_)[1]] if open_ else None

    def _settle(self, task: asyncio.Future[None]) -> None:
        holder = next(h for h in self.holders.values() if task in h.tasks)
        group, asked = holder.tasks.pop(task)
        del group.running[holder]
        if not holder.tasks:
            holder.busy += time.monotonic() - holder.since
        if task in self._cancelled or task.cancelled():
            self._cancelled.discard(task)
            return
        exc = task.exception()
        if exc is None:  # what it left out, it does not serve
            holder.lacks.update(r.hash for r in asked if r.hash in group.left)
            return
        failure = judge(exc)
        if failure is None:
            raise exc
        if failure.action is FailureAction.NOT_OFFERED:
            holder.lacks.update(r.hash for r in asked)
        elif failure.action is FailureAction.DROP:
            self._drop(holder, failure.reason, failure.means)
        else:
            self.pool.network_error(holder.peer, exc)
            if holder.peer.dropped:
                self._drop(holder, holder.peer.dropped, holder.peer.failure)
            else:
                holder.retry_at = time.monotonic() + RETRY_PAUSE

    def _drop(self, holder: Holder, reason: str, means: type[P2PNodeError]) -> None:
        """Give `holder` up; its requests are cancelled and their groups go back to the queue."""
        if not holder.peer.dropped:
            self.pool.drop(holder.peer, reason, means)
        for task in holder.tasks:
            self._cancel(task)

    def _cancel(self, task: asyncio.Future[None]) -> None:
        task.cancel()
        self._cancelled.add(task)

    def _check_stalls(self, now: float) -> None:
        """Drop a holder stalled for `stall_timeout`, while another holder is left to take its
        lines; the last one left gets `progress_timeout`, the bound of every other step (a
        busy node that is slow to start an answer is not the end of the fetch)."""
        limits = self.pool.limits
        live = self._live()
        bound = limits.stall_timeout if len(live) > 1 else limits.progress_timeout
        for holder in live:
            if not holder.tasks:
                continue
            moved = holder.peer.bytes_received - holder.progress_mark
            if moved >= limits.progress_bytes:
                holder.progressed(now)
            elif now - holder.progress_at > bound:
                self._drop(holder, f"no verified progress for {bound:g} s (no line verified, "
                                   f"{moved} bytes, fewer than {limits.progress_bytes}); peer dropped",
                           PeerUnavailable)


def _closed_by_peer(exc: BaseException) -> bool:
    """Connected, then closed by the other side (not: could not connect).  A reset while TLS
    finishes is a ConnectError without an errno: the peer hung up in the handshake."""
    if isinstance(exc, https.ConnectError):
        return not (isinstance(exc.os_error, OSError) and exc.os_error.errno)
    return isinstance(exc, https.Disconnected | ConnectionResetError)


def _describe_network_error(exc: BaseException, me: str) -> str:
    """One line for the user: no exception class names, no Python tuples (asyncio's texts have them)."""
    if _closed_by_peer(exc):
        return f"connection closed by the peer (cut link, or it does not trust this node {me})"
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, https.PayloadError):
        return "connection cut in the middle of an answer"
    os_error = exc.os_error if isinstance(exc, https.ConnectError) else exc
    if isinstance(os_error, OSError) and os_error.errno:
        return f"cannot connect: {os.strerror(os_error.errno).lower()}"
    return str(exc) or "network error"
