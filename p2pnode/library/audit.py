"""The audit trail behind `p2pnode log`: what was shared, unshared, expired, fetched and
served to whom, one JSON object per line in `<home>/audit.log` (docs/FORMAT.md, "Audit log").

Appends are crash-safe without a journal: each event is one `write` of one whole line on an
O_APPEND descriptor, then flushed to the disk (sysio.flush, F_FULLFSYNC on macOS) before the
call returns.  A crash can leave at most a torn last line; the next append first ends it with
a newline, and readers skip any line that is not a whole JSON object.  The log is bounded: an
append that takes it past `max_bytes` renames it to `audit.log.1` (replacing the older one),
so the trail keeps between `max_bytes` and twice that.  Writers hold `audit.log.lock`;
readers take no lock (a rename never shows them a half file), so `log` works while the node runs.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sysio.flush import flush_data, flush_dir
from sysio.locks import locked

MAX_BYTES = 1 << 20
"""The size at which the log is rotated (1 MiB: some 5,000 events; the older file is kept)."""
EVENTS = frozenset({"shared", "unshared", "expired", "fetched", "served", "removed", "dropped", "gc",
                    "reclaimed"})


@dataclass(frozen=True)
class ServedAnswer:
    """One answer a peer was sent (or that was cut off after `nbytes`): what a `served` event says."""

    peer: str
    name: str | None
    kind: str
    hashes: tuple[str, ...]
    nbytes: int
    complete: bool = True


class AuditLog:
    def __init__(self, path: Path, max_bytes: int = MAX_BYTES) -> None:
        self.path = path
        self.older = path.with_name(path.name + ".1")
        self.max_bytes = max_bytes
        self._lock = path.with_name(path.name + ".lock")

    def append(self, event: str, **fields: Any) -> dict[str, Any]:
        """Record one event now (durable when this returns)."""
        return self.append_many([(event, fields)])[0]

    def append_many(self, events: Sequence[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
        """Record events in one write and one flush (a fetch's many answers cost one fsync, not
        one each); durable when this returns."""
        assert all(event in EVENTS for event, _ in events), events
        now = round(time.time(), 3)
        entries = [{"time": now, "event": event, **fields} for event, fields in events]
        data = b"".join(json.dumps(e, separators=(",", ":"), sort_keys=True).encode() + b"\n"
                        for e in entries)
        with locked(self._lock):
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                size = os.fstat(fd).st_size
                if size and _last_byte(self.path, size) != b"\n":
                    data = b"\n" + data  # a crash tore the last line: it stays a line of its own
                view = memoryview(data)
                while view:  # one write in practice
                    view = view[os.write(fd, view):]
                flush_data(fd)
                size += len(data)
            finally:
                os.close(fd)
            if size > self.max_bytes:
                os.replace(self.path, self.older)
                flush_dir(self.path.parent)
        return entries

    def read(self) -> list[dict[str, Any]]:
        """Every whole event, oldest first (the rotated file's, then the current one's)."""
        return list(self._entries())

    def _entries(self) -> Iterator[dict[str, Any]]:
        for path in (self.older, self.path):
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                continue
            for raw in data.split(b"\n"):
                try:
                    entry = json.loads(raw)
                except ValueError:
                    continue  # torn by a crash (or empty)
                if isinstance(entry, dict) and entry.get("event") in EVENTS:
                    yield entry


FORGETTING = frozenset({"removed", "dropped", "gc"})
"""Events after which the node no longer holds a branch (`gc` names its branches in a list)."""


def forgotten(entries: Sequence[dict[str, Any]]) -> set[str]:
    """The branches whose last event in `entries` (oldest first) forgot them, and that no
    later share or fetch brought back: what a rebuild from the store must not bring back."""
    gone: set[str] = set()
    for e in entries:
        named = e.get("branches") if e["event"] == "gc" else [e.get("branch")]
        for branch in named if isinstance(named, list) else []:
            if not isinstance(branch, str):
                continue
            if e["event"] in FORGETTING:
                gone.add(branch)
            elif e["event"] in ("shared", "fetched"):
                gone.discard(branch)
    return gone


def _last_byte(path: Path, size: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(size - 1)
        return f.read(1)
