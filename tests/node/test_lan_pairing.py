"""`p2pnode pair` over real mDNS between lab hosts (issue 15): h1 (alice) runs a node that serves
the code, h2 (bob) has no node and joins by the code alone, h3 (eve) runs a node on the same LAN,
sees every announcement, tries a wrong code, and ends trusting nobody and trusted by nobody."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from lab import Lab
from lannode import LanNode, running, wait_for

from p2pnode.peer.identity import set_own_name
from p2pnode.peer.pgpwords import EVEN
from p2pnode.peer.trust import TrustStore

pytestmark = pytest.mark.lab


def trusted(node: LanNode) -> dict[str, str | None]:
    return {p.node_id: p.name for p in TrustStore(node.paths.trust).peers()}


def show_code(lab: Lab, node: LanNode) -> tuple[subprocess.Popen[str], str]:
    """`p2pnode pair` in the node's host (served by its running node): (process, code)."""
    proc = lab.spawn(node.host, sys.executable, "-m", "p2pnode", "pair", env=node.env)
    assert proc.stdout is not None
    shown = "".join(proc.stdout.readline() for _ in range(4))
    m = re.search(r"pairing code: (\S+)", shown)
    assert m, shown + (proc.stderr.read() if proc.stderr else "")
    return proc, m.group(1)


@pytest.fixture
def trio(lab: Lab, tmp_path: Path) -> Iterator[dict[str, LanNode]]:
    nodes = {name: LanNode(lab, host, tmp_path) for name, host in (("alice", "h1"), ("bob", "h2"),
                                                                   ("eve", "h3"))}
    for name, node in nodes.items():
        set_own_name(node.paths.identity, name)
    with running([nodes["alice"], nodes["eve"]]):
        yield nodes


def test_pair_over_mdns_wrong_code_then_right_code_and_the_listener_trusts_nobody(lab: Lab,
                                                                                   trio: dict[str, LanNode]):
    alice, bob, eve = trio["alice"], trio["bob"], trio["eve"]
    # eve, listening on the LAN, learns the channel from mDNS and guesses the words: one attempt
    proc, code = show_code(lab, alice)
    channel, first, second = code.split("-")
    tried = eve.cli("pair", f"{channel}-{first}-{next(w for w in EVEN if w != second)}")
    out, err = proc.communicate(timeout=30)
    assert tried.returncode == 8 and "burned" in tried.stderr, tried.stderr
    assert proc.returncode == 8 and "did not match" in err, err
    # the right code is dead too: the waiter withdrew it from mDNS
    late = bob.cli("pair", code)
    assert late.returncode == 6 and f"channel {channel}" in late.stderr, late.stderr
    # a new code, and bob (no node running) joins by the code alone, found over mDNS
    proc, code = show_code(lab, alice)
    joined = bob.cli("pair", code)
    out, err = proc.communicate(timeout=30)
    assert joined.returncode == 0, joined.stderr
    assert proc.returncode == 0 and f"paired with bob ({bob.node_id})" in out, err
    assert f"paired with alice ({alice.node_id})" in joined.stdout
    assert trusted(alice) == {bob.node_id: "bob"} and trusted(bob) == {alice.node_id: "alice"}
    # the keys exchanged are the TLS keys: bob's node starts and both see each other over mTLS
    bob.start()
    try:
        wait_for("alice and bob confirming each other over HTTPS",
                 lambda: (alice.peer(bob) or {}).get("online") and (bob.peer(alice) or {}).get("online"), 60)
        # names announced over mDNS work like ids: eve trusts alice by the name she announces ...
        wait_for("eve seeing alice's announced name",
                 lambda: any(p.get("announced_name") == "alice" for p in eve.status()["peers"]), 30)
        r = eve.cli("trust", "alice")
        assert r.returncode == 0 and alice.node_id in r.stdout and "check the id" in r.stdout, r.stderr
        # ... so eve's node calls alice's, which refuses it and lists it as pending, with its name
        def pending() -> list[dict]:
            return json.loads(alice.cli("peers", "--pending", "--json").stdout)

        listed = wait_for("eve pending at alice",
                          lambda: [p for p in pending() if p["id"] == eve.node_id], 30)
        assert listed[0]["name"] == "eve"
        text = alice.cli("peers", "--pending").stdout  # trust by id: the name is only what eve announces
        assert f"eve ({eve.node_id})" in text and f"run p2pnode trust {eve.node_id}" in text
        # ... and eve's side says so too: alice does not trust eve
        refusing = wait_for("eve's node noticing that alice refuses it", lambda: [
            p for p in json.loads(eve.cli("peers", "--json").stdout) if p["id"] == alice.node_id
            and p.get("trusts_us") is False], 30)
        assert refusing[0]["name"] == "alice"
        assert "does not trust this node" in eve.cli("peers").stdout
        assert eve.cli("untrust", "alice").returncode == 0
    finally:
        bob.stop()
    assert trusted(eve) == {}
    assert eve.node_id not in trusted(alice) and eve.node_id not in trusted(bob)
