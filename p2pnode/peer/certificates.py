"""Making the node's key and certificates: the one part of the identity that needs an X.509
library (`cryptography`), imported only when a key or certificate is made.  Reading them is
identity.py's and spki.py's, without it.
"""
from __future__ import annotations

import datetime as dt
import functools
import hashlib

from cryptography import x509
from cryptography.exceptions import InternalError, InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from p2pnode.peer.nodeid import format_node_id

CERT_DNS_NAME = "p2pnode"
"""The one DNS name in every node certificate (for curl's `--resolve p2pnode:PORT:IP`)."""

_OPEN_CA_SEED = hashlib.sha256(b"p2pnode open introduction CA v1 - this key is public").digest()


def spki_sha256_of_key(public_key: object) -> bytes:
    """The node id's bytes for a key object (identity.py reads them from a certificate instead)."""
    spki = public_key.public_bytes(  # type: ignore[attr-defined]
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(spki).digest()


@functools.cache
def open_ca() -> tuple[Ed25519PrivateKey, x509.Certificate]:
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


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not cert_sign, content_commitment=False, key_encipherment=False,
        data_encipherment=False, key_agreement=False, key_cert_sign=cert_sign, crl_sign=cert_sign,
        encipher_only=False, decipher_only=False,
    )


def issue_certificate(key: Ed25519PrivateKey, *, valid_days: int = 3650) -> x509.Certificate:
    """A leaf certificate for `key`, for both server and client auth."""
    ca_key, ca_cert = open_ca()
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


def new_key_and_certificate() -> tuple[bytes, bytes]:
    """A new Ed25519 node key and its certificate, both PEM."""
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    return pem, issue_certificate(key).public_bytes(serialization.Encoding.PEM)


def _ed25519_key(key_pem: bytes) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (UnsupportedAlgorithm, InternalError) as exc:  # a damaged algorithm identifier or key
        raise ValueError(str(exc)) from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError("not an Ed25519 key")
    return key


def certificate_for(key_pem: bytes) -> bytes:
    """A fresh certificate (PEM) for an existing PEM key; ValueError if it is not an Ed25519 key."""
    return issue_certificate(_ed25519_key(key_pem)).public_bytes(serialization.Encoding.PEM)


def key_fingerprint(key_pem: bytes) -> bytes:
    """The node id's bytes for a PEM key; ValueError if it is not an Ed25519 key."""
    return spki_sha256_of_key(_ed25519_key(key_pem).public_key())


def certified_fingerprint(cert_pem: bytes) -> bytes | None:
    """The node id's bytes of a certificate the open CA really signed, else None (unreadable,
    or damaged since it was signed): which key an intact certificate was issued for."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        cert.verify_directly_issued_by(open_ca()[1])
    except (ValueError, TypeError, InvalidSignature, UnsupportedAlgorithm, x509.InvalidVersion):
        return None
    return spki_sha256_of_key(cert.public_key())
