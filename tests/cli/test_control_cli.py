"""`share --expires/--to`, `log`, `gc`, `rm` and `status` as real processes: on their own and
through a running node (real TLS on loopback between three nodes)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from corpus import A3, B5
from procnode import Node

from p2pnode.paths import NodePaths
from p2pnode.peer import wire
from p2pnode.peer.nodeid import format_node_id
from p2pnode.peer.trust import TrustStore


@pytest.fixture
def nodes(tmp_path: Path, corpus_dir: Path) -> tuple[Node, Node, Node]:
    """A holds the corpus and trusts B as "bob" and C as "carol"; they trust A."""
    a, b, c = (Node(tmp_path, n) for n in "abc")
    shutil.copytree(corpus_dir / "sessions", a.agent / "sessions")
    TrustStore(NodePaths(a.home).trust).trust(b.id, name="bob")
    TrustStore(NodePaths(a.home).trust).trust(c.id, name="carol")
    for x in (b, c):
        TrustStore(NodePaths(x.home).trust).trust(a.id)
    return a, b, c


def test_share_to_a_name_with_an_expiry_then_log_gc_and_status(nodes, corpus_dir: Path) -> None:
    a, b, c = nodes
    shared = json.loads(a.run("share", str(a.agent / B5), "--to", "bob", "--expires", "7d", "--json").stdout)
    assert shared["to"] == [b.id] and shared["expires_at"] is not None
    listed = a.run("ls").stdout
    assert "(expires in 7d)" in listed and "(to bob)" in listed  # the name it is trusted by here
    TrustStore(NodePaths(a.home).trust).trust(b.id, name="")  # no name: its short id
    assert f"(to {b.id[:7]})" in a.run("show", shared["branch"]).stdout  # its first group, as browse
    TrustStore(NodePaths(a.home).trust).trust(b.id, name="bob")
    with a.serving() as port:
        fetched = b.fetch_json(shared["branch"], "--from", f"127.0.0.1:{port}")
        refused = c.run("fetch", shared["branch"], "--from", f"127.0.0.1:{port}", check=False)
    assert fetched["path"] and Path(fetched["path"]).read_bytes() == (corpus_dir / B5).read_bytes()
    assert refused.returncode == 3 and "not offered" in refused.stderr  # as if it did not exist

    entries = json.loads(a.run("log", "--json").stdout)
    assert entries[0]["event"] == "shared" and entries[0]["to"] == [b.id]
    served = [e for e in entries if e["event"] == "served"]
    assert served and {e["peer"] for e in served} == {b.id} and {e["peer_name"] for e in served} == {"bob"}
    text = a.run("log").stdout
    assert "shared" in text and f"to bob {b.id}" in text
    assert [e["event"] for e in json.loads(b.run("log", "--json").stdout)] == ["fetched"] * 4
    assert len(json.loads(a.run("log", "-n", "2", "--json").stdout)) == 2

    for bad, why in ((("--to", "nobody"), "no trusted peer"), (("--expires", "7y"), "expiry '7y'")):
        proc = a.run("share", str(a.agent / B5), *bad, check=False)
        assert proc.returncode == 4 and why in proc.stderr

    big = a.run("share", str(a.agent / A3)).stdout.split()[0]
    a.run("unshare", big)
    status = json.loads(a.run("status", "--json").stdout)
    assert status["reclaimable_bytes"] > 1_000_000 and status["store_bytes"] > status["reclaimable_bytes"]
    assert "reclaimable" in a.run("status").stdout
    report = json.loads(a.run("gc", "--json").stdout)
    assert report["branches"] == [big] and report["bytes_freed"] > 1_000_000
    assert json.loads(a.run("status", "--json").stdout)["reclaimable_bytes"] == 0
    assert a.run("cat", shared["branch"]).stdout.encode() == (corpus_dir / B5).read_bytes()
    assert big not in a.run("ls", "--all", "--json").stdout  # forgotten by gc


def test_through_a_running_node(nodes, corpus_dir: Path) -> None:
    a, b, _ = nodes
    with a.node_running():
        shared = json.loads(a.run("share", str(a.agent / B5), "--to", "bob", "--json").stdout)
        assert shared["to"] == [b.id] and shared["expires_at"] is None
        big = a.run("share", str(a.agent / A3)).stdout.split()[0]
        assert [e["event"] for e in json.loads(a.run("log", "--json").stdout)] == ["shared", "shared"]
        removed = json.loads(a.run("rm", big, "--json").stdout)
        assert [i["branch"] for i in removed["removed"]] == [big] and removed["gc"]["bytes_freed"] > 1_000_000
        assert "removed" in a.run("log").stdout
        assert json.loads(a.run("gc", "--json").stdout)["branches"] == []
        status = json.loads(a.run("status", "--json").stdout)
        assert status["running"] and status["reclaimable_bytes"] == 0
        assert a.run("rm", big, check=False).returncode == 3
        assert a.run("cat", shared["branch"]).stdout.encode() == (corpus_dir / B5).read_bytes()


def test_log_lines_say_who_got_what() -> None:
    from p2pnode.cli.log import log_line

    shared = {"time": 0, "event": "shared", "branch": "ab" * 32, "title": "fix\x1b[2J the bug", "to": None,
              "expires_at": None, "secrets_allowed": True}
    assert "to all trusted peers" in log_line(shared) and "(secrets allowed)" in log_line(shared)
    assert "\x1b" not in log_line(shared)  # a title from a session is printed escaped
    served = {"time": 0, "event": "served", "peer": "N" * 56, "peer_name": "bob", "kind": "batch",
              "branches": ["cd" * 32], "bytes": 10, "complete": False}
    assert f"to bob {'N' * 56}, 10 bytes" in log_line(served) and "cut off" in log_line(served)
    # a share's peers by the name each is trusted by here; one no longer trusted by its whole id
    to = dict(shared, to=["B" * 63, "C" * 63])
    assert f"to bob, {'C' * 63}" in log_line(to, {"B" * 63: "bob"})
    # the branches offered before whose audience a share changed (its other versions, ancestors)
    wider = dict(shared, audience_changed=[{"branch": "ef" * 32, "to": None, "expires_at": None}])
    assert log_line(wider).endswith(f"; the audience of {'ef' * 8} too")


def test_a_follows_first_event_says_what_is_followed(capsys: pytest.CaptureFixture[str]) -> None:
    """`follow`'s first line names the session by its title (a peer's text: shown escaped), not
    by its hash alone; a follow event without one (an older node's) prints as before."""
    from p2pnode.cli.follow import print_event

    event = {"time": 0, "kind": "following", "branch": "ab" * 32, "peer": "N@127.0.0.1:7",
             "title": "fix\x1b[2J the  flaky\ntest"}
    print_event(event)
    print_event({k: v for k, v in event.items() if k != "title"})
    titled, bare = capsys.readouterr().out.splitlines()
    assert titled.endswith(f"following {'ab' * 8} from N@127.0.0.1:7  fix\\x1b[2J the flaky test")
    assert bare.endswith(f"following {'ab' * 8} from N@127.0.0.1:7")


def test_log_names_a_shares_peers_as_trusted_here(nodes) -> None:
    a, b, _ = nodes
    a.run("share", "01a1ff93-69ef", "--to", "bob")
    assert "  to bob" in a.run("log").stdout and b.id[:16] not in a.run("log").stdout


def test_unshare_of_a_branch_not_offered_says_so_and_logs_nothing(nodes) -> None:
    a, _, _ = nodes
    branch = a.run("share", "01a1ff93-69ef").stdout.split()[0]
    for _ in (1, 2):
        a.run("unshare", branch)
    again = a.run("unshare", branch, "--json")
    assert json.loads(again.stdout)["was_offered"] is False
    text = a.run("unshare", branch)
    assert text.stdout.startswith(f"not offered: {branch} (unshared already)")
    assert [e["event"] for e in json.loads(a.run("log", "--json").stdout)] == ["shared", "unshared"]


def test_peers_json_has_one_schema_with_and_without_a_node(nodes) -> None:
    a, b, c = nodes
    keys = {"id", "name", "added_at", "trusted", "addresses", "port", "online", "trusts_us", "reached"}
    offline = json.loads(a.run("peers", "--json").stdout)
    assert [set(p) for p in offline] == [keys, keys] and {p["trusts_us"] for p in offline} == {None}
    with a.node_running():
        online = json.loads(a.run("peers", "--json").stdout)
    assert [set(p) for p in online] == [keys, keys]


async def test_unshare_from_the_command_line_stops_a_running_nodes_transfer(nodes) -> None:
    """The whole path: `p2pnode unshare` (another process) -> the node's control endpoint ->
    the library -> the peer server aborts the answer a slow peer is reading."""
    import asyncio
    import random

    import aiohttp

    from p2pnode.peer import wire
    from p2pnode.peer.identity import load_or_create_identity
    from p2pnode.peer.tls import client_context

    a, b, _ = nodes
    path = a.agent / "sessions" / "--w--" / "2026-11-21T20-00-00-000Z_big.jsonl"
    path.parent.mkdir(parents=True)
    rnd = random.Random(7)
    path.write_bytes(b'{"type":"session","version":3,"id":"big","timestamp":"2026-11-21T20:00:00.000Z","cwd":"/w"}\n'
                     + b"".join(b'{"type":"custom","data":"' + rnd.randbytes(300_000).hex().encode() + b'"}\n'
                                for _ in range(40)))
    shared = json.loads(a.run("share", str(path), "--json").stdout)
    b_id = load_or_create_identity(NodePaths(b.home).identity)
    tls = client_context(b_id, TrustStore(NodePaths(b.home).trust), load_or_create_identity(
        NodePaths(a.home).identity).fingerprint)
    with a.node_running():
        port = json.loads(a.run("status", "--json").stdout)["port"]
        url = f"https://127.0.0.1:{port}" + wire.PATH_OBJECT.format(hash=shared["src"])
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls)) as s, s.get(url) as r:
            assert r.status == 200
            await asyncio.sleep(0.5)  # the node is now blocked writing to us
            await asyncio.to_thread(a.run, "unshare", shared["branch"])
            with pytest.raises(aiohttp.ClientPayloadError):
                await asyncio.wait_for(r.read(), 20)  # far below the node's 30 s slow-reader timeout
        log = json.loads(a.run("log", "--json").stdout)
    assert [e["event"] for e in log if e["event"] != "served"] == ["shared", "unshared"]


def test_share_through_a_running_node_answers_the_fetch_line_and_a_ticket(nodes, corpus_dir: Path) -> None:
    """The node answers `share` with the hand-off (what the CLI prints last): the fetch command
    and a ticket for its real address, and the ticket fetches what was shared."""
    a, b, _ = nodes
    with a.node_running():
        shared = json.loads(a.run("share", str(a.agent / B5), "--json").stdout)
        port = json.loads(a.run("status", "--json").stdout)["port"]
        text = a.run("share", str(a.agent / B5))
        ticket = wire.decode_ticket(shared["ticket"])
        assert shared["fetch"] == f"p2pnode fetch {shared['branch'][:12]}"
        assert ticket.branch.hex() == shared["branch"] and format_node_id(ticket.node) == a.id
        assert ticket.addresses == (("127.0.0.1", port),)
        assert text.stdout.split() == [shared["branch"], shared["ticket"]]
        assert f"teammates on the LAN run:  {shared['fetch']}" in text.stderr
        fetched = b.fetch_json(shared["ticket"])
    assert Path(fetched["path"]).read_bytes() == (corpus_dir / B5).read_bytes()
    alone = json.loads(a.run("share", str(a.agent / B5), "--json").stdout)  # no node: no address to name
    assert "ticket" not in alone and alone["fetch"] == shared["fetch"]


def test_unshare_of_a_prefix_names_the_whole_branch(nodes) -> None:
    a, _, _ = nodes
    first = json.loads(a.run("share", str(a.agent / B5), "--json").stdout)["branch"]
    assert a.run("unshare", first[:8]).stdout == f"unshared {first}\n"  # in this process
    again = json.loads(a.run("share", str(a.agent / B5), "--json").stdout)["branch"]
    with a.node_running():
        assert a.run("unshare", again[:8]).stdout == f"unshared {again}\n"  # through the node
