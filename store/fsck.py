"""Check a store, and with repair=True fix what opening can fix.

The checks read the files without changing them: every pack record's CRC (and with full=True
its hash), index ↔ pack agreement, every turn record's CRC, parent and depth, jump pointers,
heads (snapshot + WAL, as the next open would see them) → existing turns at the right depth,
blobs of every turn reachable from a head or patch.  Repair opens the store, which truncates
torn tails and replays the head WAL, rebuilds `blobs.idx` from the whole pack and
acknowledges damage.log, then checks again.
"""
from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from store.api import LOCK, Store
from store.codec import DecodeError, blob_hash, decode_stored
from store.config import StoreConfig
from store.errors import CorruptRecord, StoreLocked, UnknownTurn
from store.files import patchlog, snapshot
from store.files.blobindex import INDEX
from store.files.blobpack import PACK, BlobPack, scan_pack
from store.files.patchlog import PatchLog, patches_lost
from store.files.turnlog import LOG, SKIPS, TurnLog
from store.layout import BLOB_HEADER, PATCH_REPLACE, TURN_SIZE, BlobHeader
from store.recovery import DAMAGE, damage_found, replay
from store.types import NO_TURN, RecoveryNotes
from sysio.locks import lock_with_timeout


@dataclass
class FsckReport:
    path: str
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.errors

    def summary(self) -> str:
        lines = [f"store {self.path}: {'ok' if self.ok else f'{len(self.errors)} error(s)'}"]
        if self.stats:
            lines.append("  " + ", ".join(f"{k} {v}" for k, v in self.stats.items()))
        lines += [f"  repaired: {m}" for m in self.repaired]
        lines += [f"  error: {m}" for m in self.errors]
        lines += [f"  warning: {m}" for m in self.warnings]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "ok": self.ok, "errors": self.errors, "warnings": self.warnings,
                "repaired": self.repaired, "stats": self.stats}


def fsck(path: str | os.PathLike[str], full: bool = False, repair: bool = False,
         lock_timeout: float = 10.0) -> FsckReport:
    """The report; StoreLocked when another process holds the store past `lock_timeout` (a
    store that could not be checked is not a damaged one)."""
    root = Path(path)
    report = FsckReport(str(root))
    if not (root / LOG).exists() and not (root / PACK).exists():
        report.errors.append(f"{root} is not a store (no {LOG}, no {PACK})")
        return report
    if repair:
        _repair(root, report, lock_timeout)
    with _locked(root, lock_timeout):
        if missing := [name for name in (LOG, SKIPS, PACK, patchlog.LOG) if not (root / name).exists()]:
            report.errors += [f"{name} is missing (the next open makes it anew, empty: fsck --repair does, "
                              "then checks what that lost)" for name in missing]
        else:
            _check(root, full, report)
    return report


def _repair(root: Path, report: FsckReport, lock_timeout: float) -> None:
    """Open the store (its recovery truncates torn tails and replays the WAL), rebuild the
    index from the pack, and acknowledge damage.log."""
    with Store.open(root, StoreConfig(lock_timeout=lock_timeout)) as store:
        report.repaired += store.recovery_notes
        store.rebuild_index()
        report.repaired.append(f"{INDEX} rebuilt from {PACK}")
        damage = root / DAMAGE
        if damage.exists():
            report.repaired += [f"acknowledged: {line}" for line in damage.read_text().splitlines()]
            damage.unlink()


@contextmanager
def _locked(root: Path, timeout: float) -> Iterator[None]:
    """Hold the store's lock (as Store.open does) so that no process writes while we read; an
    existing lock file is opened for reading, so that a store this user may only read is checked."""
    fd = lock_with_timeout(root / LOCK, timeout, read_only=(root / LOCK).exists())
    if fd is None:
        raise StoreLocked(str(root))
    try:
        yield
    finally:
        os.close(fd)


def _check(root: Path, full: bool, report: FsckReport) -> None:
    pack_notes, notes = RecoveryNotes(), RecoveryNotes()
    pack = BlobPack(root, durable=False, problems=pack_notes, readonly=True)
    log = TurnLog(root, readonly=True)
    patches = PatchLog(root, durable=False, problems=notes, readonly=True)
    try:
        # the pack's damaged records and stretches: _check_pack's, from a walk of the whole pack
        report.errors += [n for n in pack_notes if n not in pack_notes.damage] + notes
        damaged, seen = _check_pack(root, pack, full, report)
        report.errors += [f"found when opened: {stamp} {what} (fsck --repair acknowledges)"
                          for stamp, what in damage_found(root) if not what.startswith(seen)]
        depths, damaged_turns = _check_turns(root, log, report)
        _check_heads(root, log, pack, patches, depths, damaged, damaged_turns, report)
    finally:
        pack.close()
        log.close()
        patches.close()


def _check_pack(root: Path, pack: BlobPack, full: bool,
                report: FsckReport) -> tuple[dict[bytes, str], tuple[str, ...]]:
    """Checks the whole pack; returns the blobs whose only record is damaged, and how, and
    the start of what is reported of each damaged record or stretch (the same damage in
    damage.log is not listed again: reported here, it is an error until a good copy is stored)."""
    size = os.path.getsize(root / PACK)
    if not size:
        report.stats["blobs"] = 0
        return {}, ()
    with open(root / PACK, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mm:
        scan = scan_pack(mm)
        by_offset = dict(scan.records)
        for off, hdr in scan.records:
            if not pack.has(hdr.hash):
                report.errors.append(f"{PACK} at offset {off}: blob {hdr.hash.hex()} is not in {INDEX}")
            if full:
                _rehash(mm, off, hdr, report)
        damaged = dict(scan.damaged)
        good = {hdr.hash: off for off, hdr in scan.records}
        seen: list[str] = []
        for off, hdr in scan.damaged:
            seen.append(where := f"{PACK} at offset {off}: blob {hdr.hash.hex()} failed its CRC")
            if hdr.hash in good:  # stored again since: harmless, GC drops it
                report.warnings.append(f"{where} (a good copy is at offset {good[hdr.hash]})")
            else:
                report.errors.append(f"{where} (damaged)")
        for off, reason in scan.corrupt:
            seen.append(where := f"{PACK} at offset {off}: {reason}")
            report.errors.append(f"{where} (blobs there are unreadable)")
        for h in pack.hashes():
            loc = pack.locate(h)
            if loc is not None and loc.offset in damaged:
                continue  # reported above
            rec = by_offset.get(loc.offset) if loc else None
            if loc is None or rec is None or (rec.hash, rec.stored_len, rec.raw_len, rec.codec) != (
                    h, loc.stored_len, loc.raw_len, loc.codec):
                report.errors.append(f"{INDEX}: blob {h.hex()} has no matching record in {PACK}")
    report.stats["blobs"] = len(scan.records)
    report.stats["pack_bytes"] = scan.end
    return {hdr.hash: f"its record at offset {off} of {PACK} failed its CRC"
            for off, hdr in scan.damaged if hdr.hash not in good}, tuple(seen)


def _rehash(mm: mmap.mmap, off: int, hdr: BlobHeader, report: FsckReport) -> None:
    stored = mm[off + BLOB_HEADER.size : off + BLOB_HEADER.size + hdr.stored_len]
    try:
        data = decode_stored(hdr.codec, stored, hdr.raw_len)
    except DecodeError as exc:
        report.errors.append(f"{PACK} at offset {off}: blob {hdr.hash.hex()} does not decode: {exc}")
        return
    if blob_hash(data) != hdr.hash:
        report.errors.append(f"{PACK} at offset {off}: blob {hdr.hash.hex()} fails its hash")


def _check_turns(root: Path, log: TurnLog, report: FsckReport) -> tuple[list[int], dict[int, str]]:
    """Every record's CRC, id, parent and depth; returns depth by TurnID (-1: unreadable) and
    the records that failed their check (reported by _check_heads: an error while a head
    reaches one)."""
    size = os.path.getsize(root / LOG)
    if size % TURN_SIZE:
        report.errors.append(f"{LOG}: torn record at offset {size - size % TURN_SIZE} (repair truncates it)")
    depths = [-1] * (log.count + 1)
    damaged: dict[int, str] = {}
    bad_skips = 0
    for tid in range(1, log.count + 1):
        try:
            t = log.read(tid)
        except CorruptRecord as exc:
            damaged[tid] = str(exc)
            continue
        if t.parent_turn_id >= tid:
            report.errors.append(f"turn {tid}: parent {t.parent_turn_id} is not older")
        elif t.parent_turn_id == NO_TURN:
            if t.depth != 0:
                report.errors.append(f"turn {tid}: a root at depth {t.depth}")
        elif depths[t.parent_turn_id] >= 0 and t.depth != depths[t.parent_turn_id] + 1:
            pd = depths[t.parent_turn_id]
            report.errors.append(f"turn {tid}: depth {t.depth} but its parent has depth {pd}")
        depths[tid] = t.depth
        if t.parent_turn_id and not log.jump(tid):
            bad_skips += 1
    if bad_skips:
        report.warnings.append(f"turns.skip: {bad_skips} missing or damaged jump pointers (depth reads walk)")
    report.stats["turns"] = log.count
    return depths, damaged


def _check_heads(root: Path, log: TurnLog, pack: BlobPack, patches: PatchLog, depths: list[int],
                 damaged: dict[bytes, str], damaged_turns: dict[int, str], report: FsckReport) -> None:
    """Heads → turns → blobs.  A damaged turn record is an error while a head reaches it (or the
    next open would rewrite it from the WAL), else a warning: no chain in use goes through it,
    and its id stays taken."""
    notes = RecoveryNotes()
    loaded = snapshot.load(root, notes, lambda snap: log.count < snap.checkpoint_turn_id)

    def readable(tid: int) -> bool:
        return 0 < tid < len(depths) and depths[tid] >= 0

    r = replay(loaded, log.count, log.slot_ok, readable, pack.has,
                         damaged.get)
    lost = patches_lost(patches.seq, loaded.snapshot)
    if lost:
        report.errors.append(lost)
    notes.merge(r.notes)  # damage (a snapshot that fails its CRC) is an error before an open as after
    report.errors += [f"next open: {n}" for n in notes.damage]
    report.warnings += [f"next open: {n}" for n in notes if n not in notes.damage]
    report.stats["contexts"] = len(r.logged)
    reachable: set[int] = set()
    rewritten = {t.turn_id for t in r.writes}
    reached: dict[int, int] = {}  # damaged turn -> a context whose chain reaches it
    for ctx, (head, depth, _, _) in sorted(r.logged.items()):
        if head == NO_TURN:
            continue
        if not readable(head) and head not in rewritten and head not in damaged_turns:
            report.errors.append(f"context {ctx}: head turn {head} does not exist")
            continue
        if readable(head) and depths[head] != depth:
            report.errors.append(f"context {ctx}: head depth {depth}, turn {head} has depth {depths[head]}")
        tid = head
        while tid != NO_TURN and tid not in reachable and readable(tid):
            reachable.add(tid)
            tid = log.read(tid).parent_turn_id
        if tid in damaged_turns:
            reached.setdefault(tid, ctx)
    for tid, what in damaged_turns.items():
        if tid in rewritten:
            report.errors.append(f"{what} (the next open rewrites it from the head WAL: fsck --repair)")
        elif tid in reached:
            report.errors.append(f"{what}: the chain of context {reached[tid]}'s head goes through it and "
                                 "cannot be read (its users must drop such heads)")
        else:
            report.warnings.append(f"{what}: no head reaches it (harmless; its id stays taken)")
    missing = 0
    for tid in sorted(reachable):
        h = log.read(tid).payload_hash
        if h in damaged or (not pack.has(h) and h not in r.blobs):  # (the WAL's copies are restored)
            missing += 1
            if missing <= 20:
                why = damaged.get(h) or (r.damaged[h][1] if h in r.damaged else
                                         "lost: neither blobs.pack nor the head WAL holds it")
                report.errors.append(
                    f"turn {tid} (reachable from a head): payload blob {h.hex()} is damaged: {why}")
    for p in patches.all():
        try:
            log.read(p.target_turn_id)
        except (CorruptRecord, UnknownTurn):
            report.errors.append(f"patch {p.seq}: target turn {p.target_turn_id} does not exist")
        if p.flags == PATCH_REPLACE and not pack.has(p.new_payload_hash):
            report.errors.append(f"patch {p.seq}: blob {p.new_payload_hash.hex()} is missing")
    report.stats["reachable_turns"] = len(reachable)
    report.stats["patches"] = len(patches.all())
