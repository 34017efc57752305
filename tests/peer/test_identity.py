"""Node identity, the trust list, and mutual TLS with key pinning (real sockets, real TLS)."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import ssl
import stat
from pathlib import Path

import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from p2pnode.errors import InvalidInput, NotFound
from p2pnode.peer import https
from p2pnode.peer.certificates import open_ca
from p2pnode.peer.identity import (
    OPEN_CA_PEM,
    IdentityError,
    IdentityLost,
    existing_identity,
    load_identity,
    load_or_create_identity,
    reissue_certificate,
)
from p2pnode.peer.nodeid import InvalidNodeId, format_node_id, normalise_node_id, parse_node_id
from p2pnode.peer.spki import spki_sha256
from p2pnode.peer.tls import client_context, peer_fingerprint, server_context
from p2pnode.peer.trust import TrustFileCorrupt, TrustStore

# Syncthing's own test vector (lib/protocol/deviceid_test.go): the same base32 + Luhn layout.
SYNCTHING_FORMATTED = "P56IOI7-MZJNU2Y-IQGDREY-DM2MGTI-MGL3BXN-PQ6W5BM-TBBZ4TJ-XZWICQ2"
SYNCTHING_UNCHECKED = "P56IOI-7MZJNU-2IQGDR-EYDM2M-GTMGL3-BXNPQ6-W5BTBB-Z4TJXZ-WICQ"


def test_node_id_layout_matches_syncthing() -> None:
    fp = parse_node_id(SYNCTHING_UNCHECKED)
    assert format_node_id(fp) == SYNCTHING_FORMATTED
    assert parse_node_id(SYNCTHING_FORMATTED) == fp
    assert normalise_node_id(SYNCTHING_FORMATTED.lower().replace("-", " ")) == SYNCTHING_FORMATTED


def test_node_id_typos_are_refused() -> None:
    typo = SYNCTHING_FORMATTED.replace("MZJNU2Y", "MZJNV2Y")
    with pytest.raises(InvalidNodeId, match="check character of group 1"):
        parse_node_id(typo)
    with pytest.raises(InvalidNodeId, match="expected 56 characters"):
        parse_node_id(SYNCTHING_FORMATTED[:-3])
    with pytest.raises(InvalidNodeId, match="base32"):
        parse_node_id("P56IOI7-MZJNU2Y-!")
    # Syncthing's typo fixes: 0→O, 1→I, 8→B
    assert parse_node_id(SYNCTHING_FORMATTED.replace("O", "0").replace("I", "1")) == parse_node_id(
        SYNCTHING_FORMATTED)


def test_the_open_ca_certificate_constant_is_the_derived_one() -> None:
    assert open_ca()[1].public_bytes(Encoding.PEM) == OPEN_CA_PEM


def test_identity_files_and_reissue(tmp_path: Path) -> None:
    d = tmp_path / "identity"
    ident = load_or_create_identity(d)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    for f in (ident.key_path, ident.cert_path):
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600
    assert len(ident.node_id) == 63 and ident.node_id.count("-") == 7
    assert load_or_create_identity(d).node_id == ident.node_id  # stable across loads
    old_cert = ident.cert_path.read_bytes()
    again = reissue_certificate(d)
    assert again.node_id == ident.node_id and ident.cert_path.read_bytes() != old_cert
    der = x509.load_pem_x509_certificate(ident.cert_path.read_bytes()).public_bytes(Encoding.DER)
    assert spki_sha256(der) == ident.fingerprint
    ident.cert_path.unlink()  # a lost cert is re-issued for the same key
    assert load_or_create_identity(d).node_id == ident.node_id


def test_trust_store_roundtrip_and_listeners(tmp_path: Path) -> None:
    a = load_or_create_identity(tmp_path / "a")
    t1 = TrustStore(tmp_path / "trust.json")
    t1.trust(a.node_id.lower().replace("-", ""), name="laptop")
    assert t1.is_trusted(a.fingerprint) and t1.peers()[0].name == "laptop"
    assert stat.S_IMODE(os.stat(tmp_path / "trust.json").st_mode) == 0o600
    t2 = TrustStore(tmp_path / "trust.json")  # another process's view
    assert t2.is_trusted(a.fingerprint)
    removed: list[set[bytes]] = []
    t2.add_listener(removed.append)
    t1.untrust(a.node_id)
    assert t2.is_trusted(a.fingerprint)  # not yet re-read
    assert t2.reload_if_changed() and not t2.is_trusted(a.fingerprint)
    assert removed == [{a.fingerprint}]
    with pytest.raises(NotFound, match="not in the trust list"):
        t1.untrust(a.node_id)


def test_a_name_names_one_trusted_peer(tmp_path: Path) -> None:
    """`trust --name carol` for a second peer was taken silently: `--to carol` then failed as
    ambiguous.  Refused (exit 4); pairing, which must not fail after the codes matched, gives
    the second one the name and its id's first group."""
    a, b = (load_or_create_identity(tmp_path / n) for n in "ab")
    store = TrustStore(tmp_path / "trust.json")
    store.trust(a.node_id, name="carol")
    with pytest.raises(InvalidInput, match="taken by"):
        store.trust(b.node_id, name="carol")
    assert store.trust(a.node_id, name="carol").name == "carol"  # its own name again: fine
    assert store.free_name("carol", a.node_id) == "carol" and store.free_name("dave", b.node_id) == "dave"
    second = store.trust(b.node_id, name=store.free_name("carol", b.node_id))
    assert second.name == f"carol-{b.node_id[:7]}"


def test_corrupt_trust_file_is_reported_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "trust.json"
    path.write_text('{"version": 1, "peers": [{"id": "nonsense"}]}')
    with pytest.raises(TrustFileCorrupt, match="trust.json"):
        TrustStore(path)
    assert json.loads(path.read_text())["peers"] == [{"id": "nonsense"}]


# --- mutual TLS over real loopback sockets ------------------------------------------------------


@pytest.fixture
def three(tmp_path: Path):
    """Server S, client C trusted by S, stranger X; S and C trust each other."""
    ids = {n: load_or_create_identity(tmp_path / n) for n in ("s", "c", "x")}
    trusts = {n: TrustStore(tmp_path / f"{n}-trust.json") for n in ids}
    trusts["s"].trust(ids["c"].node_id)
    trusts["c"].trust(ids["s"].node_id)
    trusts["x"].trust(ids["s"].node_id)
    return ids, trusts


async def _serve(ids, trusts):
    async def hello(request: web.Request) -> web.Response:
        fp = peer_fingerprint(request.transport.get_extra_info("ssl_object"))
        return web.Response(text=format_node_id(fp))

    app = web.Application()
    app.router.add_get("/", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_context(ids["s"], trusts["s"]))
    await site.start()
    return runner, runner.addresses[0][1]


async def _get(ident, trust, expected, port) -> str:
    """GET / with the fetcher's client (https.py), on a new connection each time."""
    s = https.Session("127.0.0.1", port, client_context(ident, trust, expected), https.Timeouts(5, 5))
    try:
        async with s.request("GET", "/") as r:
            return b"".join([c async for c in r.chunks()]).decode()
    finally:
        await s.close()


async def test_mutual_tls_pins_both_sides(three) -> None:
    ids, trusts = three
    runner, port = await _serve(ids, trusts)
    try:
        # trusted client, expected server: the server sees the client's node id
        assert await _get(ids["c"], trusts["c"], ids["s"].fingerprint, port) == ids["c"].node_id
        # a client the server does not trust is cut off in the handshake
        with pytest.raises(https.ClientError):
            await _get(ids["x"], trusts["x"], ids["s"].fingerprint, port)
        # the client expected another node at this address (no man in the middle)
        trusts["c"].trust(ids["x"].node_id)
        with pytest.raises(https.CertificateError, match="expected"):
            await _get(ids["c"], trusts["c"], ids["x"].fingerprint, port)
        # a server the client does not trust is refused even without an expected id
        trusts["c"].untrust(ids["s"].node_id)
        with pytest.raises(https.CertificateError, match="not trusted"):
            await _get(ids["c"], trusts["c"], None, port)
        trusts["c"].trust(ids["s"].node_id)
        # untrust on the server takes effect on the very next handshake
        trusts["s"].untrust(ids["c"].node_id)
        with pytest.raises(https.ClientError):
            await _get(ids["c"], trusts["c"], ids["s"].fingerprint, port)
    finally:
        await runner.cleanup()


async def test_curl_speaks_the_same_mtls(three, tmp_path: Path) -> None:
    """The benchmark's baseline: curl with --cert/--key/--cacert against the same contexts."""
    import shutil
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    ids, trusts = three
    runner, port = await _serve(ids, trusts)
    try:
        c = ids["c"]
        proc = await asyncio.create_subprocess_exec(
            "curl", "-sS", "--fail", "--cert", str(c.cert_path), "--key", str(c.key_path),
            "--cacert", str(c.ca_path), "--resolve", f"p2pnode:{port}:127.0.0.1", f"https://p2pnode:{port}/",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
        assert proc.returncode == 0, err
        assert out.decode() == c.node_id
    finally:
        await runner.cleanup()


def _flip_in_signature(cert: Path) -> None:
    """One bit flipped in the certificate's signature (its last bytes): the key, and so the
    id, read the same, but a peer's chain check fails."""
    der = bytearray(ssl.PEM_cert_to_DER_cert(cert.read_text()))
    der[-5] ^= 1
    cert.write_text(ssl.DER_cert_to_PEM_cert(bytes(der)))


@pytest.mark.parametrize("damage", ["signature", "cut", "emptied", "deleted"])
def test_a_damaged_certificate_is_seen_and_reissued_from_the_key(
        tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    """A bit flip in node.crt's signature went unnoticed (every peer then refused the node,
    which read as a trust problem): loading checks the certificate as a peer does, and
    load_or_create_identity re-issues it for the same key and id, with one warning."""
    d = tmp_path / "identity"
    ident = load_or_create_identity(d)
    cert = ident.cert_path
    if damage == "signature":
        _flip_in_signature(cert)
    elif damage == "cut":
        cert.write_bytes(cert.read_bytes()[:300])
    elif damage == "emptied":
        cert.write_bytes(b"")
    else:
        cert.unlink()
    with pytest.raises(IdentityError, match=f"{cert}.*`p2pnode id` re-issues it"):
        load_identity(d)
    with caplog.at_level(logging.WARNING, "p2pnode.peer.identity"):
        again = load_or_create_identity(d)
    assert again.node_id == ident.node_id and load_identity(d).node_id == ident.node_id
    assert [r.getMessage() for r in caplog.records if "re-issued the node certificate" in r.getMessage()]
    assert len(caplog.records) == 1


def test_a_damaged_key_is_not_taken_for_a_damaged_certificate(tmp_path: Path) -> None:
    """A key that reads as another Ed25519 key beside an intact certificate: re-issuing would
    silently change the node id, so it is refused, naming the key and how to start over."""
    d = tmp_path / "identity"
    ident = load_or_create_identity(d)
    other = load_or_create_identity(tmp_path / "other")
    ident.key_path.write_bytes(other.key_path.read_bytes())
    old_cert = ident.cert_path.read_bytes()
    with pytest.raises(IdentityError, match=f"{ident.key_path} is not the key of .*intact.*remove {d}"):
        load_or_create_identity(d)
    assert ident.cert_path.read_bytes() == old_cert


def test_a_lost_key_does_not_silently_become_a_new_node_id(tmp_path: Path) -> None:
    """node.key deleted: the certificate beside it shows the node had an id its peers trust,
    so no new one is made (nothing overwritten) until the identity dir is removed on purpose.
    A brand-new home still makes its identity without a word."""
    d = tmp_path / "identity"
    ident = load_or_create_identity(d)
    ident.key_path.unlink()
    old_cert = ident.cert_path.read_bytes()
    with pytest.raises(IdentityLost, match=f"node key {ident.key_path} is missing.*remove {d}") as lost:
        load_or_create_identity(d)
    assert lost.value.exit_code == 1
    assert ident.cert_path.read_bytes() == old_cert and not ident.key_path.exists()
    assert existing_identity(tmp_path / "never") is None and not (tmp_path / "never").exists()
    with pytest.raises(IdentityLost):
        existing_identity(d)
    shutil.rmtree(d)  # starting over, deliberately
    assert load_or_create_identity(d).node_id != ident.node_id
