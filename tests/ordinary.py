"""An ordinary user to run `p2pnode` processes as: this run's own uid, or `nobody` (65534) when
the suite runs as root, so that a test of what users meet proves it under both of `.ci/run`'s
parts.  Its directory is made under the system temp dir (pytest's tmp_path is private to the
uid running the suite) and is short enough for a Unix socket path on Linux and macOS."""
from __future__ import annotations

import json
import os
import shutil
import signal
import site
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


REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Python:
    """An interpreter the user can run, and the PYTHONPATH it needs to find p2pnode and its
    dependencies (None: it finds them itself, as the venv's own python does)."""

    executable: str
    path: str | None = None


def pythons() -> list[Python]:
    """This run's interpreter, then a system one of the same version given this run's
    site-packages: a venv made from a python under a private home (pyenv's in /root) is
    not runnable by `nobody`, but its packages are readable."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    path = os.pathsep.join([str(REPO), *site.getsitepackages()])
    return [Python(sys.executable), *(Python(f"{d}/{version}", path) for d in ("/usr/bin", "/usr/local/bin")
                                      if os.path.exists(f"{d}/{version}"))]


@dataclass(frozen=True)
class OrdinaryUser:
    uid: int
    gid: int
    root: Path
    """A directory this user owns (0700); every node of the test lives under it."""
    python: Python = Python(sys.executable)

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
        if self.python.path:
            env["PYTHONPATH"] = self.python.path
        return {**env, "HOME": str(base), "P2PNODE_HOME": str(base / "node"),
                "PI_CODING_AGENT_DIR": str(agent)}

    def _as_user(self) -> dict[str, Any]:
        return {"user": self.uid, "group": self.gid, "extra_groups": []} if self.dropped else {}

    def run(self, env: dict[str, str], *args: str, cwd: Path | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[bytes]:
        """`p2pnode *args` as this user; the caller checks the exit code."""
        return subprocess.run([self.python.executable, "-m", "p2pnode", *args], env=env, cwd=cwd or self.root,
                              capture_output=True, timeout=timeout, **self._as_user())

    def popen(self, env: dict[str, str], *args: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen([self.python.executable, "-m", "p2pnode", *args], env=env, cwd=self.root,
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


def runnable(user: OrdinaryUser, python: Python) -> bool:
    env = {"PYTHONPATH": python.path} if python.path else {}
    try:
        probe = subprocess.run([python.executable, "-c",
                                "import p2pnode.cli.main, aiohttp, blake3, zstandard"],
                               cwd=user.root, env=env, capture_output=True, timeout=60, **user._as_user())
    except PermissionError:
        return False
    return probe.returncode == 0


@contextmanager
def ordinary_user() -> Iterator[OrdinaryUser | str]:
    """The user, or (a str) why no interpreter here can run p2pnode as `nobody`."""
    uid, gid = (NOBODY, NOBODY) if os.geteuid() == 0 else (os.geteuid(), os.getegid())
    root = Path(tempfile.mkdtemp(prefix="p2pu-"))
    try:
        user = OrdinaryUser(uid, gid, root)
        user.own(root)
        if user.dropped:
            usable = [p for p in pythons() if runnable(user, p)]
            if not usable:
                version = f"{sys.version_info.major}.{sys.version_info.minor}"
                yield f"uid {uid} can run neither {sys.executable} nor a system python{version} with p2pnode"
                return
            user = OrdinaryUser(uid, gid, root, usable[0])
        yield user
    finally:
        shutil.rmtree(root, ignore_errors=True)
