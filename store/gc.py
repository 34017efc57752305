"""Mark-and-sweep GC: which blobs are live.  The sweep (copy live blobs into a new pack and
swap it in crash-safely) is BlobPack.compact; Store.gc runs both with writers held off."""
from __future__ import annotations

from collections.abc import Callable, Iterable

from store.layout import PATCH_REPLACE
from store.types import NO_TURN, ContextHead, Patch, Turn


def mark(heads: Iterable[ContextHead], read_turn: Callable[[int], Turn], turn_count: int,
         patches: Iterable[Patch], pinned: Iterable[bytes]) -> set[bytes]:
    """Payload hashes of every turn reachable from a head, every patch's new payload and
    every pinned (put but not yet referenced) blob.  Shared history is walked once."""
    live: set[bytes] = set(pinned)
    seen = bytearray(turn_count + 1)
    for head in heads:
        tid = head.head_turn_id
        while tid != NO_TURN and not seen[tid]:
            seen[tid] = 1
            t = read_turn(tid)
            live.add(t.payload_hash)
            tid = t.parent_turn_id
    live.update(p.new_payload_hash for p in patches if p.flags == PATCH_REPLACE)
    return live
