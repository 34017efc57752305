"""Where a command runs: the running node owns the store while it runs, so a command that
writes asks it (via_node) and one that reads goes through it (open_library); with no node the
command acts on the store itself (a fetch with no node: fetch_here).  Used by the CLI, which
only parses and prints."""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from p2pnode.errors import PeerUnavailable
from p2pnode.node.control_client import (
    CONTROL_TIMEOUT,
    FETCH_TIMEOUT,
    NodeLibrary,
    call_node,
    call_node_streamed,
    node_running,
)
from p2pnode.paths import NodePaths, PiDirs

if TYPE_CHECKING:
    from p2pnode.peer import wire
    from p2pnode.peer.address import PeerAddress
    from p2pnode.peer.get import Progress
    from p2pnode.peer.identity import Identity
    from p2pnode.peer.trust import TrustStore

log = logging.getLogger("p2pnode")


def via_node(paths: NodePaths, op: str, payload: dict[str, Any]) -> dict[str, Any] | None:
    """Have the running node do `op` (it owns the store while it runs); None: no node, act here."""
    return call_node(paths, op, payload, timeout=FETCH_TIMEOUT if op == "fetch" else 30.0)


def via_node_streamed(paths: NodePaths, op: str, payload: dict[str, Any],
                      on_event: Callable[[dict[str, Any]], None] = lambda event: None
                      ) -> dict[str, Any] | None:
    """`via_node` for work that may take minutes (`share`, `gc`, `rm`): answered as events
    (node/answers.py), its progress to `on_event`, so that CONTROL_TIMEOUT bounds the silence
    between them, not the work (as one silent reply, a big share failed in the command after
    30 s while the node went on).  None: no node, act here."""
    return call_node_streamed(paths, op, payload, on_event, timeout=CONTROL_TIMEOUT)


Asker = Callable[[NodePaths, str, dict[str, Any]], "dict[str, Any] | None"]


def routed(paths: NodePaths, op: str, payload: dict[str, Any], here: Callable[[Any], dict[str, Any]],
           ask: Asker = via_node, *, read_only: bool = False) -> dict[str, Any]:
    """A command that writes (or, `read_only`, reads what only the node knows besides: status):
    `op` through the running node (`ask`), else `here(library)` on the store itself.  A node
    that started between the two holds the store by then: it is asked after all (its read-only
    library cannot do the work)."""
    for _ in range(2):
        answer = ask(paths, op, payload)
        if answer is not None:
            return answer
        lib = open_library(paths, read_only=read_only)
        if isinstance(lib, NodeLibrary):
            continue
        from store.errors import StoreError  # loaded with the store by now: free

        try:
            answer = here(lib)
        except BaseException:
            with contextlib.suppress(Exception):  # the failure to report is `here`'s
                lib.close()
            raise
        try:
            lib.close()
        except (StoreError, OSError) as exc:  # what `op` recorded was flushed before it returned
            log.warning("%s: done and recorded, but closing the store then failed (%s); `p2pnode fsck` "
                        "checks it", op, exc)
        return answer
    raise PeerUnavailable(f"the node at {paths.home} started and stopped while `{op}` began; run it again")


def open_library(paths: NodePaths, *, read_only: bool = False) -> Any:
    """The session library: the running node's (read-only) if there is one, else the store
    itself (`read_only`: opened without writing, Library.open); while another process holds
    the store (StoreConfig.lock_timeout in all, then StoreLocked, reported by main), a node
    that answers meanwhile is read through (it holds the store from its first moments, its
    control socket comes a little later)."""
    from p2pnode.library.api import Library
    from store.config import StoreConfig

    lib = Library.open_unless(paths, wait=StoreConfig().lock_timeout, pointless=lambda: node_running(paths),
                              read_only=read_only)
    return NodeLibrary(paths) if lib is None else lib


def share_handoff(branch_hex: str, held: Iterable[str], fingerprint: bytes | None,
                  addresses: list[tuple[str, int]]) -> dict[str, Any]:
    """What `share` ends with: "fetch", the command a teammate on the LAN types (the shortest
    prefix, at least SHARE_PREFIX hex, unique among the branches `held` here), and "ticket" for
    off the LAN (None without an identity or an address to name).  The running node answers it
    with the share itself (one control round trip for the CLI); with no node the CLI computes it."""
    from p2pnode.peer import wire
    from p2pnode.peer.offers import SHARE_PREFIX, unique_prefix

    ticket = None
    if fingerprint is not None and addresses:
        ticket = wire.encode_ticket(wire.Ticket(bytes.fromhex(branch_hex), fingerprint, tuple(addresses)))
    return {"fetch": f"p2pnode fetch {unique_prefix(branch_hex, held, SHARE_PREFIX)}", "ticket": ticket}


def ticket_addresses(status: dict[str, Any]) -> list[tuple[str, int]]:
    """Where a ticket says to reach the node of `status`: the addresses its peer port really
    listens on (a node bound to 127.0.0.1 gives only that), with its port."""
    port = status.get("port")
    return [(a, port) for a in status.get("addresses", [])] if port else []


def fetch_here(paths: NodePaths, branch: str, peers: list[PeerAddress], pi: PiDirs, identity: Identity,
               trust: TrustStore, progress: Progress, *, exact: bool = False) -> dict[str, Any]:
    """A one-shot fetch with no node running: the peers given, else the trusted holders found
    on the LAN; a hash prefix resolved against the given peers' catalogs; the latest version of
    the session unless `exact` (node/follow.py); the store is opened only for each local step
    (OpenPerUse), never while a peer is awaited; a `gc` in another process is skipped meanwhile
    (library/space.py, FETCHING_LOCK).  Each peer's TLS connection is made once, by the catalog
    step, and used again by the fetch (link.Connections)."""
    from dataclasses import replace

    from p2pnode.node.follow import fetch_newest, newest_to_fetch
    from p2pnode.peer import offers
    from p2pnode.peer.get import OpenPerUse
    from p2pnode.peer.link import Connections
    from p2pnode.peer.nodeid import parse_node_id
    from p2pnode.pi.session import is_session_id

    async def on_lan(target: str) -> list[PeerAddress]:
        if is_session_id(target):  # mDNS is asked for branches: only a node knows who is around
            return []
        from p2pnode.discovery.mdns import lan_peers  # here: a fetch --from never starts mDNS

        return await lan_peers(target, lambda n: trust.is_trusted(parse_node_id(n)))

    async def fetch() -> dict[str, Any]:
        target, given = branch, peers
        seen: dict[PeerAddress, wire.CatalogMessage] = {}
        links = Connections()
        try:
            if offers.is_prefix(target):  # which branch, from whom (their catalogs are not asked twice)
                target, given = await offers.resolve_prefix(target, given, identity, trust, seen, links)
            newest = await newest_to_fetch(target, given, identity, trust, on_lan, exact=exact, known=seen,
                                           connections=links)
            holders = newest.peers or await on_lan(newest.branch)
            opener = OpenPerUse(paths, taken=lambda: node_running(paths))
            result = await fetch_newest(opener, replace(newest, peers=holders), identity, trust,
                                        agent_dir=pi.agent, progress=progress, session_dir=pi.sessions,
                                        connections=links)
        finally:
            await links.close()
        return result.as_dict()

    from p2pnode.library.space import fetching_lock
    from sysio import eventloop
    from sysio.locks import shared

    with shared(fetching_lock(paths.ensure().home)):  # no `gc` in another process while lines are staged
        return eventloop.run(fetch())
