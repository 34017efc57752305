"""What `p2pnode gc` and `rm` reclaim, and what `status` says about space (README, "Space").

Garbage is what the node's user no longer offers and nothing kept needs:
- branches withdrawn (unshared or expired) that are not the ancestor of a kept branch;
- versions no remaining branch names (superseded: a share the secret scan refused, or the
  version of a branch removed).
Kept: offered branches, fetched ones (never shared here: they are Pi's files' copies and the
base the next fetch of that session builds on; `rm` forgets one), and their ancestors.

Forgetting records deletes the store contexts only they used; the store's GC
(store/gc.py: mark from live heads, compact the pack crash-safely) then drops their blobs,
except blobs a kept chain still reaches: lines shared with other versions stay.
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypedDict

from p2pnode.library.sessions import SessionStore
from store.api import Store
from store.files.headwal import is_wal_file
from store.layout import BLOB_OVERHEAD

GC_THRESHOLD_BYTES = 64 << 20
"""The running node collects in the background when at least this much is reclaimable, or
GC_THRESHOLD_SHARE of the store (and at least GC_MIN_BYTES)."""
GC_THRESHOLD_SHARE = 0.5
GC_MIN_BYTES = 1 << 20
GC_CHECK_SECONDS = 300.0
"""How often the running node estimates the garbage (the estimate walks every kept turn)."""
GC_QUIET_SECONDS = 30.0
"""The background GC waits until no peer was served lines or objects for this long, and
looks again that often: GC holds off every read of the store while it sweeps (about a second
per 100 MB kept), which a teammate's fetch would see as a stalled holder."""
FETCHING_LOCK = "fetching.lock"
"""In the node's home: a one-shot fetch (no node running: it opens the store only for each
step, so a `gc` in another process could open it in between) holds a shared flock on it for as
long as it runs; GC takes it exclusively or is skipped.  Within the node, Library.leases."""


def fetching_lock(home: Path) -> Path:
    return home / FETCHING_LOCK


@dataclass(frozen=True)
class Garbage:
    branches: list[str]
    versions: list[str]


@dataclass(frozen=True)
class GCReport:
    branches: list[str]
    versions: list[str]
    bytes_freed: int
    """What the store's GC cut from its pack: the records of the blobs it dropped (what
    `status` estimates as reclaimable)."""
    store_bytes_before: int
    """store_bytes when GC began, the blobs left in the head WAL packed first (as `status`
    counts them)."""
    store_bytes_after: int
    """store_bytes when it ended: before, less bytes_freed, plus what rewriting the blob index
    whole and the head table added or took (a few bytes a blob)."""
    skipped: str | None = None
    """Why GC did not run (a fetch held a transfer lease); nothing was changed then."""
    staging_bytes_freed: int = 0
    """Left in the fetch staging dir by fetches that no longer run (sweep_fetching)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def garbage(sessions: SessionStore) -> Garbage:
    """The branch and version records `gc` forgets (module docstring)."""
    records = {r.branch: r for r in sessions.branches()}
    kept = {b for b, r in records.items() if r.withdrawn is None}
    stack = list(kept)
    while stack:
        parent = records[stack.pop()].parent
        if parent is not None and parent in records and parent not in kept:
            kept.add(parent)
            stack.append(parent)
    srcs = {records[b].src for b in kept}
    versions = sorted(v.src for v in sessions.all_versions() if v.src not in srcs)
    return Garbage(sorted(set(records) - kept), versions)


def reclaimable_bytes(sessions: SessionStore, store: Store) -> int:
    """The pack records (stored bytes and BLOB_OVERHEAD) of blobs no kept record reaches: what
    `gc` would free now, in GCReport.bytes_freed's measure; an estimate (blobs put in the last
    hour that no turn uses yet count, though GC keeps them).  Walks every kept turn once,
    reads each dead blob once."""
    drop = garbage(sessions)
    gone = set(drop.branches) | set(drop.versions)
    heads = [r.head for r in sessions.branches() if r.branch not in gone]
    heads += [v.head for v in sessions.all_versions() if v.src not in gone]
    seen: set[int] = set()
    live: set[bytes] = set()
    for tid in heads:
        while tid and tid not in seen:
            seen.add(tid)
            turn = store.get_turn(tid)
            live.add(turn.payload_hash)
            tid = turn.parent_turn_id
    return sum(BLOB_OVERHEAD + store.stored_size(h) for h in store.blob_hashes() if h not in live)


def sweep_fetching(directory: Path, grace_seconds: float) -> int:
    """Remove what fetches that no longer run left in the node's fetch staging dir; the bytes
    removed.  Called by GC only while no fetch runs (FETCHING_LOCK and the library's leases):
    every temp session file there is a killed or failed fetch's, and a kept line manifest
    (peer/get.py's KeptManifests) or batch format measures older than `grace_seconds` belong
    to a fetch nobody ran again (a younger one still spares a rerun its manifest, its tries)."""
    freed = 0
    now = time.time()
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return 0
    for e in entries:
        try:
            st = e.stat(follow_symlinks=False)
            if not e.is_file(follow_symlinks=False):
                continue
            if e.name.endswith(".tmp") or (e.name.endswith((".lines", ".pace"))
                                           and now - st.st_mtime > grace_seconds):
                os.unlink(e.path)
                freed += st.st_size
        except FileNotFoundError:
            continue
    return freed


def store_bytes(store: Store) -> int:
    """Bytes of the store's data files, its blob index counted with the entries it keeps in
    memory until it is next written whole (a GC writes it: else a GC that freed a little would
    show the store grown), and the blobs appends left raw in the head WAL as the pack will hold
    them (as `gc` counts them, without packing them now); not the head WAL itself, 1-2 MiB of
    journal that comes and goes with checkpoints."""
    files = sum(e.stat().st_size for e in os.scandir(store.root)
                if e.is_file(follow_symlinks=False) and not is_wal_file(e.name))
    return files + store.unwritten_index_bytes + store.unpacked_bytes


class SpaceReport(TypedDict):
    """Library.space: what `status` shows of the store."""

    store_bytes: int
    reclaimable_bytes: int | None
    """None when a turn record the estimate walks cannot be read (`store_damage` says which)."""
    store_damage: str | None


def worth_collecting(reclaimable: int, total: int) -> bool:
    """The background GC's threshold (GC_THRESHOLD_BYTES, GC_THRESHOLD_SHARE, GC_MIN_BYTES)."""
    return reclaimable >= GC_THRESHOLD_BYTES or (reclaimable >= GC_MIN_BYTES
                                                 and reclaimable >= GC_THRESHOLD_SHARE * total)
