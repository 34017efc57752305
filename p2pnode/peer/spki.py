"""The key inside an X.509 certificate, found without an X.509 library.

A node is named by the SHA-256 of its key's SubjectPublicKeyInfo (identity.py), and every
TLS connection pins that hash (tls.py, provider.py).  Reading it needs only the certificate's
first fields, so a bounds-checked walk over its DER does it: loading `cryptography`'s X.509
stack for it cost some 45 ms of every CLI command's start (a third of a small fetch's
imports).  Certificates reach it after OpenSSL parsed and checked them (a peer's) or from the
node's own files; anything that is not a certificate's layout is a ValueError.
"""
from __future__ import annotations

import hashlib

_SEQUENCE, _INTEGER, _VERSION = 0x30, 0x02, 0xA0
ED25519_SPKI_PREFIX = bytes.fromhex("302a300506032b6570032100")
"""An Ed25519 key's SubjectPublicKeyInfo up to its 32 key bytes (RFC 8410): the node key's."""


def _field(der: bytes, pos: int, end: int) -> tuple[int, int, int]:
    """(tag, start of contents, end of the field) of the DER field at der[pos:end]."""
    if pos + 2 > end:
        raise ValueError(f"certificate cut short at byte {pos}")
    tag, size = der[pos], der[pos + 1]
    pos += 2
    if tag & 0x1F == 0x1F:
        raise ValueError(f"certificate: a multi-byte tag at byte {pos - 2}")
    if size & 0x80:
        count = size & 0x7F
        if not 1 <= count <= 4 or pos + count > end:
            raise ValueError(f"certificate: a bad length at byte {pos - 1}")
        size = int.from_bytes(der[pos:pos + count], "big")
        pos += count
    if pos + size > end:
        raise ValueError(f"certificate: a field at byte {pos} runs past its end")
    return tag, pos, pos + size


def certificate_spki(der: bytes) -> bytes:
    """The DER SubjectPublicKeyInfo of a DER certificate: the seventh field of its
    TBSCertificate, after the optional version, serial number, signature algorithm, issuer,
    validity and subject (RFC 5280, 4.1)."""
    tag, pos, end = _field(der, 0, len(der))
    if tag != _SEQUENCE or end != len(der):
        raise ValueError("not a DER certificate")
    tag, pos, end = _field(der, pos, end)
    if tag != _SEQUENCE:
        raise ValueError("certificate: no TBSCertificate")
    tag, _, after = _field(der, pos, end)
    if tag == _VERSION:
        pos = after
    for expected in (_INTEGER, _SEQUENCE, _SEQUENCE, _SEQUENCE, _SEQUENCE):
        tag, _, after = _field(der, pos, end)
        if tag != expected:
            raise ValueError(f"certificate: tag {tag:#x} at byte {pos}, not {expected:#x}")
        pos = after
    tag, _, after = _field(der, pos, end)
    if tag != _SEQUENCE:
        raise ValueError("certificate: no SubjectPublicKeyInfo")
    return der[pos:after]


def spki_sha256(cert_der: bytes) -> bytes:
    """Fingerprint of the key inside a DER certificate (what tls.py pins)."""
    return hashlib.sha256(certificate_spki(cert_der)).digest()
