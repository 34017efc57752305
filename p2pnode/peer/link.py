"""One peer for the duration of a fetch: its HTTPS session (mutual TLS, pinned), requests that
never follow redirects, bounded response bodies, the small GETs of the peer protocol, and the
peer's standing (bytes received, lines served, why it was dropped).  Which peer to ask next is the
downloader's business."""
from __future__ import annotations

from collections.abc import Callable

from p2pnode.errors import P2PNodeError, PeerUnavailable, Refused
from p2pnode.peer import https, wire
from p2pnode.peer.address import PeerAddress
from p2pnode.peer.identity import Identity
from p2pnode.peer.nodeid import parse_node_id
from p2pnode.peer.tls import client_context
from p2pnode.peer.trust import TrustStore
from p2pnode.pi.lines import LineRef
from p2pnode.pi.sidecar import InvalidSidecar, Sidecar, parse_sidecar


class NotOffered(Exception):
    """The peer answered 404: it does not offer this object (or does not exist, same answer)."""


class CopyDamaged(Exception):
    """The peer answered 503: it offers this object, but its own store's copy failed its checks."""


class PeerLink:
    """One peer for the duration of a fetch: its HTTPS session and its standing."""

    def __init__(self, addr: PeerAddress, identity: Identity, trust: TrustStore, limits: wire.Limits,
                 connections: Connections | None = None) -> None:
        self.addr = addr
        self.limits = limits
        self._owned = connections is None
        self.session = (_session(addr, identity, trust, limits, self._accepted) if connections is None
                        else connections.session(self, identity, trust))
        self.dropped: str | None = None
        """Why this peer was given up for this fetch (None: still in use)."""
        self.failure: type[P2PNodeError] = PeerUnavailable
        """What giving it up means: VerificationFailed (it lied), Refused (TLS/trust), PeerUnavailable."""
        self.network_errors = 0
        self.closed_after_handshake = 0
        """Network errors that were the peer hanging up on a TLS session we had accepted."""
        self.accepted: bytes | None = None
        """The fingerprint of the last server this side accepted in a handshake (tls.client_context)."""
        self.proven = False
        """A handshake in this fetch accepted the server here (pinned to the node the address
        names, if it names one): PeerPool.holders prefers such an address of a node."""
        self.bytes_received = 0
        self.lines_served = 0
        self.bytes_served = 0
        """Lines (and their raw bytes) this peer was the first to deliver verified in this fetch."""

    def __str__(self) -> str:
        """Its address: the holder a fetch run again finds it the same as (pace.Measures)."""
        return str(self.addr)

    def _accepted(self, fingerprint: bytes) -> None:
        self.accepted = fingerprint
        self.proven = True

    async def close(self) -> None:
        if self._owned:  # else its Connections' owner closes the session
            await self.session.close()

    def request(self, method: str, path: str, data: bytes = b"",
                headers: dict[str, str] | None = None) -> https.Exchange:
        """Every request to a peer: redirects are never followed (a 3xx could lead past the
        TLS pin, to plain http or to another host); `_check` refuses them."""
        return self.session.request(method, path, data, headers)

    def _check(self, resp: https.Response, what: str) -> None:
        if 300 <= resp.status < 400:
            raise wire.WireError(f"peer {self.addr} answered {resp.status} (a redirect) for {what}; "
                                 "peers must not redirect")
        if resp.status == 404:
            raise NotOffered(what)
        if resp.status == 503:
            raise CopyDamaged(what)
        if resp.status == 403:
            raise Refused(f"peer {self.addr} refused the request for {what} (403)")
        if resp.status not in (200, 206):
            raise https.ResponseError(f"peer {self.addr} answered {resp.status} for {what}", resp.status)

    async def get_small(self, path: str, limit: int, what: str,
                        too_big: type[P2PNodeError] = wire.WireError) -> bytes:
        """A whole response body of at most `limit` bytes (larger is refused with `too_big`)."""
        async with self.request("GET", path) as resp:
            self._check(resp, what)
            if (resp.content_length or 0) > limit:
                raise too_big(f"{what}: peer announced {resp.content_length} bytes, limit {limit}")
            body = bytearray()
            async for chunk in resp.chunks():
                body += chunk
                self.bytes_received += len(chunk)
                if len(body) > limit:
                    raise too_big(f"{what}: peer sent more than the limit of {limit} bytes")
            return bytes(body)

    async def sidecar(self, branch: str) -> tuple[bytes, Sidecar]:
        raw = await self.get_small(wire.PATH_OBJECT.format(hash=branch), self.limits.max_sidecar,
                                   f"sidecar of branch {branch}", InvalidSidecar)
        return raw, parse_sidecar(raw, branch)

    async def line_manifest(self, src: str) -> list[LineRef]:
        limit = wire.LINE_MANIFEST_HEAD.size + self.limits.max_manifest_lines * wire.LINE_ENTRY.size
        body = await self.get_small(wire.PATH_LINES.format(src=src), limit, f"line manifest of {src}")
        return wire.decode_line_manifest(body, bytes.fromhex(src), self.limits)

    async def catalog(self) -> wire.CatalogMessage:
        body = await self.get_small(wire.PATH_CATALOG, self.limits.max_catalog_bytes, "catalog")
        return wire.decode_catalog(body, self.limits)


def _session(addr: PeerAddress, identity: Identity, trust: TrustStore, limits: wire.Limits,
             on_accepted: Callable[[bytes], None]) -> https.Session:
    """One peer's HTTPS session: mutual TLS pinned to `addr`'s node id (if it names one)."""
    expected = parse_node_id(addr.node_id) if addr.node_id else None
    return https.Session(addr.host, addr.port, client_context(identity, trust, expected, on_accepted),
                         https.Timeouts(connect=limits.connect_timeout, read=limits.slow_reader_timeout))


class Connections:
    """The peers' HTTPS sessions of one command, kept across its steps: the catalog read (a
    hash prefix, the newest version) and the fetch that follows share one TLS connection per
    peer address, so a one-shot fetch makes one handshake per peer, not two.  Each step still
    has its own PeerLinks (standing is per fetch); the link made last for an address hears of
    that session's handshakes.  Its owner closes it, after the last step."""

    def __init__(self) -> None:
        self._sessions: dict[tuple[PeerAddress, wire.Limits], https.Session] = {}
        self._links: dict[PeerAddress, PeerLink] = {}

    def session(self, link: PeerLink, identity: Identity, trust: TrustStore) -> https.Session:
        addr = link.addr
        self._links[addr] = link
        key = (addr, link.limits)
        if (found := self._sessions.get(key)) is None or found.closed:
            found = self._sessions[key] = _session(addr, identity, trust, link.limits,
                                                   lambda fp: self._links[addr]._accepted(fp))
        return found

    async def close(self) -> None:
        for s in self._sessions.values():
            await s.close()
        self._sessions.clear()
        self._links.clear()
