"""The client side of the control channel to a running node: JSON over HTTP on a Unix socket.

`p2pnode serve` listens on `<home>/control.sock` (mode 0600: only its owner may drive it;
paths.socket_path says where when the home is too long for a Unix socket);
the CLI asks it to do what needs the store, which the running node holds locked.  This module
uses the standard library only, and loads its HTTP client only to talk to a node, so that a
command that finds no node pays nothing for it.
Endpoints and their bodies are listed in node/daemon.py (and node/transfers.py, whose
`fetch` may answer as a stream of NDJSON events: call_node_streamed).
"""
from __future__ import annotations

import base64
import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from p2pnode.errors import Conflict, P2PNodeError, PeerUnavailable
from p2pnode.paths import NodePaths
from sysio.sockets import listener_at

if TYPE_CHECKING:
    import http.client

    from p2pnode.library.api import BranchInfo

CONTROL_TIMEOUT = 30.0
FETCH_TIMEOUT = 3600.0
CONTROL_MAX_EVENT = 1 << 20
"""Longest event line a streamed answer may send (a result is a few KiB)."""
READ_CALLS = frozenset({"branches", "branch", "lineage", "children", "sidecar_bytes",
                        "sessions_latest", "versions"})
"""Library methods `/v1/read` may call: read-only ones, for `ls`, `show` and `cat`."""


class NodeError(P2PNodeError):
    """An error the running node reported; carries the node's exit code."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def socket_answers(path: Path) -> bool:
    """A yes or no for the CLI: a socket that cannot be probed counts as no node."""
    try:
        return listener_at(path)
    except OSError:
        return False


def node_running(paths: NodePaths) -> bool:
    return socket_answers(paths.control_socket)


T = TypeVar("T")


def _exchange(paths: NodePaths, op: str, payload: dict[str, Any], timeout: float, doing: str,
              read: Callable[[http.client.HTTPResponse], T]) -> T | None:
    """POST op to the running node and `read` its answer (status 200); None when no node runs.
    An error the node reports is a NodeError; a node that fails to answer (`doing`: what it
    did not do) is PeerUnavailable."""
    path = paths.control_socket
    if not path.exists():
        return None
    import http.client  # here: a command that finds no node never loads it (with email's parser)

    conn = http.client.HTTPConnection("localhost", timeout=timeout)
    try:
        conn.sock = _connected(path, timeout)
        conn.request("POST", f"/v1/{op}", body=json.dumps(payload),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            data = json.loads(resp.read() or b"{}")
            raise NodeError(str(data.get("message", data)), int(data.get("exit_code", 1)))
        return read(resp)
    except (FileNotFoundError, ConnectionRefusedError):
        return None  # a socket file left by a killed node: nobody is listening
    except _OutputFailed as exc:
        raise exc.error from None
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise PeerUnavailable(f"the running node at {path} did not {doing} {op}: {exc}") from exc
    finally:
        conn.close()


class _OutputFailed(Exception):
    """The caller's own output failed while it took the node's events (its stdout closed:
    `cat | head`): passed on as it is, not as the node's failure."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


def _connected(path: Path, timeout: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
    except OSError:
        sock.close()
        raise
    return sock


def call_node(paths: NodePaths, op: str, payload: dict[str, Any] | None = None,
              timeout: float = CONTROL_TIMEOUT) -> dict[str, Any] | None:
    """Ask the running node to do op; None when no node runs for these paths."""
    return _exchange(paths, op, payload or {}, timeout, "answer",
                     lambda resp: dict(json.loads(resp.read() or b"{}")))


def call_node_streamed(paths: NodePaths, op: str, payload: dict[str, Any],
                       on_event: Callable[[dict[str, Any]], None],
                       timeout: float = FETCH_TIMEOUT) -> dict[str, Any] | None:
    """Ask the running node to do op, answered as NDJSON events (node/transfers.py): each
    event goes to on_event, and the last one, a result or an error, ends the call.  None when no
    node runs.  The connection closes on any way out (Ctrl-C included): the node then stops
    what it was doing for this command."""

    def events(resp: http.client.HTTPResponse) -> dict[str, Any]:
        while line := resp.readline(CONTROL_MAX_EVENT):
            event = json.loads(line)
            if event.get("event") == "result":
                return dict(event["result"])
            if event.get("event") == "error":
                raise NodeError(str(event.get("message")), int(event.get("exit_code", 1)))
            try:
                on_event(event)
            except OSError as exc:
                raise _OutputFailed(exc) from exc
        raise PeerUnavailable(f"the running node at {paths.control_socket} stopped before {op} ended")

    return _exchange(paths, op, dict(payload, stream=True), timeout, "finish", events)


def store_in_use(paths: NodePaths, doing: str) -> Conflict:
    """The error for a node home whose store another process holds: it names the home and,
    when that process is a running node, the node and its port."""
    try:
        status = call_node(paths, "status", timeout=5.0)
    except P2PNodeError:
        status = None
    if status:
        return Conflict(f"could not {doing}: {paths.home} is in use by the running node {status['node_id']} "
                        f"(peer port {status['port']}); stop that node first, or use another --home")
    return Conflict(f"could not {doing}: {paths.home} is in use by another p2pnode process (a node, "
                    f"`serve-peers`, or a share or fetch still running); wait for it or stop it")


class NodeLibrary:
    """The running node's library, read-only: what `ls`, `show` and `cat` need while the node
    holds the store (the same methods and return types as Library's)."""

    def __init__(self, paths: NodePaths):
        self.paths = paths

    def __enter__(self) -> NodeLibrary:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def _call(self, call: str, *args: Any) -> Any:
        reply = call_node(self.paths, "read", {"call": call, "args": list(args)})
        if reply is None:
            raise PeerUnavailable(f"the node for {self.paths.home} stopped while answering {call}")
        return base64.b64decode(reply["b64"]) if "b64" in reply else reply["value"]

    def _infos(self, call: str, *args: Any) -> list[BranchInfo]:
        from p2pnode.library.api import BranchInfo

        return [BranchInfo(**d) for d in self._call(call, *args)]

    def branches(self, include_unshared: bool = False) -> list[BranchInfo]:
        return self._infos("branches", include_unshared)

    def branch(self, branch_hex: str) -> BranchInfo:
        from p2pnode.library.api import BranchInfo

        return BranchInfo(**self._call("branch", branch_hex))

    def sessions_latest(self, include_unshared: bool = False) -> list[BranchInfo]:
        return self._infos("sessions_latest", include_unshared)

    def versions(self, branch_hex: str) -> list[BranchInfo]:
        return self._infos("versions", branch_hex)

    def lineage(self, branch_hex: str) -> list[BranchInfo]:
        return self._infos("lineage", branch_hex)

    def children(self, branch_hex: str) -> list[BranchInfo]:
        return self._infos("children", branch_hex)

    def sidecar_bytes(self, branch_hex: str) -> bytes:
        return bytes(self._call("sidecar_bytes", branch_hex))

    def write_session(self, src_hex: str, write: Callable[[bytes], object]) -> int:
        """Library.write_session through the node: its runs as they come (/v1/cat)."""
        def data(event: dict[str, Any]) -> None:
            if event.get("event") == "data":
                write(base64.b64decode(event["b64"], validate=True))

        result = call_node_streamed(self.paths, "cat", {"src": src_hex}, data, CONTROL_TIMEOUT)
        if result is None:
            raise PeerUnavailable(f"the node for {self.paths.home} stopped before cat began")
        return int(result["size"])
