"""The overlay patch log (`patches.log`): edits and tombstones over immutable turns.

Patches are rare, so the whole log is read at open into a per-turn list ordered by seq; an
as-of read takes the last patch with seq <= as_of, a latest read the last one.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from bisect import bisect_right
from pathlib import Path

from store.errors import CorruptRecord
from store.layout import PATCH_SIZE, Snapshot, decode_patch, encode_patch
from store.types import Patch, RecoveryNotes
from sysio.files import open_private
from sysio.flush import flush_data, write_at

LOG = "patches.log"


def patches_lost(log_seq: int, snap: Snapshot) -> str | None:
    """Why patches.log is shorter than the last checkpoint recorded, or None if it is not."""
    if log_seq >= snap.patch_seq:
        return None
    return (f"{LOG} ends at patch seq {log_seq} but seq {snap.patch_seq} was checkpointed: "
            "acknowledged patches lost")


class PatchLog:
    def __init__(self, root: Path, durable: bool, problems: RecoveryNotes, readonly: bool = False) -> None:
        self.durable = durable
        self._lock = threading.Lock()
        self._fd = open_private(root / LOG, os.O_RDONLY if readonly else os.O_RDWR | os.O_CREAT)
        self._by_target: dict[int, list[Patch]] = {}
        self.seq = 0
        data = os.pread(self._fd, os.fstat(self._fd).st_size, 0)
        used, bad = 0, []
        for slot in range(len(data) // PATCH_SIZE):
            try:
                p = decode_patch(data, slot * PATCH_SIZE)
            except CorruptRecord:
                bad.append(slot * PATCH_SIZE)
                continue
            self._by_target.setdefault(p.target_turn_id, []).append(p)
            self.seq = max(self.seq, p.seq)
            used = slot + 1
        for off in bad:
            if off < used * PATCH_SIZE:
                problems.add(f"{LOG} at offset {off}: damaged patch record skipped", damage=True)
        if len(data) != used * PATCH_SIZE:
            problems.append(f"{LOG}: torn tail after offset {used * PATCH_SIZE} dropped")
            if not readonly:
                os.ftruncate(self._fd, used * PATCH_SIZE)
        self._slots = used

    def add(self, target: int, new_hash: bytes, flags: int) -> Patch:
        with self._lock:
            p = Patch(target, new_hash, flags, self.seq + 1)
            try:
                write_at(self._fd, encode_patch(p, int(time.time() * 1000)), self._slots * PATCH_SIZE)
                if self.durable:
                    flush_data(self._fd)
            except OSError:
                with contextlib.suppress(OSError):  # a refused patch must not come back on reopen
                    os.ftruncate(self._fd, self._slots * PATCH_SIZE)
                raise
            self._slots += 1
            self.seq = p.seq
            self._by_target.setdefault(target, []).append(p)
            return p

    def effective(self, target: int, as_of_seq: int | None = None) -> Patch | None:
        """The patch that applies to target at as_of_seq (None: latest), if any."""
        patches = self._by_target.get(target)
        if not patches:
            return None
        if as_of_seq is None:
            return patches[-1]
        i = bisect_right([p.seq for p in patches], as_of_seq)
        return patches[i - 1] if i else None

    def all(self) -> list[Patch]:
        with self._lock:
            return sorted((p for ps in self._by_target.values() for p in ps), key=lambda p: p.seq)

    def close(self) -> None:
        os.close(self._fd)
