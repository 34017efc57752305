"""An ordinary user to run `p2pnode` processes as: this run's own uid, or `nobody` (65534) when
the suite runs as root, so that a test of what users meet proves it under both of `.ci/run`'s
parts.  Its directory is made under the system temp dir (pytest's tmp_path is private to the
uid running the suite) and is short enough for a Unix socket path on Linux and macOS."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NOBODY = 65534
KEPT_ENV = ("PATH", "LANG", "LC_ALL", "TMPDIR")
"""What a user's environment keeps of the suite's; everything else is set per node."""


@dataclass(frozen=True)
class OrdinaryUser:
    uid: int
    gid: int
    root: Path
    """A directory this user owns (0700); every node of the test lives under it."""

    @property
    def dropped(self) -> bool:
        """True when the suite runs as root and the processes run as `nobody`."""
        return self.uid != os.geteuid()

    def own(self, path: Path) -> None:
        """Give `path` (and what is under it) to this user."""
        if not self.dropped:
            return
        for p in [path, *path.rglob("*")]:
            os.lchown(p, self.uid, self.gid)

    def node(self, name: str, sessions: Path | None = None) -> dict[str, str]:
        """The environment of a node `name`: its own P2PNODE_HOME (not made: the node makes it),
        Pi agent dir (with a copy of `sessions`) and HOME."""
        base = self.root / name
        agent = base / "agent"
        agent.mkdir(parents=True)
        if sessions is not None:
            shutil.copytree(sessions, agent / "sessions")
        self.own(base)
        env = {k: os.environ[k] for k in KEPT_ENV if k in os.environ}
        return {**env, "HOME": str(base), "P2PNODE_HOME": str(base / "node"),
                "PI_CODING_AGENT_DIR": str(agent)}

    def _as_user(self) -> dict[str, Any]:
        return {"user": self.uid, "group": self.gid, "extra_groups": []} if self.dropped else {}

    def run(self, env: dict[str, str], *args: str, cwd: Path | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[bytes]:
        """`p2pnode *args` as this user; the caller checks the exit code."""
        return subprocess.run([sys.executable, "-m", "p2pnode", *args], env=env, cwd=cwd or self.root,
                              capture_output=True, timeout=timeout, **self._as_user())

    def popen(self, env: dict[str, str], *args: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-m", "p2pnode", *args], env=env, cwd=self.root,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, **self._as_user())

    def start_node(self, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], int]:
        """`p2pnode serve` on loopback without mDNS, once its control socket answers; (process, port)."""
        node = self.popen(env, "serve", "--host", "127.0.0.1", "--port", "0", "--no-mdns")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and node.poll() is None:
            status = self.run(env, "status", "--json")
            if status.returncode == 0 and json.loads(status.stdout)["running"]:
                return node, int(json.loads(status.stdout)["port"])
            time.sleep(0.2)
        node.kill()
        raise AssertionError(f"the node did not start: {node.communicate(timeout=30)[1].decode()}")

    @staticmethod
    def stop_node(node: subprocess.Popen[bytes]) -> None:
        """SIGTERM, as systemd and launchd stop it: a clean exit 0 without a traceback."""
        if node.poll() is None:
            node.send_signal(signal.SIGTERM)
        _, err = node.communicate(timeout=30)
        assert node.returncode == 0 and b"Traceback" not in err, err.decode()

    def shell(self, env: dict[str, str], command: str,
              timeout: float = 60) -> subprocess.CompletedProcess[bytes]:
        """A `sh -c` pipeline as this user (for `p2pnode ls | head`)."""
        return subprocess.run(["sh", "-c", command], env=env, cwd=self.root, capture_output=True,
                              timeout=timeout, **self._as_user())


def unusable_reason(user: OrdinaryUser) -> str | None:
    """Why `nobody` cannot run this suite's interpreter (a venv made from a python under a
    private home such as /root/.pyenv), or None.  `.ci/run` builds its venv where it can."""
    if not user.dropped:
        return None
    try:
        probe = subprocess.run([sys.executable, "-c", "import p2pnode"], cwd=user.root, capture_output=True,
                               timeout=60, **user._as_user())
        if probe.returncode == 0:
            return None
    except PermissionError:
        pass
    return f"uid {user.uid} cannot run {sys.executable} with p2pnode: make the venv from a python it can read"


@contextmanager
def ordinary_user() -> Iterator[OrdinaryUser]:
    uid, gid = (NOBODY, NOBODY) if os.geteuid() == 0 else (os.geteuid(), os.getegid())
    root = Path(tempfile.mkdtemp(prefix="p2pu-"))
    user = OrdinaryUser(uid, gid, root)
    try:
        user.own(root)
        yield user
    finally:
        shutil.rmtree(root, ignore_errors=True)
