"""The running node's fetches as transfers: streamed to the waiting CLI, cancelled by its Ctrl-C,
left running with --background and listed by `status`.  Real processes on loopback: the sharer
runs `serve-peers` behind a relay that throttles what it sends (a slow peer), the fetcher runs
`p2pnode serve` (no mDNS) and the CLI talks to it over its control socket."""
from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from pathlib import Path

import pytest
from procnode import PY, Node
from relay import Relay

from p2pnode.node.control_client import call_node
from p2pnode.paths import NodePaths
from p2pnode.peer.trust import TrustStore

HEADER = (b'{"type":"session","version":3,"id":"slow","timestamp":"2026-11-21T20:00:00.000Z",'
          b'"cwd":"/w/slowproj"}\n')


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Node, Node, str]:
    """A shares a 4 MB incompressible session; A and B trust each other."""
    a, b = Node(tmp_path, "a"), Node(tmp_path, "b")
    for x, y in ((a, b), (b, a)):
        TrustStore(NodePaths(x.home).trust).trust(y.id, name=f"{y.home.parent.name}-laptop")
    rnd = random.Random(12)
    path = a.agent / "sessions" / "--w-slowproj--" / "2026-11-21T20-00-00-000Z_slow.jsonl"
    path.parent.mkdir(parents=True)
    path.write_bytes(HEADER + b"".join(b'{"type":"custom","data":"' + rnd.randbytes(150_000).hex().encode()
                                       + b'"}\n' for _ in range(14)))
    branch = a.run("share", str(path)).stdout.split()[0]
    return a, b, branch


async def _until(check, what: str, seconds: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"not within {seconds} s: {what}"
        await asyncio.sleep(0.1)


def _status(node: Node) -> dict:
    return json.loads(node.run("status", "--json").stdout)


async def test_ctrl_c_on_the_waiting_cli_stops_the_nodes_transfer(pair) -> None:
    a, b, branch = pair
    with a.serving() as port, b.node_running():
        async with (relay := Relay(port, rate=150_000)) as slow_port:
            cli = await asyncio.create_subprocess_exec(
                PY, "-m", "p2pnode", "fetch", branch[:12], "--from", f"127.0.0.1:{slow_port}", env=b.env,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            await _until(lambda: any(t["bytes_done"] for t in _status(b)["transfers"]),
                         "the node verified the first lines")
            running = _status(b)["transfers"]
            assert [t["branch"] for t in running] == [branch] and running[0]["state"] == "running"
            assert 0 < running[0]["bytes_done"] < running[0]["bytes_total"]
            assert running[0]["peers"] == [f"127.0.0.1:{slow_port}"]
            cli.send_signal(signal.SIGINT)
            _, err = await asyncio.wait_for(cli.communicate(), 30)
            assert cli.returncode == 130, err
            assert b"cancelled" in err and b"Traceback" not in err
            # the node let go of the peer: no connection left, nothing more relayed
            await _until(lambda: relay.open == 0, "the node closed its connections to the peer", 15)
            relayed = relay.relayed
            await asyncio.sleep(1.0)
            assert relay.relayed == relayed
        assert _status(b)["transfers"] == []
        assert json.loads(b.run("ls", "--all", "--json").stdout) == []
    assert not list(b.agent.rglob("*.jsonl"))


async def test_background_fetch_returns_at_once_and_status_shows_it(pair) -> None:
    a, b, branch = pair
    with a.serving() as port, b.node_running():
        async with (relay := Relay(port, rate=600_000)) as slow_port:
            started = json.loads(b.run("fetch", branch, "--from", f"127.0.0.1:{slow_port}", "--background",
                                       "--json").stdout)
            assert started["branch"] == branch and started["background"] is True
            assert relay.relayed < 3_000_000  # returned long before the slow peer could send it all
            await _until(lambda: relay.relayed > 200_000, "the background transfer moved bytes")
            listed = {t["id"]: t for t in _status(b)["transfers"]}
            assert listed[started["id"]]["background"] is True
            assert listed[started["id"]]["state"] in ("running", "done")
            assert "background" in b.run("status").stdout
            def state() -> str:
                return {t["id"]: t for t in _status(b)["transfers"]}[started["id"]]["state"]

            await _until(lambda: state() == "done", "the background transfer finished", 60)
        ended = {t["id"]: t for t in _status(b)["transfers"]}[started["id"]]
        assert ended["bytes_done"] == ended["bytes_total"] > 4_000_000
        placed = list(b.agent.rglob("*.jsonl"))
        assert len(placed) == 1 and placed[0].read_bytes() == next(a.agent.rglob("*.jsonl")).read_bytes()


def test_fetch_through_the_node_streams_and_the_one_reply_form_still_works(pair, tmp_path: Path) -> None:
    a, b, branch = pair
    c = Node(tmp_path, "c")
    TrustStore(NodePaths(c.home).trust).trust(a.id)
    TrustStore(NodePaths(a.home).trust).trust(c.id)
    with a.serving() as port, b.node_running(), c.node_running():
        streamed = b.fetch_json(branch[:10], "--from", f"127.0.0.1:{port}")  # a prefix, via the node
        assert streamed["branch"] == branch and streamed["fetched"] == [branch]
        one_reply = call_node(NodePaths(c.home), "fetch", {"branch": branch, "peers": [f"127.0.0.1:{port}"]})
        assert one_reply is not None and one_reply["branch"] == branch and one_reply["fetched"] == [branch]
        assert _status(b)["transfers"] == [] and _status(c)["transfers"] == []
        missing = b.run("fetch", "0123abcd", "--from", f"127.0.0.1:{port}", check=False)
        assert missing.returncode == 3 and "no branch matching '0123abcd'" in missing.stderr


def test_background_needs_a_running_node(pair) -> None:
    _, b, branch = pair
    proc = b.run("fetch", branch, "--from", "127.0.0.1:9", "--background", check=False)
    assert proc.returncode == 6 and "needs a running node" in proc.stderr  # as follow and share --live
