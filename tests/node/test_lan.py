"""Issue 6 scenarios: real `p2pnode serve` processes in lab namespaces, real mDNS, real mTLS.

h1..h3 run nodes that all trust each other, h4 runs a node nobody trusts, h5 is a LAN host
that does not run p2pnode.  Every wait is a bounded poll; every node is stopped at the end.
"""
from __future__ import annotations

import configparser
import json
import os
import plistlib
import shlex
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import pytest
from lab import Lab
from lannode import REPO, LanNode, grow, place, running, wait_for

from p2pnode.node.daemon import LIVENESS_INTERVAL
from p2pnode.paths import NodePaths

BETA = "sessions/--tmp-pi-harness-work-beta--/"
SMALL = BETA + "2026-11-21T19-26-46-592Z_01a1ff93-4f3f-74a0-8c1a-0b533764bed8.jsonl"
FORK_OF_SMALL = BETA + "2026-11-21T19-26-52-475Z_01a1ff93-663b-7434-a15c-ca966db56817.jsonl"
BIG_BASE = ("sessions/--tmp-pi-harness-work-alpha--/"
            "2026-11-21T19-26-31-001Z_01a1ff93-1258-73ae-a9a4-6ce4a586df6a.jsonl")
OTHER_BASE = ("sessions/--tmp-pi-harness-work-alpha--/"
              "2026-11-21T19-26-40-099Z_01a1ff93-35e2-7622-81e5-d27867041d79.jsonl")
BIG_MB = 16
LIVENESS_ROUND = LIVENESS_INTERVAL + 0.5  # long enough for every node to probe every peer it knows
LINK_MBIT = 40  # holders' links are slowed so a cut lands mid-transfer (tc tbf; netem is absent)


def fetched_file(node: LanNode, result: dict[str, Any]) -> bytes:
    path = Path(result["path"])
    assert path.is_relative_to(node.agent / "sessions"), path
    return path.read_bytes()


class Counter:
    """h5: a host that does not run p2pnode; it listens on p2pnode's port and counts callers."""

    CODE = """
import signal, socket, sys, time
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 47470)); s.listen(); s.settimeout(0.5)
n, end = 0, time.monotonic() + float(sys.argv[1])
print("ready", flush=True)
while not stop and time.monotonic() < end:
    try:
        c, _ = s.accept(); n += 1; c.close()
    except socket.timeout:
        pass
print(n, flush=True)
"""

    def __init__(self, lab: Lab, life: float):
        self.proc = lab.spawn("h5", sys.executable, "-c", self.CODE, str(life))
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"

    def stop(self) -> int:
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=10)
        return int(out.split()[-1]) if out.split() and out.split()[-1].isdigit() else -1


@pytest.fixture(scope="module")
def net(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, LanNode]]:
    root = tmp_path_factory.mktemp("lan")
    nodes = {h: LanNode(lab, h, root) for h in ("h1", "h2", "h3", "h4")}
    h1, h2, h3, h4 = nodes.values()
    for node in (h1, h2, h3):
        node.trust(*(n for n in (h1, h2, h3) if n is not node))
    h4.trust(h1)  # h4 trusts h1, but nobody trusts h4
    try:
        with running(nodes.values()):  # all four start at once
            yield nodes
    finally:
        for host in ("h1", "h2"):
            lab.rate(host, 0)


pytestmark = pytest.mark.lab


def test_nodes_see_and_confirm_each_other(net: dict[str, LanNode]):
    h1, h2, h3, h4 = net.values()
    for a in (h1, h2, h3):
        for b in (h1, h2, h3):
            if a is not b:
                def confirmed(a: LanNode = a, b: LanNode = b) -> dict[str, Any] | None:
                    p = a.peer(b)
                    return p if p and p["online"] else None

                peer = wait_for(f"{a.host} to confirm {b.host} over HTTPS", confirmed, 30)
                assert peer["trusted"] and peer["addresses"] == [a.lab.addr(b.host)]
    status = h1.status()
    assert status["node_id"] == h1.node_id and status["port"] == 47470
    assert status["addresses"] == [h1.lab.addr("h1")]


def test_share_then_fetch_by_hash_alone_over_mdns(net: dict[str, LanNode], corpus_dir: Path):
    h1, h2, h3, _ = net.values()
    src = place(corpus_dir, SMALL, h1.agent)
    branch = h1.share(src)
    assert branch in [b["branch"] for b in h1.status()["shared"]]
    for fetcher in (h3, h2):
        r = fetcher.fetch(branch)
        assert r.returncode == 0, r.stderr
        result = json.loads(r.stdout)
        assert fetched_file(fetcher, result) == src.read_bytes()
        assert blake3.blake3(src.read_bytes()).hexdigest() == result["src"]
    # the read commands work while the node holds the store: they go through it
    listed = json.loads(h3.cli("ls", "--all", "--json").stdout)  # fetched: held, not offered on
    assert branch in [b["branch"] for b in listed]
    assert h3.cli("cat", branch).stdout == src.read_text()


def test_holder_cut_mid_transfer_fetch_completes_from_the_other(net: dict[str, LanNode], corpus_dir: Path):
    h1, h2, h3, _ = net.values()
    lab = h1.lab
    src = place(corpus_dir, BIG_BASE, h1.agent)
    grow(src, BIG_MB)
    branch = h1.share(src)
    r = h2.fetch(branch, timeout=120)
    assert r.returncode == 0, r.stderr
    assert h2.share(Path(json.loads(r.stdout)["path"])) == branch  # fetched: offered on only if shared
    for host in ("h1", "h2"):
        lab.rate(host, LINK_MBIT)
    fetch = lab.spawn("h3", sys.executable, "-m", "p2pnode", "fetch", branch, "--json", env=h3.env)
    try:
        before = {h: lab.tx_bytes(h) for h in ("h1", "h2")}
        serving = wait_for("h3's transfer to start", lambda: next(
            (h for h in ("h1", "h2") if lab.tx_bytes(h) - before[h] > 2 << 20), None), 60, every=0.05)
        lab.cut(serving)
        out, err = fetch.communicate(timeout=120)
    finally:
        if fetch.poll() is None:
            fetch.kill()
        lab.heal("h1")
        lab.heal("h2")
    assert fetch.returncode == 0, err
    assert fetched_file(h3, json.loads(out)) == src.read_bytes()
    other = "h2" if serving == "h1" else "h1"
    assert lab.tx_bytes(other) - before[other] > 1 << 20, "the other holder sent nothing"


def test_fetching_node_killed_mid_transfer_leaves_nothing_half_written(net: dict[str, LanNode],
                                                                       corpus_dir: Path, tmp_path: Path):
    h1, h2, _, _ = net.values()
    lab = h1.lab
    src = place(corpus_dir, OTHER_BASE, h1.agent)  # another large session, new to everyone
    grow(src, BIG_MB // 2)
    branch = h1.share(src)
    files_before = set(h2.agent.rglob("*"))
    lab.rate("h1", LINK_MBIT)
    fetch = lab.spawn("h2", sys.executable, "-m", "p2pnode", "fetch", branch, "--json", env=h2.env)
    try:
        before = lab.tx_bytes("h1")
        wait_for("h2's transfer to start", lambda: lab.tx_bytes("h1") - before > 2 << 20, 60, every=0.05)
        h2.stop(signal.SIGKILL)  # the node doing the fetch dies mid-transfer
        _, err = fetch.communicate(timeout=30)
    finally:
        if fetch.poll() is None:
            fetch.kill()
        lab.rate("h1", 0)
    assert fetch.returncode == 6 and ("did not answer" in err or "stopped before fetch ended" in err), err
    assert set(h2.agent.rglob("*")) == files_before  # no partial or temp file where Pi looks
    h2.start()  # the store and state come back after the kill
    r = h2.fetch(branch, timeout=120)
    assert r.returncode == 0, r.stderr
    assert fetched_file(h2, json.loads(r.stdout)) == src.read_bytes()


def test_vanished_peer_is_noticed_and_a_restart_on_a_new_port_is_found(net: dict[str, LanNode]):
    h1, h2, h3, _ = net.values()
    wait_for("h1 to confirm h2", lambda: (p := h1.peer(h2)) and p["online"], 30)
    h2.stop(signal.SIGKILL)  # no goodbye: only HTTPS liveness can tell
    gone = wait_for("h1 to notice h2 vanished", lambda: (p := h1.peer(h2)) and p["online"] is False and p, 20)
    assert gone["trusted"]
    assert h2.paths.control_socket.exists()  # left behind by the kill ...
    assert h2.status()["running"] is False  # ... and recognised as nobody listening
    h2.start(port=47471)
    back = wait_for("h1 to find h2 on its new port",
                    lambda: (p := h1.peer(h2)) and p["port"] == 47471 and p["online"] and p, 30)
    assert back["addresses"] == [h1.lab.addr("h2")]


def test_sigterm_sends_goodbye_and_stops_cleanly(net: dict[str, LanNode]):
    h1, _, h3, _ = net.values()
    wait_for("h1 to see h3", lambda: h1.peer(h3), 30)
    assert h3.stop(signal.SIGTERM) == 0
    assert not h3.paths.control_socket.exists()
    wait_for("h1 to drop h3 after its goodbye",
             lambda: (p := h1.peer(h3)) is None or p["addresses"] == [], 10)
    h3.start()


def test_untrusted_node_is_seen_but_refused(net: dict[str, LanNode], corpus_dir: Path):
    h1, h2, _, h4 = net.values()
    seen = wait_for("h1 to list h4", lambda: h1.peer(h4), 30)
    assert seen["trusted"] is False and seen["online"] is None
    text = h1.cli("status").stdout
    assert h4.node_id in text and "UNTRUSTED" in text
    listed = {p["id"]: p for p in json.loads(h1.cli("peers", "--json").stdout)}
    assert listed[h4.node_id]["trusted"] is False and listed[h4.node_id]["addresses"] == [h1.lab.addr("h4")]
    assert listed[h2.node_id]["trusted"] is True
    branch = h1.share(place(corpus_dir, SMALL, h1.agent))
    r = h4.fetch(branch)
    assert r.returncode != 0 and h1.node_id[:7] in r.stderr, r.stderr
    assert not list(h4.agent.rglob("*.jsonl"))
    assert f"peer {h4.node_id} is not trusted" in h1.log.read_text()


def test_host_without_p2pnode_is_untouched(net: dict[str, LanNode], corpus_dir: Path):
    h1, h2, h3, _ = net.values()
    counter = Counter(h1.lab, life=60)
    place(corpus_dir, SMALL, h1.agent)
    child = place(corpus_dir, FORK_OF_SMALL, h1.agent)
    branch = h1.share(child)  # with its parent: a fetch of a fork lineage
    r = h3.fetch(branch)
    assert r.returncode == 0, r.stderr
    assert fetched_file(h3, json.loads(r.stdout)) == child.read_bytes()
    time.sleep(LIVENESS_ROUND)
    assert counter.stop() == 0
    for node in (h1, h2, h3):
        assert all(p["addresses"] != [h1.lab.addr("h5")] for p in node.status()["peers"])


def test_one_shot_fetch_and_status_without_a_node(net: dict[str, LanNode], corpus_dir: Path,
                                                  tmp_path: Path):
    h1 = net["h1"]
    loner = LanNode(h1.lab, "h5", tmp_path)  # never started: every command acts on its own
    loner.trust(h1)
    h1.trust(loner)
    status = loner.status()
    assert status["running"] is False and status["node_id"] == loner.node_id
    assert [(p["node_id"], p["trusted"], p["online"]) for p in status["peers"]] == [(h1.node_id, True, None)]
    src = place(corpus_dir, SMALL, h1.agent)
    branch = h1.share(src)
    r = loner.fetch(branch)  # browses mDNS itself for the holder
    assert r.returncode == 0, r.stderr
    assert fetched_file(loner, json.loads(r.stdout)) == src.read_bytes()
    assert loner.cli("cat", branch).stdout == src.read_text()


def test_serve_on_a_fresh_machine_needs_no_configuration(lab: Lab, tmp_path: Path):
    """The README's quick start: `p2pnode serve` with nothing set up, then Ctrl-C."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("P2PNODE_HOME", "PI_CODING_AGENT_DIR", "XDG_STATE_HOME")}
    env.update(HOME=str(tmp_path), PYTHONPATH=str(REPO))
    proc = lab.spawn("h5", sys.executable, "-m", "p2pnode", "serve", env=env)
    try:
        def answers() -> dict[str, Any] | None:
            if proc.poll() is not None:
                raise AssertionError(f"serve exited {proc.returncode}: {proc.communicate()[1]}")
            r = lab.run("h5", sys.executable, "-m", "p2pnode", "status", "--json", env=env)
            return json.loads(r.stdout) if r.returncode == 0 and json.loads(r.stdout)["running"] else None

        status = wait_for("the fresh node to answer", answers, 30)
        assert Path(status["home"]).is_relative_to(tmp_path) and status["port"] == 47470
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    assert proc.returncode == 0, err
    assert "serving on port 47470" in err and "Traceback" not in err
    assert not NodePaths(Path(status["home"])).control_socket.exists()


def test_taken_port_and_second_node_for_one_home(lab: Lab, tmp_path: Path):
    squatter = Counter(lab, life=60)  # something else already listens on 47470 on h5
    node = LanNode(lab, "h5", tmp_path)
    try:
        node.start()  # the default port is taken: a free one instead
        port = node.status()["port"]
        assert port not in (47470, 0)
        again = node.cli("serve", timeout=30)
        assert again.returncode == 7 and "stop that node first" in again.stderr
        other = LanNode(lab, "h5", tmp_path / "other")
        explicit = other.cli("serve", "--port", str(port), timeout=30)
        assert explicit.returncode == 7, explicit.stderr
        assert f"cannot listen on 0.0.0.0:{port}: port {port} is taken" in explicit.stderr
    finally:
        assert node.stop() == 0
        squatter.stop()


def test_service_files_start_serve():
    unit = configparser.ConfigParser(interpolation=None)
    unit.read(REPO / "scripts" / "p2pnode.service")
    assert unit["Service"]["ExecStart"].endswith("p2pnode serve")
    assert unit["Service"]["KillSignal"] == "SIGTERM"
    plist = plistlib.loads((REPO / "scripts" / "com.p2pnode.node.plist").read_bytes())
    shell, flag, script = plist["ProgramArguments"]  # through sh, so that $HOME expands
    assert (shell, flag) == ("/bin/sh", "-c") and plist["RunAtLoad"] is True
    assert shlex.split(script)[:3] == ["exec", "$HOME/.local/bin/p2pnode", "serve"]
