"""`p2pnode doctor` (issue 15, "A health check") and the ticket addresses it checks: real
nodes on loopback (no mDNS here; tests/node/test_lan_doctor.py has the LAN with real mDNS)."""
from __future__ import annotations

import asyncio
import json
import ssl
import time
from pathlib import Path

from procnode import Node

from p2pnode.discovery.mdns import listen_addresses, local_ipv4_addresses
from p2pnode.library.api import Library
from p2pnode.node.doctor import FAIL, OK, SKIP, check_identity, check_trust
from p2pnode.paths import NodePaths
from p2pnode.peer import wire
from p2pnode.peer.trust import TrustStore


def doctor(node: Node) -> tuple[int, dict[str, dict]]:
    proc = node.run("doctor", "--json", "--timeout", "2", check=False)
    assert proc.returncode in (0, 1), proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] == (proc.returncode == 0)
    return proc.returncode, {c["name"]: c for c in report["checks"]}


def test_without_a_node_it_says_to_start_one(tmp_path: Path) -> None:
    a = Node(tmp_path, "a")
    code, checks = doctor(a)
    assert code == 1
    assert checks["node"]["outcome"] == FAIL and "p2pnode serve" in checks["node"]["fix"]
    assert checks["store"]["outcome"] == OK and checks["pi"]["outcome"] == OK
    assert {checks[n]["outcome"] for n in ("peer port", "tickets", "mdns")} == {SKIP}
    text = a.run("doctor", check=False)
    assert text.returncode == 1
    lines = text.stdout.splitlines()
    assert len(lines) == len(checks) and lines[2].startswith("FAIL  node") and "-> start it" in lines[2]


def test_a_node_on_loopback_gives_tickets_for_loopback(tmp_path: Path, corpus_new_dir: Path) -> None:
    """A node bound to 127.0.0.1 puts 127.0.0.1 (and its real port) in tickets, not the
    machine's LAN address where nothing listens."""
    a = Node(tmp_path, "a")
    src = next((corpus_new_dir / "sessions").glob("*epsilon*/*_my.session_1.jsonl"))
    with a.node_running():
        port = json.loads(a.run("status", "--json").stdout)["port"]
        shared = json.loads(a.run("share", str(src), "--json").stdout)
        ticket = wire.decode_ticket(shared["ticket"])
        assert ticket.addresses == (("127.0.0.1", port),)
        assert ticket.branch.hex() == shared["branch"]
        code, checks = doctor(a)
    assert code == 0, checks
    assert checks["tickets"]["outcome"] == OK
    assert checks["tickets"]["detail"] == f"tickets carry 127.0.0.1:{port} (loopback only: for this " \
        "machine's users alone; --host 0.0.0.0 for the LAN)"
    assert checks["mdns"]["outcome"] == SKIP and checks["peer port"]["outcome"] == SKIP  # serve --no-mdns


def test_listen_addresses_are_where_the_port_answers() -> None:
    """What status reports and tickets carry: every LAN address for a wildcard bind, else the
    bound address itself (a name resolved: `localhost` from the hosts file, no DNS query)."""
    assert listen_addresses("0.0.0.0") == listen_addresses("") == local_ipv4_addresses()
    assert listen_addresses("127.0.0.1") == ["127.0.0.1"]
    assert listen_addresses("localhost") == ["127.0.0.1"]


def test_trust_held_one_sidedly_is_a_failure_with_what_the_peer_must_run(tmp_path: Path) -> None:
    """Asked for its catalog over mutual TLS, a peer that does not trust us refuses after the
    handshake: that is reported with the command its user must run; mutual trust passes; a
    peer that does not answer cannot be asked (skip, not a failure)."""
    a, b = Node(tmp_path, "a"), Node(tmp_path, "b")
    TrustStore(NodePaths(a.home).trust).trust(b.id, name="bob")
    paths = NodePaths(a.home)
    with b.serving() as port:
        status = {"peers": [{"node_id": b.id, "addresses": ["127.0.0.1"], "port": port}]}
        (one_sided,) = asyncio.run(check_trust(paths, status, 5.0))
        assert (one_sided.name, one_sided.outcome) == ("trust bob", FAIL)
        assert one_sided.fix == f"on that machine run: p2pnode trust {a.id}"
        TrustStore(NodePaths(b.home).trust).trust(a.id)
        for _ in range(50):  # until b's server has re-read its trust file (it polls it)
            (mutual,) = asyncio.run(check_trust(paths, status, 5.0))
            if mutual.outcome == OK:
                break
            time.sleep(0.2)
        assert mutual.outcome == OK, mutual
    (gone,) = asyncio.run(check_trust(paths, status, 2.0))
    assert gone.outcome == SKIP and "did not answer" in gone.detail
    (unseen,) = asyncio.run(check_trust(paths, {"peers": []}, 2.0))
    assert unseen.outcome == SKIP and "not seen on the LAN" in unseen.detail


def test_a_store_held_by_another_process_is_reported(tmp_path: Path) -> None:
    a = Node(tmp_path, "a")
    with Library.open(NodePaths(a.home)):  # a share or fetch still running, say
        code, checks = doctor(a)
    assert code == 1 and checks["store"]["outcome"] == FAIL
    assert checks["store"]["detail"] == f"{a.home / 'store'} is held by another p2pnode process"


def test_a_pi_session_dir_that_does_not_exist_fails(tmp_path: Path) -> None:
    """With PI_CODING_AGENT_SESSION_DIR set (~ expanded), that flat dir is where Pi and
    p2pnode look: missing, the check fails; there, it names it and counts its sessions."""
    a = Node(tmp_path, "a")
    home = tmp_path / "userhome"
    a.env.update(HOME=str(home), PI_CODING_AGENT_SESSION_DIR="~/flat")
    code, checks = doctor(a)
    assert code == 1 and checks["pi"]["outcome"] == FAIL and str(home / "flat") in checks["pi"]["detail"]
    (home / "flat").mkdir(parents=True)
    (home / "flat" / "2026-11-23T11-40-10-981Z_x.jsonl").write_bytes(b"{}\n")
    _, checks = doctor(a)
    assert checks["pi"]["outcome"] == OK and f"flat in {home / 'flat'} (1 there)" in checks["pi"]["detail"]


def test_a_damaged_certificate_fails_the_identity_check(tmp_path: Path) -> None:
    """`doctor` said nothing while every peer refused a node.crt with a flipped bit: the
    identity line fails, naming the file and `p2pnode id`, which re-issues it (same id)."""
    a = Node(tmp_path, "a")
    assert check_identity(NodePaths(a.home)).outcome == OK
    cert = NodePaths(a.home).identity / "node.crt"
    der = bytearray(ssl.PEM_cert_to_DER_cert(cert.read_text()))
    der[-5] ^= 1  # in the signature: the key and the id read the same
    cert.write_text(ssl.DER_cert_to_PEM_cert(bytes(der)))
    code, checks = doctor(a)
    assert code == 1 and checks["identity"]["outcome"] == FAIL
    assert str(cert) in checks["identity"]["detail"] and checks["identity"]["fix"].startswith("p2pnode id")
    fixed = a.run("id")
    assert fixed.stdout.strip() == a.id and "re-issued the node certificate" in fixed.stderr
    assert check_identity(NodePaths(a.home)).outcome == OK
    assert check_identity(NodePaths(tmp_path / "fresh")).outcome == SKIP
