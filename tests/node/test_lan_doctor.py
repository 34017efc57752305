"""`p2pnode doctor` on a LAN (issue 15, "A health check"): lab namespaces, real mDNS.

A node bound to 127.0.0.1 while mDNS announces its LAN address: the peer-port check fails and
says how to listen on the LAN, and tickets carry 127.0.0.1, where it does listen.  Bound to all
addresses, the port answers where mDNS says; trust held one-sidedly fails with what the other
side must run, and passes once the other side trusts back.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from lab import Lab
from lannode import LanNode, running, wait_for

pytestmark = pytest.mark.lab


def doctor(node: LanNode) -> tuple[int, dict[str, dict[str, Any]]]:
    r = node.cli("doctor", "--json", "--timeout", "3")
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, {c["name"]: c for c in json.loads(r.stdout)["checks"]}


def test_doctor_on_the_lan(lab: Lab, tmp_path: Path) -> None:
    a, b = LanNode(lab, "h1", tmp_path), LanNode(lab, "h2", tmp_path)
    a.trust(b)  # b does not trust a (yet)

    with open(a.log, "a") as log:  # a listens on loopback only, yet announces on the LAN
        a.proc = lab.spawn("h1", sys.executable, "-m", "p2pnode", "serve", "--host", "127.0.0.1",
                           "--port", "47470", env=a.env, stdout=log, stderr=log)
    try:
        a.wait_running()
        code, checks = doctor(a)
    finally:
        a.stop()
    assert code == 1
    assert checks["peer port"]["outcome"] == "fail"
    assert f"mDNS announces {lab.addr('h1')} but peer port 47470 does not answer there" in \
        checks["peer port"]["detail"]
    assert checks["peer port"]["fix"] == "restart it listening on the LAN: p2pnode serve --host 0.0.0.0"
    assert checks["tickets"]["detail"].startswith("tickets carry 127.0.0.1:47470 ")
    assert checks["mdns"]["outcome"] == "ok"

    with running([a, b]):
        wait_for("h1 to see h2", lambda: (p := a.peer(b)) and p["addresses"], 30)
        code, checks = doctor(a)
        assert code == 1
        assert {n: c["outcome"] for n, c in checks.items()} == {
            "store": "ok", "identity": "ok", "node": "ok", "peer port": "ok", "tickets": "ok", "mdns": "ok",
            "trust h2": "fail", "pi": "ok"}
        assert checks["tickets"]["detail"] == f"tickets carry {lab.addr('h1')}:47470"
        assert checks["mdns"]["detail"] == f"announced and heard on {lab.addr('h1')}, port 47470"
        assert checks["trust h2"]["fix"] == f"on that machine run: p2pnode trust {a.node_id}"

        b.trust(a)  # b's node re-reads its trust file when it next polls it
        code, checks = wait_for("h2's node to trust h1", lambda: (r := doctor(a))[0] == 0 and r, 30,
                                every=1.0)
        assert checks["trust h2"]["detail"] == f"mutual (answered at {lab.addr('h2')}:47470)"
