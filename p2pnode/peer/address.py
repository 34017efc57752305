"""Where a peer is: `[NODEID@]HOST:PORT`, parsed and printed (no I/O)."""
from __future__ import annotations

import re
from dataclasses import dataclass

from p2pnode.errors import InvalidInput
from p2pnode.peer.nodeid import format_node_id, parse_node_id


@dataclass(frozen=True)
class PeerAddress:
    node_id: str | None
    """The node expected at this address; None accepts any trusted node (`--from HOST:PORT`)."""
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> PeerAddress:
        """`HOST:PORT`, `[V6]:PORT` or `NODEID@HOST:PORT`."""
        node_id, _, hostport = text.rpartition("@")
        m = re.fullmatch(r"\[([0-9a-fA-F:.]+)\]:(\d+)|([^:\[\]@]+):(\d+)", hostport)
        if not m or not 0 < int(m.group(2) or m.group(4)) <= 65535:
            raise InvalidInput(f"peer address {text!r} is not HOST:PORT or NODEID@HOST:PORT")
        host = m.group(1) or m.group(3)
        port = int(m.group(2) or m.group(4))
        return cls(format_node_id(parse_node_id(node_id)) if node_id else None, host, port)

    def __str__(self) -> str:
        """The form `parse` reads back: `[NODEID@]HOST:PORT`."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.node_id + '@' if self.node_id else ''}{host}:{self.port}"
