"""Branch sidecars: the tiny JSON object whose BLAKE3 hash is a branch's network identity.

We always write the canonical form (compact JSON, keys type/version/src/parent in that
order, no trailing newline), so every implementation derives the same branch hash from the
same (src, parent).  A sidecar received from a peer is accepted by its hash whatever its
bytes are, but it is validated before anything uses its fields.  Sans-IO.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import blake3

from p2pnode.errors import InvalidInput, VerificationFailed

MAX_SIDECAR_BYTES = 4096
"""Canonical sidecars are 116 (root) or 178 bytes; anything far larger is not a sidecar."""

SIDECAR_VERSION = 1
"""The sidecar version this p2pnode reads and writes."""
_HEX64 = re.compile(r"[0-9a-f]{64}")


class InvalidSidecar(InvalidInput):
    """Sidecar bytes that are not a valid version-1 branch sidecar."""


def is_hash_hex(value: object) -> bool:
    """True for a hash in our text form: exactly 64 lowercase hex characters."""
    return isinstance(value, str) and _HEX64.fullmatch(value) is not None


def blake3_hex(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


@dataclass(frozen=True, slots=True)
class Sidecar:
    src: str
    """BLAKE3 of the session file's bytes as Pi wrote them, 64 lowercase hex: the one version
    of the session this branch names.  Everywhere in p2pnode, `src` (and `src_hex`) means
    exactly this: a session version's content hash; never a path, a branch hash or a line's."""
    parent: str | None
    """Branch hash of the parent branch, or None for a root."""

    def __post_init__(self) -> None:
        if not is_hash_hex(self.src):
            raise InvalidSidecar(f"sidecar src {self.src!r} is not 64 lowercase hex characters")
        if self.parent is not None and not is_hash_hex(self.parent):
            raise InvalidSidecar(f"sidecar parent {self.parent!r} is not 64 lowercase hex characters or null")

    def encode(self) -> bytes:
        """The canonical bytes (see docs/FORMAT.md, "Sessions and branch sidecars")."""
        parent = "null" if self.parent is None else f'"{self.parent}"'
        return (f'{{"type":"branch","version":{SIDECAR_VERSION},"src":"{self.src}",'
                f'"parent":{parent}}}').encode()

    @property
    def branch(self) -> str:
        """The branch hash: BLAKE3 of the canonical bytes."""
        return blake3_hex(self.encode())


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        raise InvalidSidecar(f"duplicate keys: {sorted(keys)}")
    return dict(pairs)


def parse_sidecar(data: bytes, expected_branch: str | None = None) -> Sidecar:
    """Validate received sidecar bytes (and, if given, that they hash to `expected_branch`).

    Unknown extra keys are ignored: the bytes are identified by their hash, not re-encoded.
    """
    where = f"sidecar of branch {expected_branch}" if expected_branch else "sidecar"
    if len(data) > MAX_SIDECAR_BYTES:
        raise InvalidSidecar(f"{where} is {len(data)} bytes, over the limit of {MAX_SIDECAR_BYTES}")
    if expected_branch is not None:
        actual = blake3_hex(data)
        if actual != expected_branch:
            raise VerificationFailed(f"{where}: bytes hash to {actual}")
    try:
        obj = json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidSidecar(f"{where} is not UTF-8 JSON: {exc}") from None
    except RecursionError:  # 4096 bytes of '[' nest deeper than the parser recurses
        raise InvalidSidecar(f"{where} is JSON nested too deeply to be a sidecar") from None
    except InvalidSidecar as exc:  # _no_duplicate_keys's
        raise InvalidSidecar(f"{where} has {exc}") from None
    if not isinstance(obj, dict):
        raise InvalidSidecar(f"{where} is not a JSON object")
    if obj.get("type") != "branch":
        raise InvalidSidecar(f"{where} has type {obj.get('type')!r}, expected 'branch'")
    version = obj.get("version")
    if type(version) is not int or version != SIDECAR_VERSION:
        newer = type(version) is int and version > SIDECAR_VERSION
        raise InvalidSidecar(f"{where} has version {version!r}; this p2pnode reads version {SIDECAR_VERSION} "
                             f"only{' (made by a newer p2pnode? update this one)' if newer else ''}")
    if "src" not in obj or "parent" not in obj:
        raise InvalidSidecar(f"{where} lacks the src or parent field")
    try:
        return Sidecar(src=obj["src"], parent=obj["parent"])
    except InvalidSidecar as exc:
        raise InvalidSidecar(f"{where}: {exc}") from None
