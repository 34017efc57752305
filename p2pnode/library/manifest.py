"""The node's small JSON indexes of local files: `manifest.json` (branch hash -> local session
path, the seed's convenience index) and `placed.json` (what fetches placed under Pi's
sessions dir: path -> size and BLAKE3).

Each is a flat JSON object.  Two `p2pnode` processes may update one at once, so every
read-modify-write holds an flock on `<name>.lock` and the new file replaces the old one
atomically.  They are not distributed and not content-addressed.  A file that is not what
it should be is reported and never overwritten.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from p2pnode.errors import InvalidInput
from p2pnode.pi.sidecar import is_hash_hex
from sysio.files import atomic_write
from sysio.locks import locked

V = TypeVar("V")


class ManifestCorrupt(InvalidInput):
    """An index file exists but is not the JSON object it should be; we never overwrite it."""


class _JsonIndex(Generic[V]):
    """A flat JSON object of str -> V in one file, updated under a lock, replaced atomically."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = path.with_name(path.name + ".lock")

    def _valid(self, key: str, value: Any) -> bool:
        raise NotImplementedError

    def load(self) -> dict[str, V]:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise ManifestCorrupt(f"{self.path} is not JSON ({type(exc).__name__}); move it aside "
                                  "(`p2pnode fsck --repair` does)") from None
        if not isinstance(data, dict) or not all(self._valid(k, v) for k, v in data.items()):
            raise ManifestCorrupt(f"{self.path} does not hold what it should; move it aside "
                                  "(`p2pnode fsck --repair` does)")
        return data

    def _update(self, change: Callable[[dict[str, V]], object]) -> None:
        with locked(self._lock):
            current = self.load()
            before = dict(current)
            change(current)
            if current != before or not self.path.exists():
                text = json.dumps(current, indent=1, sort_keys=True) + "\n"
                atomic_write(self.path, text.encode())


class Manifest(_JsonIndex[str]):
    """branch hash -> the local session file of that branch."""

    def _valid(self, key: str, value: Any) -> bool:
        return is_hash_hex(key) and isinstance(value, str)

    def get(self, branch: str) -> str | None:
        return self.load().get(branch)

    def record(self, branch: str, path: Path | str) -> None:
        self._update(lambda m: m.__setitem__(branch, str(path)))

    def remove(self, branch: str) -> None:
        self._update(lambda m: m.pop(branch, None))


@dataclass(frozen=True)
class PlacedFile:
    """A session file as a fetch placed it: only a file still exactly so may be updated."""

    size: int
    blake3: str


class PlacedFiles(_JsonIndex[dict[str, Any]]):
    """Absolute path -> {"size", "blake3"} of each session file a fetch wrote.  A file at a
    path not listed here, or no longer matching its entry, is the user's: never replaced."""

    def _valid(self, key: str, value: Any) -> bool:
        return (isinstance(value, dict) and isinstance(value.get("size"), int)
                and is_hash_hex(value.get("blake3")))

    def get(self, path: Path) -> PlacedFile | None:
        entry = self.load().get(str(path.absolute()))
        return PlacedFile(entry["size"], entry["blake3"]) if entry else None

    def record(self, path: Path, placed: PlacedFile, stamp: list[int] | None = None) -> None:
        """`stamp`: the file's (inode, size, mtime_ns) once written, so that a later fetch can
        tell it is unchanged without reading it (an incremental fetch appends to it)."""
        entry: dict[str, Any] = {"size": placed.size, "blake3": placed.blake3}
        if stamp is not None:
            entry["stamp"] = stamp
        self._update(lambda m: m.__setitem__(str(path.absolute()), entry))

    def stamp(self, path: Path) -> list[int] | None:
        entry = self.load().get(str(path.absolute()))
        stamp = entry.get("stamp") if entry else None
        return stamp if isinstance(stamp, list) else None

    def appending(self, path: Path, new: PlacedFile) -> None:
        """Note, before an incremental fetch appends to the placed file, the version it is
        writing: a kill -9 part-way leaves the old version plus a prefix of the new one's bytes,
        which the next fetch may then finish (`appended_to`), and no other change of the file."""
        key, note = str(path.absolute()), {"size": new.size, "blake3": new.blake3}

        def note_it(m: dict[str, Any]) -> None:
            if key in m:  # an entry `rm` dropped meanwhile stays dropped
                m[key] = {**m[key], "appending": note}

        self._update(note_it)

    def appended_to(self, path: Path) -> PlacedFile | None:
        """The version an append cut short was writing (`appending`), or None."""
        entry = self.load().get(str(path.absolute()))
        new = entry.get("appending") if entry else None
        if not (isinstance(new, dict) and isinstance(new.get("size"), int)
                and is_hash_hex(new.get("blake3"))):
            return None
        return PlacedFile(new["size"], new["blake3"])
