"""Where the node keeps its state and where Pi keeps its sessions."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import platformdirs


def agent_dir() -> Path:
    """Pi's agent dir: $PI_CODING_AGENT_DIR (a leading ~ expanded, as Pi does) or ~/.pi/agent."""
    env = os.environ.get("PI_CODING_AGENT_DIR")
    if env:
        return Path(os.path.expanduser(env))
    return Path.home() / ".pi" / "agent"


@dataclass(frozen=True)
class NodePaths:
    """The node's state directory ($P2PNODE_HOME, else the platform's user state dir)."""

    home: Path

    @classmethod
    def default(cls) -> NodePaths:
        env = os.environ.get("P2PNODE_HOME")
        return cls(Path(env) if env else Path(platformdirs.user_state_dir("p2pnode")))

    @property
    def store(self) -> Path:
        return self.home / "store"

    @property
    def store_socket(self) -> Path:
        return self.home / "store.sock"

    @property
    def manifest(self) -> Path:
        return self.home / "manifest.json"

    @property
    def placed(self) -> Path:
        """What fetches placed under Pi's sessions dir (manifest.PlacedFiles)."""
        return self.home / "placed.json"

    @property
    def identity(self) -> Path:
        return self.home / "identity"

    @property
    def trust(self) -> Path:
        return self.home / "trust.json"

    def ensure(self) -> NodePaths:
        self.home.mkdir(parents=True, exist_ok=True, mode=0o700)
        return self
