"""A node as a real `p2pnode` process with its own P2PNODE_HOME and Pi agent dir, for tests that
drive the CLI end to end (tests/peer, tests/library, tests/pi share it)."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from p2pnode.paths import NodePaths
from p2pnode.peer.identity import load_or_create_identity

PY = sys.executable

PEAK_RSS = """
import atexit, sys
def peak():
    with open("/proc/self/status") as f:
        hwm = next(line for line in f if line.startswith("VmHWM:"))
    sys.stderr.write("PEAK " + hwm.split()[1] + "\\n")
atexit.register(peak)
from p2pnode.cli.main import main
raise SystemExit(main(sys.argv[1:]))
"""
"""`python -c PEAK_RSS <p2pnode args>`: the CLI, which prints its peak RSS (VmHWM, Linux) to
stderr as it exits (`peak_kb` reads it)."""


def peak_kb(stderr: str) -> int:
    """The peak RSS in kB that a PEAK_RSS run printed."""
    return int(stderr.rsplit("PEAK ", 1)[1].split()[0])


def hwm_kb(pid: int) -> int:
    """Another process's peak RSS so far, in kB (Linux /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1])


class Node:
    def __init__(self, root: Path, name: str) -> None:
        self.home = root / name / "home"
        self.agent = root / name / "agent"
        self.agent.mkdir(parents=True)
        self.env = dict(os.environ, P2PNODE_HOME=str(self.home), PI_CODING_AGENT_DIR=str(self.agent))
        self.id = load_or_create_identity(NodePaths(self.home).identity).node_id  # as `p2pnode id` does

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([PY, "-m", "p2pnode", *args], env=self.env, capture_output=True, text=True,
                              timeout=60)
        if check and proc.returncode != 0:
            raise AssertionError(f"p2pnode {' '.join(args)} exited {proc.returncode}: {proc.stderr}")
        return proc

    def fetch_json(self, *args: str) -> dict:
        return json.loads(self.run("fetch", *args, "--json").stdout)

    @contextlib.contextmanager
    def serving(self) -> Iterator[int]:
        """`p2pnode serve-peers` on loopback; yields its port; stopped (SIGTERM) at the end."""
        proc = subprocess.Popen([PY, "-m", "p2pnode", "serve-peers", "--port", "0"], env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = proc.stdout.readline() if proc.stdout else ""
            assert line.startswith("listening on"), proc.stderr.read() if proc.stderr else line
            yield int(line.rsplit(":", 1)[1])
        finally:
            proc.terminate()
            proc.wait(timeout=10)

    @contextlib.contextmanager
    def node_running(self, log: Path | None = None) -> Iterator[subprocess.Popen[bytes]]:
        """`p2pnode serve` (no mDNS, loopback, any port) until its control socket is there
        (bounded: 10 s); stopped (SIGTERM) at the end.  Its log (stderr) is appended to `log`."""
        serve = ["serve", "--no-mdns", "--host", "127.0.0.1", "--port", "0"]
        with open(log or os.devnull, "ab") as err:
            proc = subprocess.Popen([PY, "-m", "p2pnode", *serve], env=self.env,
                                    stdout=subprocess.DEVNULL, stderr=err)
        try:
            sock = NodePaths(self.home).control_socket
            for _ in range(100):
                if sock.exists():
                    break
                time.sleep(0.1)
            assert sock.exists(), f"the node of {self.home} did not start"
            yield proc
        finally:
            proc.terminate()
            proc.wait(timeout=10)
