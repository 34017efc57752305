"""Mutual-TLS contexts for peer traffic: TLS 1.3, both sides present a certificate, and
both sides pin the other's key against the live allowlist during the handshake.

The only trust anchor is the open CA (identity.py), which every node certificate chains to;
the real check is the pin, run in `do_handshake` through `SSLContext.sslobject_class`
(asyncio creates its TLS objects with `wrap_bio`, so this covers the client, https.py, and
the server, aiohttp).
The pin reads `TrustStore`'s live set, so an untrusted peer is refused from the next
handshake on.  A client also pins the node id it *expected* to reach: a trusted node
answering at the wrong address is refused too, so nobody can stand in for the peer.
"""
from __future__ import annotations

import ssl
from collections.abc import Callable

from p2pnode.peer.identity import Identity, open_ca_pem
from p2pnode.peer.nodeid import format_node_id
from p2pnode.peer.spki import spki_sha256
from p2pnode.peer.trust import TrustStore

PinCheck = Callable[[bytes | None], str | None]
"""fingerprint (None: no certificate) → None if accepted, else the reason for refusing."""


def peer_fingerprint(ssl_object: ssl.SSLObject | ssl.SSLSocket | None) -> bytes | None:
    """The SPKI SHA-256 of the certificate the other side presented, if any."""
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    return spki_sha256(der) if der else None


def _pinned_class(check: PinCheck) -> type[ssl.SSLObject]:
    class PinnedSSLObject(ssl.SSLObject):
        def do_handshake(self) -> None:
            super().do_handshake()  # raises SSLWantReadError until the handshake is done
            try:
                problem = check(peer_fingerprint(self))
            except ValueError as exc:  # a certificate OpenSSL took whose key spki.py cannot find
                problem = f"unreadable certificate: {exc}"
            if problem is not None:
                raise ssl.SSLCertVerificationError(problem)

    return PinnedSSLObject


def _context(purpose: int, identity: Identity, check: PinCheck) -> ssl.SSLContext:
    ctx = ssl.SSLContext(purpose)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False  # the identity is the key, not a DNS name
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cadata=open_ca_pem().decode())
    ctx.load_cert_chain(identity.cert_path, identity.key_path)
    ctx.sslobject_class = _pinned_class(check)
    return ctx


def server_context(identity: Identity, trust: TrustStore) -> ssl.SSLContext:
    """Accepts only clients whose key is in the allowlist at handshake time."""

    def check(fp: bytes | None) -> str | None:
        if fp is None:
            return "the client presented no certificate"
        if trust.is_trusted(fp):
            return None
        trust.pending.note(fp)  # `p2pnode peers --pending`: it holds this key (TLS 1.3 proved it)
        return f"client {format_node_id(fp)} is not trusted"

    return _context(ssl.PROTOCOL_TLS_SERVER, identity, check)


def client_context(identity: Identity, trust: TrustStore, expected: bytes | None,
                   on_accepted: Callable[[bytes], None] | None = None) -> ssl.SSLContext:
    """Accepts only a trusted server, and only the expected one when `expected` is given.
    `on_accepted(fingerprint)` hears of each server this side accepted: if that server then
    closes the connection unanswered, it is the server that refused us (one-sided trust)."""

    def check(fp: bytes | None) -> str | None:
        if fp is None:
            return "the server presented no certificate"
        if expected is not None and fp != expected:
            return f"server is {format_node_id(fp)}, expected {format_node_id(expected)}"
        if not trust.is_trusted(fp):
            node_id = format_node_id(fp)
            return f"server {node_id} is not trusted here (to allow it: p2pnode trust {node_id})"
        if on_accepted is not None:
            on_accepted(fp)
        return None

    return _context(ssl.PROTOCOL_TLS_CLIENT, identity, check)
