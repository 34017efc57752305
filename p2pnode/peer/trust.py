"""The allowlist of trusted peers (node id → name), in `NodePaths.trust` (trust.json).

The in-memory set of trusted fingerprints is *live*: tls.py's handshake pin and the peer
server's middleware read it on every connection and request, so `untrust` takes effect at
once.  Listeners hear about removed peers so that a server can close their open
connections.  Another process (the CLI) may change the file; `reload_if_changed()` picks
that up (the peer server polls it about once a second).

The allowlist holds keys, not certificates: a peer that re-issues its certificate stays
trusted, and no certificate has to be copied around (see identity.py for why).

File format: {"version": 1, "peers": [{"id": "<node id>", "name": "<str or null>",
"added_at": <unix seconds>}]}, written atomically (temp, fsync, rename, dir fsync) under an
flock on `trust.json.lock` so two commands at once cannot lose an entry.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from p2pnode.errors import InvalidInput, NotFound, P2PNodeError
from p2pnode.peer.nodeid import format_node_id, parse_node_id
from sysio.files import atomic_write
from sysio.locks import locked

MAX_NAME_LEN = 100
MAX_PENDING = 64
"""Untrusted nodes remembered (the most recent), so that a flood of fresh keys costs nothing."""
log = logging.getLogger(__name__)


class TrustFileCorrupt(P2PNodeError):
    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"trust file {path} is unreadable ({reason}); fix or remove it by hand")


@dataclass(frozen=True)
class TrustedPeer:
    fingerprint: bytes
    name: str | None
    added_at: float

    @property
    def node_id(self) -> str:
        return format_node_id(self.fingerprint)

    def as_dict(self) -> dict:
        return {"id": self.node_id, "name": self.name, "added_at": self.added_at}


RemovedListener = Callable[[set[bytes]], None]


@dataclass
class PendingPeer:
    """An untrusted node that tried to connect (its key from its certificate, not a claim)."""

    fingerprint: bytes
    first_seen: float
    last_seen: float
    attempts: int

    @property
    def node_id(self) -> str:
        return format_node_id(self.fingerprint)

    def as_dict(self) -> dict:
        return {"id": self.node_id, "first_seen": self.first_seen, "last_seen": self.last_seen,
                "attempts": self.attempts}


class PendingPeers:
    """The untrusted nodes whose TLS handshakes the peer server refused, in memory, bounded
    (MAX_PENDING, the least recently seen dropped first): `p2pnode peers --pending`."""

    def __init__(self, limit: int = MAX_PENDING) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._seen: dict[bytes, PendingPeer] = {}

    def note(self, fingerprint: bytes) -> None:
        now = round(time.time(), 3)
        with self._lock:
            peer = self._seen.pop(fingerprint, None)
            if peer is None:
                peer = PendingPeer(fingerprint, now, now, 0)
                log.info("node %s tried to connect but is not trusted (any key can try: to accept this one, "
                         "check its id with its user, then p2pnode trust %s)", peer.node_id, peer.node_id)
            peer.last_seen, peer.attempts = now, peer.attempts + 1
            self._seen[fingerprint] = peer  # most recent last
            while len(self._seen) > self.limit:
                del self._seen[next(iter(self._seen))]

    def discard(self, fingerprint: bytes) -> None:
        with self._lock:
            self._seen.pop(fingerprint, None)

    def peers(self) -> list[PendingPeer]:
        with self._lock:
            return sorted(self._seen.values(), key=lambda p: p.last_seen, reverse=True)


class TrustStore:
    """The allowlist file plus the live fingerprint set that TLS pins read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._peers: dict[bytes, TrustedPeer] = {}
        self._fps: frozenset[bytes] = frozenset()
        self._stamp: tuple[int, int, int] | None = None
        self._listeners: list[RemovedListener] = []
        self.pending = PendingPeers()
        """Untrusted nodes that tried to connect (filled by tls.server_context's pin)."""
        self.reload_if_changed()

    # -- reading ---------------------------------------------------------------------------

    def is_trusted(self, fingerprint: bytes | None) -> bool:
        return fingerprint is not None and fingerprint in self._fps

    def peers(self) -> list[TrustedPeer]:
        return sorted(self._peers.values(), key=lambda p: (p.added_at, p.node_id))

    def get(self, fingerprint: bytes) -> TrustedPeer | None:
        return self._peers.get(fingerprint)

    def add_listener(self, listener: RemovedListener) -> None:
        self._listeners.append(listener)

    def remove_listener(self, listener: RemovedListener) -> None:
        with contextlib.suppress(ValueError):
            self._listeners.remove(listener)

    # -- changing ---------------------------------------------------------------------------

    def trust(self, node_id: str, name: str | None = None) -> TrustedPeer:
        """Add (or rename) a peer.  The id is checked and normalised first."""
        fp = parse_node_id(node_id)
        if name is not None and (len(name) > MAX_NAME_LEN or not name.isprintable()):
            raise InvalidInput(f"peer name {name[:40]!r}: at most {MAX_NAME_LEN} printable characters")
        with self._file_lock():
            peers = self._read_file()
            taken = [p for p in peers.values() if name is not None and p.name == name and p.fingerprint != fp]
            if taken:  # `trust carol`, `--to carol` would then be ambiguous
                raise InvalidInput(f"peer name {name!r} is taken by {format_node_id(taken[0].fingerprint)}: "
                                   "choose another, or `p2pnode untrust` that peer first")
            old = peers.get(fp)
            peers[fp] = TrustedPeer(fp, name if name is not None else (old.name if old else None),
                                    old.added_at if old else round(time.time(), 3))
            self._write_file(peers)
            self._apply(peers)
        return peers[fp]

    def free_name(self, name: str | None, node_id: str) -> str | None:
        """`name`, or, when another trusted peer has it (pairing with a second "carol"), it with
        the first group of this peer's id, so that names stay unique and pairing never fails late."""
        fp = parse_node_id(node_id)
        if name is None or all(p.name != name or p.fingerprint == fp for p in self._read_file().values()):
            return name
        return f"{name[:MAX_NAME_LEN - 8]}-{format_node_id(fp)[:7]}"

    def untrust(self, node_id: str) -> TrustedPeer:
        fp = parse_node_id(node_id)
        with self._file_lock():
            peers = self._read_file()
            if fp not in peers:
                raise NotFound(f"node {format_node_id(fp)} is not in the trust list")
            removed = peers.pop(fp)
            self._write_file(peers)
            self._apply(peers)
        return removed

    def reload_if_changed(self) -> bool:
        """Re-read the file if another process changed it; True if it was re-read."""
        try:
            st = os.stat(self.path)
            stamp: tuple[int, int, int] | None = (st.st_ino, st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            stamp = None
        if stamp == self._stamp:
            return False
        self._apply(self._read_file())
        return True

    # -- internals --------------------------------------------------------------------------

    def _apply(self, peers: dict[bytes, TrustedPeer]) -> None:
        for fp in peers:
            self.pending.discard(fp)
        with self._lock:
            removed = set(self._peers) - set(peers)
            self._peers = dict(peers)
            self._fps = frozenset(peers)
            try:
                st = os.stat(self.path)
                self._stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
            except FileNotFoundError:
                self._stamp = None
        if removed:
            for listener in list(self._listeners):
                listener(removed)

    @contextlib.contextmanager
    def _file_lock(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with locked(self.path.with_name(self.path.name + ".lock")):
            yield

    def _read_file(self) -> dict[bytes, TrustedPeer]:
        try:
            doc = json.loads(self.path.read_bytes())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise TrustFileCorrupt(self.path, str(exc)) from exc
        if not isinstance(doc, dict) or doc.get("version") != 1 or not isinstance(doc.get("peers"), list):
            raise TrustFileCorrupt(self.path, "not a version 1 trust file")
        peers: dict[bytes, TrustedPeer] = {}
        for entry in doc["peers"]:
            try:
                fp = parse_node_id(entry["id"])
                name = entry.get("name")
                peers[fp] = TrustedPeer(fp, str(name) if name is not None else None, float(entry["added_at"]))
            except (KeyError, TypeError, ValueError, InvalidInput) as exc:
                raise TrustFileCorrupt(self.path, f"bad entry {entry!r}: {exc}") from exc
        return peers

    def _write_file(self, peers: dict[bytes, TrustedPeer]) -> None:
        doc = {"version": 1, "peers": [p.as_dict() for p in sorted(peers.values(), key=lambda p: p.added_at)]}
        atomic_write(self.path, (json.dumps(doc, indent=2) + "\n").encode())
