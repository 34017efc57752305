"""What a peer may not have, it may not learn of: a version of a session shared `--to` another
peer (or unshared) was named in the `previous` field of the newer version's catalog entry that
every peer sees, telling them a branch they may not have exists.  The real peer server over real
mutual TLS, with the peers of tests/peer/test_access.py."""
from __future__ import annotations

from test_access import A6, World, answer, server, session, world  # noqa: F401

from p2pnode.peer import wire
from p2pnode.peer.provider import PeerServer


async def test_a_catalog_names_no_version_the_peer_may_not_have(world: World, server: PeerServer) -> None:  # noqa: F811
    """A session's versions share one audience, the latest share's (each holds the older ones'
    bytes): a version offered to everyone, then grown and shared to alice only, is no longer
    in bob's catalog, nor is the link to it in alice's entries a name bob could use."""
    path = world.agent / A6
    first = world.lib.share(str(path))
    with open(path, "ab") as f:
        f.write(b'{"type":"message","id":"grown01","parentId":null,"message":{"role":"user",'
                b'"content":"one more line"}}\n')
    second = world.lib.share(str(path), to=[world.peers["alice"][0].node_id])
    assert world.lib.branch(second.branch).previous == first.branch
    url = f"https://127.0.0.1:{server.port}{wire.PATH_CATALOG}"
    async with session(world, "alice") as alice, session(world, "bob") as bob:
        seen_by_bob = wire.decode_catalog((await answer(bob, "GET", url))[2])
        seen_by_alice = wire.decode_catalog((await answer(alice, "GET", url))[2])
    assert seen_by_bob.branches == []
    assert world.lib.offered_object(first.src, world.peers["bob"][0].node_id) is None
    assert {b.branch: b.previous for b in seen_by_alice.branches} == {first.branch: None,
                                                                     second.branch: first.branch}
