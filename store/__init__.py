"""The turn and blob store: an append-dominant, crash-safe store of immutable turns
(a parent-pointer DAG), context heads and a deduplicated, zstd-compressed blob pack.

This package knows nothing of Pi sessions, peers or the command line.
"""
from __future__ import annotations

from store.api import Store
from store.config import GCStats, StoreConfig
from store.durability.packer import Prepared
from store.errors import (
    BlobMismatch,
    CorruptRecord,
    DamagedPayload,
    ParentConflict,
    PayloadTooLarge,
    StoreClosed,
    StoreError,
    StoreFailed,
    StoreFull,
    StoreLocked,
    StoreNeedsWrite,
    TurnNotInContext,
    UnknownBlob,
    UnknownContext,
    UnknownTurn,
)
from store.types import NO_TURN, ContextHead, Page, Patch, StoredBlob, Turn, TurnBlobRef, TurnInput

__all__ = [
    "NO_TURN", "BlobMismatch", "ContextHead", "CorruptRecord", "DamagedPayload", "GCStats", "Page",
    "ParentConflict", "Patch", "PayloadTooLarge", "Prepared", "Store", "StoreClosed", "StoreConfig",
    "StoreError", "StoreFailed", "StoreFull", "StoreLocked", "StoreNeedsWrite", "StoredBlob", "Turn",
    "TurnBlobRef", "TurnInput", "TurnNotInContext", "UnknownBlob", "UnknownContext", "UnknownTurn",
]
