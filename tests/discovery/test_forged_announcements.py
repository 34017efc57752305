"""A LAN host announcing under a trusted peer's name (its id, another address or port, a tarpit,
dozens of addresses): the node keeps reaching the peer where it proved its key over mutual TLS,
and looks a peer up again when it stops answering.  Two real in-process nodes on loopback with
real TLS; the mDNS side is a stand-in (the table's entry as a forged packet leaves it, and a
`resolve` answering what the cache holds): forging another machine's packets on demand is an
attack script's work (a review ran one in network namespaces), not a test's."""
from __future__ import annotations

from pathlib import Path

import pytest
from nodepair import trusting_nodes

from p2pnode.discovery.mdns import MAX_ADDRESSES, Discovery, Peer


async def test_a_forged_announcement_does_not_cut_off_a_trusted_peer(tmp_path: Path) -> None:
    async with trusting_nodes(tmp_path) as (a, b):
        b.discovery = Discovery(b.identity.node_id)  # its table, not started: no multicast here
        honest = Peer(a.identity.node_id, "p2p-a._p2pnode._tcp.local.", ("127.0.0.1",), a.port, 1, ())
        b.discovery.peers[honest.node_id] = honest
        await b._probe(honest)
        assert honest.online and honest.proven == ("127.0.0.1", a.port)

        # one forged packet: the attacker's addresses (a dead port) under A's name
        many = tuple(f"127.0.0.{i}" for i in range(2, 2 + MAX_ADDRESSES))  # what resolve keeps of more
        forged = Peer(honest.node_id, honest.instance, many, 1, 99, ())
        b.discovery.resolve = _answering(forged)  # type: ignore[method-assign]
        await b.discovery._resolve(honest.instance)
        entry = b.discovery.peers[honest.node_id]
        assert entry.port == 1 and entry.proven == ("127.0.0.1", a.port)  # announced, but not taken away
        assert entry.online  # decided over TLS where it proved its key, not by the announcement
        assert [str(x) for x in b._addresses(entry)] == [f"{a.identity.node_id}@127.0.0.1:{a.port}"]  # alone
        assert len(b._addresses(entry, every=True)) == 1 + MAX_ADDRESSES  # the probe looks everywhere
        await b._probe(entry)
        assert entry.online  # reached where it proved its key
        assert entry.as_dict()["reached"] == f"127.0.0.1:{a.port}"  # what `peers` shows

        # never proven (the forged packet came first): a probe that fails looks it up again
        entry.proven = None
        looked_up = []
        honest_again = Peer(honest.node_id, honest.instance, ("127.0.0.1",), a.port, 100, ())

        async def cache_now(name: str) -> Peer:
            looked_up.append(name)
            return honest_again

        b.discovery.resolve = cache_now  # type: ignore[method-assign]
        await b._probe(entry)
        assert not entry.online and looked_up == [honest.instance]
        now = b.discovery.peers[honest.node_id]
        assert now.port == a.port
        await b._probe(now)
        assert now.online and now.proven == ("127.0.0.1", a.port)


def _answering(peer: Peer):  # type: ignore[no-untyped-def]
    async def resolve(name: str) -> Peer:
        return Peer(peer.node_id, peer.instance, peer.addresses, peer.port, peer.generation, peer.branches)
    return resolve


def test_malformed_announcements_are_logged_a_few_a_minute(monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """Every host on the LAN can send malformed announcements; each was a WARNING on every
    node (2,204 lines from one flood): ten a minute, then one line with how many more."""
    import logging

    from p2pnode import logquota

    clock = [1000.0]
    monkeypatch.setattr(logquota.time, "monotonic", lambda: clock[0])
    quota = logquota.LogQuota(logging.getLogger("p2pnode.discovery"), logging.WARNING,
                              "malformed announcements ignored")
    with caplog.at_level("WARNING", logger="p2pnode.discovery"):
        for i in range(500):
            quota.log("ignoring announcement: %d", i)
        clock[0] += 61
        quota.roll()  # the housekeeping's tick: said although no announcement came since
        quota.log("ignoring announcement: %s", "next minute")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:10] == [f"ignoring announcement: {i}" for i in range(10)]
    summary = "490 more malformed announcements ignored in the last minute, not logged one by one"
    assert lines[10:] == [summary, "ignoring announcement: next minute"]
