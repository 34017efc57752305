"""Where the node keeps its state and where Pi keeps its sessions."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import blake3
import platformdirs

from p2pnode.errors import InvalidInput

log = logging.getLogger(__name__)

STATE_DIR_MODE = 0o700
STATE_FILE_MODE = 0o600
"""The node's state (keys, trust, what was shared and fetched) is for its user alone, whatever
the umask and whatever modes an existing home had."""

SESSION_DIR_ENV = "PI_CODING_AGENT_SESSION_DIR"

SUN_PATH_MAX = 103 if sys.platform == "darwin" else 107
"""The longest path a Unix socket can be bound or reached at (sun_path less its final NUL)."""


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
        return socket_path(self.home, "store.sock")

    @property
    def control_socket(self) -> Path:
        """Where `p2pnode serve` takes commands (node/control_client.py)."""
        return socket_path(self.home, "control.sock")

    @property
    def manifest(self) -> Path:
        return self.home / "manifest.json"

    @property
    def placed(self) -> Path:
        """What fetches placed under Pi's sessions dir (manifest.PlacedFiles)."""
        return self.home / "placed.json"

    @property
    def fetching(self) -> Path:
        """Sessions being fetched, until they are published into Pi's folder (pi/placement.py)."""
        return self.home / "fetching"

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
        self.store.mkdir(exist_ok=True, mode=STATE_DIR_MODE)
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


def socket_path(home: Path, name: str) -> Path:
    """`home/name`; or, when that is too long for a Unix socket (a deep --home, pytest's temp
    dirs on macOS), a short name for it in this user's private dir under the temp dir
    (`p2pnode-<uid>`, made 0700 and checked to be this user's alone), keyed by the home."""
    path = home / name
    if len(os.fsencode(path)) <= SUN_PATH_MAX:
        return path
    key = blake3.blake3(os.fsencode(os.path.abspath(home))).hexdigest(length=8)
    short = _private_dir(Path(tempfile.gettempdir()) / f"p2pnode-{os.getuid()}") / f"{key}-{name}"
    if len(os.fsencode(short)) > SUN_PATH_MAX:
        raise InvalidInput(f"the node's home {home} is too long for its sockets ({len(os.fsencode(path))} "
                           f"bytes; at most {SUN_PATH_MAX}), and so is the temp dir's {short}: choose a "
                           "shorter --home or P2PNODE_HOME")
    return short


def _private_dir(path: Path) -> Path:
    """A directory only this user can enter: made 0700, or found as one this user owns (not a
    symlink, no access for others), so that no other local user can plant a socket there."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=STATE_DIR_MODE)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise InvalidInput(f"{path} (for the node's sockets, its home being too long for them) is not a "
                           "directory of this user's alone (mode 0700): remove it, or choose a shorter "
                           "--home or P2PNODE_HOME")
    return path


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
