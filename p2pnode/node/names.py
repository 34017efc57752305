"""Peer names wherever a node id is taken (`trust`, `untrust`, `fetch --from`): the names in
trust.json (given with `trust --name` or sent when pairing), and the names nodes announce over
mDNS (as the running node sees them, with the untrusted nodes that tried to connect).  An
announced name is a claim anyone on the LAN can make: the commands print the id they used.
A name shared by several nodes is an error that lists them; a node id always works."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from p2pnode.errors import InvalidInput, PeerUnavailable
from p2pnode.node.control_client import call_node
from p2pnode.paths import NodePaths
from p2pnode.peer.address import PeerAddress
from p2pnode.peer.nodeid import InvalidNodeId, normalise_node_id
from p2pnode.peer.trust import TrustStore

TRUSTED, PENDING, LAN = "trusted", "tried to connect", "on the LAN"


class UnknownPeer(InvalidInput):
    """Neither a node id nor the name of a peer this node knows."""


@dataclass(frozen=True)
class KnownPeer:
    node_id: str
    name: str | None
    how: str                            # TRUSTED, PENDING or LAN
    addresses: tuple[str, ...] = ()
    port: int | None = None


def known_peers(paths: NodePaths) -> list[KnownPeer]:
    """Trusted peers (trust.json), then what a running node sees: pending callers and LAN nodes."""
    known = [KnownPeer(p.node_id, p.name, TRUSTED) for p in TrustStore(paths.trust).peers()]
    status = call_node(paths, "status", {}, timeout=5.0)
    if status is None:
        return known
    trusted = {k.node_id for k in known}
    seen = {p["node_id"]: p for p in status.get("peers", [])}
    for p in (call_node(paths, "pending", {}, timeout=5.0) or {}).get("pending", []):
        s = seen.pop(p["id"], {})
        addresses = tuple(s.get("addresses") or ())
        known.append(KnownPeer(p["id"], p.get("name"), PENDING, addresses, s.get("port")))
    for node_id, s in seen.items():
        addresses, port = tuple(s.get("addresses") or ()), s.get("port")
        if node_id in trusted:  # where a trusted peer is: for `--from NAME`
            known = [KnownPeer(k.node_id, k.name, k.how, addresses, port) if k.node_id == node_id else k
                     for k in known]
        else:
            known.append(KnownPeer(node_id, s.get("announced_name"), LAN, addresses, port))
    return known


def resolve(text: str, known: Iterable[KnownPeer],
            kinds: tuple[str, ...] = (TRUSTED, PENDING, LAN)) -> KnownPeer:
    """A node id, or a name among the `kinds` of known peers (exact, then ignoring case)."""
    known = list(known)
    try:
        node_id, not_an_id = normalise_node_id(text), None
    except InvalidNodeId as exc:
        node_id, not_an_id = None, exc
    if node_id is not None:
        return next((k for k in known if k.node_id == node_id), KnownPeer(node_id, None, ""))
    candidates = [k for k in known if k.how in kinds and k.name is not None]
    for same in (lambda n: n == text, lambda n: n.casefold() == text.casefold()):
        matches = {k.node_id: k for k in candidates if same(k.name)}
        if len(matches) == 1:
            return next(iter(matches.values()))
        if len(matches) > 1:
            listed = "; ".join(f"{k.node_id} ({k.how})" for k in matches.values())
            raise InvalidInput(f"the name {text!r} is ambiguous, it could be: {listed}; use the node id")
    where = " or ".join(kinds)
    raise UnknownPeer(f"no peer named {text!r} ({where}); and as a node id: {not_an_id}")


def from_addresses(paths: NodePaths, texts: list[str]) -> list[PeerAddress]:
    """`--from` values: `[NODEID@]HOST:PORT` as before, and `NAME@HOST:PORT` or `NAME` (where the
    running node sees that trusted peer on the LAN)."""
    out: list[PeerAddress] = []
    known: list[KnownPeer] | None = None
    for text in texts:
        who, at, hostport = text.rpartition("@")
        if ":" in (hostport if at else text) and not _is_name(who):
            out.append(PeerAddress.parse(text))
            continue
        known = known if known is not None else known_peers(paths)
        try:
            peer = resolve(who if at else text, known, (TRUSTED,))
        except UnknownPeer:
            raise InvalidInput(f"peer address {text!r} is not HOST:PORT, NODEID@HOST:PORT, NAME@HOST:PORT "
                               "or the name of a trusted peer") from None
        if at:
            out.append(PeerAddress.parse(f"{peer.node_id}@{hostport}"))
        elif peer.addresses and peer.port:
            out += [PeerAddress(peer.node_id, host, peer.port) for host in peer.addresses]
        else:
            raise PeerUnavailable(f"--from {text}: {peer.node_id} is not seen on the LAN by a running node; "
                           "give its address: --from NAME@HOST:PORT")
    return out


def _is_name(who: str) -> bool:
    """`who@HOST:PORT`: true when `who` is a name rather than a node id (or nothing)."""
    if not who:
        return False
    try:
        normalise_node_id(who)
    except InvalidNodeId:
        return True
    return False
