"""`p2pnode fetch` through the running node: the node's transfer shown live as it streams its
progress, cancelled by Ctrl-C, or left running with `--background` (`status` shows it).  The
one-shot fetch (no node) is node/routing.fetch_here, shown by the same TransferBar."""
from __future__ import annotations

import contextlib
import sys
from typing import Any

from p2pnode.errors import P2PNodeError, PeerUnavailable
from p2pnode.node.control_client import call_node, call_node_streamed
from p2pnode.paths import NodePaths


def fetch_via_node(paths: NodePaths, payload: dict[str, Any]) -> dict[str, Any] | None:
    """The node's FetchResult, its progress drawn meanwhile; None when no node runs.  Ctrl-C
    closes the control connection, which cancels the node's transfer; it is also cancelled by
    id, in case the node has not noticed yet."""
    from p2pnode.cli.progress import TransferBar

    started: dict[str, Any] = {}

    def on_event(event: dict[str, Any]) -> None:
        if event.get("event") == "started":
            started.update(event)
        view.event(event)

    with TransferBar(payload.get("peers")) as view:
        try:
            return call_node_streamed(paths, "fetch", payload, on_event)
        except KeyboardInterrupt:
            if started:
                with contextlib.suppress(P2PNodeError, OSError):
                    call_node(paths, "cancel", {"id": started["id"]}, timeout=5.0)
                print(f"p2pnode: the node's transfer {started['id']} was cancelled", file=sys.stderr)
            raise


def fetch_in_background(paths: NodePaths, payload: dict[str, Any]) -> dict[str, Any]:
    """Start the fetch on the running node and return at once: {"id", "branch", "background"}."""
    started = call_node(paths, "fetch", dict(payload, background=True))
    if started is None:
        raise PeerUnavailable("fetch --background needs a running node (`p2pnode serve`); "
                              "without --background the fetch runs here")
    return started
