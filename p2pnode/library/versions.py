"""Versions of one Pi session: the successive stored versions of a growing file.

Pi appends to a session file as the user works, and each `share` of the grown file is a new
version and a new branch (the branch hash stays BLAKE3 of the seed's sidecar, which has no
room for a link).  What makes them one session is recorded beside the sidecar: a version
stored as the growth of an older one (the same header id, the older bytes a prefix of the
newer) names it in `Version.previous` (sessions.json).  Following those links backwards from
any version reaches the session's first version held here: that is the session's key, and a
version's number is its place in that chain (1 = the first version this node holds).

Pure bookkeeping over the records in sessions.json; no store reads but the line hashes
`unlinked_growths` is given (docs/FORMAT.md, "Versions of a session").
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # sessions.py records versions and asks `later_growths` as it does
    from p2pnode.library.sessions import BranchRecord, Version


@dataclass(frozen=True, slots=True)
class VersionIndex:
    """Where each stored version stands in its session's chain of versions."""

    root: dict[str, str]
    """src -> the src of the first version of its chain held here."""
    number: dict[str, int]
    """src -> its place in the chain (1 = the first version held here)."""
    previous: dict[str, str]
    """src -> the src of the version it grew from (only when that version is held)."""

    def chain(self, src: str) -> list[str]:
        """The versions `src` grew from, oldest first, ending with `src`."""
        out = [src]
        while (prev := self.previous.get(out[-1])) is not None and len(out) <= len(self.previous):
            out.append(prev)
        return out[::-1]

    def same_session(self, a: str, b: str) -> bool:
        return self.root.get(a, a) == self.root.get(b, b)


def build_index(versions: Iterable[Version]) -> VersionIndex:
    """The chains of versions among `versions` (O(n); a link to a version not held ends a chain)."""
    by_src = {v.src: v for v in versions}
    previous = {v.src: v.previous for v in by_src.values()
                if v.previous is not None and v.previous in by_src}
    root: dict[str, str] = {}
    number: dict[str, int] = {}
    for src in by_src:
        path = [src]
        # sizes strictly grow along a chain, so there is no cycle; bounded anyway
        while (path[-1] not in root and (prev := previous.get(path[-1])) is not None
               and len(path) <= len(by_src)):
            path.append(prev)
        base_root, base_number = (root[path[-1]], number[path[-1]]) if path[-1] in root else (path[-1], 1)
        for depth, s in enumerate(reversed(path)):
            root.setdefault(s, base_root)
            number.setdefault(s, base_number + depth)
    return VersionIndex(root, number, previous)


def previous_branch(record: BranchRecord, index: VersionIndex,
                    branches_of_src: list[BranchRecord]) -> str | None:
    """The branch of the version `record`'s version grew from: the one with the same lineage
    parent if there is one (a re-share keeps the parent), else an offered one, else the newest.
    `branches_of_src`: the branches of that older version."""
    if index.previous.get(record.src) is None or not branches_of_src:
        return None
    best = max(branches_of_src, key=lambda b: (b.parent == record.parent, b.offered, b.shared_at))
    return best.branch


def unlinked_growths(versions: Iterable[Version],
                     line_hashes: Callable[[str], list[bytes]]) -> dict[str, str]:
    """Links for versions stored before `previous` existed: src -> the largest smaller version
    of the same header id whose lines (hashes: turn records only, no line is read) are this
    one's first lines, i.e. whose bytes are a prefix of its bytes.  Only a version with no
    `previous` and a smaller one of its session is looked at, so a home linked once costs
    nothing more (a session Pi rewrote, not a growth, is looked at again on each open)."""
    by_id: dict[str, list[Version]] = {}
    for v in versions:
        by_id.setdefault(v.session_id, []).append(v)
    hashes: dict[str, list[bytes]] = {}

    def lines_of(src: str) -> list[bytes]:
        if src not in hashes:
            hashes[src] = line_hashes(src)
        return hashes[src]

    links: dict[str, str] = {}
    for group in by_id.values():
        group.sort(key=lambda v: v.size)
        for i, v in enumerate(group):
            if v.previous is not None or i == 0:
                continue
            for older in reversed(group[:i]):
                before = lines_of(older.src) if older.size < v.size and older.lines <= v.lines else None
                if before is not None and lines_of(v.src)[:len(before)] == before:
                    links[v.src] = older.src
                    break
    return links


def later_growths(new: Version, versions: Iterable[Version],
                  line_hashes: Callable[[str], list[bytes]]) -> list[str]:
    """The versions held before `new` that `new` comes between: of its session, larger, grown
    from what `new` grew from (or from no version held), and whose first lines are all of
    `new`'s (hashes: turn records only).  Versions fetched out of order (v1, v3, then v2; or
    the newest first) are linked as they arrive: v3 grew from v2, whatever was held when v3
    came.  Nothing to read in the usual case, a version newer than every one held."""
    later = [v for v in versions if v.session_id == new.session_id and v.previous == new.previous
             and v.src != new.src and v.size > new.size and v.lines >= new.lines]
    if not later or new.last_line_start != new.size:  # an incomplete last line is no line prefix
        return []
    mine = line_hashes(new.src)
    return [v.src for v in later if line_hashes(v.src)[:len(mine)] == mine]
