"""`turns.log` (fixed-size TurnRecordV1s) and `turns.skip` (one depth jump pointer per turn).

TurnIDs are dense (1, 2, 3, ...) and every record is TURN_SIZE bytes, so turn N sits at
offset (N - 1) * TURN_SIZE: the log is its own `turns.idx`, and opening reads nothing per turn.

Jump pointers follow the skew-binary scheme (Myers 1983): a turn's jump is its parent's
jump's jump when the two hops below the parent have equal length, else its parent.  Any
ancestor at a given depth is then reached in O(log depth) hops.  `turns.skip` is a
rebuildable cache: entries missing at open are recomputed, and a damaged entry is ignored
(the walk takes the parent instead; fsck reports it).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from store.errors import CorruptRecord, UnknownTurn
from store.layout import SKIP, TURN_SIZE, decode_turn, encode_turn, skip_crc
from store.types import NO_TURN, Turn
from sysio.files import open_private
from sysio.flush import flush_data, write_at

LOG = "turns.log"
SKIPS = "turns.skip"


class TurnLog:
    def __init__(self, root: Path, readonly: bool = False) -> None:
        flags = os.O_RDONLY if readonly else os.O_RDWR | os.O_CREAT
        self._fd = open_private(root / LOG, flags)
        self._skip_fd = open_private(root / SKIPS, flags)
        self.count = os.fstat(self._fd).st_size // TURN_SIZE
        """Highest TurnID written (the engine trims it to what recovery accepts)."""
        self._recent_jumps: dict[int, int] = {}  # appends look up the jumps of recent turns

    # --- records -------------------------------------------------------------------------------

    def read(self, turn_id: int) -> Turn:
        return self.decode_chain(self.read_run(turn_id, turn_id), turn_id, turn_id, 1)[0]

    def read_run(self, first: int, last: int) -> bytes:
        """The records of turns first..last in one read (a walk towards the root: a chain's
        turns were mostly appended together); `decode_chain` takes them out."""
        if not 0 < first <= last <= self.count:
            raise UnknownTurn(last if first > 0 else first)
        return os.pread(self._fd, (last - first + 1) * TURN_SIZE, (first - 1) * TURN_SIZE)

    def decode_chain(self, run: bytes, first: int, turn_id: int, limit: int) -> list[Turn]:
        """Turn turn_id from `run` (read_run's, from turn `first`) and, while each one's parent
        is the slot before it (a chain appended in one go), its ancestors in `run`: at most
        `limit`, newest first.  Each is checked: its CRC, and that its slot holds it (errors
        say where in the file).  A walk takes a run of records in one pass, not a turn-cache
        lookup and a decode per turn."""
        out: list[Turn] = []
        while True:
            off = (turn_id - 1) * TURN_SIZE
            at = (turn_id - first) * TURN_SIZE
            if at + TURN_SIZE > len(run):
                raise CorruptRecord(LOG, off, f"turn {turn_id} is missing")
            try:
                t = decode_turn(run, LOG, at)
            except CorruptRecord as exc:  # told where it is in the file, not in `run`
                raise CorruptRecord(LOG, off, exc.reason) from None
            if t.turn_id != turn_id:
                raise CorruptRecord(LOG, off, f"slot of turn {turn_id} holds turn {t.turn_id}")
            out.append(t)
            if len(out) == limit or turn_id == first or t.parent_turn_id != turn_id - 1:
                return out
            turn_id -= 1

    def slot_ok(self, t: Turn) -> bool:
        """True when the log already holds exactly this record."""
        return os.pread(self._fd, TURN_SIZE, (t.turn_id - 1) * TURN_SIZE) == encode_turn(t)

    def write(self, t: Turn) -> None:
        write_at(self._fd, encode_turn(t), (t.turn_id - 1) * TURN_SIZE)
        if t.turn_id > self.count:
            self.count = t.turn_id

    def write_run(self, turns: list[Turn], records: list[bytes], jumps: list[int]) -> None:
        """Consecutive new turns (and their `records`, encode_turn's), and their jump pointers,
        one pwrite per file."""
        first = turns[0].turn_id
        write_at(self._fd, b"".join(records), (first - 1) * TURN_SIZE)
        entries = b"".join(SKIP.pack(j, skip_crc(t.turn_id, j)) for t, j in zip(turns, jumps, strict=True))
        write_at(self._skip_fd, entries, (first - 1) * SKIP.size)
        self.count = max(self.count, turns[-1].turn_id)

    def truncate(self, count: int) -> None:
        self.count = count
        self._recent_jumps.clear()
        os.ftruncate(self._fd, count * TURN_SIZE)
        if os.fstat(self._skip_fd).st_size > count * SKIP.size:
            os.ftruncate(self._skip_fd, count * SKIP.size)

    def sync(self) -> None:
        flush_data(self._fd)

    def close(self) -> None:
        os.close(self._fd)
        os.close(self._skip_fd)

    # --- jump pointers -------------------------------------------------------------------------

    def jump(self, turn_id: int) -> int:
        """The stored jump target of turn_id, or NO_TURN when the entry is missing or damaged."""
        target = self._recent_jumps.get(turn_id)
        if target is not None:
            return target
        buf = os.pread(self._skip_fd, SKIP.size, (turn_id - 1) * SKIP.size)
        if len(buf) != SKIP.size:
            return NO_TURN
        target, crc = SKIP.unpack(buf)
        return target if crc == skip_crc(turn_id, target) and target < turn_id else NO_TURN

    def compute_jump(self, parent: int, parent_depth: int, depth_of: Callable[[int], int]) -> int:
        """The jump target of a new turn under `parent` (NO_TURN: the turn is a root), from
        depths alone (a root is the one turn at depth 0): a batch of new turns looks its own up
        in a dict, not as Turn records."""
        if parent == NO_TURN:
            return NO_TURN
        pj = self.jump(parent) or parent
        pj_depth = depth_of(pj)
        pjj = (self.jump(pj) or pj) if pj_depth else pj
        if parent_depth - pj_depth == pj_depth - depth_of(pjj):
            return pjj
        return parent

    def remember_jump(self, turn_id: int, target: int) -> None:
        """Make a jump known before write_run stores it (the next turn's jump needs it)."""
        if len(self._recent_jumps) >= 1 << 16:
            self._recent_jumps.clear()
        self._recent_jumps[turn_id] = target

    def set_jump(self, turn_id: int, target: int) -> None:
        self.remember_jump(turn_id, target)
        write_at(self._skip_fd, SKIP.pack(target, skip_crc(turn_id, target)), (turn_id - 1) * SKIP.size)

    def skips_valid_upto(self) -> int:
        return min(self.count, os.fstat(self._skip_fd).st_size // SKIP.size)

    def ancestor_at_depth(self, t: Turn, depth: int, get: Callable[[int], Turn]) -> Turn:
        """The ancestor of t (or t) at depth, in O(log t.depth) record reads."""
        while t.depth > depth:
            j = self.jump(t.turn_id)
            if j:
                jt = get(j)
                if jt.depth >= depth:
                    t = jt
                    continue
            t = get(t.parent_turn_id)
        return t
