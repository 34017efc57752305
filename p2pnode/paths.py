"""Where the node keeps its state and where Pi keeps its sessions."""
from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import platformdirs

log = logging.getLogger(__name__)

STATE_DIR_MODE = 0o700
STATE_FILE_MODE = 0o600
"""The node's state (keys, trust, what was shared and fetched) is for its user alone, whatever
the umask and whatever modes an existing home had."""


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
        """Create the home (0700) and tighten what is already there (privacy_problems says
        what could not be tightened)."""
        self.home.mkdir(parents=True, exist_ok=True, mode=STATE_DIR_MODE)
        for path, mode in self._state_entries():
            if mode & 0o077:
                want = STATE_DIR_MODE if stat.S_ISDIR(mode) else STATE_FILE_MODE
                try:
                    os.chmod(path, stat.S_IMODE(mode) & want)
                except OSError as exc:
                    log.warning("cannot make %s private: %s", path, exc)
        return self

    def privacy_problems(self) -> list[str]:
        """State that other local users can read or enter (for `status` to warn about)."""
        return [f"{path} is mode {stat.S_IMODE(mode):04o}: other local users can "
                f"{'enter it' if stat.S_ISDIR(mode) else 'read it'} (chmod go-rwx {path})"
                for path, mode in self._state_entries() if mode & 0o077]

    def _state_entries(self) -> list[tuple[Path, int]]:
        """The home and what is directly in it (the store's own files are the store's care;
        a closed home keeps them from others anyway).  Symlinks are left alone."""
        entries = []
        for path in [self.home, *(self.home.iterdir() if self.home.is_dir() else [])]:
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if not stat.S_ISLNK(st.st_mode):
                entries.append((path, st.st_mode))
        return entries
