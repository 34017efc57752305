"""p2pnode nodes in lab hosts, for tests/node/test_lan.py and scripts/bench_lan.py.

A LanNode is one node's state dir and Pi agent dir (on the shared disk) plus its
`p2pnode serve` process inside a lab host namespace; its `cli()` runs `p2pnode` in the same
host with the same environment, so commands reach the running node over its control socket.
"""
from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from lab import Lab

from p2pnode.paths import NodePaths
from p2pnode.peer.identity import load_or_create_identity
from p2pnode.peer.trust import TrustStore

REPO = Path(__file__).resolve().parents[1]


def wait_for(what: str, probe: Callable[[], Any], timeout: float, every: float = 0.2) -> Any:
    """Poll probe() until it returns something truthy; fail with `what` after timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = probe()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)


class LanNode:
    """One node's state dir and agent dir (on the shared disk) and its `serve` process in a host."""

    def __init__(self, lab: Lab, host: str, root: Path):
        self.lab, self.host = lab, host
        self.paths = NodePaths(root / host / "node").ensure()
        self.agent = root / host / "agent"
        self.agent.mkdir(parents=True)
        self.node_id = load_or_create_identity(self.paths.identity).node_id
        self.log = root / host / "serve.log"
        self.proc: subprocess.Popen[str] | None = None

    @property
    def env(self) -> dict[str, str]:
        return dict(os.environ, P2PNODE_HOME=str(self.paths.home), PI_CODING_AGENT_DIR=str(self.agent),
                    PYTHONPATH=str(REPO), PYTHONSAFEPATH="1")  # this tree's, whatever the cwd (python -m)

    def trust(self, *others: LanNode) -> None:
        store = TrustStore(self.paths.trust)
        for other in others:
            store.trust(other.node_id, name=other.host)

    def start(self, port: int = 47470, wait: bool = True) -> None:
        with open(self.log, "a") as log:
            self.proc = self.lab.spawn(self.host, sys.executable, "-m", "p2pnode", "--log-level", "DEBUG",
                                       "serve", "--port", str(port), env=self.env, stdout=log, stderr=log)
        if wait:
            self.wait_running()

    def wait_running(self) -> None:
        wait_for(f"{self.host}'s node to answer", lambda: self.running(), 30)

    def running(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.host}'s node exited {self.proc.returncode}:\n{self.log.read_text()}")
        r = self.cli("status", "--json")
        return r.returncode == 0 and json.loads(r.stdout)["running"]

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            raise AssertionError(f"{self.host}'s node ignored signal {sig}") from None

    def cli(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return self.lab.run(self.host, sys.executable, "-m", "p2pnode", *argv, env=self.env, timeout=timeout)

    def status(self) -> dict[str, Any]:
        r = self.cli("status", "--json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    def peer(self, other: LanNode) -> dict[str, Any] | None:
        return next((p for p in self.status()["peers"] if p["node_id"] == other.node_id), None)

    def share(self, path: Path) -> str:
        r = self.cli("share", str(path), "--json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["branch"]

    def fetch(self, branch: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
        return self.cli("fetch", branch, "--json", timeout=timeout)



class Laptop(LanNode):
    """A LanNode with its own HOME too, as on a laptop of its own."""

    @property
    def env(self) -> dict[str, str]:
        home = self.agent.parent / "home"
        home.mkdir(exist_ok=True)
        return dict(super().env, HOME=str(home))


@contextlib.contextmanager
def running(nodes: Iterable[LanNode]) -> Iterator[None]:
    """Start every node at once (each `serve` in its host), wait until all answer, stop them all."""
    nodes = list(nodes)
    try:
        for node in nodes:
            node.start(wait=False)
        for node in nodes:
            node.wait_running()
        yield
    finally:
        for node in nodes:
            node.stop()


def place(corpus_dir: Path, rel: str, agent: Path) -> Path:
    dest = agent / rel
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(corpus_dir / rel, dest)
    return dest


def grow(path: Path, mb: int) -> None:
    """Append mb MiB of real-shaped, incompressible, unique message entries to a Pi session."""
    last = json.loads(path.read_bytes().splitlines()[-1])["id"]
    with open(path, "ab") as f:
        for i in range(mb * 8):
            entry_id = f"{i:08x}"
            text = base64.b64encode(os.urandom(96 * 1024)).decode()
            f.write(json.dumps({"type": "message", "id": entry_id, "parentId": last,
                                "timestamp": "2026-11-21T19:30:00.000Z",
                                "message": {"role": "user", "content": [{"type": "text", "text": text}]}},
                               separators=(",", ":")).encode() + b"\n")
            last = entry_id
