"""Issue 14, following a teammate live on the LAN: real `p2pnode serve` in two lab namespaces
with real mDNS, each with its own HOME and agent dir.  A shares a session with `--live`; B
follows it by branch hash alone (no address: mDNS finds the holder); A's file grows twice and
each time B's placed file follows, byte-identical; the chain of versions is one session in
`ls` on both nodes.  A then restarts and the follow goes on.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from lab import Lab
from lannode import LanNode, Laptop, place, running, wait_for
from pifork import ROOT_FORK

pytestmark = pytest.mark.lab


@pytest.fixture
def laptops(lab: Lab, tmp_path: Path) -> Iterator[tuple[Laptop, Laptop]]:
    a, b = Laptop(lab, "h1", tmp_path), Laptop(lab, "h2", tmp_path)
    a.trust(b)
    b.trust(a)
    with running((a, b)):
        yield a, b


def grow(path: Path, tag: str) -> None:
    with open(path, "ab") as f:
        for i in range(2):
            f.write(json.dumps({"type": "message", "id": f"{tag}{i}", "parentId": None,
                                "timestamp": "2026-11-23T12:00:00.000Z",
                                "message": {"role": "user", "content": f"{tag} {i}: keep going"}},
                               separators=(",", ":")).encode() + b"\n")


def placed_on(node: LanNode, data: bytes) -> bool:
    files = list(node.agent.rglob("*.jsonl"))
    return len(files) == 1 and files[0].read_bytes() == data


def test_follow_a_live_share_over_mdns(laptops: tuple[Laptop, Laptop], corpus_new_dir: Path) -> None:
    a, b = laptops
    session = place(corpus_new_dir, ROOT_FORK["1.5.2"][0], a.agent)
    r = a.cli("share", str(session), "--live", "--json")
    assert r.returncode == 0, r.stderr
    shared = json.loads(r.stdout)

    r = b.cli("follow", shared["branch"], "--detach")  # the node retries until mDNS finds the holder
    assert r.returncode == 0, r.stderr
    wait_for("B to place the first version", lambda: placed_on(b, session.read_bytes()), 90)
    for tag in ("one", "two"):
        grow(session, tag)
        started = time.monotonic()
        wait_for(f"B to follow growth {tag}", lambda: placed_on(b, session.read_bytes()), 60, every=0.05)
        print(f"growth {tag} placed on B {time.monotonic() - started:.2f} s after it was written on A")
    session_id = shared["header"]["id"]
    for node, flag in ((a, ()), (b, ("--all",))):
        rows = json.loads(node.cli("ls", *flag, "--json").stdout)
        assert [(r["header"]["id"], r["versions"]) for r in rows] == [(session_id, 3)], node.host
    following = b.status()["following"]
    assert [(f["key"], f["state"]) for f in following] == [(shared["branch"], "following")]
    assert [x["path"] for x in a.status()["live"]] == [str(session)]

    a.stop()  # A goes away and comes back (the live share from live.json, announced again)
    grow(session, "three")
    a.start()
    wait_for("B to follow after A restarted", lambda: placed_on(b, session.read_bytes()), 90, every=0.1)
    rows = json.loads(b.cli("ls", "--all", "--json").stdout)
    assert [(r["header"]["id"], r["versions"]) for r in rows] == [(session_id, 4)]
