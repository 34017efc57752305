"""Pairing for the node: the waiting side of `p2pnode pair` (served by the running node's control
endpoints, or by the `pair` process itself when no node runs), the joining side (always the
`pair <code>` process: it only needs the identity and trust.json), and the untrusted nodes
that tried to connect (`peers --pending`).  Protocol: peer/pairing.py and peer/pairlink.py.

Control endpoints of a running node (registered through `NodePairing.routes()`):
    /v1/pair/start {}        -> {"code", "channel", "port", "addresses", "expires_in"} (the node's
                                name is the one `pair --name` saved)
    /v1/pair/wait {"code"}   -> {"id", "name"}: a long poll until paired, burned or expired; a
                                caller that goes away (Ctrl-C) cancels the code
    /v1/pending {}           -> {"pending": [{"id", "name", "first_seen", "last_seen", "attempts"}]}
    /v1/trust/reload {}      -> {}: trust.json re-read now (`trust`, `untrust`)
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from p2pnode.discovery.mdns import Discovery, listen_addresses
from p2pnode.errors import Conflict, InvalidInput, NotFound, PeerUnavailable, listen_failed
from p2pnode.paths import NodePaths
from p2pnode.peer.identity import Identity, load_or_create_identity, own_name, set_own_name
from p2pnode.peer.pairing import CODE_TTL, Code, Joiner, Party, Waiter
from p2pnode.peer.pairlink import PairingListener, join
from p2pnode.peer.trust import TrustStore

if TYPE_CHECKING:
    from p2pnode.node.daemon import Node

log = logging.getLogger(__name__)

FIND_SECONDS = 4.0
"""How long `pair <code>` looks for the waiter on the LAN (mDNS queries go out at 0, 1, 3 s)."""


class PairingHost:
    """At most one waiting code at a time: its listener, its mDNS announcement, its deadline."""

    def __init__(self, identity: Identity, trust: TrustStore, host: str, discovery: Discovery | None) -> None:
        self.identity, self.trust, self.host, self.discovery = identity, trust, host, discovery
        self._listener: PairingListener | None = None
        self._code: Code | None = None

    async def start(self, name: str | None, mdns: bool = True) -> dict[str, Any]:
        """Listen for the code's one exchange; announced on the LAN when `mdns` and this host
        browses it ("mdns" in the answer: else the other side needs --from and an address)."""
        if self._listener is not None and not self._listener.result.done():
            raise Conflict("a pairing code of this node is waiting already: finish or stop that "
                           "`p2pnode pair` first")
        await self.close()
        code = Code.generate()
        waiter = Waiter(code, Party(self.identity.node_id, name), time.monotonic())
        listener = PairingListener(waiter, self._paired)
        try:
            await listener.start(self.host)
        except OSError as exc:
            raise listen_failed(self.host, 0, exc) from exc
        self._listener, self._code = listener, code
        discovery = self.discovery if mdns else None
        if discovery is not None:
            await discovery.announce_pairing(code.channel, listener.port)
        log.info("pairing: waiting on channel %d, port %d, for %g s", code.channel, listener.port, CODE_TTL)
        addresses = await asyncio.to_thread(listen_addresses, self.host)
        return {"code": str(code), "channel": code.channel, "port": listener.port, "addresses": addresses,
                "expires_in": CODE_TTL, "mdns": discovery is not None}

    def _paired(self, peer: Party) -> None:
        self.trust.trust(peer.node_id, name=self.trust.free_name(peer.name, peer.node_id))
        log.info("pairing: paired with %s (%s); trusted", peer.node_id, peer.name)

    async def wait(self, code: str) -> Party:
        listener = self._listener
        if listener is None or self._code is None or str(self._code) != str(Code.parse(code)):
            raise NotFound("no pairing code of this node waits with that code")
        try:
            return await listener.wait()
        finally:  # paired, burned, expired or the caller went away: the code is over
            await self.close()

    async def close(self) -> None:
        if self.discovery is not None:
            await self.discovery.withdraw_pairing()
        if self._listener is not None:
            await self._listener.close()
        self._listener, self._code = None, None


class NodePairing:
    """The running node's pairing endpoints and its list of untrusted callers."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.host = PairingHost(node.identity, node.trust, node.config.host, node.discovery)

    def routes(self) -> dict[str, Callable[[dict[str, Any]], Awaitable[Any]]]:
        return {"pair/start": self._start, "pair/wait": self._wait, "pending": self._pending,
                "trust/reload": self._reload}

    async def close(self) -> None:
        await self.host.close()

    async def _start(self, body: dict[str, Any]) -> dict[str, Any]:
        """The node's own name is the one `pair --name` saved (the CLI saved it before asking);
        `pair --no-mdns` ({"mdns": false}) keeps the code off the LAN also when the node announces."""
        mdns = body.get("mdns", True)
        if not isinstance(mdns, bool):
            raise InvalidInput("control: 'mdns' must be true or false")
        name = own_name(self.node.paths.identity)
        if self.node.discovery is not None and self.node.discovery.name != name:
            self.node.discovery.name = name  # announced from now on
            await self.node.announce()
        self.host.discovery = self.node.discovery  # started after the control endpoints
        return await self.host.start(name, mdns)

    async def _wait(self, body: dict[str, Any]) -> dict[str, Any]:
        code = body.get("code")
        if not isinstance(code, str):
            raise InvalidInput("control: 'code' must be a string")
        return (await self.host.wait(code)).as_dict()

    async def _reload(self, body: dict[str, Any]) -> dict[str, Any]:
        """`trust` or `untrust` just changed trust.json from another process: applied now (an
        untrusted peer's connections reset before the command returns), not at the next poll."""
        await asyncio.to_thread(self.node.trust.reload_if_changed)
        return {}

    async def _pending(self, body: dict[str, Any]) -> dict[str, Any]:
        self.node.trust.reload_if_changed()  # a `trust` just now, from another process
        seen = self.node.discovery.peers if self.node.discovery else {}
        return {"pending": [dict(p.as_dict(), name=getattr(seen.get(p.node_id), "name", None))
                            for p in self.node.trust.pending.peers()
                            if not self.node.trust.is_trusted(p.fingerprint)]}


# --- `p2pnode pair` without a running node, and `p2pnode pair <code>` ------------------------------


def my_party(paths: NodePaths, name: str | None) -> tuple[Identity, Party]:
    """This node's identity and what it tells the other side; a given name is remembered."""
    identity = load_or_create_identity(paths.identity)
    if name is not None:
        set_own_name(paths.identity, name)
    return identity, Party(identity.node_id, own_name(paths.identity))


async def wait_here(paths: NodePaths, name: str | None, host: str, mdns: bool,
                    show: Callable[[dict[str, Any]], None]) -> Party:
    """The waiting side in this process: shows the code (`show`), returns the paired peer."""
    identity, me = my_party(paths, name)
    discovery = Discovery(None) if mdns else None
    if discovery is not None:
        await discovery.start()
    pairing = PairingHost(identity, TrustStore(paths.trust), host, discovery)
    try:
        info = await pairing.start(me.name)
        show(info)
        return await pairing.wait(info["code"])
    finally:
        await pairing.close()
        if discovery is not None:
            await discovery.close()


async def join_code(paths: NodePaths, code_text: str, addresses: list[tuple[str, int]],
                    name: str | None) -> Party:
    """The joining side: find the waiter (mDNS by channel, unless addresses are given), run the
    exchange, trust the peer under the name it sent."""
    code = Code.parse(code_text)  # a typo is refused before anything is sent
    identity, me = my_party(paths, name)
    if not addresses:
        addresses = await _find_waiter(code.channel)
    peer = await join(Joiner(code, me), addresses)
    store = TrustStore(paths.trust)
    store.trust(peer.node_id, name=store.free_name(peer.name, peer.node_id))
    return peer


async def _find_waiter(channel: int) -> list[tuple[str, int]]:
    discovery = Discovery(None)
    await discovery.start()
    try:
        found = await discovery.find_pairing(channel, FIND_SECONDS)
    finally:
        await discovery.close()
    if not found:
        raise PeerUnavailable(f"no node on this LAN waits with a pairing code on channel {channel} (is "
                              "`p2pnode pair` still running there? where mDNS cannot reach: "
                              "--from HOST:PORT)")
    if len(found) > 1:  # one attempt per code: never guess which one is meant
        raise Conflict(f"{len(found)} nodes wait on channel {channel}: run `p2pnode pair` again there for "
                       "a new code, or use --from HOST:PORT")
    return [(address, found[0].port) for address in found[0].addresses]
