"""Issue 14's team loop on three laptops with the real `pi` (0.73.1 and 1.5.2 from npm): real
`p2pnode serve` in lab namespaces with real mDNS, fetches by hash alone (no address), each
laptop with its own HOME and agent dir, on sessions the real pi writes during the test.

pi itself needs no LAN: it runs beside the lab (the machine's own namespace, where the scripted
stand-in for the model listens on loopback) and writes into each laptop's agent dir, which
that laptop's node reads.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from lab import Lab
from lannode import LanNode, running, wait_for
from pimodel import ScriptedModel, serve_model, write_models_json
from realpi import VERSIONS, installed_pi, run_pi

from p2pnode.pi import session as pisession

pytestmark = pytest.mark.lab


@pytest.fixture(params=VERSIONS)
def pi_bin(request: pytest.FixtureRequest) -> Path:
    return installed_pi(request.param)


class Laptop(LanNode):
    """A LanNode with its own HOME and project dir, and the real pi run as its user would."""

    def __init__(self, lab: Lab, host: str, root: Path):
        super().__init__(lab, host, root)
        self.home = root / host / "userhome"
        self.work = root / host / "work" / "project"
        self.home.mkdir()
        self.work.mkdir(parents=True)

    @property
    def env(self) -> dict[str, str]:
        return dict(super().env, HOME=str(self.home))

    def pi(self, binary: Path, *args: str) -> subprocess.CompletedProcess[str]:
        return run_pi(binary, *args, cwd=self.work, env=self.env)

    def sessions(self) -> set[Path]:
        return set((self.agent / "sessions").glob("*/*.jsonl"))

    def fetched(self, branch: str) -> dict[str, Any]:
        """Fetch by hash alone; retried while mDNS has not yet told this node who holds it."""
        def attempt() -> dict[str, Any] | None:
            r = self.fetch(branch)
            return json.loads(r.stdout) if r.returncode == 0 else None

        return wait_for(f"{self.host} to fetch {branch[:16]}", attempt, 60, every=1.0)


def test_team_loop_with_the_real_pi(lab: Lab, tmp_path: Path, pi_bin: Path) -> None:
    model = ScriptedModel(["Alice's answer.", "Bob's answer.", "Carol's answer."])
    a, b, c = (Laptop(lab, h, tmp_path) for h in ("h1", "h2", "h3"))
    for node in (a, b, c):
        node.trust(*(n for n in (a, b, c) if n is not node))
    with serve_model(model) as base_url, running([a, b, c]):
        for laptop in (a, b, c):
            write_models_json(laptop.agent, base_url)

        a.pi(pi_bin, "Alice asks.")
        (root,) = a.sessions()
        branch = a.share(root)

        fetched = Path(b.fetched(branch)["path"])
        assert fetched.read_bytes() == root.read_bytes()
        before = b.sessions()
        assert b.pi(pi_bin, "--fork", str(fetched), "Bob continues.").stdout.strip() == "Bob's answer."
        (fork,) = b.sessions() - before
        assert pisession.read_header(fork).parent_session == str(fetched)
        r = b.cli("share", str(fork), "--json")
        assert r.returncode == 0, r.stderr
        b_shared = json.loads(r.stdout)
        assert b_shared["parent"] == branch

        got = c.fetched(b_shared["branch"])
        assert got["fetched"] == [b_shared["branch"], branch]
        for br, original in ((branch, root), (b_shared["branch"], fork)):
            assert c.cli("cat", br).stdout.encode() == original.read_bytes()

        # Carol goes one generation further, and Alice's laptop goes away: Bob has it all
        before = c.sessions()
        assert c.pi(pi_bin, "--fork", got["path"], "Carol continues.").stdout.strip() == "Carol's answer."
        (c_fork,) = c.sessions() - before
        c_branch = c.share(c_fork)
        a.stop()
        got_b = b.fetched(c_branch)
        assert got_b["fetched"] == [c_branch] and Path(got_b["path"]).read_bytes() == c_fork.read_bytes()
