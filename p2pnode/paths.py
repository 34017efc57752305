"""Where the node keeps its state and where Pi keeps its sessions."""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import platformdirs

SESSION_DIR_ENV = "PI_CODING_AGENT_SESSION_DIR"


def agent_dir(env: Mapping[str, str] | None = None) -> Path:
    """Pi's agent dir: $PI_CODING_AGENT_DIR (a leading ~ expanded, as Pi does) or ~/.pi/agent."""
    value = (os.environ if env is None else env).get("PI_CODING_AGENT_DIR")
    if value:
        return Path(os.path.expanduser(value))
    return Path.home() / ".pi" / "agent"


def _settings_session_dir(path: Path) -> str | None:
    """`sessionDir` of one Pi settings.json (None if unset, or the file is missing or unreadable,
    as Pi then goes on without it)."""
    try:
        value = json.loads(path.read_bytes()).get("sessionDir")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None


def session_dir(cwd: str, agent: Path, option: str | None = None,
                env: Mapping[str, str] | None = None) -> Path | None:
    """Pi's session-dir override, or None for its default per-project layout.

    Pi's order (pi 0.73.1 `main.js`, the same in 1.5.2): `--session-dir`, then
    $PI_CODING_AGENT_SESSION_DIR (`~` expanded), then `sessionDir` of the settings (the
    project's `<cwd>/.pi/settings.json` over the global `<agent dir>/settings.json`, `~`
    expanded).  A relative dir is relative to the cwd, as in Pi's process.  With an override,
    Pi keeps every session flat in that one dir and looks nowhere else.
    """
    value = option or (os.environ if env is None else env).get(SESSION_DIR_ENV) or (
        _settings_session_dir(Path(cwd) / ".pi" / "settings.json")
        or _settings_session_dir(agent / "settings.json"))
    if not value:
        return None
    return Path(cwd) / os.path.expanduser(value)


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
    def identity(self) -> Path:
        return self.home / "identity"

    @property
    def trust(self) -> Path:
        return self.home / "trust.json"

    def ensure(self) -> NodePaths:
        """Home and store dir 0700: sessions and keys are the user's alone (the store would
        make its dir with the umask's mode)."""
        self.home.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.store.mkdir(exist_ok=True, mode=0o700)
        return self


@dataclass(frozen=True)
class PiDirs:
    """Where Pi keeps sessions for one caller: its agent dir and its session-dir override."""

    agent: Path
    sessions: Path | None = None
    """The session-dir override (files flat in it), or None: <agent>/sessions/--<cwd>--/."""

    @classmethod
    def resolve(cls, cwd: str, option: str | None = None, env: Mapping[str, str] | None = None) -> PiDirs:
        """As Pi started in `cwd` (with `--session-dir option`, environment `env`) would see them."""
        agent = agent_dir(env)
        return cls(agent, session_dir(cwd, agent, option, env))

    def as_dict(self) -> dict[str, str | None]:
        return {"agent_dir": str(self.agent), "session_dir": str(self.sessions) if self.sessions else None}

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> PiDirs:
        agent, sessions = d.get("agent_dir"), d.get("session_dir")
        if not isinstance(agent, str) or not os.path.isabs(agent) or not (
                sessions is None or isinstance(sessions, str) and os.path.isabs(sessions)):
            raise ValueError("agent_dir and session_dir must be absolute paths (session_dir may be null)")
        return cls(Path(agent), Path(sessions) if sessions else None)
