"""What trusted peers offer: their catalogs asked all at once (`browse`), a hash prefix
resolved against them (`fetch <prefix>`), and the shortest prefix that names a
branch among those this node holds (what `share` tells the teammate to type).

A peer is asked once, at each of its addresses in turn (one PeerPool per node); a peer that
does not answer within CATALOG_TIMEOUT is reported, not waited for.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from p2pnode.errors import InvalidInput, NotFound, P2PNodeError, PeerUnavailable, Refused
from p2pnode.pi.session import is_session_id
from p2pnode.pi.sidecar import is_hash_hex

if TYPE_CHECKING:  # asking peers imports these (a fetch handed to the node only checks its target)
    from p2pnode.peer import wire
    from p2pnode.peer.address import PeerAddress
    from p2pnode.peer.identity import Identity
    from p2pnode.peer.link import Connections
    from p2pnode.peer.trust import TrustStore

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
    failure: type[P2PNodeError] = PeerUnavailable
    """What kind of failure `error` is (Refused: the peer does not trust this node)."""


def by_node(addresses: Iterable[PeerAddress]) -> list[list[PeerAddress]]:
    """Addresses grouped per node (an address without a node id is a node of its own)."""
    groups: dict[object, list[PeerAddress]] = {}
    for a in addresses:
        groups.setdefault(a.node_id or a, []).append(a)
    return list(groups.values())


async def ask_catalogs(nodes: list[list[PeerAddress]], identity: Identity, trust: TrustStore,
                       timeout: float = CATALOG_TIMEOUT,
                       connections: Connections | None = None) -> list[PeerOffer]:
    """Every node's catalog at once, each node asked at its addresses in turn.  `connections`:
    the command's HTTPS sessions, kept open for a fetch that follows (link.Connections)."""
    import asyncio

    from p2pnode.peer import wire
    from p2pnode.peer.downloader import PeerPool

    async def ask(addresses: list[PeerAddress]) -> PeerOffer:
        try:
            pool = PeerPool(addresses, identity, trust, wire.DEFAULT_LIMITS, connections)
        except P2PNodeError as exc:  # an untrusted node named by --from
            return PeerOffer(addresses, error=str(exc), failure=type(exc))
        try:
            catalog = await asyncio.wait_for(pool.run("catalog", lambda p: p.catalog()), timeout)
            return PeerOffer(addresses, catalog=catalog)
        except TimeoutError:
            return PeerOffer(addresses, error=f"no answer within {timeout:g} s")
        except P2PNodeError as exc:
            return PeerOffer(addresses, error=str(exc), failure=type(exc))
        finally:
            await pool.close()

    return list(await asyncio.gather(*(ask(n) for n in nodes)))


def check_target(text: str) -> str:
    """A full hash or a hash prefix (at least MIN_PREFIX hex), lowercased, or a Pi session id
    (as it is: ids are case-sensitive); InvalidInput for anything else."""
    t = text.strip()
    if is_session_id(t):
        return t
    t = t.lower()
    if is_hash_hex(t) or is_prefix(t):
        return t
    raise InvalidInput(f"{text!r} is not a branch hash, a prefix of one (at least {MIN_PREFIX} hex digits), "
                       "a Pi session id or a p2p1: ticket")


def is_prefix(t: str) -> bool:
    """A hash prefix to resolve against peers' catalogs (not a whole hash)."""
    return MIN_PREFIX <= len(t) < 64 and set(t) <= _HEX


async def resolve_prefix(text: str, peers: list[PeerAddress], identity: Identity, trust: TrustStore,
                         seen: dict[PeerAddress, wire.CatalogMessage] | None = None,
                         connections: Connections | None = None) -> tuple[str, list[PeerAddress]]:
    """The branch a hash prefix names among what `peers` offer, and the peers offering it.
    `seen` gets each answering node's catalog under each of its addresses (so that the fetch
    does not ask for it again: follow.newest_to_fetch's `known`)."""
    if not peers:
        raise PeerUnavailable(f"{text}: a hash prefix is resolved against peers' catalogs, and no trusted "
                              "peer was found to ask: none is seen online on the LAN (a running node "
                              "looks there) and none was given with --from HOST:PORT")
    answers = await ask_catalogs(by_node(peers), identity, trust, connections=connections)
    if seen is not None:
        seen.update((a, o.catalog) for o in answers if o.catalog is not None for a in o.addresses)
    return resolve(text, answers)


def resolve(text: str, offers: list[PeerOffer]) -> tuple[str, list[PeerAddress]]:
    """The one branch the hash prefix `text` names among what the peers offer, and the peers
    offering it.  NotFound (exit 3) for no match or several, naming them; when no peer could
    be asked, what kept them from answering (unreachable: PeerUnavailable, exit 6; refused:
    Refused, exit 8).  (A Pi session id names the newest version of a session:
    node/follow.py's newest_to_fetch.)"""
    t = check_target(text)
    holders: dict[str, list[PeerAddress]] = {}
    entries: dict[str, wire.CatalogEntry] = {}
    for offer in offers:
        for e in offer.catalog.branches if offer.catalog else []:
            if e.branch.startswith(t):
                holders.setdefault(e.branch, []).extend(offer.addresses)
                entries[e.branch] = e
    if len(entries) == 1:
        branch = next(iter(entries))
        return branch, holders[branch]
    asked = [o for o in offers if o.catalog is not None]
    silent = [f"{o.addresses[0]}: {o.error}" for o in offers if o.error]
    if not entries and not asked and silent:
        failure = unanswered(o.failure.exit_code for o in offers if o.error)
        raise failure(f"no peer could be asked for {text!r}: {'; '.join(silent)}")
    if not entries:
        why = f"; not asked: {'; '.join(silent)}" if silent else ""
        raise NotFound(f"no branch matching {text!r} is offered by the {len(asked)} peer(s) asked{why}")
    names = ", ".join(f"{b[:16]} ({_title(e)})" for b, e in sorted(entries.items()))
    raise NotFound(f"{text!r} matches {len(entries)} offered branches: {names}; give more of the hash")


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
    """`browse --json`: one row per Pi session a peer offers, its newest version (who, title,
    project, size, lines, session time, how many versions the peer offers), and one per peer
    asked (how many branches it offers, or why it did not answer).  Text in it comes from
    peers: whoever prints it escapes it (cli/render.shown)."""
    rows: list[dict[str, Any]] = []
    peers: list[dict[str, Any]] = []
    for a in answers:
        node_id = a.catalog.node_id if a.catalog else a.addresses[0].node_id
        who = {"node_id": node_id, "name": names.get(node_id) if node_id else None,
               "short_id": node_id.split("-")[0] if node_id else None}  # its first group, as Syncthing
        peers.append(dict(who, addresses=[str(x) for x in a.addresses], error=a.error,
                          exit_code=a.failure.exit_code if a.error else None,
                          offers=len(a.catalog.branches) if a.catalog else None))
        for versions in _sessions(a.catalog.branches if a.catalog else []):
            e = versions[-1]
            rows.append(dict(who, branch=e.branch, title=e.title, project=_project(e.header.get("cwd")),
                             cwd=e.header.get("cwd"), size=e.size, lines=e.lines,
                             timestamp=e.header.get("timestamp"), session_id=e.header.get("id"),
                             parent=e.parent, versions=len(versions)))
    rows.sort(key=lambda r: str(r["timestamp"] or ""), reverse=True)
    return {"branches": rows, "peers": peers}


def _sessions(entries: list[wire.CatalogEntry]) -> list[list[wire.CatalogEntry]]:
    """A catalog's entries grouped into sessions (the same header id and parent branch: the
    versions of one Pi session), each oldest first (by `version`, else size)."""
    groups: dict[tuple[str, str | None], list[wire.CatalogEntry]] = {}
    for e in entries:
        key = (str(e.header.get("id")), e.parent) if e.header.get("id") else (e.branch, None)
        groups.setdefault(key, []).append(e)
    return [sorted(g, key=lambda e: (e.version or 0, e.size, e.lines)) for g in groups.values()]


def _project(cwd: object) -> str | None:
    """The last part of the session's cwd (POSIX or Windows), as a project name."""
    if not isinstance(cwd, str) or not cwd:
        return None
    parts = [p for p in cwd.replace("\\", "/").split("/") if p]
    return parts[-1] if parts else cwd


_FAILURES = {e.exit_code: e for e in (InvalidInput, PeerUnavailable, Refused)}


def unanswered(exit_codes: Iterable[int | None]) -> type[P2PNodeError]:
    """The failure of asking peers none of whom answered, from the exit codes of theirs: theirs
    when they all failed alike (all refused this node: Refused), else PeerUnavailable."""
    kinds = {_FAILURES.get(code or 0, PeerUnavailable) for code in exit_codes}
    return kinds.pop() if len(kinds) == 1 else PeerUnavailable

