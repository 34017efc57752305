"""p2pnode: share Pi coding-agent sessions with their fork lineage, by one hash, over the LAN.

The public library API, re-exported: the session library and its records, and the errors
(each with its CLI exit code).  Loaded on first use, so that `import p2pnode.<module>` (the
CLI finding no running node, a test of one module) does not open the store's dependencies."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Library": "p2pnode.library.api", "BranchInfo": "p2pnode.library.api",
    "ShareResult": "p2pnode.library.api", "Catalog": "p2pnode.library.api",
    "P2PNodeError": "p2pnode.errors", "NotFound": "p2pnode.errors", "InvalidInput": "p2pnode.errors",
    "VerificationFailed": "p2pnode.errors", "PeerUnavailable": "p2pnode.errors",
    "Conflict": "p2pnode.errors", "Refused": "p2pnode.errors",
}
__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:  # the names as the type checker sees them (`X as X`: re-exported)
    from p2pnode.errors import Conflict as Conflict
    from p2pnode.errors import InvalidInput as InvalidInput
    from p2pnode.errors import NotFound as NotFound
    from p2pnode.errors import P2PNodeError as P2PNodeError
    from p2pnode.errors import PeerUnavailable as PeerUnavailable
    from p2pnode.errors import Refused as Refused
    from p2pnode.errors import VerificationFailed as VerificationFailed
    from p2pnode.library.api import BranchInfo as BranchInfo
    from p2pnode.library.api import Catalog as Catalog
    from p2pnode.library.api import Library as Library
    from p2pnode.library.api import ShareResult as ShareResult


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'p2pnode' has no attribute {name!r}")
