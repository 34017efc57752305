"""What teammates see: `browse` / `ls --peers` (with --from, and through a running node), `share`
ending with the line the teammate types, and `fetch` by a hash prefix or a Pi session id.
Real `p2pnode` processes on loopback with the real Pi files of the corpus."""
from __future__ import annotations

import io
import json
import re
import shutil
from contextlib import redirect_stdout
from pathlib import Path

import pytest
from corpus import A3, B5
from procnode import Node

from p2pnode.cli.browse import age, print_offers
from p2pnode.paths import NodePaths
from p2pnode.peer.trust import TrustStore


@pytest.fixture
def team(tmp_path: Path, corpus_dir: Path) -> tuple[Node, Node]:
    """alice holds the corpus; alice and bob trust each other by name."""
    a, b = Node(tmp_path, "alice"), Node(tmp_path, "bob")
    shutil.copytree(corpus_dir / "sessions", a.agent / "sessions")
    TrustStore(NodePaths(a.home).trust).trust(b.id, name="bob")
    TrustStore(NodePaths(b.home).trust).trust(a.id, name="alice")
    return a, b


def test_browse_lists_what_a_peer_offers(team: tuple[Node, Node]) -> None:
    a, b = team
    a.run("share", str(a.agent / B5))
    a.run("share", str(a.agent / A3))
    offered = {x["branch"]: x for x in json.loads(a.run("ls", "--json").stdout)}
    with a.serving() as port:
        seen = json.loads(b.run("browse", "--from", f"127.0.0.1:{port}", "--json").stdout)
        alias = json.loads(b.run("ls", "--peers", "--from", f"127.0.0.1:{port}", "--json").stdout)
        by_name = json.loads(b.run("browse", "--from", f"alice@127.0.0.1:{port}", "--json").stdout)
        assert by_name["branches"] == seen["branches"]  # NAME@HOST:PORT, as fetch takes it
        text = b.run("browse", "--from", f"127.0.0.1:{port}").stdout
        with b.node_running():
            via_node = json.loads(b.run("browse", "--from", f"127.0.0.1:{port}", "--json").stdout)
    assert seen == alias == via_node
    rows = {r["branch"]: r for r in seen["branches"]}
    assert rows.keys() == offered.keys() and len(rows) == 5  # B5, its three ancestors, A3
    beta = rows[next(b for b, x in offered.items() if x["header"]["id"].startswith("01a1ff93-69ef"))]
    assert beta["name"] == "alice" and beta["node_id"] == a.id and beta["short_id"] == a.id[:7]
    assert beta["project"] == "beta" and beta["cwd"] == "/tmp/pi-harness/work/beta"
    assert beta["versions"] == 1 and beta["size"] == 1317
    assert beta["lines"] == offered[beta["branch"]]["lines"]
    assert beta["title"] == offered[beta["branch"]]["title"]
    assert seen["peers"] == [{"node_id": a.id, "name": "alice", "short_id": a.id[:7],
                              "addresses": [f"127.0.0.1:{port}"], "error": None, "exit_code": None,
                              "offers": 5}]
    assert text.splitlines()[0].split()[:4] == ["WHO", "BRANCH", "AGE", "LINES"]
    assert sum(f"alice ({a.id[:7]})" in line and "beta" in line for line in text.splitlines()) == 4


def test_browse_reports_an_unreachable_peer_and_needs_peers_without_a_node(team: tuple[Node, Node]) -> None:
    _, b = team
    nobody = b.run("browse", check=False)
    assert nobody.returncode == 6 and "--from" in nobody.stderr
    with b.node_running():  # a node, but no trusted peer online: the same exit as without one
        alone = b.run("browse", "--json", check=False)
    assert alone.returncode == 6 and "no trusted peer is online" in alone.stderr
    assert json.loads(alone.stdout)["error"]["exit_code"] == 6
    gone = b.run("browse", "--from", "127.0.0.1:9", "--json", check=False)  # none of the peers asked answers
    assert gone.returncode == 6 and json.loads(gone.stdout)["error"]["kind"] == "peer_unavailable"
    assert gone.stderr.startswith("p2pnode: no peer asked answered: 127.0.0.1:9: ")


def test_share_prints_the_fetch_line_and_it_fetches(team: tuple[Node, Node]) -> None:
    a, b = team
    share = a.run("share", str(a.agent / B5))
    branch = share.stdout.split()[0]
    line = re.search(r"teammates on the LAN run:  (p2pnode fetch ([0-9a-f]+))$", share.stderr, re.M)
    assert line, share.stderr
    prefix = line.group(2)
    assert len(prefix) >= 12 and branch.startswith(prefix)
    assert "off the LAN" in share.stderr
    assert json.loads(a.run("share", str(a.agent / B5), "--json").stdout)["fetch"] == line.group(1)
    with a.serving() as port:
        fetched = b.fetch_json(*line.group(1).split()[2:], "--from", f"127.0.0.1:{port}")
    assert fetched["branch"] == branch and Path(fetched["path"]).read_bytes() == (a.agent / B5).read_bytes()


def test_fetch_by_prefix_or_session_id_and_the_errors(team: tuple[Node, Node]) -> None:
    a, b = team
    branch = a.run("share", str(a.agent / B5)).stdout.split()[0]
    a.run("share", str(a.agent / A3))
    with a.serving() as port:
        peer = f"127.0.0.1:{port}"
        by_id = b.fetch_json("01a1ff93-69ef-76bb-aaf0-d291c98d9fe0", "--from", peer)
        assert by_id["branch"] == branch
        unknown_id = b.run("fetch", "01a1ff93-0000", "--from", peer, check=False)
        assert unknown_id.returncode == 3 and "no trusted peer offers a session with id" in unknown_id.stderr
        unknown = b.run("fetch", "ffffffffffff", "--from", peer, check=False)
        assert unknown.returncode == 3 and "no branch matching 'ffffffffffff'" in unknown.stderr
        short = b.run("fetch", "abc", "--from", peer, check=False)
        assert short.returncode == 4 and "at least 4 hex digits" in short.stderr
    alone = b.run("fetch", branch[:12], check=False)  # no node, no --from: nobody to ask
    assert alone.returncode == 6 and "--from" in alone.stderr


def test_browse_text_escapes_what_peers_sent() -> None:
    row = {"node_id": "N" * 56, "name": "mallory\x1b[2J", "short_id": "NNNNNNNN", "branch": "ab" * 32,
           "title": "title\x1b]0;pwned\x07", "project": "p\u202eroj", "size": 2_500_000, "lines": 7,
           "timestamp": "2026-11-21T19:26:53.423Z", "versions": 3}
    out = io.StringIO()
    with redirect_stdout(out):
        print_offers([row], now=0.0)
    text = out.getvalue()
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text
    assert "\\x1b[2J" in text and "2.5 MB" in text and f"{'ab' * 6}  " in text


def test_age_is_one_short_unit() -> None:
    assert age("2026-11-21T19:00:00.000Z", now=1_795_287_600.0 + 3 * 3600 + 59) == "3h"
    assert age("not a time", now=0.0) == "?"


def test_from_a_trusted_name_not_seen_on_the_lan_is_unreachable(team: tuple[Node, Node]) -> None:
    """`--from alice` names a trusted peer, but no running node sees it on the LAN: it cannot be
    reached (exit 6, and how to give its address), not "not found" (3) nor an unknown name (4)."""
    _, b = team
    for command in (["fetch", "0" * 64], ["browse"]):
        r = b.run(*command, "--from", "alice", check=False)
        assert r.returncode == 6 and "not seen on the LAN" in r.stderr and "NAME@HOST:PORT" in r.stderr
    unknown = b.run("fetch", "0" * 64, "--from", "mallory", check=False)
    assert unknown.returncode == 4 and "not HOST:PORT" in unknown.stderr
