"""The key inside a certificate, found by spki.py's DER walk, against cryptography's parse of
the same certificates; anything that is not a certificate is a ValueError (never an
IndexError), and the identity files are checked as cryptography checked them."""
from __future__ import annotations

import datetime as dt
import hashlib
import random
import ssl
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import NameOID

from p2pnode.peer.certificates import new_key_and_certificate
from p2pnode.peer.identity import CERT_FILE, KEY_FILE, IdentityError, load_identity, load_or_create_identity
from p2pnode.peer.spki import certificate_spki, spki_sha256


def _certificate(key: object, subject: str, signer: object, units: int = 0) -> bytes:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]
                     + [x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "u" * 60)] * units)
    algorithm = None if isinstance(signer, ed25519.Ed25519PrivateKey) else hashes.SHA256()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key())  # type: ignore[attr-defined]
            .serial_number(x509.random_serial_number())
            .not_valid_before(dt.datetime(2020, 1, 1, tzinfo=dt.UTC))
            .not_valid_after(dt.datetime(2040, 1, 1, tzinfo=dt.UTC))
            .sign(signer, algorithm))  # type: ignore[arg-type]
    return cert.public_bytes(serialization.Encoding.DER)


def _expected(der: bytes) -> bytes:
    key = x509.load_der_x509_certificate(der).public_key()
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


@pytest.mark.parametrize("make", [ed25519.Ed25519PrivateKey.generate,
                                  lambda: ec.generate_private_key(ec.SECP256R1()),
                                  lambda: rsa.generate_private_key(65537, 2048)])
@pytest.mark.parametrize("units", [0, 3, 1000])  # a name's length short, of 1 and of 2 bytes
def test_the_walk_finds_the_key_cryptography_finds(make, units: int) -> None:
    key = make()
    der = _certificate(key, "node", key, units)
    assert certificate_spki(der) == _expected(der)
    assert spki_sha256(der) == hashlib.sha256(_expected(der)).digest()


def test_a_node_certificate_holds_an_ed25519_key_as_rfc_8410_lays_it_out(tmp_path: Path) -> None:
    ident = load_or_create_identity(tmp_path / "id")
    der = ssl.PEM_cert_to_DER_cert(ident.cert_path.read_text())
    assert certificate_spki(der) == _expected(der) and len(_expected(der)) == 44
    assert hashlib.sha256(_expected(der)).digest() == ident.fingerprint


def test_anything_but_a_certificate_is_a_value_error() -> None:
    key = ed25519.Ed25519PrivateKey.generate()
    der = _certificate(key, "node", key)
    for cut in range(len(der)):  # every truncation: the outer length no longer fits
        with pytest.raises(ValueError):
            certificate_spki(der[:cut])
    with pytest.raises(ValueError):
        certificate_spki(der + b"\0")
    rng = random.Random(7)
    for _ in range(3000):  # flipped bytes: a ValueError or some span of the input, nothing else
        bad = bytearray(der)
        for _ in range(rng.randint(1, 4)):
            bad[rng.randrange(len(bad))] = rng.randrange(256)
        try:
            spki = certificate_spki(bytes(bad))
        except ValueError:
            continue
        assert spki in bytes(bad)
    for size in (0, 1, 2, 5, 100):
        with pytest.raises(ValueError):
            certificate_spki(bytes(rng.randrange(256) for _ in range(size)) if size else b"")


def test_identity_files_that_do_not_hold_a_node_identity_are_refused(tmp_path: Path) -> None:
    d = tmp_path / "id"
    load_or_create_identity(d)
    other_key, other_cert = new_key_and_certificate()
    (d / CERT_FILE).write_bytes(other_cert)  # a certificate for another key
    with pytest.raises(IdentityError, match="not the certificate's"):
        load_identity(d)
    (d / KEY_FILE).write_bytes(other_key)  # the pair again
    assert load_identity(d).fingerprint == spki_sha256(
        x509.load_pem_x509_certificate(other_cert).public_bytes(serialization.Encoding.DER))
    ec_key = ec.generate_private_key(ec.SECP256R1())
    (d / KEY_FILE).write_bytes(ec_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    (d / CERT_FILE).write_bytes(x509.load_der_x509_certificate(_certificate(ec_key, "n", ec_key))
                                .public_bytes(serialization.Encoding.PEM))
    with pytest.raises(IdentityError, match="not for an Ed25519 key"):
        load_identity(d)
    (d / CERT_FILE).write_bytes(b"not a certificate")
    with pytest.raises(IdentityError, match="cannot read the node certificate"):
        load_identity(d)
    (d / CERT_FILE).write_bytes(b"\xff\xfe")
    with pytest.raises(IdentityError, match="cannot read the node certificate"):
        load_identity(d)
