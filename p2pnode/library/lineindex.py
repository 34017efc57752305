"""Which of the versions peers may be served hold each line (Library._visible): one map for
every peer, by raw digest, so what peers may have costs memory per line held, not per peer
and line (docs/SECURITY.md, "Who sees what").

A version stored as the growth of an indexed one (`Version.previous`, whose bytes are a prefix
of its own, ending with a newline: its lines are this one's first lines) claims only the lines
after them and names that version in `grown_from`: a line is held by a version that claims it
or by one grown from such a version.  Every claim is true of the version's bytes, whatever
happened to the index since (its src is their hash), so a stale claim can only cost memory.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from p2pnode.library.sessions import Version

DIGEST = 32
"""Bytes of a line's name (BLAKE3, pi/hashing.py)."""
LinesAfter = Callable[[str, int], Iterable[bytes]]
"""(src, skip) -> the version's line hashes after its first `skip` lines."""


class LineIndex:
    """The lines of the versions peers may be served, and which of those versions claim each."""

    def __init__(self) -> None:
        self._holders: dict[bytes, frozenset[str]] = {}
        """line digest -> the indexed versions that claim it (a few shared sets: the versions
        of one session and its forks hold the same lines)."""
        self._versions: dict[str, Version] = {}
        """The versions indexed, each with all its lines claimed (by it or what it grew from)."""
        self.grown_from: dict[str, str] = {}
        """src -> the indexed version it grew from, whose lines it did not claim again."""

    def holders(self, digest: bytes) -> frozenset[str]:
        return self._holders.get(digest, frozenset())

    def update(self, target: Mapping[str, Version], lines_after: LinesAfter,
               held: Callable[[str], bool]) -> None:
        """Index exactly the versions of `target`: those no longer there walked out, the new
        ones walked in (a growth of an indexed version: its new lines only), or all of them
        again when a version gone is no longer stored or one staying grew from it."""
        gone = self._versions.keys() - target.keys()
        if any(not held(s) for s in gone) or any(self.grown_from.get(s) in gone for s in target):
            self._holders, self._versions, self.grown_from = {}, {}, {}
            gone = set()
        skips = {s: self._skipped(s) for s in gone}
        for src in sorted(gone):
            del self._versions[src]  # dropped first: a walk cut short leaves it out, not half in
            self.grown_from.pop(src, None)
            self._walk(src, lines_after(src, skips[src]), frozenset.difference)
        for version in sorted((v for s, v in target.items() if s not in self._versions),
                              key=lambda v: v.size):  # after the version it grew from
            older = self._versions.get(version.previous) if version.previous else None
            if older is not None and (older.last_line_start != older.size or older.lines > version.lines):
                older = None  # its last line is not one of this version's
            self._walk(version.src, lines_after(version.src, older.lines if older else 0), frozenset.union)
            if older is not None:
                self.grown_from[version.src] = older.src
            self._versions[version.src] = version  # recorded last: only once all its lines are in

    def _skipped(self, src: str) -> int:
        """How many first lines of an indexed version it did not claim (its older version's)."""
        older = self.grown_from.get(src)
        return 0 if older is None else self._versions[older].lines

    def _walk(self, src: str, lines: Iterable[bytes],
              change: Callable[[frozenset[str], frozenset[str]], frozenset[str]]) -> None:
        """Add `src` to (or take it from) the holders of each line; the lines of one version
        mostly share their holders, so each new set is made once per set it replaces.  The
        digests kept are copies made once the walk's are gone: those lie among the turn records
        the walk read and freed, and would keep all that memory taken (for 500,000 lines, 195 MB
        of RSS against 57: docs/BENCHMARKS.md)."""
        holders, mine = self._holders, frozenset((src,))
        made: dict[frozenset[str], frozenset[str]] = {}
        empty = frozenset[str]()
        run = b"".join(lines)
        del lines  # the walk's list, the last reference to its digests
        for at in range(0, len(run), DIGEST):
            digest = run[at:at + DIGEST]
            old = holders.get(digest, empty)
            new = made.get(old)
            if new is None:
                new = made[old] = change(old, mine)
            if new:
                holders[digest] = new
            elif old:
                del holders[digest]
