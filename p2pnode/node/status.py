"""The `status` JSON, built in one place: by the running node (`/v1/status`) and by the CLI
when no node runs (offline: no addresses, no transfers, trusted peers not confirmed); and the
`peers` view made from it."""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from p2pnode.paths import NodePaths

if TYPE_CHECKING:
    from p2pnode.library.api import BranchInfo, Catalog, Library
    from p2pnode.library.space import SpaceReport
    from p2pnode.peer.trust import TrustedPeer


def trusted_peer(peer: TrustedPeer, online: bool | None) -> dict[str, Any]:
    """A trusted peer as status lists it when discovery has not seen it."""
    return {"node_id": peer.node_id, "name": peer.name, "trusted": True, "online": online,
            "addresses": [], "port": None}


def build_status(*, node_id: str | None, running: bool, home: str, catalog: Catalog,
                 branches: Iterable[BranchInfo], peers: list[dict[str, Any]],
                 addresses: list[str] | None = None, port: int | None = None, mdns: bool = False,
                 transfers: list[dict[str, Any]] | None = None, space: SpaceReport | None = None,
                 following: list[dict[str, Any]] | None = None, live: list[dict[str, Any]] | None = None,
                 announced: list[str] | None = None, store_failure: str | None = None) -> dict[str, Any]:
    """`addresses`: where the peer port answers (what tickets carry); `announced`: what mDNS
    tells peers (`doctor` checks that the port answers there); `store_failure`: why the
    node's store refuses writes (a full disk: restart the node once there is room)."""
    return {
        "node_id": node_id,
        "running": running,
        "addresses": addresses or [],
        "announced": announced or [],
        "port": port,
        "home": home,
        "mdns": mdns,
        "catalog_generation": catalog.generation,
        "shared": [{"branch": b.branch, "title": b.title, "size": b.size, "withheld": b.withheld}
                   for b in branches],
        "peers": peers,
        "transfers": transfers or [],
        "store_bytes": space["store_bytes"] if space else None,
        "reclaimable_bytes": space["reclaimable_bytes"] if space else None,
        "store_damage": space["store_damage"] if space else None,
        "store_failure": store_failure,
        "following": following or [],
        "live": live or [],
    }


def offline_status(paths: NodePaths, lib: Library) -> dict[str, Any]:
    """What `status` can say with no node running (from the store, `lib`): identity, shared
    branches, trusted peers."""
    from p2pnode.peer.identity import existing_identity
    from p2pnode.peer.trust import TrustStore

    identity = existing_identity(paths.identity)
    node_id = identity.node_id if identity is not None else None
    catalog, branches, space = lib.catalog(), lib.branches(), lib.space()
    peers = [trusted_peer(t, None) for t in TrustStore(paths.trust).peers()]
    return build_status(node_id=node_id, running=False, home=str(paths.home), catalog=catalog,
                        branches=branches, peers=peers, space=space)


def peers_view(trusted: Iterable[TrustedPeer], status: dict[str, Any] | None) -> list[dict[str, Any]]:
    """`p2pnode peers`: the trusted peers, with where and whether a running node (its status,
    None if none runs) sees them, then the untrusted nodes it sees.  Every row has the same
    keys, null where nothing is known (no node running: where, whether online, whether it
    trusts this node back)."""
    unknown: dict[str, Any] = {"addresses": [], "port": None, "online": None, "trusts_us": None,
                               "reached": None}
    peers = [dict(p.as_dict(), trusted=True, **unknown) for p in trusted]
    if status:
        seen = {p["node_id"]: p for p in status["peers"]}
        for p in peers:
            if (s := seen.pop(p["id"], None)) is not None:
                p.update(addresses=s["addresses"], port=s["port"], online=s["online"],
                         trusts_us=s.get("trusts_us"), reached=s.get("reached"))
        peers += [{"id": s["node_id"], "name": None, "added_at": None, "trusted": False, **unknown,
                   "addresses": s["addresses"], "port": s["port"]} for s in seen.values() if not s["trusted"]]
    return peers
