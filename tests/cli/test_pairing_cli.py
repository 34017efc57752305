"""`p2pnode pair` between two real nodes on loopback (`--from`, no mDNS), `peers --pending`,
names wherever ids, and a node that cannot trust itself: real processes, real sockets, real TLS."""
from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from procnode import PY, Node

from p2pnode.paths import NodePaths
from p2pnode.peer.trust import TrustStore

BETA = "--tmp-pi-harness-work-beta--/"
SESSIONS = (BETA + "2026-11-21T19-26-53-423Z_01a1ff93-69ef-76bb-aaf0-d291c98d9fe0.jsonl",
            BETA + "2026-11-21T19-26-46-592Z_01a1ff93-4f3f-74a0-8c1a-0b533764bed8.jsonl")


def trusted(node: Node) -> dict[str, str | None]:
    return {p.node_id: p.name for p in TrustStore(NodePaths(node.home).trust).peers()}


@contextlib.contextmanager
def waiting(node: Node, *extra: str) -> Iterator[tuple[subprocess.Popen[str], str, int]]:
    """`p2pnode pair` on loopback without mDNS, once it printed its code: (process, code, port)."""
    proc = subprocess.Popen([PY, "-m", "p2pnode", "pair", "--no-mdns", "--host", "127.0.0.1", *extra],
                            env=node.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        shown = "".join(proc.stdout.readline() for _ in range(4))
        # mDNS off: the command to give names the address, and nothing says it will be found over mDNS
        m = re.search(r"pairing code: (\S+)\non the other machine run:  p2pnode pair \1 "
                      r"--from 127\.0\.0\.1:(\d+)\n\(mDNS is off: .* the other side needs --from\)\n", shown)
        assert m and "mDNS cannot reach" not in shown, shown + (proc.stderr.read() if proc.stderr else "")
        yield proc, m.group(1), int(m.group(2))
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture
def pair_of(tmp_path: Path) -> tuple[Node, Node]:
    return Node(tmp_path, "alice"), Node(tmp_path, "bob")


def test_pair_by_code_over_loopback_then_fetch_both_ways(pair_of: tuple[Node, Node], corpus_dir: Path):
    alice, bob = pair_of
    with waiting(alice, "--name", "alice") as (proc, code, port):
        joined = bob.run("pair", code, "--name", "bob", "--from", f"127.0.0.1:{port}")
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert f"paired with alice ({alice.id})" in joined.stdout
    assert f"paired with bob ({bob.id})" in out
    assert trusted(alice) == {bob.id: "bob"} and trusted(bob) == {alice.id: "alice"}
    # the ids exchanged are the TLS keys: mutual TLS now works both ways, by name
    for sharer, fetcher, name, session in ((alice, bob, "alice", SESSIONS[0]),
                                           (bob, alice, "bob", SESSIONS[1])):
        path = sharer.agent / "sessions" / session
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(corpus_dir / "sessions" / session, path)
        branch = sharer.run("share", "--no-lineage", str(path)).stdout.split()[0]
        with sharer.serving() as served:
            fetched = fetcher.fetch_json(branch, "--from", f"{name}@127.0.0.1:{served}")
        assert fetched["branch"] == branch


def test_pair_served_by_the_running_node(pair_of: tuple[Node, Node]):
    """With a node running, it serves the code (its pairing listener, not its peer server) and
    picks up the new trust at once: the joiner can fetch from it straight away."""
    alice, bob = pair_of
    carol = Node(alice.home.parent.parent, "carol")
    carol.run("trust", alice.id)
    with alice.node_running():
        peer_port = json.loads(alice.run("status", "--json").stdout)["port"]
        with waiting(alice, "--name", "alice") as (proc, code, port):
            # a code waiting does not open the peer server: an untrusted node still gets nothing
            refused = carol.run("fetch", "0" * 64, "--from", f"127.0.0.1:{peer_port}", check=False)
            assert refused.returncode == 8 and "does not trust this node" in refused.stderr, refused.stderr
            joined = bob.run("pair", code, "--name", "bob", "--from", f"127.0.0.1:{port}")
            out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0 and f"paired with bob ({bob.id})" in out, err
        assert f"paired with alice ({alice.id})" in joined.stdout
        assert peer_port != port
        fetch = bob.run("fetch", "0" * 64, "--from", f"alice@127.0.0.1:{peer_port}", check=False)
        assert fetch.returncode == 3, fetch.stderr  # trusted both ways: only the branch is missing
    assert trusted(alice) == {bob.id: "bob"}


def test_a_wrong_code_fails_on_both_sides_and_nobody_trusts(pair_of: tuple[Node, Node]):
    alice, bob = pair_of
    with waiting(alice) as (proc, code, port):
        channel, first, _ = code.split("-")
        wrong = f"{channel}-{first}-{'aardvark' if not code.endswith('-aardvark') else 'absurd'}"
        joined = bob.run("pair", wrong, "--from", f"127.0.0.1:{port}", check=False)
        out, err = proc.communicate(timeout=30)
    assert joined.returncode == 8 and "burned" in joined.stderr, joined.stderr
    assert proc.returncode == 8 and "did not match" in err and "Traceback" not in err, err
    # the code is spent: the right code now finds nobody listening
    again = bob.run("pair", code, "--from", f"127.0.0.1:{port}", check=False)
    assert again.returncode == 6, again.stderr
    assert trusted(alice) == {} and trusted(bob) == {}


def test_joining_ones_own_code_is_invalid_input_on_both_sides(pair_of: tuple[Node, Node]):
    """A node that types the code it shows: exit 4 on both sides ("a node trusting itself"),
    not a refusal for the joiner; nobody trusts anybody."""
    alice, _ = pair_of
    with waiting(alice) as (proc, code, port):
        joined = alice.run("pair", code, "--from", f"127.0.0.1:{port}", check=False)
        out, err = proc.communicate(timeout=30)
    assert joined.returncode == 4 and "own code" in joined.stderr, joined.stderr
    assert proc.returncode == 4 and "own code" in err and "Traceback" not in err, err
    assert trusted(alice) == {}


def test_a_typo_in_the_code_is_refused_before_anything_is_sent(pair_of: tuple[Node, Node]):
    alice, bob = pair_of
    with waiting(alice) as (proc, code, port):
        typo = code[:-1]
        joined = bob.run("pair", typo, "--from", f"127.0.0.1:{port}", check=False)
        assert joined.returncode == 4 and "typo" in joined.stderr, joined.stderr
        ok = bob.run("pair", code, "--from", f"127.0.0.1:{port}")  # the code was not burned
        proc.communicate(timeout=30)
    assert proc.returncode == 0 and "paired with" in ok.stdout


def test_an_untrusted_caller_is_pending_and_trust_accepts_it(pair_of: tuple[Node, Node], corpus_dir: Path):
    """Bob trusts Alice, Alice does not trust Bob: Bob's fetch says what Alice must run, and
    Alice's node lists Bob in `peers --pending` until she trusts him."""
    alice, bob = pair_of
    bob.run("trust", alice.id, "--name", "alice")
    with alice.node_running():
        port = json.loads(alice.run("status", "--json").stdout)["port"]
        assert json.loads(alice.run("peers", "--pending", "--json").stdout) == []
        fetch = bob.run("fetch", "0" * 64, "--from", f"alice@127.0.0.1:{port}", check=False)
        assert fetch.returncode == 8 and f"p2pnode trust {bob.id}" in fetch.stderr, fetch.stderr
        pending = json.loads(alice.run("peers", "--pending", "--json").stdout)
        assert [p["id"] for p in pending] == [bob.id] and pending[0]["attempts"] >= 1
        text = alice.run("peers", "--pending").stdout
        assert f"if its user confirms this id, run p2pnode trust {bob.id}" in text
        assert "trusts this node" not in text  # any key can try: the caller's trust is not known
        alice.run("trust", bob.id, "--name", "bob")
        assert json.loads(alice.run("peers", "--pending", "--json").stdout) == []
        fetch = bob.run("fetch", "0" * 64, "--from", f"alice@127.0.0.1:{port}", check=False)
        assert fetch.returncode == 3, fetch.stderr  # now served: the branch is simply not offered
    assert trusted(alice) == {bob.id: "bob"}


def test_names_work_wherever_ids_do(tmp_path: Path):
    me, a, b = Node(tmp_path, "me"), Node(tmp_path, "a"), Node(tmp_path, "b")
    me.run("trust", a.id, "--name", "carol")
    assert "trusted" in me.run("trust", "carol", "--name", "carol2").stdout  # rename by name
    assert trusted(me) == {a.id: "carol2"}
    me.run("trust", b.id, "--name", "Carol2")
    # exact name wins; ignoring case would be ambiguous
    assert a.id in me.run("untrust", "carol2").stdout
    me.run("trust", a.id, "--name", "carol2")
    ambiguous = me.run("untrust", "CAROL2", check=False)
    assert ambiguous.returncode == 4 and a.id in ambiguous.stderr and b.id in ambiguous.stderr
    unknown = me.run("untrust", "dave", check=False)
    assert unknown.returncode == 4 and "no peer named 'dave'" in unknown.stderr
    nowhere = me.run("fetch", "0" * 64, "--from", "carol2", check=False)
    assert nowhere.returncode == 6 and "--from NAME@HOST:PORT" in nowhere.stderr, nowhere.stderr
    assert trusted(me) == {a.id: "carol2", b.id: "Carol2"}


def test_a_node_cannot_trust_itself(tmp_path: Path):
    me = Node(tmp_path, "me")
    proc = me.run("trust", me.id, check=False)
    assert proc.returncode == 4 and "cannot trust itself" in proc.stderr and "Traceback" not in proc.stderr
    assert trusted(me) == {}


def test_untrust_closes_the_peers_connections_before_it_returns(pair_of: tuple[Node, Node]):
    """Alice's node serves Bob; Bob holds a connection open (handshake done, no request). Alice
    runs `untrust bob` from the CLI: her node is told at once (it would see the file at its
    next poll, up to TRUST_POLL_SECONDS later), so the connection is gone by the time the
    command returned, well within that poll."""
    import socket
    import ssl
    import time

    from p2pnode.peer.identity import load_identity
    from p2pnode.peer.provider import TRUST_POLL_SECONDS
    from p2pnode.peer.tls import client_context

    alice, bob = pair_of
    alice.run("trust", bob.id, "--name", "bob")
    bob.run("trust", alice.id, "--name", "alice")
    with alice.node_running():
        port = json.loads(alice.run("status", "--json").stdout)["port"]
        me = load_identity(NodePaths(bob.home).identity)
        tls = client_context(me, TrustStore(NodePaths(bob.home).trust), None)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
                tls.wrap_socket(raw, server_hostname=None) as conn:
            time.sleep(0.3)  # the server has counted the connection
            alice.run("untrust", "bob")
            conn.settimeout(TRUST_POLL_SECONDS / 4)  # a timeout: still open, left to the poll
            with contextlib.suppress(ConnectionResetError, ssl.SSLError):  # how the abort reads
                assert conn.recv(1) == b""
