"""Upgrading a node home written before the secret scan was recorded (no scanned.json, no
`secrets_allowed` in sessions.json): its offered branches are scanned once, in the library,
and served again if clean; one whose scan finds a secret is withheld, and `ls`, `show` and
`status` say why.  Real Pi files from tests/data with a key planted by tests/secretkeys.py."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from pifork import find
from procnode import Node
from secretkeys import PLANTED, plant

from p2pnode.library.api import Library
from p2pnode.paths import NodePaths

A1 = "*0313-7475-8d45-88a780e9fa37.jsonl"  # pi 0.73.1 alpha root
B1 = "*4f3f-74a0-8c1a-0b533764bed8.jsonl"  # pi 0.73.1 beta root
PEER = "a" * 56


@pytest.fixture
def agent(tmp_path: Path, corpus_dir: Path) -> Path:
    shutil.copytree(corpus_dir / "sessions", tmp_path / "agent" / "sessions")
    return tmp_path / "agent"


def as_before_the_scan(home: Path) -> None:
    """Make `home` look as a node before the scan wrote it: no scan records, no allowed marks."""
    (home / "scanned.json").unlink()
    state = home / "sessions.json"
    doc = json.loads(state.read_bytes())
    for record in doc["branches"].values():
        record.pop("secrets_allowed")
    state.write_text(json.dumps(doc))


def test_shares_from_before_the_scan_are_scanned_once_and_withheld_only_if_dirty(
        agent: Path, tmp_path: Path) -> None:
    paths = NodePaths(tmp_path / "node")
    dirty = find(agent, B1)
    data, line, _ = plant(dirty.read_bytes(), "toolResult", PLANTED[0][1])
    dirty.write_bytes(data)
    with Library.open(paths, agent_dir=agent) as lib:
        clean = lib.share(str(find(agent, A1)))
        leaked = lib.share(str(dirty), allow_secrets=True)
    as_before_the_scan(paths.home)
    with Library.open(paths, agent_dir=agent) as lib:
        assert lib.offered_object(clean.branch, PEER) == "sidecar"  # the first request scans
        assert lib.offered_object(leaked.branch, PEER) is None
        assert [b.branch for b in lib.catalog(PEER).branches] == [clean.branch]
        withheld = lib.branch(leaked.branch).withheld
        assert withheld and "secret" in withheld and "--redact" in withheld
        assert lib.branch(clean.branch).withheld is None
        assert lib.scan_unrecorded() == 0  # recorded: never scanned again
    scanned = json.loads((paths.home / "scanned.json").read_bytes())
    assert scanned[clean.src] == [] and scanned[leaked.src][0]["line"] == line


def test_ls_and_status_say_why_a_share_from_before_the_scan_is_withheld(tmp_path: Path,
                                                                         corpus_dir: Path) -> None:
    node = Node(tmp_path, "n")
    shutil.copytree(corpus_dir / "sessions", node.agent / "sessions")
    dirty = find(node.agent, B1)
    dirty.write_bytes(plant(dirty.read_bytes(), "bash", PLANTED[4][1])[0])
    leaked = json.loads(node.run("share", str(dirty), "--allow-secrets", "--json").stdout)
    as_before_the_scan(node.home)
    listed = node.run("ls").stdout
    assert "(withheld: secrets found)" in listed and "(secrets allowed)" not in listed
    assert "not served: the secret scan found 1 secret(s)" in node.run("show", leaked["branch"]).stdout
    with node.node_running():
        status = json.loads(node.run("status", "--json").stdout)
    assert [s["withheld"] is not None for s in status["shared"]] == [True]


def test_versions_stored_before_previous_existed_are_linked_on_open(agent: Path, tmp_path: Path) -> None:
    """Three shares of a growing session and a rewrite of another, stored with no `previous`:
    opening the library links the growths by their line hashes, never the rewrite."""
    paths = NodePaths(tmp_path / "node")
    path, other = find(agent, B1), find(agent, A1)
    with Library.open(paths, agent_dir=agent) as lib:
        branches = [lib.share(str(path)).branch]
        for tag in "ab":
            with open(path, "ab") as f:
                f.write(b'{"type":"message","id":"%s","parentId":null,"message":{"role":"user",'
                        b'"content":"more"}}\n' % tag.encode())
            branches.append(lib.share(str(path)).branch)
        first = lib.share(str(other)).branch
        other.write_bytes(other.read_bytes().replace(b'"version":3', b'"version":4', 1))
        rewritten = lib.share(str(other)).branch
    state = paths.home / "sessions.json"
    doc = json.loads(state.read_bytes())
    for version in doc["sessions"].values():
        version.pop("previous")
    state.write_text(json.dumps(doc))
    with Library.open(paths, agent_dir=agent) as lib:
        assert [lib.branch(b).version for b in branches] == [1, 2, 3]
        assert [lib.branch(b).previous for b in branches] == [None, *branches[:2]]
        assert lib.branch(rewritten).previous is None and lib.branch(first).versions == 1
        assert sorted((r.branch, r.versions) for r in lib.sessions_latest()) == sorted(
            [(branches[2], 3), (first, 1), (rewritten, 1)])
