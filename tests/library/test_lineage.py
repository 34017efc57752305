"""Lineage that survives the network: a Pi fork of a fetched session shares with the lineage
the node received by fetch, never with paths on the sharer's machine.

The end-to-end test runs three and four real nodes (`p2pnode` processes, each with its own
home and Pi agent dir) on loopback; the others use the session library directly.  Forks are
written as pi writes them (`pi_fork`, from the corpora's own forks): a new header whose
parentSession is the source's path on this machine, then every entry of the source verbatim.
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import blake3
import pytest
from pifork import ROOT_FORK, pi_fork
from procnode import Node

from p2pnode.errors import NotFound
from p2pnode.library.api import Library
from p2pnode.library.manifest import PlacedFiles
from p2pnode.paths import NodePaths, PiDirs
from p2pnode.peer.trust import TrustStore
from p2pnode.pi.placement import place_session
from p2pnode.pi.session import LineageCycle

# --- the team loop, with real nodes ----------------------------------------------------------


@pytest.mark.parametrize("pi", ["0.73.1", "1.5.2"])
def test_share_back_across_three_and_four_nodes(tmp_path: Path, corpus_dir: Path, corpus_new_dir: Path,
                                                pi: str) -> None:
    corpus = corpus_dir if pi == "0.73.1" else corpus_new_dir
    a, b, c, d = (Node(tmp_path, n) for n in "abcd")
    for x in (a, b, c, d):
        for y in (a, b, c, d):
            if x is not y:
                TrustStore(NodePaths(x.home).trust).trust(y.id)
    root_rel, fork_rel = ROOT_FORK[pi]
    for rel in (root_rel, fork_rel):
        (a.agent / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(corpus / rel, a.agent / rel)
    shared = json.loads(a.run("share", str(a.agent / fork_rel), "--json").stdout)  # root + fork
    assert len(shared["ancestors"]) == 1 and shared["parent"] == shared["ancestors"][0]["branch"]

    with a.serving() as a_port:
        got = b.fetch_json(shared["branch"], "--from", f"127.0.0.1:{a_port}")
    fetched = Path(got["path"])
    assert fetched.read_bytes() == (corpus / fork_rel).read_bytes()

    # Bob continues it with `pi --fork <fetched file>` in his own project and shares that
    b_work = tmp_path / "b" / "work" / "proj"
    b_work.mkdir(parents=True)
    typed = os.path.relpath(fetched, b_work)  # pi 0.73.1 stores the path as typed
    b_fork = pi_fork(fetched, b.agent, b_work, "b0b0b0b0-0000-7000-8000-00000000000b", pi=pi, typed=typed)
    proc = b.run("share", str(b_fork), "--json")
    b_shared = json.loads(proc.stdout)
    assert proc.returncode == 0 and b_shared["parent"] == shared["branch"]  # the fetched branch
    assert [x["branch"] for x in b_shared["ancestors"]] == [shared["parent"], shared["branch"]]

    originals = {shared["parent"]: (corpus / root_rel).read_bytes(), shared["branch"]: fetched.read_bytes(),
                 b_shared["branch"]: b_fork.read_bytes()}
    with a.serving() as a_port, b.serving() as b_port:
        got_c = c.fetch_json(b_shared["branch"], "--from", f"127.0.0.1:{a_port}",
                             "--from", f"127.0.0.1:{b_port}")
    assert got_c["fetched"] == [b_shared["branch"], shared["branch"], shared["parent"]]
    assert Path(got_c["path"]).read_bytes() == b_fork.read_bytes()
    for branch, data in originals.items():  # every generation, byte-identical
        assert c.run("cat", branch).stdout.encode() == data

    # Carol goes one generation further; Alice goes away; Dave gets all four from Bob alone
    c_work = tmp_path / "c" / "work" / "proj"
    c_work.mkdir(parents=True)
    c_fork = pi_fork(Path(got_c["path"]), c.agent, c_work, "ca401000-0000-7000-8000-00000000000c", pi=pi)
    c_shared = json.loads(c.run("share", str(c_fork), "--json").stdout)
    assert c_shared["parent"] == b_shared["branch"] and len(c_shared["ancestors"]) == 3
    originals[c_shared["branch"]] = c_fork.read_bytes()
    with c.serving() as c_port:
        got_b = b.fetch_json(c_shared["branch"], "--from", f"127.0.0.1:{c_port}")
    assert got_b["fetched"] == [c_shared["branch"]]
    # fetched sessions are offered on only once this node's user shares them (issue 13/15)
    assert json.loads(b.run("share", got_b["path"], "--json").stdout)["branch"] == c_shared["branch"]
    with b.serving() as b_port:  # A is not serving
        got_d = d.fetch_json(c_shared["branch"], "--from", f"127.0.0.1:{b_port}")
    assert len(got_d["fetched"]) == 4
    for branch, data in originals.items():
        assert d.run("cat", branch).stdout.encode() == data
    assert Path(got_d["path"]).read_bytes() == c_fork.read_bytes()


def test_missing_parent_says_what_to_do_and_no_lineage_is_recorded(tmp_path: Path,
                                                                   corpus_new_dir: Path) -> None:
    b = Node(tmp_path, "b")
    root_rel, fork_rel = ROOT_FORK["1.5.2"]
    fork = b.agent / fork_rel  # its parent is on Alice's machine only
    fork.parent.mkdir(parents=True)
    shutil.copyfile(corpus_new_dir / fork_rel, fork)
    proc = b.run("share", str(fork), check=False)
    assert proc.returncode == 3
    assert "/tmp/pi-harness-new/agent/" + root_rel in proc.stderr  # which file is missing
    assert "p2pnode fetch <branch>" in proc.stderr and "--no-lineage" in proc.stderr
    assert "Traceback" not in proc.stderr
    branch = b.run("share", "--no-lineage", str(fork)).stdout.split()[0]
    show = json.loads(b.run("show", branch, "--json").stdout)
    assert show["branch"]["parent"] is None
    assert show["branch"]["lineage_cut"] == "/tmp/pi-harness-new/agent/" + root_rel
    assert "lineage cut" in b.run("show", branch).stdout
    sidecar = show["sidecar"]  # the sidecar is a root's, as before: the cut is local
    assert json.loads(sidecar) == {"type": "branch", "version": 1, "src": show["branch"]["src"],
                                   "parent": None}


# --- the library's lookups ------------------------------------------------------------------


@pytest.fixture
def two(tmp_path: Path, corpus_new_dir: Path) -> Iterator[tuple[Library, Library, Path]]:
    """Alice's library (root + fork shared) and Bob's, who fetched Alice's fork (placed in his
    agent dir); and Bob's agent dir."""
    root_rel, fork_rel = ROOT_FORK["1.5.2"]
    alice_agent, bob_agent = tmp_path / "alice-agent", tmp_path / "bob-agent"
    for rel in (root_rel, fork_rel):
        (alice_agent / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(corpus_new_dir / rel, alice_agent / rel)
    with Library.open(NodePaths(tmp_path / "alice"), agent_dir=alice_agent) as alice, \
            Library.open(NodePaths(tmp_path / "bob"), agent_dir=bob_agent) as bob:
        shared = alice.share(str(alice_agent / fork_rel))
        fetch_into(alice, bob, shared.branch, bob_agent)
        yield alice, bob, bob_agent


def fetch_into(sender: Library, receiver: Library, branch: str, agent: Path) -> Path:
    """What `fetch` does without the network: the lineage stored, oldest first, the tip placed."""
    chain = sender.lineage(branch)
    for info in reversed(chain):
        lines = [sender.line(r.hash) for r in sender.line_manifest(info.src)]
        receiver.add_fetched(sender.sidecar_bytes(info.branch), lines)
    placed = place_session(agent, sender.session_bytes(chain[0].src), chain[0].src,
                           PlacedFiles(receiver.paths.placed))
    receiver.record_path(branch, placed.path)
    return placed.path


def placed_fork(bob: Library) -> tuple[str, Path]:
    fork = next(i for i in bob.branches(include_unshared=True) if i.parent is not None)
    assert fork.path is not None
    return fork.branch, Path(fork.path)


def test_a_fetched_session_grown_by_pi_shares_with_its_fetched_parent(two) -> None:
    """Bob continues the placed file itself (`pi -c`): its header names Alice's path, and the
    version it grew from is known, so its parent is the fetched one's."""
    alice, bob, _ = two
    branch, placed = placed_fork(bob)
    with open(placed, "ab") as f:
        f.write(b'{"type":"message","id":"b0b00001","parentId":null,"message":{"role":"user","content":"x"}}\n')
    grown = bob.share(str(placed))
    assert grown.parent == bob.branch(branch).parent and grown.branch != branch
    assert [a.branch for a in grown.ancestors] == [bob.branch(branch).parent]


def test_a_parent_that_is_gone_is_found_by_path_then_by_id(two, tmp_path: Path) -> None:
    alice, bob, agent = two
    branch, placed = placed_fork(bob)
    fork = pi_fork(placed, agent, tmp_path / "w", "b0b0-1", pi="1.5.2")
    placed.unlink()  # the placed file was deleted: the manifest still knows what was there
    assert bob.share(str(fork)).parent == branch
    other = pi_fork(fork, agent, tmp_path / "w", "b0b0-2", pi="1.5.2")
    # a path this node never saw, but a Pi file name whose id it holds
    elsewhere = str(tmp_path / "elsewhere" / placed.name).encode()
    other.write_bytes(other.read_bytes().replace(str(fork).encode(), elsewhere, 1))
    assert bob.share(str(other)).parent == branch


def test_a_final_newline_added_by_pi_is_the_same_version(tmp_path: Path, corpus_new_dir: Path) -> None:
    """A session fetched without its final newline (shared by an older node while Pi was
    writing); pi 1.5.2 adds the newline when it forks it.  The fork's parent is still the
    fetched branch, and fetching it again is no conflict."""
    root_rel, _ = ROOT_FORK["1.5.2"]
    data = (corpus_new_dir / root_rel).read_bytes()[:-1]
    src = blake3.blake3(data).hexdigest()
    from p2pnode.pi.sidecar import Sidecar

    agent = tmp_path / "agent"
    with Library.open(NodePaths(tmp_path / "bob"), agent_dir=agent) as bob:
        info = bob.add_fetched(Sidecar(src, None).encode(), data.splitlines(keepends=True))
        placed = place_session(agent, data, src, PlacedFiles(bob.paths.placed)).path
        bob.record_path(info.branch, placed)
        fork = pi_fork(placed, agent, tmp_path / "w", "b0b0-3", pi="1.5.2")
        assert placed.read_bytes() == data + b"\n"
        assert bob.share(str(fork)).parent == info.branch
        again = place_session(agent, data, src, PlacedFiles(bob.paths.placed))
        assert again.path == placed and not again.written


def test_a_parent_beside_its_child_in_a_session_dir(tmp_path: Path, corpus_new_dir: Path) -> None:
    """With a session-dir override, sessions are flat in it and a parent is looked for there."""
    root_rel, fork_rel = ROOT_FORK["1.5.2"]
    flat = tmp_path / "flat"
    flat.mkdir()
    for rel in (root_rel, fork_rel):
        shutil.copyfile(corpus_new_dir / rel, flat / Path(rel).name)
    with Library.open(NodePaths(tmp_path / "n"), agent_dir=tmp_path / "agent") as lib:
        pi = PiDirs(tmp_path / "agent", flat)
        result = lib.share(pi=pi, cwd="/tmp/pi-harness-new/work/alpha", latest=True)
        assert Path(result.path or "").parent == flat
        fork = lib.share(str(flat / Path(fork_rel).name), pi=pi)
        assert fork.parent is not None and fork.ancestors[0].path == str(flat / Path(root_rel).name)


def test_cycles_are_refused_and_nothing_is_shared(tmp_path: Path) -> None:
    d = tmp_path / "agent" / "sessions" / "--w--"
    d.mkdir(parents=True)

    def write(name: str, parent: Path) -> Path:
        header = {"type": "session", "version": 3, "id": name, "timestamp": "2026-11-23T12:00:00.000Z",
                  "cwd": "/w", "parentSession": str(parent)}
        (d / f"{name}.jsonl").write_bytes(json.dumps(header).encode() + b'\n{"type":"x","id":"1"}\n')
        return d / f"{name}.jsonl"

    with Library.open(NodePaths(tmp_path / "n"), agent_dir=tmp_path / "agent") as lib:
        x = write("x", d / "y.jsonl")
        write("y", x)
        with pytest.raises(LineageCycle, match="cycle"):
            lib.share(str(x))
        os.link(x, d / "x-hardlink.jsonl")  # the same file under another name is still the same file
        write("y", d / "x-hardlink.jsonl")
        with pytest.raises(LineageCycle):
            lib.share(str(x))
        write("s", d / "s.jsonl")
        with pytest.raises(LineageCycle):
            lib.share(str(d / "s.jsonl"))
        with pytest.raises(NotFound):
            lib.share(str(write("z", d / "gone.jsonl")))
        assert lib.branches(include_unshared=True) == []


def test_a_cut_lineage_stays_cut_for_grown_versions(tmp_path: Path, corpus_new_dir: Path) -> None:
    """A session shared with --no-lineage (here, or by the peer it was fetched from) is a known
    root: its grown versions share as roots too, with the cut recorded, not as an error."""
    _, fork_rel = ROOT_FORK["1.5.2"]
    alice_agent = tmp_path / "alice-agent"
    fork = alice_agent / fork_rel
    fork.parent.mkdir(parents=True)
    shutil.copyfile(corpus_new_dir / fork_rel, fork)  # its parent is not on this machine
    line = b'{"type":"message","id":"a1a10001","parentId":null,"message":{"role":"user","content":"x"}}\n'
    with Library.open(NodePaths(tmp_path / "alice"), agent_dir=alice_agent) as alice, \
            Library.open(NodePaths(tmp_path / "bob"), agent_dir=tmp_path / "bob-agent") as bob:
        cut = alice.share(str(fork), no_lineage=True)
        assert cut.parent is None and cut.lineage_cut is not None
        with open(fork, "ab") as f:
            f.write(line)
        grown = alice.share(str(fork))
        assert grown.parent is None and grown.lineage_cut == cut.lineage_cut and grown.src != cut.src
        placed = fetch_into(alice, bob, grown.branch, tmp_path / "bob-agent")
        assert bob.branch(grown.branch).lineage_cut is None  # the cut is local to Alice's node
        with open(placed, "ab") as f:
            f.write(line.replace(b"a1a10001", b"b0b00001"))
        assert bob.share(str(placed)).parent is None
