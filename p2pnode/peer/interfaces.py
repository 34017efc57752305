"""What the peer side needs from the node's library, as Protocols: the fetch (get.py) and the
provider depend on these, not on `Library` itself, so that the peer code says which few calls
it makes and a test may hand it anything that answers them."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

from p2pnode.library.api import BranchInfo, Catalog
from p2pnode.paths import NodePaths
from p2pnode.pi.hashing import Prefix
from p2pnode.pi.lines import LineRef
from p2pnode.pi.session import SessionHeader
from store import StoredBlob


class FetchTarget(Protocol):
    """The library a fetch looks things up in and commits verified branches to."""

    @property
    def paths(self) -> NodePaths: ...

    def has_branch(self, branch_hex: str) -> bool: ...

    def has_line(self, line_hash: bytes) -> bool: ...

    def line(self, line_hash: bytes) -> bytes: ...

    def branch(self, branch_hex: str) -> BranchInfo: ...

    def session_bytes(self, src_hex: str) -> bytes: ...

    def add_fetched(self, sidecar: bytes, lines: Sequence[bytes],
                    stored: Iterable[StoredBlob] = ()) -> BranchInfo: ...

    def record_path(self, branch_hex: str, path: Path | str) -> None: ...

    def stage_lines(self, blobs: Sequence[StoredBlob]) -> None: ...

    def add_staged(self, sidecar: bytes, refs: Sequence[LineRef], prefix: Prefix,
                   header: SessionHeader, titles: tuple[str | None, str | None]) -> BranchInfo: ...


class ServedLibrary(Protocol):
    """The library the provider serves from: only what `offered_object` allows is asked for."""

    def offered_object(self, hash_hex: str) -> str | None: ...

    def catalog(self) -> Catalog: ...

    def sidecar_bytes(self, branch_hex: str) -> bytes: ...

    def session_bytes(self, src_hex: str) -> bytes: ...

    def line_manifest(self, src_hex: str) -> list[LineRef]: ...

    def line(self, line_hash: bytes) -> bytes: ...

    def stored_line(self, line_hash: bytes) -> StoredBlob: ...
