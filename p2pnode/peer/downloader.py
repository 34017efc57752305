"""The multi-peer policy of a fetch: the peers are tried in turn for each step, and what a
failure means decides what happens to the peer that failed (FailureAction): asked no more for
this object, dropped for the rest of the fetch, or retried after a broken link.  A step that
no peer could do fails with the error that says what each peer did."""
from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import aiohttp

from p2pnode.errors import InvalidInput, NotFound, P2PNodeError, PeerUnavailable, Refused, VerificationFailed
from p2pnode.peer import wire
from p2pnode.peer.address import PeerAddress
from p2pnode.peer.identity import Identity, format_node_id, parse_node_id
from p2pnode.peer.link import NotOffered, PeerLink
from p2pnode.peer.trust import TrustStore

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
    if isinstance(exc, Refused):
        return Failure(FailureAction.DROP, str(exc), Refused)
    if isinstance(exc, VerificationFailed):  # lying bytes
        return Failure(FailureAction.DROP, f"sent data that failed verification: {exc}", VerificationFailed)
    if isinstance(exc, InvalidInput):  # bytes that hash right but are not valid (a bad sidecar)
        return Failure(FailureAction.DROP, f"sent invalid data: {exc}", InvalidInput)
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        return Failure(FailureAction.DROP, f"TLS: {exc.certificate_error}", Refused)
    if isinstance(exc, TimeoutError | aiohttp.ClientError | OSError):
        return Failure(FailureAction.RETRY)
    return None


class PeerPool:
    """The peers of one fetch, tried in turn for each step."""

    def __init__(self, peers: list[PeerAddress], identity: Identity, trust: TrustStore,
                 limits: wire.Limits) -> None:
        for p in peers:
            if p.node_id and not trust.is_trusted(parse_node_id(p.node_id)):
                raise Refused(f"node {p.node_id} is not trusted here; run `p2pnode trust {p.node_id}` first")
        self.peers = [PeerLink(p, identity, trust, limits) for p in dict.fromkeys(peers)]
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
        log.warning("dropping peer %s for this fetch: %s", peer.addr, reason)

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
        raise self._failure(what, not_offered)

    async def _network_error(self, peer: PeerLink, exc: BaseException) -> None:
        """A broken link: retried, until MAX_NETWORK_ERRORS of them give the peer up."""
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
        await asyncio.sleep(RETRY_PAUSE)

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

    def _failure(self, what: str, not_offered: set[PeerLink]) -> P2PNodeError:
        reasons = "; ".join(f"{p.addr}: {p.dropped or 'does not offer it'}" for p in self.peers)
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


def _closed_by_peer(exc: BaseException) -> bool:
    """Connected, then closed by the other side (not: could not connect).  A reset while TLS
    finishes is a ClientConnectorError without an errno: the peer hung up in the handshake."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        return not (isinstance(exc.os_error, OSError) and exc.os_error.errno)
    return isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError | ConnectionResetError)


def _describe_network_error(exc: BaseException, me: str) -> str:
    """One line for the user: no exception class names, no Python tuples (asyncio's texts have them)."""
    if _closed_by_peer(exc):
        return f"connection closed by the peer (cut link, or it does not trust this node {me})"
    if isinstance(exc, TimeoutError):
        return "timed out"
    os_error = exc.os_error if isinstance(exc, aiohttp.ClientConnectorError) else exc
    if isinstance(os_error, OSError) and os_error.errno:
        return f"cannot connect: {os.strerror(os_error.errno).lower()}"
    return str(exc) or "network error"
