"""What a store is opened with (`StoreConfig`) and what a GC reports (`GCStats`)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StoreConfig:
    durable: bool = True
    """False: no fsync at all (bulk import).  A process crash loses nothing; a power loss or
    OS crash can lose recent writes.  close() still syncs everything."""
    zstd_level: int = 3
    max_payload: int = 256 << 20  # one Pi line: the peer protocol's max_blob (docs/PROTOCOL.md)
    turn_cache_entries: int = 100_000
    blob_cache_bytes: int = 64 << 20
    lock_timeout: float = 10.0
    gc_grace_seconds: float = 3600.0
    """put_blob'd blobs that no turn references yet survive GC for this long."""
    read_only: bool = False
    """Open without writing a byte (no recovery writes, no checkpoint, every write refused): for
    what only reads, also where this user may not write.  StoreNeedsWrite when the store must be
    written first (a crash left turns or blobs to restore, or it was never made)."""


@dataclass(frozen=True, slots=True)
class GCStats:
    live_blobs: int
    dropped_blobs: int
    bytes_freed: int
    pack_bytes: int
    seconds: float
