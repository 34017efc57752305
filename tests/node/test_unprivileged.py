"""A node made and run by an ordinary user works end to end, and keeps its state private.

Real `p2pnode` processes, real TLS on loopback, each node with its own P2PNODE_HOME and
PI_CODING_AGENT_DIR; run as `nobody` when the suite itself runs as root (tests/ordinary.py),
so that the unprivileged part of `.ci/run` and a developer's root run prove the same thing."""
from __future__ import annotations

import json
import stat
from pathlib import Path

from ordinary import OrdinaryUser

from p2pnode.paths import NodePaths
from p2pnode.peer.identity import KEY_FILE

B5 = "--tmp-pi-harness-work-beta--/2026-11-21T19-26-53-423Z_01a1ff93-69ef-76bb-aaf0-d291c98d9fe0.jsonl"
PRIVATE_FILE, PRIVATE_DIR = 0o600, 0o700


def ok(user: OrdinaryUser, env: dict[str, str], *args: str) -> bytes:
    proc = user.run(env, *args)
    assert proc.returncode == 0, f"p2pnode {' '.join(args)} exited {proc.returncode}: {proc.stderr.decode()}"
    return proc.stdout


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def assert_private(user: OrdinaryUser, env: dict[str, str]) -> None:
    """Node-level state: home, identity dir and (if made) store dir 0700; key and trust file 0600;
    all of it the user's own."""
    paths = NodePaths(Path(env["P2PNODE_HOME"]))
    for d in (paths.home, paths.identity, paths.store):
        if d != paths.store or d.exists():
            assert mode(d) == PRIVATE_DIR, f"{d} is {oct(mode(d))}"
    for f in (paths.identity / KEY_FILE, paths.trust):
        assert mode(f) == PRIVATE_FILE, f"{f} is {oct(mode(f))}"
    assert {p.stat().st_uid for p in [paths.home, *paths.home.rglob("*")]} == {user.uid}


def test_an_ordinary_users_nodes_share_serve_and_fetch(ordinary: OrdinaryUser, corpus_dir: Path) -> None:
    alice = ordinary.node("alice", corpus_dir / "sessions")
    bob = ordinary.node("bob")
    session = Path(alice["PI_CODING_AGENT_DIR"]) / "sessions" / B5

    branch = ok(ordinary, alice, "share", str(session)).decode().strip()
    assert any(b["branch"] == branch for b in json.loads(ok(ordinary, alice, "ls", "--json")))
    assert json.loads(ok(ordinary, alice, "show", branch[:12], "--json"))["branch"]["branch"] == branch
    assert ok(ordinary, alice, "cat", branch) == session.read_bytes()
    ok(ordinary, alice, "fsck")

    alice_id = ok(ordinary, alice, "id").decode().strip()
    bob_id = ok(ordinary, bob, "id").decode().strip()
    ok(ordinary, alice, "trust", bob_id, "--name", "bob")
    ok(ordinary, bob, "trust", alice_id, "--name", "alice")

    node, port = ordinary.start_node(alice)
    try:
        control = NodePaths(Path(alice["P2PNODE_HOME"])).control_socket
        assert stat.S_ISSOCK(control.stat().st_mode) and mode(control) == PRIVATE_FILE
        assert ok(ordinary, alice, "cat", branch) == session.read_bytes()  # read through the node
        fetched = json.loads(ok(ordinary, bob, "fetch", branch, "--from", f"{alice_id}@127.0.0.1:{port}",
                                "--json"))
    finally:
        ordinary.stop_node(node)
    assert fetched["branch"] == branch and len(fetched["fetched"]) == 4  # the branch and its 3 ancestors
    placed = Path(fetched["path"])
    assert placed.read_bytes() == session.read_bytes() and placed.stat().st_uid == ordinary.uid
    assert ok(ordinary, bob, "cat", branch) == session.read_bytes()
    assert ordinary.run(bob, "fsck").returncode == 0
    assert ordinary.run(alice, "fsck").returncode == 0
    for env in (alice, bob):
        assert_private(ordinary, env)


def snapshot(root: Path) -> dict[str, tuple[int, bytes]]:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else b"")
            for p in [root, *root.rglob("*")]}


def test_read_commands_write_nothing_and_work_on_a_store_this_user_may_only_read(
        ordinary: OrdinaryUser, corpus_dir: Path) -> None:
    """`status`, `ls`, `show`, `cat`, `log`, `peers` and `fsck` leave every file of the store as
    it was (status packed the lines a share left in the head WAL, every open zero-filled and
    trimmed it), so they work on a store this user may read but not write (chmod -w: they
    failed, exit 4, naming store/LOCK); what must write there (share, gc, rm) says that the
    store directory is not writable (it named a journal file that did not exist, after an
    ERROR line).  A home this user may not write in: `cat` to a pipe spools elsewhere (it
    named a temp file there), and `rm` names the home (not `.sessions.json.<pid>.tmp`)."""
    env = ordinary.node("reader", corpus_dir / "sessions")
    session = Path(env["PI_CODING_AGENT_DIR"]) / "sessions" / B5
    branch = ok(ordinary, env, "share", str(session)).decode().strip()
    paths = NodePaths(Path(env["P2PNODE_HOME"]))
    p2p = f"'{ordinary.python.executable}' -m p2pnode"
    reads = [("status",), ("status", "--json"), ("ls",), ("show", branch[:12], "--versions"), ("cat", branch),
             ("log",), ("peers",), ("fsck",)]
    before = snapshot(paths.store)
    for args in reads:
        ok(ordinary, env, *args)
    assert snapshot(paths.store) == before

    for p in [paths.store, *paths.store.iterdir()]:
        p.chmod(0o500 if p.is_dir() else 0o400)
    try:
        for args in reads:
            ok(ordinary, env, *args)
        assert ok(ordinary, env, "cat", branch) == session.read_bytes()
        assert json.loads(ok(ordinary, env, "status", "--json"))["shared"]
        for args in (("share", str(session)), ("gc",), ("rm", branch)):
            proc = ordinary.run(env, *args)
            err = proc.stderr.decode()
            assert proc.returncode == 4 and err.count("\n") == 1, f"{args}: {err}"
            assert f"the directory {paths.store} is not writable by this user" in err, f"{args}: {err}"
        assert snapshot(paths.store) == before
    finally:
        for p in [paths.store, *paths.store.iterdir()]:
            p.chmod(0o700 if p.is_dir() else 0o600)

    paths.home.chmod(0o500)
    try:
        piped = ordinary.shell(env, f"{p2p} cat {branch} | cat")
        assert piped.returncode == 0 and piped.stdout == session.read_bytes(), piped.stderr.decode()
        proc = ordinary.run(env, "rm", branch)
        err = proc.stderr.decode()
        assert proc.returncode == 4 and f"the directory {paths.home} is not writable by this user" in err, err
        assert ".tmp" not in err, err
    finally:
        paths.home.chmod(0o700)
    ok(ordinary, env, "rm", branch)
