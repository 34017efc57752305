"""Real node processes on loopback: share on one, fetch on others over mutual TLS.

Every node is its own `p2pnode` process with its own P2PNODE_HOME and Pi agent dir; the
sharer runs `p2pnode serve-peers`.  Sessions are the real Pi files from the corpus.
"""
from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import blake3
import pytest
import zstandard
from corpus import A3, B1, B2, B3, B5
from procnode import PY, Node
from relay import Relay

from p2pnode.paths import NodePaths
from p2pnode.peer import wire
from p2pnode.peer.identity import load_or_create_identity
from p2pnode.peer.nodeid import parse_node_id
from p2pnode.peer.trust import TrustStore


@pytest.fixture
def nodes(tmp_path: Path, corpus_dir: Path) -> tuple[Node, Node, Node]:
    """A holds a copy of the corpus sessions; A, B and C trust each other."""
    a, b, c = (Node(tmp_path, n) for n in "abc")
    shutil.copytree(corpus_dir / "sessions", a.agent / "sessions")
    for x in (a, b, c):  # as `p2pnode trust` does (the commands themselves: test_peer_commands)
        for y in (a, b, c):
            if x is not y:
                TrustStore(NodePaths(x.home).trust).trust(y.id)
    return a, b, c


def test_peer_commands(tmp_path: Path) -> None:
    a = Node(tmp_path, "a")
    assert a.run("id").stdout.strip() == a.id
    other = load_or_create_identity(tmp_path / "other").node_id
    assert a.run("trust", other.lower().replace("-", ""), "--name", "laptop").stdout.strip() == (
        f"trusted {other} (laptop)")
    assert json.loads(a.run("peers", "--json").stdout)[0]["name"] == "laptop"
    bad = a.run("trust", other[:-1] + ("A" if other[-1] != "A" else "B"), check=False)
    assert bad.returncode == 4 and "check character" in bad.stderr
    assert a.run("untrust", other).returncode == 0
    assert a.run("untrust", other, check=False).returncode == 3
    assert json.loads(a.run("peers", "--json").stdout) == []


def test_fetch_lineage_byte_identical(nodes, corpus_dir: Path) -> None:
    a, b, _ = nodes
    branch = a.run("share", str(a.agent / B5)).stdout.split()[0]
    with a.serving() as port:
        result = b.fetch_json(branch, "--from", f"127.0.0.1:{port}")
    assert result["branch"] == branch and len(result["fetched"]) == 4  # B5 → B3 → B2 → B1
    assert result["fetched"][0] == branch and result["conflict"] is None
    placed = Path(result["path"])
    assert placed == b.agent / B5  # Pi's own layout, rebuilt from the header
    assert placed.read_bytes() == (corpus_dir / B5).read_bytes()
    assert not list(b.agent.glob("*.jsonl"))  # nothing in the agent dir root
    for rel, fetched in zip((B3, B2, B1), result["fetched"][1:], strict=True):  # ancestors, verbatim
        assert b.run("cat", fetched).stdout.encode() == (corpus_dir / rel).read_bytes()
    assert json.loads(b.run("ls", "--json").stdout) == []  # fetched branches are not offered on
    ls = json.loads(b.run("ls", "--all", "--json").stdout)
    assert {i["branch"] for i in ls} == set(result["fetched"]) and not any(i["offered"] for i in ls)
    # the same fetch again: nothing to move, the file is already there
    with a.serving() as port:
        again = b.fetch_json(branch, "--from", f"127.0.0.1:{port}")
    assert again["fetched"] == [] and again["bytes_received"] == 0 and again["written"] is False


def test_ticket_and_peer_order(nodes, corpus_dir: Path) -> None:
    """C fetches by ticket; a dead address listed first is skipped, the next one serves."""
    a, _, c = nodes
    branch = a.run("share", str(a.agent / B2)).stdout.split()[0]
    with a.serving() as port:
        dead = _free_port()
        ticket = wire.encode_ticket(wire.Ticket(bytes.fromhex(branch), parse_node_id(a.id),
                                                (("127.0.0.1", dead), ("127.0.0.1", port))))
        out = c.run("fetch", ticket).stdout
    assert f"pi --fork {c.agent / B2}" in out
    assert (c.agent / B2).read_bytes() == (corpus_dir / B2).read_bytes()


def test_wrong_node_at_address_is_refused(nodes) -> None:
    """A ticket naming B while A answers at the address: refused, nothing stored or written."""
    a, b, c = nodes
    branch = a.run("share", str(a.agent / B2)).stdout.split()[0]
    with a.serving() as port:
        proc = c.run("fetch", branch, "--from", f"{b.id}@127.0.0.1:{port}", check=False)
    assert proc.returncode == 8, proc.stderr
    assert "expected" in proc.stderr and b.id in proc.stderr
    assert not (c.agent / "sessions").exists()
    assert json.loads(c.run("ls", "--json").stdout) == []


def _grow(path: Path, n: int, seed: int) -> bytes:
    """Append n Pi-like lines of fresh (poorly compressible) text; returns the new bytes."""
    import random

    rnd = random.Random(seed)
    new = b""
    for i in range(n):
        words = ["edit", "file", "the", "tool", "result"]
        text = " ".join(rnd.choice(words + [str(rnd.random())]) for _ in range(900))
        line = {"type": "message", "id": f"{seed:04x}{i:04x}", "parentId": None,
                "timestamp": "2026-11-21T20:00:00.000Z", "message": {"role": "user", "content": text}}
        new += (json.dumps(line, separators=(",", ":")) + "\n").encode()
    with open(path, "ab") as f:
        f.write(new)
    return new


def test_grown_version_moves_only_new_lines(nodes) -> None:
    a, b, _ = nodes
    session = a.agent / A3
    v1 = a.run("share", str(session)).stdout.split()[0]
    with a.serving() as port:
        first = b.fetch_json(v1, "--from", f"127.0.0.1:{port}")
    new = _grow(session, 3, seed=1)
    v2 = a.run("share", str(session)).stdout.split()[0]
    with a.serving() as port:
        second = b.fetch_json(v2, "--from", f"127.0.0.1:{port}")
    assert second["fetched"] == [v2] and second["lines_fetched"] == 3
    lines = second["lines_total"]
    compressed_new = sum(len(zstandard.ZstdCompressor().compress(ln)) for ln in new.splitlines(keepends=True))
    # the manifest costs 36 bytes a line, the sidecar ~116, each frame 42: far below the goal
    assert second["bytes_received"] <= 1.1 * compressed_new + 40 * lines
    assert first["bytes_received"] > 10 * second["bytes_received"]
    # the older fetched copy (a prefix, held by this node) is replaced by the grown one
    assert second["written"] and (b.agent / A3).read_bytes() == session.read_bytes()


def test_a_session_of_its_header_alone_and_its_next_version_are_fetched(nodes) -> None:
    """`pi --session <empty file>` leaves the header alone: one line, whose hash is the session's
    (the line was offered as the session only, so no peer could fetch it, nor its next version)."""
    a, b, _ = nodes
    session = a.agent / "sessions" / "--tmp-p--" / "2026-11-28T17-00-00-000Z_hdr-1.jsonl"
    session.parent.mkdir()
    session.write_bytes(b'{"type":"session","version":3,"id":"hdr-1","timestamp":"2026-11-28T17:00:00.000Z",'
                        b'"cwd":"/tmp/p"}\n')
    for version in (1, 2):
        branch = a.run("share", str(session)).stdout.split()[0]
        with a.serving() as port:
            got = b.fetch_json(branch, "--from", f"127.0.0.1:{port}")
        assert Path(got["path"]).read_bytes() == session.read_bytes(), version
        _grow(session, 1, seed=version)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _fetch_via(proxy: Relay, node: Node, target: str) -> dict:
    """`p2pnode fetch TARGET --json` by `node`, from the peer behind the started `proxy`,
    which is closed afterwards; the fetch's result."""
    proxy_port = await proxy.start()
    try:
        proc = await asyncio.create_subprocess_exec(
            PY, "-m", "p2pnode", "fetch", target, "--from", f"127.0.0.1:{proxy_port}", "--json",
            env=node.env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        await proxy.close()
    assert proc.returncode == 0, err
    return json.loads(out)


async def test_cut_link_resumes_without_starting_over(nodes) -> None:
    a, b, c = nodes
    branch = a.run("share", str(a.agent / A3)).stdout.split()[0]
    with a.serving() as port:
        clean = c.fetch_json(branch, "--from", f"127.0.0.1:{port}")
        proxy = Relay(port, drop_first_after=clean["bytes_received"] // 2)
        resumed = await _fetch_via(proxy, b, branch)
    assert proxy.connections >= 2  # the link was cut and a new connection made
    # no verified line was fetched twice: the retry asked only for what was still missing
    assert resumed["lines_fetched"] == clean["lines_fetched"]
    biggest_line = max(len(ln) for ln in (a.agent / A3).read_bytes().splitlines())
    assert resumed["bytes_received"] < clean["bytes_received"] + biggest_line
    data = (b.agent / A3).read_bytes()
    assert blake3.blake3(data).hexdigest() == resumed["src"] == clean["src"]


def test_share_prints_a_ticket_when_a_node_runs(nodes) -> None:
    """With `p2pnode serve` running, `share` (routed through the node) prints a ticket naming
    the branch and this node; without a running node it prints the hash alone."""
    a, _, _ = nodes
    alone = a.run("share", str(a.agent / B2)).stdout.split()
    assert len(alone) == 1
    with a.node_running():
        out = a.run("share", str(a.agent / B3)).stdout.split()
    branch, ticket = out
    decoded = wire.decode_ticket(ticket)
    assert decoded.branch.hex() == branch and decoded.node == parse_node_id(a.id)
    assert decoded.addresses and all(port > 0 for _, port in decoded.addresses)


async def test_fetch_killed_mid_transfer_leaves_nothing(nodes, tmp_path: Path) -> None:
    """SIGKILL the fetching process halfway: no session file (whole or partial) under Pi's
    sessions dir, nothing in its store; the next fetch completes, byte-identical."""
    import random
    import signal

    a, b, _ = nodes
    rnd = random.Random(7)
    path = a.agent / "sessions" / "--w--" / "2026-11-21T20-00-00-000Z_big.jsonl"
    path.parent.mkdir(parents=True)
    header = b'{"type":"session","version":3,"id":"big","timestamp":"2026-11-21T20:00:00.000Z","cwd":"/w"}\n'
    path.write_bytes(header + b"".join(b'{"type":"custom","data":"' + rnd.randbytes(200_000).hex().encode()
                                       + b'"}\n' for _ in range(60)))  # 24 MB, incompressible
    branch = a.run("share", str(path)).stdout.split()[0]
    with a.serving() as port:
        proxy = Relay(port, notify_at=8_000_000)
        proxy_port = await proxy.start()
        try:
            proc = await asyncio.create_subprocess_exec(
                PY, "-m", "p2pnode", "fetch", branch, "--from", f"127.0.0.1:{proxy_port}", env=b.env,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
            await asyncio.wait_for(proxy.reached.wait(), 60)
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
        finally:
            await proxy.close()
        assert not list((b.agent).rglob("*.jsonl"))
        assert json.loads(b.run("ls", "--all", "--json").stdout) == []
        result = b.fetch_json(branch, "--from", f"127.0.0.1:{port}")
    assert Path(result["path"]).read_bytes() == path.read_bytes()


async def test_one_shot_fetch_of_a_prefix_makes_one_connection_per_peer(nodes, corpus_dir: Path) -> None:
    """`fetch <prefix>` with no node: the catalogs read (the prefix, the newest version) and the
    fetch that follows use one TLS connection to the peer (link.Connections), not one per step."""
    a, b, _ = nodes
    branch = a.run("share", str(a.agent / B2)).stdout.split()[0]
    with a.serving() as port:
        proxy = Relay(port)
        result = await _fetch_via(proxy, b, branch[:12])
    assert result["branch"] == branch and len(result["fetched"]) == 2  # B2 → B1: several steps, one link
    assert Path(result["path"]).read_bytes() == (corpus_dir / B2).read_bytes()
    assert proxy.connections == 1
