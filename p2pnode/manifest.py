"""`manifest.json`: branch hash -> local session path, the seed's convenience index.

The file is a flat JSON object, as in the seed design.  Two `p2pnode` processes may update
it at once, so every read-modify-write holds an flock on `manifest.json.lock` and the new
file replaces the old one atomically.  It is not distributed and not content-addressed.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from p2pnode.errors import InvalidInput
from p2pnode.sidecar import is_hash_hex
from sysio.files import atomic_write
from sysio.locks import locked


class ManifestCorrupt(InvalidInput):
    """manifest.json exists but is not a JSON object of hash -> path; we never overwrite it."""


class Manifest:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = path.with_name(path.name + ".lock")

    def load(self) -> dict[str, str]:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise ManifestCorrupt(f"{self.path} is not valid JSON ({exc}); move it aside") from None
        if not isinstance(data, dict) or not all(
            is_hash_hex(k) and isinstance(v, str) for k, v in data.items()
        ):
            raise ManifestCorrupt(f"{self.path} is not an object of branch hash -> path; move it aside")
        return data

    def get(self, branch: str) -> str | None:
        return self.load().get(branch)

    def record(self, branch: str, path: Path | str) -> None:
        self._update(lambda m: m.__setitem__(branch, str(path)))

    def remove(self, branch: str) -> None:
        self._update(lambda m: m.pop(branch, None))

    def _update(self, change: Callable[[dict[str, str]], object]) -> None:
        with locked(self._lock):
            current = self.load()
            before = dict(current)
            change(current)
            if current != before or not self.path.exists():
                text = json.dumps(current, indent=1, sort_keys=True) + "\n"
                atomic_write(self.path, text.encode())
