"""Typed records that the store's API hands out.  Layouts on disk live in layout.py."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

NO_TURN = 0
"""TurnID 0 means "no turn": the parent of a root, the head of an empty context."""


class Turn(NamedTuple):
    """A named tuple, not a frozen dataclass: reads build dozens per call, and a frozen
    dataclass takes four times as long to construct."""

    turn_id: int
    parent_turn_id: int
    depth: int
    type_tag: int
    codec: int
    payload_hash: bytes
    flags: int
    created_at_unix_ms: int


@dataclass(frozen=True, slots=True)
class ContextHead:
    context_id: int
    head_turn_id: int
    """NO_TURN for an empty context."""
    head_depth: int
    created_at_unix_ms: int
    flags: int


@dataclass(frozen=True, slots=True)
class TurnInput:
    """One turn of an append: the payload bytes and the caller's type and codec tags."""

    payload: bytes
    type_tag: int = 0
    codec: int = 0


@dataclass(frozen=True, slots=True)
class TurnBlobRef:
    """One turn of an append whose payload is already stored (put_blob / put_stored_blob):
    saves hashing and compressing bytes the caller holds only in stored form."""

    payload_hash: bytes
    type_tag: int = 0
    codec: int = 0


@dataclass(frozen=True, slots=True)
class Page:
    turns: list[Turn] = field(default_factory=list)
    next_cursor: int = NO_TURN
    """Pass as before_turn_id to get the next older page; NO_TURN when the root was reached."""


@dataclass(frozen=True, slots=True)
class StoredBlob:
    """A blob as it sits in the pack: what a peer can send on without recompressing."""

    hash: bytes
    codec: int
    raw_len: int
    stored: bytes


@dataclass(frozen=True, slots=True)
class Patch:
    target_turn_id: int
    new_payload_hash: bytes
    flags: int
    seq: int


class RecoveryNotes(list[str]):
    """What opening a store found and repaired, in order.  `damage` holds the entries that
    mean stored data was damaged, not just a crash's torn tail: the store records those in
    `damage.log`, and fsck reports them until `fsck --repair` acknowledges them."""

    def __init__(self) -> None:
        super().__init__()
        self.damage: list[str] = []

    def add(self, message: str, damage: bool = False) -> None:
        self.append(message)
        if damage:
            self.damage.append(message)

    def merge(self, other: RecoveryNotes) -> None:
        for message in other:
            self.add(message, message in other.damage)
