"""`blobs.pack`: append-only BlobRecords, their scan and repair on open, lookups through the
index (store/files/blobindex.py), and the GC sweep's crash-safe pack swap.

Blobs appended since the index was last written live in an in-memory dict (the "tail");
the index header records how many pack bytes it covers, and opening scans only the pack
beyond that.  When the index is missing, damaged or does not describe this pack, it is
rebuilt from the pack.
"""
from __future__ import annotations

import itertools
import mmap
import os
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from store.errors import CorruptRecord
from store.files.blobindex import INDEX, BlobIndex, check_index, encode_index, index_entry
from store.layout import (
    BLOB_CRC,
    BLOB_HEADER,
    BLOB_MAGIC_BYTES,
    BLOB_OVERHEAD,
    IDX_ENTRY,
    IDX_FANOUT,
    IDX_HEADER,
    IDX_PREFIX_LEN,
    BlobHeader,
    BlobLocation,
    blob_record_ok,
    decode_blob_header,
    encode_blob,
)
from store.types import RecoveryNotes
from sysio.chunks import joined_runs
from sysio.files import TMP_SUFFIX, atomic_write, fsync_dir, open_private
from sysio.flush import disk_full, flush_data, write_at

PACK = "blobs.pack"
WRITE_RUN = 8 << 20
"""Bytes of records joined into one write by append_many; a bigger record is written alone."""
BIG_READ = 8 << 20
"""A stored blob this big is read apart from its header and CRC (not sliced out of a copy)."""
FOLD_BLOBS, FOLD_BYTES = 4096, 8 << 20
"""Opening or closing the store folds the tail into blobs.idx once it holds more than FOLD_BLOBS
blobs or the pack has more than FOLD_BYTES beyond the index.  Below that the next open scans
those bytes again (a few ms), which is cheaper than the fold: a rewrite of the whole index,
which grows with the store (105k blobs: 45 ms, at every close of a command that wrote a line)."""


@dataclass
class PackScan:
    """What a walk over pack bytes found."""

    records: list[tuple[int, BlobHeader]] = field(default_factory=list)
    damaged: list[tuple[int, BlobHeader]] = field(default_factory=list)
    """Whole records that fail their CRC, whose header still names their blob: written once,
    damaged since (kept in place and reported, never truncated away)."""
    corrupt: list[tuple[int, str]] = field(default_factory=list)
    end: int = 0
    """Where valid data stops; beyond it the file holds only zeros or a torn tail."""
    torn: bool = False


def _valid_at(buf: mmap.mmap | bytes, pos: int) -> BlobHeader | None:
    hdr = decode_blob_header(memoryview(buf), pos)
    if hdr is None or pos + hdr.record_len > len(buf):
        return None
    return hdr if blob_record_ok(memoryview(buf)[pos : pos + hdr.record_len]) else None


def _damaged_at(buf: mmap.mmap | bytes, pos: int) -> BlobHeader | None:
    """A record at pos that fails its CRC but whose header is plausible and whose bytes are all
    there, ending where a valid record starts or where the data ends.  At the end of the data,
    zeros where its CRC belongs mean a write cut short (a torn tail), not damage."""
    hdr = decode_blob_header(memoryview(buf), pos)
    if hdr is None:
        return None
    end = pos + hdr.record_len
    if end > len(buf):
        return None
    if _valid_at(buf, end) is not None:
        return hdr
    if buf[end:].count(b"\0") != len(buf) - end:
        return None
    return None if buf[end - BLOB_CRC.size : end] == bytes(BLOB_CRC.size) else hdr


def _next_valid(buf: mmap.mmap | bytes, pos: int) -> int | None:
    while True:
        pos = buf.find(BLOB_MAGIC_BYTES, pos)
        if pos < 0:
            return None
        if _valid_at(buf, pos) is not None:
            return pos
        pos += 1


def scan_pack(buf: mmap.mmap | bytes, start: int = 0) -> PackScan:
    """Walk records from start.  A whole record that fails its CRC is damaged (kept, with the
    hash its header names); other bad bytes followed by a good record are reported as corrupt
    and skipped; bad bytes with nothing good after them are a torn tail."""
    scan = PackScan()
    pos, n = start, len(buf)
    while pos < n:
        hdr = _valid_at(buf, pos)
        if hdr is not None:
            scan.records.append((pos, hdr))
            pos += hdr.record_len
            continue
        hdr = _damaged_at(buf, pos)
        if hdr is not None:
            scan.damaged.append((pos, hdr))
            pos += hdr.record_len
            continue
        nxt = _next_valid(buf, pos + 1)
        if nxt is None:
            break
        scan.corrupt.append((pos, f"{nxt - pos} bytes of damaged blob records"))
        pos = nxt
    scan.end = pos
    scan.torn = buf[pos:n].count(b"\0") != n - pos
    return scan


class BlobPack:
    """The pack file and its index.  Thread-safe: appends serialise on one lock; reads are
    lock-free preads of immutable records."""

    def __init__(self, root: Path, durable: bool, problems: RecoveryNotes, readonly: bool = False) -> None:
        self.root = root
        self.durable = durable
        self.readonly = readonly
        self._fix = "repair rebuilds it" if readonly else f"rebuilt from {PACK}"
        self.problems = problems
        self._lock = threading.Lock()
        self._fd = open_private(root / PACK, os.O_RDONLY if readonly else os.O_RDWR | os.O_CREAT)
        self._tail: dict[bytes, BlobLocation] = {}
        self.damaged: dict[bytes, str] = {}
        """Blobs whose only record in the scanned part of the pack failed its CRC: what is wrong."""
        self._index = BlobIndex()
        self._file_size = os.fstat(self._fd).st_size
        self._last: tuple[int, bytes] | None = None
        self._covered = 0
        """Pack bytes blobs.idx covers."""
        self._recover()

    # --- open and recovery ---------------------------------------------------------------------

    def _recover(self) -> None:
        covered = self._load_index()
        scan = self._scan(covered or 0)
        for off, hdr in scan.records:
            self._tail[hdr.hash] = BlobLocation(off, hdr.raw_len, hdr.stored_len, hdr.codec)
        for off, hdr in scan.damaged:
            if not self.has(hdr.hash):  # no good copy elsewhere
                self.damaged[hdr.hash] = f"its record at offset {off} of {PACK} failed its CRC"
            self.problems.add(f"{PACK} at offset {off}: blob {hdr.hash.hex()} failed its CRC (damaged, kept)",
                              damage=True)
        last = max([*scan.records, *scan.damaged], default=None, key=lambda r: r[0])
        if last is not None:
            self._last = (last[0], last[1].hash)  # blobs.idx names the last record, good or not
        for off, reason in scan.corrupt:
            self.problems.add(f"{PACK} at offset {off}: {reason} (blobs there are unreadable)", damage=True)
        if scan.torn:
            fix = "repair truncates it" if self.readonly else "truncated"
            self.problems.append(f"{PACK}: torn tail after offset {scan.end} ({fix})")
        self.end = scan.end
        if self.readonly:
            return
        if scan.end != self._file_size:
            os.ftruncate(self._fd, scan.end)  # drop a torn tail and any unused zero region
            self._file_size = scan.end
        if covered is None or self._fold_due():
            try:
                self.write_index()
            except OSError as exc:  # a full disk: the store opens for reading all the same
                if not disk_full(exc):
                    raise
                self.problems.append(f"{INDEX} not brought up to date: {exc.strerror} (the pack's "
                                     "unindexed tail is indexed in memory until a write folds it)")

    def _scan(self, start: int) -> PackScan:
        """Scan what blobs.idx does not cover.  Read, not mapped: a page of a mapping that the
        disk cannot deliver (an I/O error, a file cut short by another process) kills the
        process with a signal, where a read raises an error that opening reports."""
        parts: list[bytes] = []
        at = start
        while at < self._file_size:
            chunk = os.pread(self._fd, min(self._file_size - at, BIG_READ), at)
            if not chunk:
                break  # cut short since fstat: the scan ends where the bytes do
            parts.append(chunk)
            at += len(chunk)
        # after a good close the tail is one read (FOLD_BYTES <= BIG_READ), scanned as it came,
        # not copied
        scan = scan_pack(parts[0] if len(parts) == 1 else b"".join(parts))
        return PackScan(records=[(start + off, hdr) for off, hdr in scan.records],
                        damaged=[(start + off, hdr) for off, hdr in scan.damaged],
                        corrupt=[(start + off, why) for off, why in scan.corrupt],
                        end=start + scan.end, torn=scan.torn)

    def _load_index(self) -> int | None:
        """Map blobs.idx if it is intact and describes this pack, and make it the index;
        return the pack bytes it covers."""
        path = self.root / INDEX
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            if self._file_size:
                self.problems.append(f"{INDEX} missing: {self._fix}")
            return None
        try:
            size = os.fstat(fd).st_size
            if size < IDX_PREFIX_LEN:
                self.problems.append(f"{INDEX} too short: {self._fix}")
                return None
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        reason = check_index(mm, size, self._file_size,
                             lambda off: decode_blob_header(os.pread(self._fd, BLOB_HEADER.size, off)))
        if reason:
            mm.close()
            self.problems.append(f"{INDEX} {reason}: {self._fix}")
            return None
        _, _, _, count, covered, last_off, last_hash, _ = IDX_HEADER.unpack_from(mm, 0)
        self._index = BlobIndex(mm, IDX_FANOUT.unpack_from(mm, IDX_HEADER.size), count)
        self._last = (last_off, last_hash) if count else None
        self._covered = int(covered)
        return self._covered

    def _fold_due(self) -> bool:
        return len(self._tail) > FOLD_BLOBS or self.end - self._covered > FOLD_BYTES

    # --- lookups -------------------------------------------------------------------------------

    def locate(self, h: bytes) -> BlobLocation | None:
        """Where blob h's record is; None when the pack has no record of it, or only a damaged
        one (then an append of the same bytes stores a good copy, which reads then find)."""
        loc = self._tail.get(h)
        if loc is not None:
            return loc
        if self.damaged and h in self.damaged:
            return None
        return self._index.locate(h)

    def has(self, h: bytes) -> bool:
        """`locate(h) is not None`, without making the location."""
        if h in self._tail:
            return True
        if self.damaged and h in self.damaged:
            return False
        return self._index.has(h)

    @property
    def index(self) -> BlobIndex:
        """The index now (replaced whole at each fold): what locate_since is given back."""
        return self._index

    def locate_since(self, h: bytes, index: BlobIndex) -> BlobLocation | None:
        """`locate(h)` of a blob the pack did not have when `index` was its index (the caller
        looked then, and appends of h hold h's lock): while it still is, only the records
        appended since are looked at, not the index's binary search (a share's new lines,
        looked up again by the writer).  The tail is read first: a fold swaps the index in
        before it clears the tail."""
        loc = self._tail.get(h)
        if loc is None and index is not self._index:
            return self.locate(h)
        return loc

    def mark_damaged(self, h: bytes, reason: str) -> None:
        """A read found blob h's record damaged: lookups stop finding it (see locate)."""
        self.damaged[h] = reason

    def damage_of(self, h: bytes) -> str | None:
        """What is wrong with blob h, if the pack holds it only damaged (as far as opening saw)."""
        return self.damaged.get(h)

    def read(self, h: bytes, loc: BlobLocation) -> bytes:
        """The stored bytes of blob h, CRC-checked."""
        n = loc.stored_len + BLOB_HEADER.size + 4
        if loc.stored_len < BIG_READ:
            rec = os.pread(self._fd, n, loc.offset)
            head, stored, crc = rec[: BLOB_HEADER.size], rec[BLOB_HEADER.size : -4], rec[-4:]
        else:  # its bytes read where they go, not sliced out of a copy of the record
            head = os.pread(self._fd, BLOB_HEADER.size, loc.offset)
            stored = os.pread(self._fd, loc.stored_len, loc.offset + BLOB_HEADER.size)
            crc = os.pread(self._fd, 4, loc.offset + BLOB_HEADER.size + loc.stored_len)
        hdr = decode_blob_header(head)
        if (hdr is None or hdr.hash != h or len(head) + len(stored) + len(crc) != n
                or hdr.stored_len != loc.stored_len):
            raise CorruptRecord(PACK, loc.offset, f"the record for blob {h.hex()} is damaged or missing")
        if BLOB_CRC.unpack(crc)[0] != zlib.crc32(stored, zlib.crc32(head)):
            raise CorruptRecord(PACK, loc.offset, f"blob {h.hex()} failed its CRC")
        return stored

    def hashes(self) -> Iterator[bytes]:
        """Every indexed hash (index file, then tail)."""
        idx = self._index
        if idx.mm is not None:
            mm = idx.mm
            for i in range(idx.count):
                off = IDX_PREFIX_LEN + i * IDX_ENTRY.size
                yield mm[off : off + 32]
        yield from list(self._tail)

    def __len__(self) -> int:
        return self._index.count + len(self._tail)

    @property
    def indexed(self) -> int:
        return self._index.count

    # --- writes --------------------------------------------------------------------------------

    def read_record(self, loc: BlobLocation) -> bytes:
        """The whole record at loc, as it sits in the pack (not checked)."""
        return os.pread(self._fd, loc.stored_len + BLOB_HEADER.size + 4, loc.offset)

    def append(self, rec: Sequence[bytes]) -> BlobLocation:
        """Append one BlobRecord (no sync).  The caller makes sure it is not stored yet."""
        return self.append_many([rec])[0]

    def append_many(self, recs: Sequence[Sequence[bytes]]) -> list[BlobLocation]:
        """Append BlobRecords in order, each as its parts (`blob_record`, or one encoded
        record), in few writes (no sync): a share's batch of thousands of lines costs a few
        syscalls, not one each, and a big payload is written as it is, not copied into a
        joined run.  Nothing is found until all of them are written.  The caller makes sure
        none is stored yet."""
        heads = [BLOB_HEADER.unpack_from(rec[0]) for rec in recs]  # ours, just encoded: not checked again
        with self._lock:
            start = off = self.end
            # not pre-zeroed: the pack is synced rarely
            for run in joined_runs(itertools.chain.from_iterable(recs), WRITE_RUN):
                write_at(self._fd, run, off)
                off += len(run)
            locs: list[BlobLocation] = []
            off = start
            for (_, _, codec, raw_len, stored_len, h) in heads:
                loc = BlobLocation(off, raw_len, stored_len, codec)
                self._tail[h] = loc
                self._last = (off, h)
                if self.damaged:
                    self.damaged.pop(h, None)  # a good copy now
                locs.append(loc)
                off += BLOB_OVERHEAD + stored_len
            self.end = off
            self._file_size = max(self._file_size, self.end)
        return locs

    def sync(self) -> None:
        flush_data(self._fd)

    def write_index(self) -> None:
        """Fold the tail into a new blobs.idx (temp file + rename)."""
        with self._lock:
            merged = self._index.merged(self._tail)  # a new copy wins
            atomic_write(self.root / INDEX, encode_index(merged, self.end, self._last), durable=self.durable)
            self._reload_index()
            self._tail.clear()  # only now: a lookup finds a blob in the old tail or the new index

    def rebuild_index(self) -> None:
        """Forget blobs.idx and index the whole pack again."""
        with self._lock:
            scan = self._scan(0)
            self._tail = {hdr.hash: BlobLocation(off, hdr.raw_len, hdr.stored_len, hdr.codec)
                          for off, hdr in reversed(scan.records)}  # the first copy of a blob wins
            self._index = BlobIndex()
            last = max([*scan.records, *scan.damaged], default=None, key=lambda r: r[0])
            self._last = (last[0], last[1].hash) if last else None
        self.write_index()

    def _reload_index(self) -> None:
        if self._load_index() is None:  # we just wrote it: only a failing disk gets here
            raise CorruptRecord(INDEX, 0, "the index just written does not read back")

    # --- compaction (GC) -----------------------------------------------------------------------

    def compact(self, live: set[bytes], on_phase: Callable[[str], None]) -> tuple[int, int, int]:
        """Copy the live blobs into a new pack and swap it in.  Returns (kept, dropped, bytes
        freed).  A crash at any point leaves either the old pack or the new one, both complete;
        the index is rebuilt at open if it does not match the pack.  A pack whose records are
        all live and follow each other to its end is left as it is (the copy would free
        nothing: it was a rewrite of the whole pack on every `gc` with nothing to collect)."""
        with self._lock:
            entries = [(loc.offset, h, loc) for h in self.hashes() if (loc := self.locate(h))]
            entries.sort()
            if _all_live_and_packed(entries, live, self.end):
                return len(entries), 0, 0
            new_path, new_idx = self.root / (PACK + ".gc"), self.root / (INDEX + ".gc")
            fd = open_private(new_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
            kept: list[bytes] = []
            pos, dropped, last = 0, 0, None
            try:
                for _, h, loc in entries:
                    if h not in live:
                        dropped += 1
                        continue
                    try:
                        stored = self.read(h, loc)
                    except CorruptRecord as exc:
                        self.problems.add(f"gc: dropped unreadable live blob {h.hex()}: {exc}", damage=True)
                        continue
                    rec = encode_blob(h, loc.codec, loc.raw_len, stored)
                    write_at(fd, rec, pos)
                    kept.append(index_entry(h, BlobLocation(pos, loc.raw_len, loc.stored_len, loc.codec)))
                    last = (pos, h)
                    pos += len(rec)
                flush_data(fd)
            finally:
                os.close(fd)
            kept.sort()
            atomic_write(new_idx, encode_index(kept, pos, last), durable=True)
            on_phase("new-pack-written")
            os.replace(new_path, self.root / PACK)
            fsync_dir(self.root)
            on_phase("pack-swapped")
            os.replace(new_idx, self.root / INDEX)
            fsync_dir(self.root)
            on_phase("index-swapped")
            freed = self.end - pos
            os.close(self._fd)
            self._fd = os.open(self.root / PACK, os.O_RDWR)
            self._file_size = self.end = pos
            self._reload_index()
            self._tail.clear()
            return len(kept), dropped, freed

    def flush_for_close(self) -> None:
        """Before a good close: trim the zero region, fold a big tail into blobs.idx (FOLD_BYTES), flush."""
        if self.end != self._file_size:
            os.ftruncate(self._fd, self.end)
            self._file_size = self.end
        if self._tail and self._fold_due():
            self.write_index()
        flush_data(self._fd)

    def close(self) -> None:
        """Close without writing (a failed store writes nothing more; see flush_for_close)."""
        mm, self._index = self._index.mm, BlobIndex()
        if mm is not None:
            mm.close()
        os.close(self._fd)


def _all_live_and_packed(entries: list[tuple[int, bytes, BlobLocation]], live: set[bytes], end: int) -> bool:
    pos = 0
    for offset, h, loc in entries:
        if offset != pos or h not in live:
            return False
        pos += BLOB_OVERHEAD + loc.stored_len
    return pos == end


def remove_leftovers(root: Path) -> None:
    """A gc killed before its swap leaves *.gc files, a killed atomic_write its temp file."""
    for name in (PACK + ".gc", INDEX + ".gc"):
        (root / name).unlink(missing_ok=True)
    for tmp in root.glob(f".*{TMP_SUFFIX}"):  # atomic_write's temp files: never part of the store
        tmp.unlink(missing_ok=True)
