"""A LAN in a box for tests: Linux network namespaces on one bridge (Linux and root only).

    lab = Lab.create(3)          # bridge namespace <P>-br + hosts <P>-h1..h3, P unique per run
    lab.run("h1", "ping", "-c1", lab.addr("h2"))
    lab.cut("h1"); lab.heal("h1")
    lab.down()                   # deletes exactly what create() made, also after a failed setup

Layout (the same as ../shared/tools/netlab, which the notes measured): `<P>-br` holds `br0`
(10.77.0.1/24, STP and IGMP snooping off, no forwarding, no uplink) and ports p1..pN; host i
has `lo` up and `eth0` = 10.77.0.(10+i)/24 with multicast on.  Every veth pair is created
inside the bridge namespace and its peer moved straight into the host namespace, so the
root namespace is never touched and teardown only deletes namespaces.  Each host has an nft
egress fence: it may send only to the lab subnet, multicast, broadcast and loopback, so no
test can reach a real network even by mistake.  Parallel labs reuse the same addresses;
they cannot see each other because each has its own bridge namespace.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

SUBNET = "10.77.0"
BRIDGE_ADDR = f"{SUBNET}.1"
PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,9}$")

FENCE = f"""
table inet lab_fence {{
  chain out {{
    type filter hook output priority 0; policy accept;
    oifname "lo" accept
    ip daddr {{ {SUBNET}.0/24, 224.0.0.0/4, 255.255.255.255 }} accept
    ip6 daddr {{ fe80::/10, ff00::/8 }} accept
    counter drop
  }}
}}
"""

# exit 0 when the host answers (a refused connection is an answer), 1 when it stays silent
PROBE = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], 9), timeout=float(sys.argv[2])).close()
except ConnectionRefusedError:
    pass
except OSError:
    sys.exit(1)
"""


class LabError(RuntimeError):
    """A lab command failed; the message names the command and its stderr."""


def unavailable_reason() -> str | None:
    """Why namespaces cannot be built here, or None when they can."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "needs root (CAP_NET_ADMIN/CAP_SYS_ADMIN) to create network namespaces"
    if shutil.which("ip") is None:
        return "iproute2 `ip` not found (apt-get install iproute2)"
    probe = f"lp{uuid.uuid4().hex[:6]}-x"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if r.returncode:
        return f"kernel limitation: the kernel or container refuses `ip netns add`: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


def _ip(*args: str, stdin: str | None = None, timeout: float = 30) -> str:
    r = subprocess.run(["ip", *args], input=stdin, capture_output=True, text=True, timeout=timeout)
    if r.returncode:
        raise LabError(f"`ip {' '.join(args)}` failed: {r.stderr.strip()}")
    return r.stdout


class Lab:
    """One lab: a bridge namespace and N host namespaces, all named `<prefix>-...`."""

    def __init__(self, prefix: str, hosts: int):
        if not PREFIX_RE.match(prefix):
            raise ValueError(f"bad lab prefix {prefix!r} (want [a-z][a-z0-9]{{0,9}})")
        if not 1 <= hosts <= 200:
            raise ValueError(f"bad host count {hosts} (want 1..200)")
        self.prefix = prefix
        self.hosts = hosts
        self.bridge_ns = f"{prefix}-br"
        self.created: list[str] = []  # namespaces this object made, in order

    @classmethod
    def create(cls, hosts: int, prefix: str | None = None) -> Lab:
        """Build a lab; on any failure tear down what was made and re-raise."""
        lab = cls(prefix or "lt" + uuid.uuid4().hex[:6], hosts)
        try:
            lab._up()
        except BaseException:
            lab.down()
            raise
        return lab

    # -- names -------------------------------------------------------------------------

    def _index(self, host: str) -> int:
        m = re.fullmatch(r"h(\d+)", host)
        if not m or not 1 <= int(m.group(1)) <= self.hosts:
            raise ValueError(f"no host {host!r} in lab {self.prefix} (h1..h{self.hosts})")
        return int(m.group(1))

    def ns(self, host: str) -> str:
        return f"{self.prefix}-h{self._index(host)}"

    def addr(self, host: str) -> str:
        return f"{SUBNET}.{10 + self._index(host)}"

    @property
    def names(self) -> list[str]:
        return [f"h{i}" for i in range(1, self.hosts + 1)]

    # -- setup / teardown --------------------------------------------------------------

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self.created.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def _up(self) -> None:
        if shutil.which("nft") is None:
            raise LabError("nft not found (apt-get install nftables): hosts cannot be fenced")
        br = self.bridge_ns
        self._add_ns(br)
        self._sysctl(br, "net.ipv4.ip_forward=0", "net.ipv6.conf.all.forwarding=0")
        # a dumb switch: no STP, no IGMP snooping, so every port sees all multicast
        _ip("-n", br, "link", "add", "br0", "type", "bridge", "stp_state", "0",
            "forward_delay", "0", "mcast_snooping", "0")
        _ip("-n", br, "addr", "add", f"{BRIDGE_ADDR}/24", "dev", "br0")
        _ip("-n", br, "link", "set", "br0", "up")
        for i in range(1, self.hosts + 1):
            ns, port = f"{self.prefix}-h{i}", f"p{i}"
            self._add_ns(ns)
            self._sysctl(ns, "net.ipv6.conf.all.accept_dad=0", "net.ipv6.conf.default.accept_dad=0")
            _ip("-n", br, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", br, "link", "set", port, "master", "br0")
            _ip("-n", br, "link", "set", port, "up")
            _ip("-n", ns, "link", "set", "eth0", "multicast", "on")
            _ip("-n", ns, "addr", "add", f"{SUBNET}.{10 + i}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "route", "add", "224.0.0.0/4", "dev", "eth0")
            _ip("-n", ns, "route", "add", "default", "via", BRIDGE_ADDR, "dev", "eth0")
            _ip("netns", "exec", ns, "nft", "-f", "-", stdin=FENCE)

    def _sysctl(self, ns: str, *settings: str) -> None:
        _ip("netns", "exec", ns, "sysctl", "-qw", *settings)

    def down(self) -> None:
        """Stop processes left in our namespaces (TERM, then KILL, bounded), delete them."""
        for ns in reversed(self.created):
            self._stop_procs(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.created.clear()

    @staticmethod
    def _stop_procs(ns: str) -> None:
        def pids() -> list[int]:
            r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
            return [int(p) for p in r.stdout.split()]

        for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
            left = pids()
            if not left:
                return
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait
            while pids() and time.monotonic() < deadline:
                time.sleep(0.05)

    def exists(self) -> list[str]:
        """Namespaces of this lab that exist now (for teardown checks)."""
        listed = Path("/run/netns")
        if not listed.is_dir():
            return []
        return sorted(n.name for n in listed.iterdir() if n.name.startswith(self.prefix + "-"))

    # -- using the lab -----------------------------------------------------------------

    def cmd(self, host: str, *argv: str) -> list[str]:
        """argv that runs inside host's namespace, with LAB_ADDR/LAB_HOST in its environment."""
        return ["ip", "netns", "exec", self.ns(host), "env", f"LAB_HOST={host}",
                f"LAB_ADDR={self.addr(host)}", *argv]

    def run(self, host: str, *argv: str, timeout: float = 30, env: dict[str, str] | None = None,
            check: bool = False) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.cmd(host, *argv), capture_output=True, text=True, timeout=timeout,
                              env=env, check=check)

    def spawn(self, host: str, *argv: str, env: dict[str, str] | None = None,
              **kw: object) -> subprocess.Popen[str]:
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        return subprocess.Popen(self.cmd(host, *argv), text=True, env=env, **kw)  # type: ignore[call-overload]

    def reachable(self, src: str, dst: str, timeout: float = 1.0) -> bool:
        """Does a TCP SYN from src to dst get an answer (RST counts)?  `ping` may be absent."""
        r = self.run(src, sys.executable, "-c", PROBE, self.addr(dst), str(timeout), timeout=timeout + 10)
        return r.returncode == 0

    def cut(self, host: str) -> None:
        """Unplug host: its bridge port goes down, it keeps its address, no goodbye is sent."""
        _ip("-n", self.bridge_ns, "link", "set", f"p{self._index(host)}", "down")

    def heal(self, host: str) -> None:
        _ip("-n", self.bridge_ns, "link", "set", f"p{self._index(host)}", "up")

    def rate(self, host: str, mbit: int) -> None:
        """Limit what host sends to mbit Mbit/s with tc tbf (netem is absent here); 0 removes it."""
        if mbit:
            _ip("netns", "exec", self.ns(host), "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf",
                "rate", f"{mbit}mbit", "burst", "64kb", "latency", "50ms")
        else:
            subprocess.run(["ip", "netns", "exec", self.ns(host), "tc", "qdisc", "del", "dev", "eth0",
                            "root"], capture_output=True, timeout=30)

    def tx_bytes(self, host: str) -> int:
        """Bytes host has sent on its LAN link so far."""
        stats = json.loads(_ip("-n", self.ns(host), "-s", "-j", "link", "show", "eth0"))
        return int(stats[0]["stats64"]["tx"]["bytes"])
