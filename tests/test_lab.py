"""The namespace lab itself: topology, egress fence, cut/heal, teardown of exactly what it made."""
from __future__ import annotations

import subprocess
import sys
import uuid

import pytest
from lab import Lab, LabError, unavailable_reason

pytestmark = pytest.mark.lab

SEND_UDP = "import socket,sys; socket.socket(socket.AF_INET,socket.SOCK_DGRAM).sendto(b'x',(sys.argv[1],9))"


def test_hosts_reach_each_other(lab: Lab):
    for src, dst in (("h1", "h2"), ("h3", "h1"), ("h2", "h4")):
        assert lab.reachable(src, dst), f"{src} -> {dst}"


def test_host_sees_only_lab_addresses(lab: Lab):
    out = lab.run("h2", "ip", "-4", "-o", "addr", "show", check=True).stdout
    addrs = sorted(line.split()[3] for line in out.splitlines())
    assert addrs == ["10.77.0.12/24", "127.0.0.1/8"]


def test_egress_fence_blocks_non_lab_addresses(lab: Lab):
    blocked = lab.run("h1", sys.executable, "-c", SEND_UDP, "192.0.2.1")
    assert blocked.returncode != 0 and "Operation not permitted" in blocked.stderr
    for ok in (lab.addr("h2"), "224.0.0.251", "127.0.0.1"):
        r = lab.run("h1", sys.executable, "-c", SEND_UDP, ok)
        assert r.returncode == 0, f"send to {ok}: {r.stderr}"


def test_cut_and_heal(lab: Lab):
    assert lab.reachable("h2", "h1")
    lab.cut("h1")
    try:
        assert not lab.reachable("h2", "h1", timeout=0.5)
    finally:
        lab.heal("h1")
    assert lab.reachable("h2", "h1", timeout=3)


def test_down_removes_exactly_what_it_made_and_stops_processes():
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    lab = Lab.create(2)
    sleeper = lab.spawn("h1", "sleep", "60")
    assert lab.exists() == sorted(lab.created)
    lab.down()
    assert sleeper.wait(5) != 0  # stopped by down(), not left running
    assert lab.exists() == []
    lab.down()  # twice is fine


def test_failed_setup_removes_its_namespaces_and_nothing_else():
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    prefix = "lf" + uuid.uuid4().hex[:6]
    foreign = f"{prefix}-h2"  # someone else's namespace in the way: setup of h2 fails
    subprocess.run(["ip", "netns", "add", foreign], check=True, timeout=30)
    try:
        with pytest.raises(LabError, match=foreign):
            Lab.create(3, prefix=prefix)
        probe = Lab(prefix, 3)
        assert probe.exists() == [foreign]  # ours are gone, the foreign one is untouched
    finally:
        subprocess.run(["ip", "netns", "del", foreign], timeout=30)
