"""Failures after or while a command prints (real `p2pnode` processes): a fetch that ends in a
conflict with --json ends its stdout with the error object as every failing --json command
does; a write to stdout that fails names stdout, not the node's home; an explicit `trust
--name` another peer has is refused (exit 4); `doctor` in a directory too deep for Pi's
session dir prints its report with `FAIL pi`."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from pifork import ROOT_FORK
from procnode import PY, Node

import p2pnode
from p2pnode.errors import KINDS
from p2pnode.paths import NodePaths
from p2pnode.peer.trust import TrustStore


def shared_pair(tmp_path: Path, corpus: Path) -> tuple[Node, Node, dict]:
    a, b = Node(tmp_path, "a"), Node(tmp_path, "b")
    TrustStore(NodePaths(a.home).trust).trust(b.id)
    TrustStore(NodePaths(b.home).trust).trust(a.id)
    session = a.agent / ROOT_FORK["1.5.2"][0]
    session.parent.mkdir(parents=True)
    shutil.copyfile(corpus / ROOT_FORK["1.5.2"][0], session)
    return a, b, json.loads(a.run("share", str(session), "--json").stdout)


def test_a_fetch_that_ends_in_a_conflict_with_json_ends_with_the_error(tmp_path: Path,
                                                                       corpus_new_dir: Path) -> None:
    a, b, shared = shared_pair(tmp_path, corpus_new_dir)
    with a.serving() as port:
        peer = f"{a.id}@127.0.0.1:{port}"
        placed = Path(b.fetch_json(shared["branch"], "--from", peer)["path"])
        placed.write_bytes(b"my own edits\n")
        proc = b.run("fetch", shared["branch"], "--from", peer, "--json", check=False)
    assert proc.returncode == 7, proc.stderr
    result, last = proc.stdout.rsplit("\n{", 1)[0], "{" + proc.stdout.rsplit("\n{", 1)[1]
    assert json.loads(result)["conflict"]  # the result first, as before
    error = json.loads(last)["error"]
    assert (error["kind"], error["exit_code"]) == (KINDS[7], 7)
    assert f"p2pnode: {error['message']}" in proc.stderr and str(placed) in error["message"]
    assert placed.read_bytes() == b"my own edits\n"


def test_a_failed_write_to_stdout_names_stdout(tmp_path: Path, corpus_new_dir: Path) -> None:
    """`> /dev/full` (ENOSPC) and a closed stdout (EBADF): exit 1 naming standard output (it
    was "no space left on device: in the node's home ..."; a closed pipe stays 141: test_cli_errors.py)."""
    a, _, shared = shared_pair(tmp_path, corpus_new_dir)
    for args in (["ls"], ["ls", "--json"], ["cat", shared["branch"]], ["cat", shared["branch"], "--json"],
                 ["show", shared["branch"]], ["log", "--json"]):
        with open("/dev/full", "wb") as full:
            proc = subprocess.run([PY, "-m", "p2pnode", *args], env=a.env, stdout=full,
                                  stderr=subprocess.PIPE, text=True, timeout=60)
        assert proc.returncode == 1, (args, proc.stderr)
        assert proc.stderr == "p2pnode: cannot write to standard output: no space left on device\n", args
    closed = subprocess.run([PY, "-m", "p2pnode", "ls"], env=a.env, capture_output=True, text=True,
                            timeout=60, preexec_fn=lambda: os.close(1))
    assert closed.returncode == 1 and closed.stderr == \
        "p2pnode: cannot write to standard output: bad file descriptor\n", closed.stderr


def test_trust_with_a_name_another_peer_has_is_refused(tmp_path: Path) -> None:
    """README: `trust <node-id|name> --name <a name another peer has>` exits 4 (it was renamed
    `bob-<id>` silently, and `--from bob` then named the other node)."""
    me, bob, other = Node(tmp_path, "me"), Node(tmp_path, "bob"), Node(tmp_path, "other")
    me.run("trust", bob.id, "--name", "bob")
    proc = me.run("trust", other.id, "--name", "bob", check=False)
    assert proc.returncode == 4 and f"peer name 'bob' is taken by {bob.id}" in proc.stderr, proc.stderr
    assert [(p.node_id, p.name) for p in TrustStore(NodePaths(me.home).trust).peers()] == [(bob.id, "bob")]
    assert me.run("trust", bob.id, "--name", "bob").returncode == 0  # its own name again: fine
    assert "(carol)" in me.run("trust", other.id, "--name", "carol").stdout


def test_doctor_in_a_directory_too_deep_for_pi_reports_it(tmp_path: Path) -> None:
    """A cwd whose Pi session dir name is over the file system's limit (ENAMETOOLONG): the
    whole report, with `FAIL pi` saying so, exit 1 (it was exit 4 and no report)."""
    node = Node(tmp_path, "n")
    (node.agent / "sessions").mkdir()
    deep = tmp_path / ("a" * 130) / ("b" * 130)
    deep.mkdir(parents=True)
    env = dict(node.env, PYTHONPATH=str(Path(p2pnode.__file__).parents[1]))  # this tree's, from any cwd
    proc = subprocess.run([PY, "-m", "p2pnode", "doctor", "--timeout", "1"], env=env, cwd=deep,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stdout.splitlines()
    assert {"store", "identity", "node"} <= {line.split()[1] for line in lines}  # the whole report
    [pi] = [line for line in lines if line.split()[1] == "pi"]
    assert pi.startswith("FAIL") and "Pi cannot keep sessions for" in pi and "too long" in pi, pi
    doctor = [PY, "-m", "p2pnode", "doctor", "--timeout", "1", "--json"]
    report = json.loads(subprocess.run(doctor, env=env, cwd=deep, capture_output=True, text=True,
                                       timeout=60).stdout)
    assert [c["outcome"] for c in report["checks"] if c["name"] == "pi"] == ["fail"]
