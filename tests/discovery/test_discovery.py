"""Discovery: TXT/subtype encoding (sans-IO) and real mDNS between lab namespaces."""
from __future__ import annotations

import base64
import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from lab import Lab

from p2pnode.discovery.records import (
    MAX_SUBTYPES,
    SUBTYPE_HEX,
    TXT_LIMIT,
    Announcement,
    BadAnnouncement,
    branch_instance_name,
    instance_name,
    parse_txt,
    subtype_name,
    txt_size,
)

AGENT = Path(__file__).resolve().parents[1] / "mdns_agent.py"


def new_id() -> str:
    """Shaped like p2pnode.identity's ids (8 groups of 7 base32); discovery only needs uniqueness."""
    raw = base64.b32encode(os.urandom(35)).decode()
    return "-".join(raw[i : i + 7] for i in range(0, 56, 7))


def branch() -> str:
    return os.urandom(32).hex()


# --- sans-IO -------------------------------------------------------------------------------


def test_txt_round_trip_and_budget():
    node = new_id()
    branches = tuple(branch() for _ in range(40))
    ann = Announcement(node, 47470, 9, branches)
    props = ann.txt()
    assert txt_size(props) <= TXT_LIMIT
    back = parse_txt(dict(props), instance_name(node))
    assert back.node_id == node and back.port == 47470 and back.generation == 9
    assert 10 <= len(back.branches) < 40 and back.branches == branches[: len(back.branches)]
    assert all(len(f"{k}={v}") <= 255 for k, v in props.items())


def test_names_are_valid_dns_labels():
    node, b = new_id(), branch()
    for name in (instance_name(node), branch_instance_name(node, b), subtype_name(b)):
        assert all(0 < len(label) <= 63 for label in name.rstrip(".").split("."))
    assert subtype_name(b) == f"_{b[:SUBTYPE_HEX]}._sub._p2pnode._tcp.local."
    assert instance_name(node) != instance_name(new_id())


@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        ({"id": None}, "no 'id'"),
        ({"port": "0"}, "port='0'"),
        ({"port": "http"}, "port='http'"),
        ({"port": "\u00b2"}, "port='\u00b2'"),  # a digit to str.isdigit(), not to int()
        ({"gen": "-1"}, "gen='-1'"),
        ({"b0": "AB" * 32}, "b0="),
        ({"v": None}, "no 'v'"),
    ],
)
def test_bad_txt_is_refused_with_the_reason(change, complaint):
    node = new_id()
    props: dict[str, str | None] = dict(Announcement(node, 1000, 1, (branch(),)).txt())
    props.update(change)
    props = {k: v for k, v in props.items() if v is not None}
    with pytest.raises(BadAnnouncement, match=complaint):
        parse_txt(props, instance_name(node))


def test_txt_claiming_another_nodes_id_is_refused():
    props = dict(Announcement(new_id(), 1000, 1).txt())
    with pytest.raises(BadAnnouncement, match="does not match the instance name"):
        parse_txt(props, instance_name(new_id()))


# --- between namespaces ----------------------------------------------------------------------


class Agent:
    """tests/mdns_agent.py in a lab host, driven line by line with bounded reads."""

    def __init__(self, lab: Lab, host: str, node_id: str | None):
        self.node_id = node_id
        argv = [sys.executable, str(AGENT)] + ([node_id] if node_id else [])
        self.proc = lab.spawn(host, *argv, stdin=subprocess.PIPE)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        assert self._read(20) == {"ready": True}

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def _read(self, timeout: float) -> object:
        try:
            return json.loads(self.lines.get(timeout=timeout))
        except queue.Empty:
            self.stop()
            raise AssertionError(f"agent gave no answer in {timeout} s; stderr: {self.stderr()}") from None

    def ask(self, line: str, timeout: float = 30) -> object:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def stderr(self) -> str:
        return self.proc.stderr.read() if self.proc.stderr and self.proc.poll() is not None else ""

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


@pytest.fixture
def agents(lab: Lab):
    made: list[Agent] = []

    def start(host: str, node_id: str | None = None) -> Agent:
        made.append(Agent(lab, host, node_id))
        return made[-1]

    yield start
    for a in made:
        a.stop()


@pytest.mark.lab
def test_announce_is_seen_with_address_port_generation_and_branches(lab: Lab, agents):
    b1, b2 = branch(), branch()
    browser = agents("h2")
    node = agents("h1", new_id())
    assert node.ask(f"announce 47001 3 {b1},{b2}") == {"ok": True}
    peer = browser.ask(f"wait {node.node_id} 3 10")
    assert peer is not None, "h2 did not see h1's announcement"
    assert peer["addresses"] == [lab.addr("h1")]
    assert (peer["port"], peer["generation"], peer["branches"]) == (47001, 3, [b1, b2])
    assert peer["online"] is None  # mDNS alone never says a peer is alive


@pytest.mark.lab
def test_who_holds_a_branch_is_answered_by_holders_only(lab: Lab, agents):
    b1, b2, b3 = branch(), branch(), branch()
    n1, n3 = agents("h1", new_id()), agents("h3", new_id())
    n1.ask(f"announce 47001 1 {b1},{b2}")
    n3.ask(f"announce 47003 1 {b3}")
    asker = agents("h2")
    assert asker.ask(f"holders {b2} 5 lan") == [n1.node_id]  # by the subtype query alone
    assert asker.ask(f"holders {b3} 5 lan") == [n3.node_id]
    assert asker.ask(f"holders {branch()} 1.0 lan") == []
    assert asker.ask(f"wait {n1.node_id} 1 10") is not None
    assert asker.ask(f"holders {b1} 5") == [n1.node_id]  # from the peer table's TXT


@pytest.mark.lab
def test_catalog_change_reannounces_and_withdraws_subtypes(lab: Lab, agents):
    old, new = branch(), branch()
    node = agents("h1", new_id())
    watcher = agents("h2")
    node.ask(f"announce 47001 1 {old}")
    assert watcher.ask(f"wait {node.node_id} 1 10") is not None
    node.ask(f"announce 47001 2 {new}")
    peer = watcher.ask(f"wait {node.node_id} 2 10")
    assert peer is not None and peer["branches"] == [new]
    fresh = agents("h3")
    assert fresh.ask(f"holders {new} 5 lan") == [node.node_id]
    assert fresh.ask(f"holders {old} 1.0 lan") == []


@pytest.mark.lab
def test_many_branches_stay_within_one_packet_and_subtype_limit(lab: Lab, agents):
    branches = [branch() for _ in range(MAX_SUBTYPES + 4)]
    node = agents("h1", new_id())
    node.ask(f"announce 47001 5 {','.join(branches)}")
    asker = agents("h2")
    assert asker.ask(f"holders {branches[0]} 5 lan") == [node.node_id]
    assert asker.ask(f"holders {branches[MAX_SUBTYPES - 1]} 5 lan") == [node.node_id]
    assert asker.ask(f"holders {branches[MAX_SUBTYPES]} 1.0 lan") == []  # beyond the subtype limit
    peer = asker.ask(f"wait {node.node_id} 5 10")
    assert peer is not None, "the TXT record did not arrive whole"
    in_txt = len(peer["branches"])
    assert MAX_SUBTYPES <= in_txt < len(branches) and peer["branches"] == branches[:in_txt]


@pytest.mark.lab
def test_sigterm_sends_goodbye(lab: Lab, agents):
    node = agents("h1", new_id())
    watcher = agents("h2")
    node.ask("announce 47001 1 -")
    assert watcher.ask(f"wait {node.node_id} 1 10") is not None
    assert node.stop() == 0
    assert watcher.ask(f"gone {node.node_id} 5") == {"gone": True}


@pytest.mark.lab
def test_sigkill_sends_no_goodbye_so_mdns_is_only_a_hint(lab: Lab, agents):
    node = agents("h1", new_id())
    watcher = agents("h2")
    node.ask("announce 47001 1 -")
    assert watcher.ask(f"wait {node.node_id} 1 10") is not None
    node.proc.kill()
    node.proc.wait(5)
    assert watcher.ask(f"gone {node.node_id} 2") == {"gone": False}  # liveness must come from HTTPS


@pytest.mark.lab
def test_new_address_is_announced_without_a_restart(lab: Lab, agents):
    node = agents("h1", new_id())
    watcher = agents("h2")
    node.ask("announce 47001 1 -")
    assert watcher.ask(f"wait {node.node_id} 1 10") is not None
    extra = "10.77.0.99"
    lab.run("h1", "ip", "addr", "add", f"{extra}/24", "dev", "eth0", check=True)
    try:
        peer = watcher.ask(f"addr {node.node_id} {extra} 20")
    finally:
        lab.run("h1", "ip", "addr", "del", f"{extra}/24", "dev", "eth0")
    assert peer is not None, "the new address was not announced"
    assert set(peer["addresses"]) == {lab.addr("h1"), extra}


LAN_PEERS = """
import asyncio, json, sys
from p2pnode.discovery.mdns import lan_peers
peers = asyncio.run(lan_peers(sys.argv[1], lambda node_id: node_id in sys.argv[2:], timeout=1.5))
print(json.dumps([[p.node_id, p.host, p.port] for p in peers]))
"""


@pytest.mark.lab
def test_one_shot_lan_peers_asks_holders_then_every_trusted_peer(lab: Lab, agents):
    held, old = branch(), branch()
    holder, other = agents("h1", new_id()), agents("h3", new_id())
    holder.ask(f"announce 47001 1 {held}")
    other.ask("announce 47003 1 -")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))

    def lan_peers(b: str, *trusted: str) -> list[list[object]]:
        r = lab.run("h2", sys.executable, "-c", LAN_PEERS, b, *trusted, env=env)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    assert lan_peers(held, holder.node_id, other.node_id) == [[holder.node_id, lab.addr("h1"), 47001]]
    assert lan_peers(held, other.node_id) == [[other.node_id, lab.addr("h3"), 47003]]  # holder untrusted
    # a branch nobody announces (e.g. older than the subtype window): every trusted peer seen
    assert sorted(lan_peers(old, holder.node_id, other.node_id)) == sorted(
        [[holder.node_id, lab.addr("h1"), 47001], [other.node_id, lab.addr("h3"), 47003]])
