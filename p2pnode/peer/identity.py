"""The node's identity: an Ed25519 key, its X.509 certificate, and the node id.

The node id is the SHA-256 of the key's SubjectPublicKeyInfo, shown as grouped base32 with
Luhn check characters exactly like a Syncthing device id (56 characters in 8 groups of 7).
Because the id names the key, not the certificate, a certificate can be re-issued without
changing the id.

Why the certificate is issued by the "open CA" rather than self-signed: Python's `ssl` has
no verify callback, so a TLS server can only accept client certificates that chain to an
anchor it already holds.  A peer trusted by id alone (`p2pnode trust <id>`) would then be
unable to connect until its certificate was copied over by hand.  Every node therefore has
its leaf certificate signed by one well-known CA whose private key is *public* (derived
from a constant in certificates.py).  That CA vouches for nothing: anyone can issue with
it.  It only lets the handshake reach our own check, which pins the leaf key's SPKI hash
against the allowlist (see tls.py); the TLS 1.3 CertificateVerify message proves the peer
holds that key.

Keys and certificates are made by certificates.py (the X.509 stack, imported only then);
this module reads them without it.
"""
from __future__ import annotations

import contextlib
import getpass
import hashlib
import logging
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from p2pnode.errors import PERMISSION_ERRNOS, InvalidInput, P2PNodeError
from p2pnode.peer.nodeid import format_node_id
from p2pnode.peer.spki import ED25519_SPKI_PREFIX, certificate_spki
from sysio.files import atomic_write

KEY_FILE = "node.key"
CERT_FILE = "node.crt"
CA_FILE = "open-ca.crt"
NAME_FILE = "name"
"""The name this node gives itself (`pair --name`): sent when pairing, announced over mDNS."""

logger = logging.getLogger(__name__)


class IdentityError(P2PNodeError):
    """The identity files are unreadable or inconsistent."""


def _unreadable(what: str, path: Path, exc: OSError | ValueError, remedy: str | None = None) -> IdentityError:
    """Why an identity file could not be read; one this user may not read is exit 4 (README:
    a file this user may not read or write), with what to do, as for any such file; else
    `remedy`, if there is one."""
    if isinstance(exc, OSError) and exc.errno in PERMISSION_ERRNOS:
        error = IdentityError(f"cannot read {what} {path}: {(exc.strerror or str(exc)).lower()} (it must be "
                              "this user's own file, readable by it: fix its owner or mode)")
        error.exit_code = InvalidInput.exit_code
        return error
    return IdentityError(f"cannot read {what} {path}: {exc}" + (f"; {remedy}" if remedy else ""))


OPEN_CA_PEM = b"""-----BEGIN CERTIFICATE-----
MIIBQzCB9qADAgECAgEBMAUGAytlcDAnMSUwIwYDVQQDDBxwMnBub2RlIG9wZW4g
Q0EgKHB1YmxpYyBrZXkpMCAXDTIwMDEwMTAwMDAwMFoYDzIxMjAwMTAxMDAwMDAw
WjAnMSUwIwYDVQQDDBxwMnBub2RlIG9wZW4gQ0EgKHB1YmxpYyBrZXkpMCowBQYD
K2VwAyEAWEQX8ZONJSnA3Neyern0xwM0rf6damwH+MzUawdrb/ijRTBDMBIGA1Ud
EwEB/wQIMAYBAf8CAQAwDgYDVR0PAQH/BAQDAgEGMB0GA1UdDgQWBBSBvn2pRHoG
QVcK9Rt1COxb/iFR4jAFBgMrZXADQQDVofgPkKHBWcdoBQCsI/9U/NdgsAy4pdNK
1RFhJPA1n62Zet2EE5Tofdns2o5QMKrhSEE03AN6riN8yr+IhoIM
-----END CERTIFICATE-----
"""
"""certificates.open_ca()'s certificate, as it always comes out (Ed25519 signs
deterministically): every TLS context loads it, and deriving it costs a signature and the
X.509 stack's import.  tests/peer/test_identity.py checks it against the derivation."""


def open_ca_pem() -> bytes:
    return OPEN_CA_PEM


# --- the identity on disk -----------------------------------------------------------------


@dataclass(frozen=True)
class Identity:
    """Where the node's key and certificate are, and the id they give."""

    directory: Path
    fingerprint: bytes

    @property
    def node_id(self) -> str:
        return format_node_id(self.fingerprint)

    @property
    def key_path(self) -> Path:
        return self.directory / KEY_FILE

    @property
    def cert_path(self) -> Path:
        return self.directory / CERT_FILE

    @property
    def ca_path(self) -> Path:
        """The open CA certificate, written beside the identity for curl's `--cacert`."""
        return self.directory / CA_FILE


def load_identity(directory: Path) -> Identity:
    """The existing identity; IdentityError if it is missing, if its key is not Ed25519, if the
    certificate is not for the key or if a peer would refuse it.  Read without an X.509
    library: the id from the certificate's key (spki.py), the rest by OpenSSL loading the pair
    and checking the certificate in a handshake with itself, as a peer checks it."""
    cert_path, key_path = directory / CERT_FILE, directory / KEY_FILE
    remedy = f"`p2pnode id` re-issues it from {KEY_FILE} (the node id stays the same)"
    try:
        spki = certificate_spki(ssl.PEM_cert_to_DER_cert(cert_path.read_text(encoding="ascii")))
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise _unreadable("the node certificate", cert_path, exc, remedy) from exc
    if not spki.startswith(ED25519_SPKI_PREFIX):
        raise IdentityError(f"the node certificate {cert_path} is not for an Ed25519 key; {remedy}")
    try:
        problem = _refused_by_peers(cert_path, key_path)
    except ssl.SSLError as exc:
        raise IdentityError(f"the node key {key_path} is unreadable or not the certificate's "
                            f"({exc.reason or exc}); {remedy}, or says what else is wrong") from exc
    except OSError as exc:
        raise _unreadable("the node key", key_path, exc) from exc
    if problem is not None:
        raise IdentityError(f"the node certificate {cert_path} is damaged: peers would refuse it "
                            f"({problem}); {remedy}")
    return Identity(directory, hashlib.sha256(spki).digest())


def _refused_by_peers(cert_path: Path, key_path: Path) -> str | None:
    """Why a peer would refuse this certificate (its signature, its dates), else None: a TLS
    handshake in memory, this pair serving a client that trusts only the open CA.  SSLError
    if OpenSSL cannot load the pair (an unreadable key, or not the certificate's)."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert_path, key_path)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.minimum_version = ssl.TLSVersion.TLSv1_3
    client.check_hostname = False
    client.load_verify_locations(cadata=OPEN_CA_PEM.decode())
    client_in, client_out, server_in, server_out = (ssl.MemoryBIO() for _ in range(4))
    ours = client.wrap_bio(client_in, client_out)
    theirs = server.wrap_bio(server_in, server_out, server_side=True)
    for _ in range(3):  # TLS 1.3: the client's verdict comes after the server's first flight
        try:
            ours.do_handshake()
            return None
        except ssl.SSLWantReadError:
            pass
        except ssl.SSLCertVerificationError as exc:
            return exc.verify_message or str(exc)
        server_in.write(client_out.read())
        with contextlib.suppress(ssl.SSLWantReadError):
            theirs.do_handshake()
        client_in.write(server_out.read())
    return "the handshake did not complete"


def has_identity(directory: Path) -> bool:
    return (directory / KEY_FILE).is_file()


def identity_files(directory: Path) -> list[Path]:
    """The files an identity leaves, those present: none only if this node never made one."""
    return [directory / name for name in (KEY_FILE, CERT_FILE, CA_FILE) if (directory / name).exists()]


def existing_identity(directory: Path) -> Identity | None:
    """The node's identity if it ever made one (mended as load_or_create_identity does), None
    for a home that never did: what `status` shows without making one."""
    return load_or_create_identity(directory) if identity_files(directory) else None


class IdentityLost(IdentityError):
    """The node key is gone but the node had an identity: a new one would be a stranger to
    every peer, so none is made without being asked."""


def load_or_create_identity(directory: Path) -> Identity:
    """The node's identity, made on first use (key and cert mode 0600, dir 0700).  A damaged or
    lost certificate is re-issued from the key (one warning); a lost key beside the files of an
    earlier identity is IdentityLost, never silently a new node id."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(directory, 0o700)
    key_path = directory / KEY_FILE
    if not key_path.exists():
        earlier = identity_files(directory)
        if earlier:
            raise IdentityLost(
                f"the node key {key_path} is missing, but {earlier[0]} shows this node had an "
                f"identity that its peers trust: restore {KEY_FILE} from a backup, or to start over "
                f"with a new node id (every peer must then trust it again) remove {directory}")
        from p2pnode.peer import certificates  # the X.509 stack, only to make an identity

        key, cert = certificates.new_key_and_certificate()
        atomic_write(key_path, key)
        atomic_write(directory / CERT_FILE, cert)
    if not (directory / CA_FILE).exists():
        atomic_write(directory / CA_FILE, open_ca_pem())
    try:
        return load_identity(directory)
    except IdentityError as exc:
        if exc.exit_code == InvalidInput.exit_code:  # a file this user may not read: not damage
            raise
        return _mend_certificate(directory, str(exc))


def _mend_certificate(directory: Path, problem: str) -> Identity:
    """Re-issue a lost or damaged certificate from the key (it holds nothing else), unless it
    is the key that is damaged: then the certificate, signed and intact, names another id."""
    from p2pnode.peer import certificates

    key_path, cert_path = directory / KEY_FILE, directory / CERT_FILE
    start_over = (f"restore it from a backup, or to start over with a new node id (every peer "
                  f"must then trust it again) remove {directory}")
    try:
        key_pem = key_path.read_bytes()
    except OSError as exc:
        raise _unreadable("the node key", key_path, exc) from exc
    try:
        key_id = certificates.key_fingerprint(key_pem)
    except ValueError as exc:
        raise IdentityError(f"the node key {key_path} is damaged ({str(exc).split('.')[0]}): "
                            f"{start_over}") from exc
    try:
        certified = certificates.certified_fingerprint(cert_path.read_bytes())
    except OSError:
        certified = None
    if certified is not None and certified != key_id:
        raise IdentityError(
            f"the node key {key_path} is not the key of {cert_path}, which is intact (node "
            f"{format_node_id(certified)}): the key is damaged or was replaced; {start_over}")
    identity = reissue_certificate(directory)
    logger.warning("re-issued the node certificate %s from %s, the node id %s stays the same (%s)",
                   cert_path, KEY_FILE, identity.node_id, problem.split(";")[0])
    return identity


def reissue_certificate(directory: Path) -> Identity:
    """A fresh certificate for the existing key: the node id stays the same."""
    from p2pnode.peer import certificates

    key_path = directory / KEY_FILE
    try:
        cert = certificates.certificate_for(key_path.read_bytes())
    except (OSError, ValueError) as exc:
        raise _unreadable("the node key", key_path, exc) from exc
    atomic_write(directory / CERT_FILE, cert)
    return load_identity(directory)


# --- the node's own name ------------------------------------------------------------------------


def own_name(directory: Path) -> str | None:
    """The name set with `pair --name`, else the login name (what a teammate knows you by)."""
    try:
        name = (directory / NAME_FILE).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        name = ""
    if not name:
        try:
            name = getpass.getuser()
        except (KeyError, OSError):  # no user name in the environment or the passwd database
            return None
    return name if valid_own_name(name) else None


def valid_own_name(name: str) -> bool:
    return 0 < len(name) <= 100 and name.isprintable() and name == name.strip()


def set_own_name(directory: Path, name: str) -> None:
    if not valid_own_name(name):
        raise InvalidInput(f"node name {name[:40]!r}: 1 to 100 printable characters, no outer spaces")
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    atomic_write(directory / NAME_FILE, name.encode() + b"\n")
