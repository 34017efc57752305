"""Pi session files: the header line, Pi's directory layout, and `parentSession` lineage.

Facts about the format are from ../shared/notes/pi-session-format.md (Pi 0.73.1).  A
session is keyed by its header `id` and its content hash, never by its file name: Pi
allows arbitrary names and sometimes writes a name whose uuid differs from the header id.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from p2pnode.errors import InvalidInput, NotFound

MAX_HEADER_BYTES = 64 * 1024
"""A header line longer than this is refused (Pi's own are a few hundred bytes)."""
MAX_LINEAGE_DEPTH = 1000
MAX_NAME_BYTES = 255
"""Longest file or directory name most file systems accept."""
MAX_CWD_CHARS = 4096

_SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SAFE_TIMESTAMP = re.compile(r"[0-9A-Za-z:.+-]{1,64}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
"""C0, DEL and C1 (U+0080-U+009F: U+009B is a terminal's CSI)."""


class InvalidHeader(InvalidInput):
    """A file whose first line is not a valid Pi session header."""


class HostileHeader(InvalidInput):
    """Header fields that would place a file outside Pi's sessions dir or break a file name."""


class LineageCycle(InvalidInput):
    """A chain of parentSession links that leads back to a session already on it."""


@dataclass(frozen=True, slots=True)
class SessionHeader:
    id: str
    timestamp: str | None
    cwd: str | None
    parent_session: str | None
    """The parentSession path exactly as Pi stored it (absolute or relative to cwd)."""
    version: int | None

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "timestamp": self.timestamp, "cwd": self.cwd,
                "parent_session": self.parent_session, "version": self.version}


def parse_header(line: bytes, where: str) -> SessionHeader:
    """Parse a header line as Pi's loader does: a JSON object with type "session" and a string id."""
    try:
        obj = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidHeader(f"{where}: the first line is not a JSON Pi session header ({exc})") from None
    except RecursionError:
        raise InvalidHeader(f"{where}: the first line nests too deeply to be a Pi session header") from None
    if not isinstance(obj, dict) or obj.get("type") != "session":
        raise InvalidHeader(f"{where}: the first line is not a Pi session header (type is not \"session\")")
    fields: dict[str, Any] = {}
    names = {"id": "id", "timestamp": "timestamp", "cwd": "cwd", "parentSession": "parent_session"}
    for key, name in names.items():
        value = obj.get(key)
        if value is not None and not isinstance(value, str):
            raise InvalidHeader(f"{where}: header field {key} is {type(value).__name__}, expected a string")
        fields[name] = value
    if not fields["id"]:
        raise InvalidHeader(f"{where}: the header has no id")
    if fields["parent_session"] is None and isinstance(obj.get("branchedFrom"), str):
        fields["parent_session"] = obj["branchedFrom"]  # the pre-0.31 name of the field
    version = obj.get("version")
    return SessionHeader(version=version if type(version) is int else None, **fields)


def read_header(path: Path) -> SessionHeader:
    """Read and parse the first line of a session file (never more than MAX_HEADER_BYTES)."""
    if not path.exists():
        raise NotFound(f"session file {path} does not exist")
    if path.is_dir():
        raise InvalidInput(f"{path} is a directory, not a session file")
    with open(path, "rb") as f:
        head = f.read(4096)  # Pi's headers are a few hundred bytes; scanning many files stays cheap
        if b"\n" not in head:
            head += f.read(MAX_HEADER_BYTES + 1 - len(head))
    if not head:
        raise InvalidHeader(f"{path} is empty")
    end = head.find(b"\n")
    if end < 0 and len(head) > MAX_HEADER_BYTES:
        raise InvalidHeader(f"{path}: the first line is longer than {MAX_HEADER_BYTES} bytes")
    return parse_header(head if end < 0 else head[:end], str(path))


# --- Pi's directory layout --------------------------------------------------------------


def session_dir_name(cwd: str) -> str:
    """Pi's per-project dir name: one leading / or \\ dropped, every / \\ : made '-' (lossy)."""
    return "--" + re.sub(r"[/\\:]", "-", re.sub(r"^[/\\]", "", cwd)) + "--"


def session_file_name(timestamp: str, session_id: str) -> str:
    """Pi's file name: the ISO timestamp with ':' and '.' made '-', '_', the id, '.jsonl'."""
    return re.sub(r"[:.]", "-", timestamp) + "_" + session_id + ".jsonl"


def session_relpath(header: SessionHeader) -> PurePosixPath:
    """Where Pi would keep this session, relative to the agent dir: sessions/--<cwd>--/<ts>_<id>.jsonl.

    Header fields come from other machines, so anything that could escape the sessions
    dir or make an unusable name is refused with HostileHeader.
    """
    where = f"session {header.id!r}"
    if not _SAFE_ID.fullmatch(header.id):
        raise HostileHeader(f"{where}: the id is not 1-128 letters, digits, '.', '_' or '-'")
    if header.timestamp is None or not _SAFE_TIMESTAMP.fullmatch(header.timestamp):
        raise HostileHeader(f"{where}: timestamp {header.timestamp!r} is not an ISO-like time")
    cwd = header.cwd
    if cwd is None or not cwd:
        raise HostileHeader(f"{where}: the header has no cwd")
    if len(cwd) > MAX_CWD_CHARS or _CONTROL.search(cwd):
        raise HostileHeader(f"{where}: cwd is over {MAX_CWD_CHARS} characters or has control characters")
    if ".." in re.split(r"[/\\]", cwd):
        raise HostileHeader(f"{where}: cwd {cwd!r} has a '..' component")
    dir_name = session_dir_name(cwd)
    file_name = session_file_name(header.timestamp, header.id)
    for name in (dir_name, file_name):
        if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
            raise HostileHeader(f"{where}: the name {name[:60]!r}... is over {MAX_NAME_BYTES} bytes")
    return PurePosixPath("sessions", dir_name, file_name)


# --- parentSession resolution and lineage ---------------------------------------------------


def _sessions_tail(parent_session: str) -> PurePosixPath | None:
    """The `sessions/--<dir>--/<file>.jsonl` tail of a path, if it has a well-formed one."""
    parts = PurePosixPath(parent_session.replace("\\", "/")).parts
    if len(parts) < 3 or parts[-3] != "sessions":
        return None
    dir_name, file_name = parts[-2], parts[-1]
    if not (dir_name.startswith("--") and dir_name.endswith("--") and len(dir_name) >= 4):
        return None
    if not file_name.endswith(".jsonl") or file_name.startswith("."):
        return None
    return PurePosixPath("sessions", dir_name, file_name)


def parent_candidates(header: SessionHeader, agent_dir: Path) -> list[Path]:
    """Where the parent may be, in order: as stored (relative to cwd), then under the current agent dir."""
    ps = header.parent_session
    if not ps:
        return []
    stored = Path(ps) if os.path.isabs(ps) else Path(header.cwd or ".") / ps
    found = [Path(os.path.normpath(stored))]
    tail = _sessions_tail(ps)
    if tail is not None:
        found.append(agent_dir / tail)
    return found


def resolve_parent(header: SessionHeader, child: Path, agent_dir: Path) -> Path:
    """The local file of a header's parentSession; NotFound names the path when there is none.

    The agent-dir fallback covers a home or agent dir that moved since Pi wrote the path.
    """
    candidates = parent_candidates(header, agent_dir)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    looked = ", ".join(str(c) for c in candidates)
    raise NotFound(
        f"parent session {header.parent_session} of {child} not found (looked at {looked}); "
        "share with --no-lineage to share it without its parent"
    )


def lineage(path: Path, agent_dir: Path, *, follow: bool = True) -> list[tuple[Path, SessionHeader]]:
    """The session and its ancestors, child first, each with its header.

    A file seen twice (same device and inode) is a LineageCycle; chains deeper than
    MAX_LINEAGE_DEPTH are refused too.
    """
    chain: list[tuple[Path, SessionHeader]] = []
    seen: dict[tuple[int, int], Path] = {}
    current = path
    while True:
        header = read_header(current)
        st = current.stat()
        key = (st.st_dev, st.st_ino)  # the same file however it is named
        if key in seen:
            names = " -> ".join(str(p) for p, _ in chain) + f" -> {current}"
            raise LineageCycle(f"parentSession cycle: {names}")
        seen[key] = current
        chain.append((current, header))
        if not follow or not header.parent_session:
            return chain
        if len(chain) >= MAX_LINEAGE_DEPTH:
            raise InvalidInput(f"lineage of {path} is deeper than {MAX_LINEAGE_DEPTH} sessions")
        current = resolve_parent(header, current, agent_dir)


# --- finding sessions ---------------------------------------------------------------------


def session_files(agent_dir: Path) -> list[Path]:
    """Every *.jsonl one level below <agent dir>/sessions/ (where Pi keeps them by default)."""
    root = agent_dir / "sessions"
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("*/*.jsonl") if p.is_file())


def _valid_sessions(paths: list[Path]) -> list[tuple[Path, SessionHeader]]:
    found = []
    for p in paths:
        try:
            found.append((p, read_header(p)))
        except InvalidInput:
            continue
    return found


def latest_session(agent_dir: Path, cwd: str) -> Path:
    """The newest valid session (by mtime) of a working directory, as `pi -c` picks it."""
    project = agent_dir / "sessions" / session_dir_name(cwd)
    candidates = _valid_sessions(sorted(project.glob("*.jsonl")) if project.is_dir() else [])
    if not candidates:
        raise NotFound(f"no Pi session for {cwd} in {project}")
    return max(candidates, key=lambda item: item[0].stat().st_mtime_ns)[0]


def find_by_id(agent_dir: Path, id_or_prefix: str) -> Path:
    """The session whose header id equals, or uniquely starts with, the given string."""
    sessions = _valid_sessions(session_files(agent_dir))
    exact = [p for p, h in sessions if h.id == id_or_prefix]
    matches = exact or [p for p, h in sessions if h.id.startswith(id_or_prefix)]
    if not matches:
        raise NotFound(f"no session with id or id prefix {id_or_prefix!r} under {agent_dir / 'sessions'}")
    if len(matches) > 1:
        listed = ", ".join(str(p) for p in matches[:5])
        raise InvalidInput(f"id prefix {id_or_prefix!r} matches {len(matches)} sessions: {listed}")
    return matches[0]


# --- what `ls` shows ----------------------------------------------------------------------


def line_title(line: bytes) -> tuple[str, str] | None:
    """("name", text) for a session_info line, ("user", text) for a user message, else None.

    Cheap substring tests first, so a big session's lines are rarely JSON-parsed.
    """
    if b'"session_info"' not in line and b'"role":"user"' not in line:
        return None
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    if obj.get("type") == "session_info" and isinstance(obj.get("name"), str):
        return ("name", obj["name"])
    message = obj.get("message")
    if obj.get("type") == "message" and isinstance(message, dict) and message.get("role") == "user":
        content = message.get("content")
        if isinstance(content, str):
            return ("user", content)
        if isinstance(content, list):
            texts = [b["text"] for b in content if isinstance(b, dict) and isinstance(b.get("text"), str)]
            if texts:
                return ("user", " ".join(texts))
    return None
