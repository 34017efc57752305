"""What trusted peers offer: their catalogs asked all at once (`browse`), a hash prefix or a Pi
session id resolved against them (`fetch <prefix>`), and the shortest prefix that names a
branch among those this node holds (what `share` tells the teammate to type).

A peer is asked once, at each of its addresses in turn (one PeerPool per node); a peer that
does not answer within CATALOG_TIMEOUT is reported, not waited for.
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from p2pnode.errors import InvalidInput, NotFound, P2PNodeError, PeerUnavailable
from p2pnode.peer import wire
from p2pnode.peer.address import PeerAddress
from p2pnode.peer.downloader import PeerPool
from p2pnode.peer.identity import Identity
from p2pnode.peer.trust import TrustStore
from p2pnode.pi.sidecar import is_hash_hex

CATALOG_TIMEOUT = 5.0
MIN_PREFIX = 4
"""Shortest hash prefix `fetch` resolves (as `show` does)."""
SHARE_PREFIX = 12
"""Shortest prefix `share` prints: long enough to stay unique as a team's sessions grow."""
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class PeerOffer:
    """One peer's answer: its catalog, or why there is none."""

    addresses: list[PeerAddress]
    catalog: wire.CatalogMessage | None = None
    error: str | None = None


def by_node(addresses: Iterable[PeerAddress]) -> list[list[PeerAddress]]:
    """Addresses grouped per node (an address without a node id is a node of its own)."""
    groups: dict[object, list[PeerAddress]] = {}
    for a in addresses:
        groups.setdefault(a.node_id or a, []).append(a)
    return list(groups.values())


async def ask_catalogs(nodes: list[list[PeerAddress]], identity: Identity, trust: TrustStore,
                       limits: wire.Limits = wire.DEFAULT_LIMITS,
                       timeout: float = CATALOG_TIMEOUT) -> list[PeerOffer]:
    """Every node's catalog at once, each node asked at its addresses in turn."""
    async def ask(addresses: list[PeerAddress]) -> PeerOffer:
        try:
            pool = PeerPool(addresses, identity, trust, limits)
        except P2PNodeError as exc:  # an untrusted node named by --from
            return PeerOffer(addresses, error=str(exc))
        try:
            catalog = await asyncio.wait_for(pool.run("catalog", lambda p: p.catalog()), timeout)
            return PeerOffer(addresses, catalog=catalog)
        except TimeoutError:
            return PeerOffer(addresses, error=f"no answer within {timeout:g} s")
        except P2PNodeError as exc:
            return PeerOffer(addresses, error=str(exc))
        finally:
            await pool.close()

    return list(await asyncio.gather(*(ask(n) for n in nodes)))


def check_target(text: str) -> str:
    """A full hash, a hash prefix (at least MIN_PREFIX hex) or a Pi session id (prefix), lowercased;
    InvalidInput for anything else."""
    t = text.strip().lower()
    if is_hash_hex(t) or (len(t) >= MIN_PREFIX and set(t) <= _HEX) or _is_session_id(t):
        return t
    raise InvalidInput(f"{text!r} is not a branch hash, a prefix of one (at least {MIN_PREFIX} hex digits), "
                       "a Pi session id or a p2p1: ticket")


def _is_session_id(t: str) -> bool:
    """A Pi session id or a prefix of one: hex with the dashes of a UUID (`01a1ff93-69ef`)."""
    return "-" in t and len(t.replace("-", "")) >= MIN_PREFIX and set(t) <= _HEX | {"-"}


def resolve(text: str, offers: list[PeerOffer]) -> tuple[str, list[PeerAddress]]:
    """The one branch `text` names among what the peers offer, and the peers offering it.
    A hash prefix must match one branch; a session id names the newest version of that session
    (its longest offered branch) when it is the only session it matches.  NotFound (exit 3)
    for no match or several, naming them."""
    t = check_target(text)
    holders: dict[str, list[PeerAddress]] = {}
    entries: dict[str, wire.CatalogEntry] = {}
    for offer in offers:
        for e in offer.catalog.branches if offer.catalog else []:
            if _names(t, e):
                holders.setdefault(e.branch, []).extend(offer.addresses)
                entries[e.branch] = e
    sessions = {str(e.header.get("id")) for e in entries.values()}
    if len(entries) > 1 and _is_session_id(t) and len(sessions) == 1:
        newest = max(entries.values(), key=lambda e: (e.lines, e.size))
        entries = {newest.branch: newest}
    if len(entries) == 1:
        branch = next(iter(entries))
        return branch, holders[branch]
    asked = [o for o in offers if o.catalog is not None]
    silent = [f"{o.addresses[0]}: {o.error}" for o in offers if o.error]
    if not entries:
        why = f"; not asked: {'; '.join(silent)}" if silent else ""
        raise NotFound(f"no branch matching {text!r} is offered by the {len(asked)} peer(s) asked{why}")
    names = ", ".join(f"{b[:16]} ({_title(e)})" for b, e in sorted(entries.items()))
    raise NotFound(f"{text!r} matches {len(entries)} offered branches: {names}; give more of the hash")


def _names(t: str, e: wire.CatalogEntry) -> bool:
    if _is_session_id(t):
        return str(e.header.get("id") or "").lower().startswith(t)
    return e.branch.startswith(t)


def _title(e: wire.CatalogEntry) -> str:
    return " ".join((e.title or "untitled").split())[:40]


def unique_prefix(branch: str, others: Iterable[str], minimum: int = SHARE_PREFIX) -> str:
    """The shortest prefix of `branch`, at least `minimum` long, that no other hash starts with."""
    longest = max((_common(branch, o) for o in others if o != branch), default=0)
    return branch[: max(minimum, longest + 1)]


def _common(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def offered_rows(answers: list[PeerOffer], names: dict[str, str | None]) -> dict[str, Any]:
    """`browse --json`: one row per branch a peer offers (who, title, project, size, lines,
    session time, versions) and one per peer asked (how many it offers, or why it did not answer).
    Text in it comes from peers: whoever prints it escapes it (cli/render.shown)."""
    rows: list[dict[str, Any]] = []
    peers: list[dict[str, Any]] = []
    for a in answers:
        node_id = a.catalog.node_id if a.catalog else a.addresses[0].node_id
        who = {"node_id": node_id, "name": names.get(node_id) if node_id else None,
               "short_id": node_id.split("-")[0] if node_id else None}  # its first group, as Syncthing
        peers.append(dict(who, addresses=[str(x) for x in a.addresses], error=a.error,
                          offers=len(a.catalog.branches) if a.catalog else None))
        for e in a.catalog.branches if a.catalog else []:
            rows.append(dict(who, branch=e.branch, title=e.title, project=_project(e.header.get("cwd")),
                             cwd=e.header.get("cwd"), size=e.size, lines=e.lines,
                             timestamp=e.header.get("timestamp"), session_id=e.header.get("id"),
                             parent=e.parent, versions=_versions(e)))
    rows.sort(key=lambda r: str(r["timestamp"] or ""), reverse=True)
    return {"branches": rows, "peers": peers}


def _project(cwd: object) -> str | None:
    """The last part of the session's cwd (POSIX or Windows), as a project name."""
    if not isinstance(cwd, str) or not cwd:
        return None
    parts = [p for p in cwd.replace("\\", "/").split("/") if p]
    return parts[-1] if parts else cwd


def _versions(e: wire.CatalogEntry) -> int:
    """How many versions of the session the entry says the peer holds (a count or a list); 1 if
    it says nothing (catalogs before versions were listed)."""
    v = getattr(e, "versions", None)
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return v
    if isinstance(v, list | tuple) and v:
        return len(v)
    return 1


def no_peers(text: str) -> PeerUnavailable:
    return PeerUnavailable(f"fetch {text}: a hash prefix is resolved against peers' catalogs, and no "
                           "trusted peer was found to ask (give --from HOST:PORT, or start the node)")
