"""`share --to`: the trusted peers named on the command line, as node ids, and shown by name."""
from __future__ import annotations

from p2pnode.errors import InvalidInput, P2PNodeError
from p2pnode.paths import NodePaths


def share_to(paths: NodePaths, names: list[str] | None) -> list[str] | None:
    """Each name or node id of a trusted peer as its node id (None: every trusted peer)."""
    if not names:
        return None
    from p2pnode.peer.nodeid import parse_node_id
    from p2pnode.peer.trust import TrustStore

    trusted = TrustStore(paths.trust).peers()
    ids = []
    for name in names:
        found = [p.node_id for p in trusted if p.name == name]
        if not found:
            try:
                fp = parse_node_id(name)
            except InvalidInput:
                fp = None
            found = [p.node_id for p in trusted if p.fingerprint == fp]
        if len(found) > 1:
            raise InvalidInput(f"share --to {name}: several trusted peers by that name: {', '.join(found)}; "
                               "give the id of the one meant")
        if not found:
            raise InvalidInput(f"share --to {name}: no trusted peer by that name or id "
                               "(`p2pnode peers` lists them)")
        ids.append(found[0])
    return sorted(set(ids))


def peer_names(paths: NodePaths) -> dict[str, str]:
    """Node id -> the name it is trusted by here, for a listing's "(to bob)"; no names when the
    trust file cannot be read (the listing shows ids: it must not fail for that)."""
    from p2pnode.peer.trust import TrustStore

    try:
        return {p.node_id: p.name for p in TrustStore(paths.trust).peers() if p.name}
    except (OSError, P2PNodeError):
        return {}
