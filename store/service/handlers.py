"""The service's request handlers: one engine call per request type, its reply payload out.

No I/O and no threads here: the server decides where a handler runs (the event loop or a
write worker, `table`) and sends what it returns; an exception becomes an ERROR reply.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from store.errors import (
    PayloadTooLarge,
)
from store.service import messages as m
from store.service.frames import (
    BadRequest,
    ReplyTooLarge,
)
from store.service.limits import ServiceLimits
from store.types import Turn

Reply = bytes | list[bytes]
"""A reply payload, whole or in pieces to be written one after another."""
PAYLOAD_BATCH = 32
"""Payloads read from the engine per call while building a reply."""

def _older_than(turns: list[Turn]) -> int:
    """A TurnList's next_cursor: the oldest turn returned, which GET_BEFORE takes to page
    on to older turns; 0 when there are none (the root was reached, or nothing returned)."""
    return turns[0].turn_id if turns and turns[0].parent_turn_id else 0


class Handlers:
    """One method per request type; each returns the reply payload or raises."""

    def __init__(self, store: Any, limits: ServiceLimits) -> None:
        self.store = store
        self.limits = limits

    def _payload_size(self, data: bytes) -> None:
        if len(data) > self.limits.max_payload:
            raise PayloadTooLarge(len(data), self.limits.max_payload)

    def _limit(self, limit: int) -> None:
        if limit > self.limits.max_turns:
            raise BadRequest(f"limit {limit} exceeds max_turns {self.limits.max_turns}", 0, limit)

    def _turn_list(self, turns: list[Turn], opts: int, next_cursor: int, head_depth: int) -> Reply:
        payloads = self._payloads(turns, bool(opts & m.READ_PATCHED)) if opts & m.READ_PAYLOADS else None
        return m.TurnList(turns, payloads, next_cursor, head_depth).encode_parts()

    def _payloads(self, turns: list[Turn], patched: bool) -> list[bytes | None]:
        """The turns' payloads, a few at a time, given up as soon as they cannot fit in a reply
        (so a GET_LAST of 65536 big turns does not load them all first)."""
        out: list[bytes | None] = []
        size = m.TURN_LIST.size + len(turns) * (m.TURN.size + m.U32.size)
        for i in range(0, len(turns), PAYLOAD_BATCH):
            batch = turns[i : i + PAYLOAD_BATCH]
            got = [self.store.payload_of(t) for t in batch] if patched else self.store.payloads(batch)
            size += sum(len(p) for p in got if p is not None)
            if size > self.limits.max_frame:
                raise ReplyTooLarge(
                    f"reply of at least {size} bytes exceeds max_frame {self.limits.max_frame}; "
                    "ask for fewer turns or without payloads",
                    0, size, self.limits.max_frame,
                )  # fmt: skip
            out += got
        return out

    def ctx_create(self, r: m.CtxCreate) -> bytes:
        return m.encode_context_head(self.store.create_context(r.base_turn_id))

    def ctx_fork(self, r: m.CtxFork) -> bytes:
        return m.encode_context_head(self.store.fork(r.turn_id))

    def get_head(self, r: m.GetHead) -> bytes:
        return m.encode_context_head(self.store.get_head(r.context_id))

    def ctx_delete(self, r: m.CtxDelete) -> bytes:
        self.store.delete_context(r.context_id)
        return b""

    def get_turn(self, r: m.GetTurn) -> bytes:
        return m.encode_turn(self.store.get_turn(r.turn_id))

    def append_turn(self, r: m.AppendTurn) -> bytes:
        self._payload_size(r.payload)
        expected = r.expected_parent if r.opts & m.EXPECT_PARENT else None
        turn = self.store.append_turn(r.context_id, r.payload, r.type_tag, r.codec, expected_parent=expected)
        return m.encode_turn(turn)

    def append_batch(self, r: m.AppendBatch) -> bytes:
        for t in r.turns:
            self._payload_size(t.payload)
        expected = r.expected_parent if r.opts & m.EXPECT_PARENT else None
        turns = self.store.append_turns(r.context_id, r.turns, expected_parent=expected)
        return m.TurnList(turns, None, 0, turns[-1].depth).encode()

    def get_last(self, r: m.GetLast) -> Reply:
        self._limit(r.limit)
        turns = self.store.get_last(r.context_id, r.limit)
        head_depth = turns[-1].depth if turns else self.store.get_head(r.context_id).head_depth
        return self._turn_list(turns, r.opts, _older_than(turns), head_depth)

    def get_before(self, r: m.GetBefore) -> Reply:
        self._limit(r.limit)
        head_depth = self.store.get_head(r.context_id).head_depth
        page = self.store.get_before(r.context_id, r.before_turn_id, r.limit)
        return self._turn_list(page.turns, r.opts, page.next_cursor, head_depth)

    def get_range_by_depth(self, r: m.GetRangeByDepth) -> Reply:
        self._limit(r.limit)
        head_depth = self.store.get_head(r.context_id).head_depth
        turns = self.store.range_by_depth(r.context_id, r.start_depth, r.limit)
        return self._turn_list(turns, r.opts, _older_than(turns), head_depth)

    def get_chain(self, r: m.GetChain) -> Reply:
        turns = self.store.chain(r.turn_id)
        return self._turn_list(turns, r.opts, 0, turns[-1].depth)

    def get_blob(self, r: m.GetBlob) -> bytes:
        data = self.store.get_blob(r.blob_hash, verify=bool(r.opts & m.VERIFY_HASH))
        return m.encode_maybe_payload(data)

    def put_blob(self, r: m.PutBlob) -> bytes:
        self._payload_size(r.data)
        return bytes(self.store.put_blob(r.data))

    def patch(self, r: m.PatchTurn) -> bytes:
        self._payload_size(r.payload)
        return m.encode_patch(self.store.patch(r.target_turn_id, r.payload))

    def tombstone(self, r: m.Tombstone) -> bytes:
        return m.encode_patch(self.store.tombstone(r.target_turn_id))

    def get_payload(self, r: m.GetPayload) -> bytes:
        as_of = r.as_of_seq if r.opts & m.AS_OF else None
        return m.encode_maybe_payload(self.store.payload_of(self.store.get_turn(r.turn_id), as_of_seq=as_of))

    def table(self) -> dict[type, tuple[Callable[[Any], Reply], bool]]:
        """Request type -> (handler, runs in the thread pool)."""
        return {
            m.CtxCreate: (self.ctx_create, True),
            m.CtxFork: (self.ctx_fork, True),
            m.CtxDelete: (self.ctx_delete, True),
            m.AppendTurn: (self.append_turn, True),
            m.AppendBatch: (self.append_batch, True),
            m.PutBlob: (self.put_blob, True),
            m.PatchTurn: (self.patch, True),
            m.Tombstone: (self.tombstone, True),
            m.GetHead: (self.get_head, False),
            m.GetTurn: (self.get_turn, False),
            m.GetLast: (self.get_last, False),
            m.GetBefore: (self.get_before, False),
            m.GetRangeByDepth: (self.get_range_by_depth, False),
            m.GetChain: (self.get_chain, False),
            m.GetBlob: (self.get_blob, False),
            m.GetPayload: (self.get_payload, False),
        }
