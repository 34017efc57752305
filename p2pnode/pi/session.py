"""Pi session files: the header line, Pi's directory layout, and `parentSession` lineage.

Facts about the format are from ../shared/notes/pi-session-format.md (Pi 0.73.1).  A
session is keyed by its header `id` and its content hash, never by its file name: Pi
allows arbitrary names and sometimes writes a name whose uuid differs from the header id.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from p2pnode.errors import InvalidInput, NotFound
from sysio.files import open_regular

MAX_HEADER_BYTES = 64 * 1024
"""A header line longer than this is refused (Pi's own are a few hundred bytes)."""
HEADER_SCAN_BYTES = 1024 * 1024
"""pi 1.5.2 looks for the header within the first 1 MiB, skipping blank or malformed lines
before it (pi 0.73.1 needs it first, and `pi -c` there reads only the first 512 bytes)."""
MAX_LINEAGE_DEPTH = 1000
MAX_NAME_BYTES = 255
"""Longest file or directory name most file systems accept."""
MAX_CWD_CHARS = 4096

SESSION_ID = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")
"""pi 1.5.2's rule for a session id (`--session-id`); its only bound is the file name's
255 bytes.  `share` and `fetch` apply the same rule, so no branch is offered that a peer
could not place."""


def is_session_id(text: str) -> bool:
    """A Pi session id rather than a branch hash (or a prefix of one, or a typo of one): an id
    by Pi's rule with a `-`, `.` or `_` in it (Pi makes UUIDs).  An id without any, such as
    `xyz`, is taken for a mistyped hash and refused as one."""
    return SESSION_ID.fullmatch(text) is not None and any(c in text for c in "-._")


_SAFE_TIMESTAMP = re.compile(r"[0-9A-Za-z:.+-]{1,64}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def well_formed(text: str) -> str:
    """`text` with each lone UTF-16 surrogate replaced by U+FFFD, as Node writes such a string
    out.  JavaScript cuts a string inside an emoji and JSON.stringify writes the half as
    "\\ud83d"; json.loads gives it back as a lone surrogate, which UTF-8 cannot encode (a
    catalog or a JSON answer holding it could not be sent at all)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)
    return text
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
        fields[name] = None if value is None else well_formed(value)
    if not fields["id"]:
        raise InvalidHeader(f"{where}: the header has no id")
    if fields["parent_session"] is None and isinstance(obj.get("branchedFrom"), str):
        fields["parent_session"] = well_formed(obj["branchedFrom"])  # the pre-0.31 name of the field
    version = obj.get("version")
    return SessionHeader(version=version if type(version) is int else None, **fields)


def is_header_candidate(line: bytes) -> bool:
    """Whether pi 1.5.2 would take this line for the header when no header came before it:
    any JSON line (blank and malformed ones are passed over)."""
    if not line.strip():
        return False
    try:
        json.loads(line)
    except (UnicodeDecodeError, ValueError):
        return False
    except RecursionError:
        return True  # JSON too deep for Python's parser: parse_header refuses it as the header
    return True


def header_index(lines: Sequence[bytes], where: str) -> int:
    """Which of a session's first lines is its header, as pi 1.5.2 reads it: blank and
    malformed lines before it are skipped within the first HEADER_SCAN_BYTES; the first line
    that is JSON must be the header.  InvalidHeader if there is none."""
    offset = 0
    for i, line in enumerate(lines):
        if offset >= HEADER_SCAN_BYTES:
            break
        if is_header_candidate(line):
            parse_header(line.rstrip(b"\n"), where)
            return i
        offset += len(line)
    if not lines:
        raise InvalidHeader(f"{where} is empty")
    if not any(line.strip() for line in lines):  # a file of blank lines, or a first MiB of them
        scanned = f" in its first {HEADER_SCAN_BYTES} bytes (pi 1.5.2 looks for the header no further)" \
            if offset >= HEADER_SCAN_BYTES else ""
        raise InvalidHeader(f"{where} has only blank lines{scanned}: no Pi session header")
    parse_header(lines[0].rstrip(b"\n"), where)  # raises what is wrong with the first line
    raise InvalidHeader(f"{where}: no Pi session header in the first {HEADER_SCAN_BYTES} bytes")


def find_header(lines: Sequence[bytes], where: str) -> SessionHeader:
    """The header among a session's first lines (see header_index)."""
    return parse_header(lines[header_index(lines, where)].rstrip(b"\n"), where)


def read_header(path: Path) -> SessionHeader:
    """Read and parse the header of a session file (within its first HEADER_SCAN_BYTES)."""
    if not path.exists():
        raise NotFound(f"session file {path} does not exist")
    if path.is_dir():
        raise InvalidInput(f"{path} is a directory, not a session file")
    opened = open_regular(path)
    if opened is None:
        raise InvalidInput(f"{path} is not a regular file (a pipe, device or socket), not a session file")
    with opened as f:
        head = f.read(4096)  # Pi's headers are a few hundred bytes; scanning many files stays cheap
        if b"\n" not in head:
            head += f.read(MAX_HEADER_BYTES + 1 - len(head))
        if not head:
            raise InvalidHeader(f"{path} is empty")
        end = head.find(b"\n")
        if end < 0 and len(head) > MAX_HEADER_BYTES:
            raise InvalidHeader(f"{path}: the first line is longer than {MAX_HEADER_BYTES} bytes")
        first = head if end < 0 else head[:end]
        if is_header_candidate(first) or end < 0:
            return parse_header(first, str(path))
        head += f.read(HEADER_SCAN_BYTES - len(head))  # pi 1.5.2 skips lines before the header
    return find_header(head.splitlines(keepends=True), str(path))


# --- Pi's directory layout --------------------------------------------------------------


def session_dir_name(cwd: str) -> str:
    """Pi's per-project dir name: one leading / or \\ dropped, every / \\ : made '-' (lossy)."""
    return "--" + re.sub(r"[/\\:]", "-", re.sub(r"^[/\\]", "", cwd)) + "--"


def session_file_name(timestamp: str, session_id: str) -> str:
    """Pi's file name: the ISO timestamp with ':' and '.' made '-', '_', the id, '.jsonl'."""
    return re.sub(r"[:.]", "-", timestamp) + "_" + session_id + ".jsonl"


def placed_names(header: SessionHeader) -> tuple[str, str]:
    """(project dir name, file name) that Pi would give this session.

    Header fields come from other machines, so anything that could escape the sessions
    dir or make an unusable name is refused with HostileHeader.  `share` checks the same, so
    that it never offers a session that peers would refuse.
    """
    where = f"session {header.id[:80]!r}"
    if not SESSION_ID.fullmatch(header.id):
        raise HostileHeader(f"{where}: the id is not letters, digits, '.', '_' or '-' starting and ending "
                            "with a letter or digit")
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
    return dir_name, file_name


def session_relpath(header: SessionHeader) -> PurePosixPath:
    """Where Pi keeps this session by default, relative to the agent dir:
    sessions/--<cwd>--/<ts>_<id>.jsonl (HostileHeader: see placed_names)."""
    dir_name, file_name = placed_names(header)
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


def parent_candidates(header: SessionHeader, agent_dir: Path, child: Path | None = None,
                      session_dir: Path | None = None) -> list[Path]:
    """Where the parent may be on this machine, in order: as stored (relative to cwd), under
    the current agent dir (the path's sessions/--<dir>--/<file> tail: an agent dir that moved),
    in Pi's session-dir override, and beside the child (flat session dirs, copied folders)."""
    ps = header.parent_session
    if not ps:
        return []
    stored = Path(ps) if os.path.isabs(ps) else Path(header.cwd or ".") / ps
    found = [Path(os.path.normpath(stored))]
    tail = _sessions_tail(ps)
    if tail is not None:
        found.append(agent_dir / tail)
    name = PurePosixPath(ps.replace("\\", "/")).name
    if name.endswith(".jsonl") and not name.startswith("."):
        found += [d / name for d in (session_dir, child.parent if child else None) if d is not None]
    return list(dict.fromkeys(found))


# --- finding sessions ---------------------------------------------------------------------


def session_files(agent_dir: Path, session_dir: Path | None = None) -> list[Path]:
    """Every *.jsonl where Pi keeps sessions: flat in the session-dir override if there is one
    (Pi then looks nowhere else), else one level below <agent dir>/sessions/."""
    root = session_dir if session_dir is not None else agent_dir / "sessions"
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("*.jsonl" if session_dir else "*/*.jsonl") if p.is_file())


def _valid_sessions(paths: list[Path]) -> list[tuple[Path, SessionHeader]]:
    """The Pi sessions among `paths`; a file that is not one, that this user may not read, or
    that went meanwhile is passed over (another file in the folder does not stop a share)."""
    found = []
    for p in paths:
        try:
            found.append((p, read_header(p)))
        except (InvalidInput, NotFound, OSError):
            continue
    return found


def _project_sessions(agent_dir: Path, cwd: str,
                      session_dir: Path | None) -> tuple[Path, list[tuple[Path, SessionHeader]]]:
    """(where, sessions) of a working directory: its --<cwd>-- dir, or the session-dir
    override's files whose header cwd is that directory."""
    if session_dir is not None:
        return session_dir, [(p, h) for p, h in _valid_sessions(session_files(agent_dir, session_dir))
                             if h.cwd == cwd]
    project = agent_dir / "sessions" / session_dir_name(cwd)
    return project, _valid_sessions(sorted(project.glob("*.jsonl")) if project.is_dir() else [])


def latest_session(agent_dir: Path, cwd: str, session_dir: Path | None = None) -> Path:
    """The newest valid session (by mtime) of a working directory, as `pi -c` picks it."""
    where, candidates = _project_sessions(agent_dir, cwd, session_dir)
    if not candidates:
        raise NotFound(f"no Pi session for {cwd} in {where}")
    return max(candidates, key=lambda item: item[0].stat().st_mtime_ns)[0]


def find_by_id(agent_dir: Path, id_or_prefix: str, session_dir: Path | None = None) -> Path:
    """The session whose header id equals, or uniquely starts with, the given string."""
    sessions = _valid_sessions(session_files(agent_dir, session_dir))
    exact = [p for p, h in sessions if h.id == id_or_prefix]
    matches = exact or [p for p, h in sessions if h.id.startswith(id_or_prefix)]
    where = session_dir if session_dir is not None else agent_dir / "sessions"
    if not matches:
        raise NotFound(f"no session with id or id prefix {id_or_prefix!r} under {where}")
    if len(matches) > 1:
        listed = ", ".join(str(p) for p in matches[:5])
        raise InvalidInput(f"id prefix {id_or_prefix!r} matches {len(matches)} sessions: {listed}")
    return matches[0]


SYSTEM_PROMPT_SCAN_LINES = 8


def has_system_prompt(path: Path) -> bool:
    """Whether the session opens with a `message` of role `system`, as pi 1.5.2 writes its
    whole system prompt (cwd, install path, AGENTS.md, skills) into every session."""
    with open(path, "rb") as f:
        head = f.read(HEADER_SCAN_BYTES)
    for line in head.split(b"\n")[:SYSTEM_PROMPT_SCAN_LINES]:
        if b'"role":"system"' not in line:
            continue
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):
            continue
        message = obj.get("message") if isinstance(obj, dict) else None
        if obj.get("type") == "message" and isinstance(message, dict) and message.get("role") == "system":
            return True
    return False


# --- what `ls` shows ----------------------------------------------------------------------


TITLE_SCAN = 512
"""Bytes at the start of a line where titles_after looks for a title's mark: Pi writes an
entry's `type` first and a message's `role` first in it (`{"type":"session_info",…` and
`{"type":"message",…,"message":{"role":"user",…`, docs/FORMAT.md), so the rest of a long line
(an image, a tool's output) is not searched for them."""


def titles_after(line: bytes, name: str | None, first_user: str | None,
                 start: int = 0, end: int | None = None) -> tuple[str | None, str | None]:
    """(session name, first user message) once `line` (or line[start:end], a line in a run
    of them) is read too: the last session_info names the session; the first user message
    is kept."""
    end = len(line) if end is None else end
    scan = min(end, start + TITLE_SCAN)
    if line.find(b'"session_info"', start, scan) >= 0 or (
            first_user is None and line.find(b'"role":"user"', start, scan) >= 0):
        found = line_title(line if (start, end) == (0, len(line)) else line[start:end])
        if found and found[0] == "name":
            return found[1], first_user
        if found and first_user is None:
            return name, found[1]
    return name, first_user


def line_title(line: bytes) -> tuple[str, str] | None:
    """("name", text) for a session_info line, ("user", text) for a user message, else None;
    the text well_formed.

    Cheap substring tests first, so a big session's lines are rarely JSON-parsed.
    """
    if b'"session_info"' not in line and b'"role":"user"' not in line:
        return None
    found = _line_title(line)
    return None if found is None else (found[0], well_formed(found[1]))


TITLE_PARSE_MAX = 1 << 20
"""Lines longer than this have their images' base64 data taken out before the title search
parses them (`_without_image_data`): parsing a 200 MB image line whole held twice its size."""
_DATA_KEY = b'"data":"'


def _without_image_data(line: bytes) -> bytes:
    """`line` with every long string value of a "data" key made empty (an image's base64; the
    title is never in one), the rest byte for byte: still valid JSON, as it was.  Outside a
    string, `":"` ends a key and opens a string value; a value without a backslash ends at
    the next quote.  `line` itself when there is none to take out."""
    pieces: list[bytes] = []
    kept = pos = 0
    while (key := line.find(_DATA_KEY, pos)) >= 0:
        start = key + len(_DATA_KEY)
        end = line.find(b'"', start)
        if end < 0:
            break
        if end - start > 4096 and line.find(b"\\", start, end) < 0:
            pieces.append(line[kept:start])
            kept = end
        pos = end
    return line if not pieces else b"".join([*pieces, line[kept:]])


def _line_title(line: bytes) -> tuple[str, str] | None:
    if len(line) > TITLE_PARSE_MAX:
        line = _without_image_data(line)
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):
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
