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
from a constant below).  That CA vouches for nothing: anyone can issue with it.  It only
lets the handshake reach our own check, which pins the leaf key's SPKI hash against the
allowlist (see tls.py); the TLS 1.3 CertificateVerify message proves the peer holds that key.
"""
from __future__ import annotations

import datetime as dt
import functools
import getpass
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from p2pnode.errors import InvalidInput, P2PNodeError
from p2pnode.peer.nodeid import format_node_id
from sysio.files import atomic_write

KEY_FILE = "node.key"
CERT_FILE = "node.crt"
CA_FILE = "open-ca.crt"
NAME_FILE = "name"
"""The name this node gives itself (`pair --name`): sent when pairing, announced over mDNS."""
CERT_DNS_NAME = "p2pnode"
"""The one DNS name in every node certificate (for curl's `--resolve p2pnode:PORT:IP`)."""

_OPEN_CA_SEED = hashlib.sha256(b"p2pnode open introduction CA v1 - this key is public").digest()


class IdentityError(P2PNodeError):
    """The identity files are unreadable or inconsistent."""


def spki_sha256_of_key(public_key: object) -> bytes:
    spki = public_key.public_bytes(  # type: ignore[attr-defined]
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(spki).digest()


def spki_sha256(cert_der: bytes) -> bytes:
    """Fingerprint of the key inside a DER certificate (what tls.py pins)."""
    return spki_sha256_of_key(x509.load_der_x509_certificate(cert_der).public_key())


# --- certificates -----------------------------------------------------------------------


@functools.cache
def _open_ca() -> tuple[Ed25519PrivateKey, x509.Certificate]:
    """The public "open CA": deterministic key and certificate, the same bytes everywhere."""
    key = Ed25519PrivateKey.from_private_bytes(_OPEN_CA_SEED)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "p2pnode open CA (public key)")])
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(dt.datetime(2020, 1, 1, tzinfo=dt.UTC))
        .not_valid_after(dt.datetime(2120, 1, 1, tzinfo=dt.UTC))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(ski, critical=False)
        .sign(key, None)
    )
    return key, cert


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
"""_open_ca()'s certificate, as it always comes out (Ed25519 signs deterministically): every
TLS context loads it, and deriving it costs a signature (~14 ms of each CLI command's start).
tests/peer/test_identity.py checks it against the derivation."""


def open_ca_pem() -> bytes:
    return OPEN_CA_PEM


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not cert_sign, content_commitment=False, key_encipherment=False,
        data_encipherment=False, key_agreement=False, key_cert_sign=cert_sign, crl_sign=cert_sign,
        encipher_only=False, decipher_only=False,
    )


def issue_certificate(key: Ed25519PrivateKey, *, valid_days: int = 3650) -> x509.Certificate:
    """A leaf certificate for `key`, for both server and client auth."""
    ca_key, ca_cert = _open_ca()
    node_id = format_node_id(spki_sha256_of_key(key.public_key()))
    now = dt.datetime.now(dt.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=valid_days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=False), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(CERT_DNS_NAME)]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, None)
    )


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


def _load_key(path: Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError) as exc:
        raise IdentityError(f"cannot read the node key {path}: {exc}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise IdentityError(f"the node key {path} is not an Ed25519 key")
    return key


def load_identity(directory: Path) -> Identity:
    """The existing identity; IdentityError if it is missing or the cert doesn't match the key."""
    key = _load_key(directory / KEY_FILE)
    fp = spki_sha256_of_key(key.public_key())
    try:
        cert = x509.load_pem_x509_certificate((directory / CERT_FILE).read_bytes())
    except (OSError, ValueError) as exc:
        raise IdentityError(f"cannot read the node certificate in {directory}: {exc}") from exc
    if spki_sha256_of_key(cert.public_key()) != fp:
        raise IdentityError(f"the certificate in {directory} is not for the node key")
    return Identity(directory, fp)


def has_identity(directory: Path) -> bool:
    return (directory / KEY_FILE).is_file()


def load_or_create_identity(directory: Path) -> Identity:
    """The node's identity, made on first use (key and cert mode 0600, dir 0700)."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(directory, 0o700)
    if not (directory / KEY_FILE).exists():
        key = Ed25519PrivateKey.generate()
        pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        atomic_write(directory / KEY_FILE, pem)
        atomic_write(directory / CERT_FILE, issue_certificate(key).public_bytes(serialization.Encoding.PEM))
    if not (directory / CA_FILE).exists():
        atomic_write(directory / CA_FILE, open_ca_pem())
    if not (directory / CERT_FILE).exists():  # lost cert: re-issue for the same key and id
        reissue_certificate(directory)
    return load_identity(directory)


def reissue_certificate(directory: Path) -> Identity:
    """A fresh certificate for the existing key: the node id stays the same."""
    key = _load_key(directory / KEY_FILE)
    atomic_write(directory / CERT_FILE, issue_certificate(key).public_bytes(serialization.Encoding.PEM))
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
