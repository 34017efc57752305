"""The team loop with the real `pi` (issue 14, "The Pi people run today"): pi 0.73.1
(@mariozechner/pi-coding-agent) and pi 1.5.2 (@earendil-works/pi-coding-agent) from npm, each
answered by a scripted stand-in for the model on loopback (tests/pimodel.py).

Alice's real pi writes a session (in her own HOME and agent dir), Alice shares it; Bob's
running node fetches it by hash over loopback TLS; Bob's real `pi -p --fork <fetched file>`
accepts it, sends its history to the model and records the fetched path as `parentSession`;
Bob shares his fork and Carol's node fetches it from Bob with its whole lineage, byte-identical.

pi is installed by `.ci/install-real-pi` (run by .ci/run before the tests; a developer runs it
once) into $P2PNODE_REAL_PI_DIR, else ~/.cache/p2pnode/real-pi, with a node from npm beside
it when the machine's is older than pi needs; tests/realpi.py finds and runs it.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pimodel import ScriptedModel, serve_model, write_models_json
from procnode import Node
from realpi import VERSIONS, installed_pi, run_pi

from p2pnode.paths import NodePaths
from p2pnode.peer.trust import TrustStore
from p2pnode.pi import session as pisession


@pytest.fixture(params=VERSIONS)
def pi_bin(request: pytest.FixtureRequest) -> Path:
    return installed_pi(request.param)


class Laptop(Node):
    """A node with its own HOME, Pi agent dir and project dir, as on a laptop of its own."""

    def __init__(self, root: Path, name: str) -> None:
        super().__init__(root, name)
        self.env["HOME"] = str(root / name / "userhome")
        self.work = root / name / "work" / "project"
        self.work.mkdir(parents=True)
        Path(self.env["HOME"]).mkdir()

    def pi(self, binary: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        """The real pi in print mode against the stand-in, in this laptop's project dir (or cwd)."""
        return run_pi(binary, *args, cwd=cwd or self.work, env=self.env)

    def sessions(self) -> set[Path]:
        return set((self.agent / "sessions").glob("*/*.jsonl"))


def trust_each_other(*nodes: Node) -> None:
    for x in nodes:
        for y in nodes:
            if x is not y:
                TrustStore(NodePaths(x.home).trust).trust(y.id)


def body(data: bytes) -> list[bytes]:
    """A session's lines after its header."""
    lines = data.splitlines(keepends=True)
    return lines[pisession.header_index(lines, "session") + 1:]


def test_a_fetched_session_is_forked_by_the_real_pi_and_travels_on(pi_bin: Path, tmp_path: Path) -> None:
    model = ScriptedModel(["Alice's answer from the stand-in.", "Bob's answer, continuing Alice's session."])
    alice, bob, carol = (Laptop(tmp_path, n) for n in ("alice", "bob", "carol"))
    trust_each_other(alice, bob)
    trust_each_other(bob, carol)
    with serve_model(model) as base_url:
        for laptop in (alice, bob, carol):
            write_models_json(laptop.agent, base_url)

        answer = alice.pi(pi_bin, "Alice asks a question.").stdout
        assert answer.strip() == "Alice's answer from the stand-in."
        (root,) = alice.sessions()
        shared = json.loads(alice.run("share", str(root), "--json").stdout)

        with alice.serving() as port, bob.node_running():  # Bob's node does his fetch and share
            got_b = bob.fetch_json(shared["branch"], "--from", f"127.0.0.1:{port}")
            fetched = Path(got_b["path"])
            assert fetched.read_bytes() == root.read_bytes()

            before = bob.sessions()
            assert bob.pi(pi_bin, "--fork", str(fetched), "Bob continues.").stdout.strip() == \
                "Bob's answer, continuing Alice's session."
            (fork,) = bob.sessions() - before
            header = pisession.read_header(fork)
            assert header.parent_session == str(fetched)  # pi records the fetched path
            assert header.cwd == str(bob.work)
            fork_body = body(fork.read_bytes())
            assert fork_body[:len(body(root.read_bytes()))] == body(root.read_bytes())  # copied verbatim
            sent = [m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]
                    for m in model.requests[-1]["messages"] if m["role"] in ("user", "assistant")]
            assert sent == ["Alice asks a question.", "Alice's answer from the stand-in.", "Bob continues."]
            assert fetched.read_bytes() == root.read_bytes()  # the fork's source: still the version placed

            b_shared = json.loads(bob.run("share", str(fork), "--json").stdout)
            assert b_shared["parent"] == shared["branch"]
            b_port = json.loads(bob.run("status", "--json").stdout)["port"]
            got_c = carol.fetch_json(b_shared["branch"], "--from", f"127.0.0.1:{b_port}")
        assert got_c["fetched"] == [b_shared["branch"], shared["branch"]]
        assert Path(got_c["path"]).read_bytes() == fork.read_bytes()
        for branch, original in ((shared["branch"], root), (b_shared["branch"], fork)):
            assert carol.run("cat", branch).stdout.encode() == original.read_bytes()


def test_a_session_placed_in_a_session_dir_is_continued_by_the_real_pi(pi_bin: Path, tmp_path: Path) -> None:
    """With PI_CODING_AGENT_SESSION_DIR (`~` expanded) set, a fetch places the session flat in
    that dir, where the real `pi -c` finds it (pi 0.73.1 reads only the first 512 bytes for
    that; 1.5.2 also matches the header's cwd, so Bob works in the same project path as Alice)
    and appends to it; `share` with no argument, searching that dir by header cwd, shares the
    grown file, and Carol's `fetch --session-dir` places it flat in hers, byte-identical."""
    model = ScriptedModel(["Alice's answer.", "Bob's answer, in the same file."])
    alice, bob, carol = (Laptop(tmp_path, n) for n in ("alice", "bob", "carol"))
    trust_each_other(alice, bob)
    trust_each_other(bob, carol)
    bob.env["PI_CODING_AGENT_SESSION_DIR"] = "~/pi-sessions"
    flat = Path(bob.env["HOME"]) / "pi-sessions"
    with serve_model(model) as base_url:
        for laptop in (alice, bob):
            write_models_json(laptop.agent, base_url)
        alice.pi(pi_bin, "Alice asks.")
        (root,) = alice.sessions()
        shared = json.loads(alice.run("share", str(root), "--json").stdout)
        with alice.serving() as port:
            placed = Path(bob.fetch_json(shared["branch"], "--from", f"127.0.0.1:{port}")["path"])
        assert placed == flat / root.name and placed.read_bytes() == root.read_bytes()
        assert not (bob.agent / "sessions").exists()  # Pi looks only in the session dir

        assert bob.pi(pi_bin, "-c", "Bob goes on.", cwd=alice.work).stdout.strip() == \
            "Bob's answer, in the same file."
        grown = placed.read_bytes()
        assert grown.startswith(root.read_bytes()) and len(body(grown)) == len(body(root.read_bytes())) + 2
        assert list(flat.iterdir()) == [placed]  # continued in place, no new file

        proc = subprocess.run([sys.executable, "-m", "p2pnode", "share", "--json"], cwd=alice.work,
                              env=bob.env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        b_shared = json.loads(proc.stdout)
        assert b_shared["path"] == str(placed)
        with bob.serving() as port:
            got = carol.fetch_json(b_shared["branch"], "--from", f"127.0.0.1:{port}",
                                   "--session-dir", str(tmp_path / "carol-flat"))
        assert Path(got["path"]) == tmp_path / "carol-flat" / root.name
        assert Path(got["path"]).read_bytes() == grown


def test_a_header_after_blank_lines_is_placed_where_the_real_pi_continues_it(pi_bin: Path,
                                                                            tmp_path: Path) -> None:
    """A shared file whose header follows blank and malformed lines (pi 1.5.2 reads it; 0.73.1
    reads only a header on the first line, within 512 bytes) is placed header first: the real
    `pi -c` of either version continues that file rather than starting a new session."""
    model = ScriptedModel(["Alice's answer.", "Bob's answer, in the placed file."])
    alice, bob = Laptop(tmp_path, "alice"), Laptop(tmp_path, "bob")
    trust_each_other(alice, bob)
    with serve_model(model) as base_url:
        for laptop in (alice, bob):
            write_models_json(laptop.agent, base_url)
        alice.pi(pi_bin, "Alice asks.")
        (root,) = alice.sessions()
        root.write_bytes(b"\n{broken\n" + root.read_bytes())
        shared = json.loads(alice.run("share", str(root), "--json").stdout)
        with alice.serving() as port:
            placed = Path(bob.fetch_json(shared["branch"], "--from", f"127.0.0.1:{port}")["path"])
        header, rest = root.read_bytes().split(b"\n{broken\n", 1)[1].split(b"\n", 1)
        assert placed.read_bytes() == header + b"\n\n{broken\n" + rest

        before = placed.read_bytes()
        assert bob.pi(pi_bin, "-c", "Bob goes on.", cwd=alice.work).stdout.strip() == \
            "Bob's answer, in the placed file."
        assert bob.sessions() == {placed}  # continued, not a new session
        after = placed.read_bytes()
        assert after.startswith(before) and len(body(after)) == len(body(before)) + 2
