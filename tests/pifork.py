"""Forks written as `pi --fork` writes them, from the corpora's own forks, for the lineage tests
(tests/library/test_lineage.py, tests/node/test_lan_lineage.py)."""
from __future__ import annotations

import json
from pathlib import Path

from p2pnode.pi.session import header_index, session_dir_name, session_file_name

# a root and its `pi --fork` in each corpus
OLD, NEW = "sessions/--tmp-pi-harness-work-alpha--/", "sessions/--tmp-pi-harness-new-work-alpha--/"
ROOT_FORK = {
    "0.73.1": (OLD + "2026-11-21T19-26-27-092Z_01a1ff93-0313-7475-8d45-88a780e9fa37.jsonl",
               OLD + "2026-11-21T19-26-36-560Z_01a1ff93-2810-72f3-bf21-ab15b19d413f.jsonl"),
    "1.5.2": (NEW + "2026-11-23T11-39-56-914Z_01a20834-a271-70bf-bc80-66a3334c5c30.jsonl",
              NEW + "2026-11-23T11-39-59-855Z_01a20834-adef-737d-a843-74114bf9e448.jsonl"),
}


def find(agent: Path, pattern: str) -> Path:
    """The session file under `agent`'s sessions/--<cwd>--/ dirs whose name matches `pattern`."""
    return next((agent / "sessions").glob("*/" + pattern))


def pi_fork(source: Path, agent: Path, cwd: Path, session_id: str, *, pi: str,
            typed: str | None = None, timestamp: str = "2026-11-23T12:00:00.000Z") -> Path:
    """What `pi --fork <source>` run in `cwd` writes: a new header (parentSession = the source
    path as typed; pi 1.5.2 stores it absolute), every non-header entry of the source, byte
    for byte, then the new prompt and answer.  pi 1.5.2 first adds a missing final newline to
    the source file itself."""
    data = source.read_bytes()
    if pi == "1.5.2" and not data.endswith(b"\n"):
        with open(source, "ab") as f:
            f.write(b"\n")
        data += b"\n"
    lines = data.splitlines(keepends=True)
    first = header_index(lines, str(source))
    body = lines[first + 1:]
    parent_session = str(source) if pi == "1.5.2" or typed is None else typed
    header = {"type": "session", "version": 3, "id": session_id, "timestamp": timestamp, "cwd": str(cwd),
              "parentSession": parent_session}
    last = json.loads(body[-1])["id"]
    new = [{"type": "message", "id": f"{session_id[-4:]}0001", "parentId": last, "timestamp": timestamp,
            "message": {"role": "user", "content": [{"type": "text", "text": f"continued as {session_id}"}],
                        "timestamp": 1795300000000}},
           {"type": "message", "id": f"{session_id[-4:]}0002", "parentId": f"{session_id[-4:]}0001",
            "timestamp": timestamp,
            "message": {"role": "assistant", "content": [{"type": "text", "text": "ok"}],
                        "stopReason": "stop", "timestamp": 1795300000001}}]
    dest = agent / "sessions" / session_dir_name(str(cwd)) / session_file_name(timestamp, session_id)
    dest.parent.mkdir(parents=True, exist_ok=True)
    encode = lambda obj: json.dumps(obj, separators=(",", ":")).encode() + b"\n"  # noqa: E731
    dest.write_bytes(encode(header) + b"".join(body) + b"".join(encode(e) for e in new))
    return dest
