"""Issue 14, the team loop on three laptops: real `p2pnode serve` in lab namespaces, real
mDNS, each node with its own HOME and Pi agent dir; fetches by hash alone (no address).

A shares a root and its fork; B fetches the fork, continues it as `pi --fork` does and
shares that; C fetches B's branch and gets every generation byte-identical, then goes one
generation further; A goes offline and C, starting over from an empty home, still gets
everything from B.
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lab import Lab
from lannode import LanNode, Laptop, place, running, wait_for
from pifork import ROOT_FORK, pi_fork

from p2pnode.paths import NodePaths

pytestmark = pytest.mark.lab


def fetched(node: LanNode, branch: str) -> dict[str, Any]:
    """Fetch by hash alone; retried while mDNS has not yet told the fetcher who holds it."""
    def attempt() -> dict[str, Any] | None:
        r = node.fetch(branch)
        return json.loads(r.stdout) if r.returncode == 0 else None

    return wait_for(f"{node.host} to fetch {branch[:16]}", attempt, 60, every=1.0)


@pytest.fixture
def laptops(lab: Lab, tmp_path: Path) -> Iterator[dict[str, Laptop]]:
    nodes = {h: Laptop(lab, h, tmp_path) for h in ("h1", "h2", "h3")}
    for node in nodes.values():
        node.trust(*(n for n in nodes.values() if n is not node))
    with running(nodes.values()):
        yield nodes


@pytest.mark.parametrize("pi", ["0.73.1", "1.5.2"])
def test_team_loop_across_three_laptops(laptops: dict[str, Laptop], corpus_dir: Path, corpus_new_dir: Path,
                                        tmp_path: Path, pi: str) -> None:
    a, b, c = laptops.values()
    corpus = corpus_dir if pi == "0.73.1" else corpus_new_dir
    root_rel, fork_rel = ROOT_FORK[pi]
    place(corpus, root_rel, a.agent)
    fork = place(corpus, fork_rel, a.agent)
    shared = json.loads(a.cli("share", str(fork), "--json").stdout)
    assert shared["parent"] == shared["ancestors"][0]["branch"]
    originals = {shared["parent"]: (corpus / root_rel).read_bytes(), shared["branch"]: fork.read_bytes()}

    got_b = fetched(b, shared["branch"])
    b_work = tmp_path / "b-work"
    b_work.mkdir()
    b_fork = pi_fork(Path(got_b["path"]), b.agent, b_work, "b0b0b0b0-0000-7000-8000-00000000000b", pi=pi)
    r = b.cli("share", str(b_fork), "--json")
    assert r.returncode == 0, r.stderr
    b_shared = json.loads(r.stdout)
    assert b_shared["parent"] == shared["branch"]
    originals[b_shared["branch"]] = b_fork.read_bytes()

    got_c = fetched(c, b_shared["branch"])
    assert got_c["fetched"] == [b_shared["branch"], shared["branch"], shared["parent"]]
    for branch, data in originals.items():
        assert c.cli("cat", branch).stdout.encode() == data

    c_work = tmp_path / "c-work"
    c_work.mkdir()
    c_fork = pi_fork(Path(got_c["path"]), c.agent, c_work, "ca401000-0000-7000-8000-00000000000c", pi=pi)
    c_shared = json.loads(c.cli("share", str(c_fork), "--json").stdout)
    assert c_shared["parent"] == b_shared["branch"]
    originals[c_shared["branch"]] = c_fork.read_bytes()
    got = fetched(b, c_shared["branch"])
    assert got["fetched"] == [c_shared["branch"]]
    # a fetched session is offered on only once its receiver shares it (SECURITY.md): Bob does
    assert json.loads(b.cli("share", got["path"], "--json").stdout)["branch"] == c_shared["branch"]

    a.stop()  # Alice's laptop goes away; Carol starts over from an empty home, same identity
    c.stop()
    old = c.paths
    c.paths = NodePaths(tmp_path / "h3-again" / "node").ensure()
    c.agent = tmp_path / "h3-again" / "agent"
    c.agent.mkdir()
    for name in (old.identity.name, old.trust.name):
        source = old.home / name
        if source.is_dir():
            shutil.copytree(source, c.paths.home / name)
        else:
            shutil.copyfile(source, c.paths.home / name)
    c.start()
    again = fetched(c, c_shared["branch"])
    assert len(again["fetched"]) == 4
    for branch, data in originals.items():
        assert c.cli("cat", branch).stdout.encode() == data
