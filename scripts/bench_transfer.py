#!/usr/bin/env python3
"""Transfer benchmark (issue 12): p2pnode share + fetch against curl, rsync and Syncthing,
side by side in a namespace lab (Linux, root).

    .venv/bin/python scripts/bench_transfer.py [--quick] [--reps N] [--only PART ...] [--tools a,b]

Hosts h1 (holder), h2 (fetcher) and h3 (a second holder) on one bridge.  Every tool moves
the same generated Pi-shaped sessions (scripts/bench_share.py's generator, with image lines)
from h1 to h2; the daemons run before the clock starts, the commands' own start is timed:
  * curl over mutual TLS from nginx (`ssl_verify_client on`), writing the file then `sync`
    (fsync) on it; +1 % with `-C -` (appends the tail, unverified);
  * `rsync -az --fsync` from an rsync daemon on h1;
  * Syncthing (Debian's): one folder shared by h1 and h2, devices given by id and address,
    global/local discovery, relays, NAT off; a scan is triggered over h1's REST API and the
    clock stops when h2's REST API says its copy is complete;
  * p2pnode: `share` (through h1's running `p2pnode serve`), then a one-shot
    `p2pnode fetch BRANCH --from h1 --json` in h2 (verified, stored, placed, fsynced), and
    the same fetch again through h2's own running node, as the README runs it (a node on
    each laptop, as Syncthing has its daemon on each): reported beside the one-shot one,
    with goals of its own (`node_*` figures; the one-shot's goals are the issue's).
Scenarios: first transfer unthrottled and at 100 Mbit/s (tc tbf on the holders' veth),
+1 % appended, a fork (90 % of the parent's lines) with the parent held, two holders at
100 Mbit/s each against one, one of them cut mid-transfer, the fetch killed (-9) at ~50 %
then run again, peak RSS of fetch, serving node and share on a 2 GB session with ~5,000
image lines.  Wire bytes are counted on h2's veth (both directions: everything the fetch
moved), CPU is user+sys of every process of the tool (clients from wait4, daemons from
/proc, children included).  Medians of --reps runs.  Missing baselines are installed with
apt-get when run as root; one that cannot run leaves its goals unmet with the reason.
`--quick`: small sessions (16 MB, the "2 GB" one 96 MB), one run each, about a minute;
the JSON says so.  One JSON object on stdout (goals as in issue 12), progress on stderr.
"""
from __future__ import annotations

import argparse
import atexit
import compileall
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO / "tests"), str(REPO)]

from _benchlib import emit, goal, goals_met, log, median, process_cpu, unmet  # noqa: E402
from bench_share import SessionWriter  # noqa: E402  (the Pi-shaped generator)
from lab import Lab, unavailable_reason  # noqa: E402
from lannode import LanNode, wait_for  # noqa: E402

from p2pnode.pi.hashing import hash_file  # noqa: E402

MB = 1_000_000
P2P_PORT, HTTPS_PORT, RSYNC_PORT, ST_PORT = 47470, 8443, 8730, 22000
ST_GUI = "127.0.0.1:8384"
ST_KEY = "bench-transfer-api-key"
ST_FOLDER = "bench"
TOOLS = ("curl", "rsync", "syncthing", "p2pnode")
STEPS = ("unthrottled", "100mbit", "first_100mbit", "holders", "memory")
"""--only's parts: the unthrottled first transfers, +1 % and fork; the first transfers and the
fork at 100 Mbit/s (first_100mbit: the first transfers alone); two holders, the cut and the
kill -9; the 2 GB session's memory."""
PACKAGES = {"curl": "curl", "openssl": "openssl", "nginx": "nginx-light", "rsync": "rsync",
            "syncthing": "syncthing", "sync": "coreutils"}
STAMP = "2026-11-21T19-00-00-000Z"


# --- processes: time, CPU and peak RSS ---------------------------------------------------------


@dataclass
class Run:
    """One command run in a lab host: wall seconds, CPU from wait4 (its waited-for children
    included) and peak RSS (its VmHWM, sampled every ~2 ms: wait4's ru_maxrss would count the
    benchmark's own pages, which a forked child holds until it execs)."""

    rc: int
    out: str
    err: str
    seconds: float
    cpu: float
    peak_rss_mb: float

    def check(self, what: str) -> Run:
        if self.rc:
            raise RuntimeError(f"{what} failed (exit {self.rc}): {self.err.strip()[-800:]}")
        return self


def run(lab: Lab, host: str, argv: list[str], env: dict[str, str] | None = None, timeout: float = 900,
        on_poll: Callable[[subprocess.Popen[bytes]], None] | None = None, max_as: int | None = None) -> Run:
    """Run argv in host; `on_poll(proc)` is called every ~2 ms while it runs (to cut a link or
    kill it at a point); `max_as` caps its address space (bytes, with prlimit) so a runaway
    fails instead of taking the machine.  Killed with SIGKILL after `timeout` seconds."""
    if max_as is not None:
        argv = ["prlimit", f"--as={max_as}", "--", *argv]
    peak = 0.0
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        proc = subprocess.Popen(lab.cmd(host, *argv), stdout=out, stderr=err, env=env)
        while True:
            with contextlib.suppress(OSError, RuntimeError):  # not exec'd yet, or exiting
                peak = max(peak, vm_hwm_mb(proc.pid))
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - t0 > timeout:
                proc.kill()
            elif on_poll is not None:
                on_poll(proc)
            time.sleep(0.002)
        seconds = time.monotonic() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return Run(proc.returncode, out.read().decode(errors="replace"), err.read().decode(errors="replace"),
                   seconds, usage.ru_utime + usage.ru_stime, peak)


def tree_cpu(pid: int) -> float:
    """CPU seconds of a daemon and of every process under it (a Syncthing monitor's child,
    nginx's workers, the node's scan process); exited children count once reaped."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                parents.setdefault(ppid, []).append(int(entry.name))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += process_cpu(p, reaped_children=True)
        todo += parents.get(p, [])
    return total


def vm_hwm_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


class Links:
    """Byte counters of each host's eth0, read from the root namespace through /proc/<pid>/net/dev
    of one idle process per host (no subprocess per read: cheap enough to poll)."""

    def __init__(self, lab: Lab) -> None:
        null = subprocess.DEVNULL
        self.anchors = {h: lab.spawn(h, "sleep", "86400", stdout=null, stderr=null) for h in lab.names}

    def rx_tx(self, host: str) -> tuple[int, int]:
        for line in Path(f"/proc/{self.anchors[host].pid}/net/dev").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name.strip() == "eth0":
                f = rest.split()
                return int(f[0]), int(f[8])
        raise RuntimeError(f"no eth0 in {host}")

    def total(self, host: str) -> int:
        return sum(self.rx_tx(host))

    def close(self) -> None:
        for p in self.anchors.values():
            p.kill()
            p.wait(10)


# --- sessions --------------------------------------------------------------------------------


class Sessions:
    """The generated sessions, on the shared disk, with the writer of each (to grow or fork it)."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "sessions"
        self.dir.mkdir(parents=True)
        self.writers: dict[Path, SessionWriter] = {}

    def make(self, seed: int, size: int, image_rate: float = 0.02) -> Path:
        session_id = str(uuid.UUID(int=(0x01A1FF93 << 96) | seed))
        path = self.dir / f"{STAMP}_{session_id}.jsonl"
        writer = SessionWriter(seed, image_rate)
        with open(path, "wb") as f:
            f.write(writer.session(session_id, min(size, 4 * MB)))
            while f.tell() < size:
                f.write(writer.growth(min(64 * MB, size - f.tell())))
            _settled(f)
        self.writers[path] = writer
        return path

    def grow(self, path: Path, fraction: float) -> int:
        """Append whole turns (about `fraction` of the file), as Pi does; bytes appended."""
        tail = self.writers[path].growth(int(path.stat().st_size * fraction))
        with open(path, "ab") as f:
            f.write(tail)
            _settled(f)
        return len(tail)

    def fork(self, parent: Path, seed: int) -> Path:
        """A Pi fork: a new header naming the parent, 90 % of its lines, then 1 % of new ones."""
        writer = self.writers[parent]
        session_id = str(uuid.UUID(int=(0x01A1FF93 << 96) | seed))
        path = self.dir / f"{STAMP}_{session_id}.jsonl"
        lines = parent.read_bytes().split(b"\n")[1:-1]
        body = b"\n".join(lines[: len(lines) * 9 // 10]) + b"\n"
        writer.last_id = None
        with open(path, "wb") as f:
            f.write(writer.header(session_id, parent=str(parent)) + body)
            f.write(writer.growth(parent.stat().st_size // 100))
            _settled(f)
        self.writers[path] = writer
        return path


def _settled(f: BinaryIO) -> None:
    """The benchmark's own session file on disk before any tool moves it: its write-back
    (256 MB left to the kernel's 30 s timer) must not land in a tool's measurement."""
    f.flush()
    os.fsync(f.fileno())


# --- the tools ---------------------------------------------------------------------------------


@dataclass
class Moved:
    """One transfer by one tool: wall seconds, CPU of all its processes, bytes on h2's wire."""

    seconds: float
    cpu: float
    wire: int
    parts: dict[str, float] = field(default_factory=dict)


class Tool:
    """A tool moving files from h1 to h2; `send` places the file at the holder, `get` moves it."""

    name = ""

    def __init__(self, lab: Lab, root: Path, links: Links) -> None:
        self.lab, self.links = lab, links
        self.dir = root / self.name
        self.out = self.dir / "h2"
        self.out.mkdir(parents=True)

    def move(self, path: Path, again: bool = False) -> Moved:
        """Offer path (new, or grown when `again`) on h1 and get it on h2, measured."""
        raise NotImplementedError

    def received(self, path: Path) -> Path:
        return self.out / path.name

    def close(self) -> None:
        """Daemons stop with the lab (Lab.down TERMs, then KILLs, every process in it)."""


class Curl(Tool):
    name = "curl"
    CONF = textwrap.dedent("""
        user root;
        worker_processes 2;
        daemon off;
        pid {d}/nginx.pid;
        error_log {d}/error.log;
        events {{ worker_connections 64; }}
        http {{
            access_log off;
            sendfile on;
            client_body_temp_path {d}/tmp; proxy_temp_path {d}/tmp; fastcgi_temp_path {d}/tmp;
            uwsgi_temp_path {d}/tmp; scgi_temp_path {d}/tmp;
            server {{
                listen {addr}:{port} ssl;
                ssl_protocols TLSv1.3;
                ssl_certificate {d}/server.crt; ssl_certificate_key {d}/server.key;
                ssl_client_certificate {d}/client.crt; ssl_verify_client on;
                root {d}/www;
            }}
        }}
    """)

    def __init__(self, lab: Lab, root: Path, links: Links) -> None:
        super().__init__(lab, root, links)
        d = self.dir
        (d / "www").mkdir()
        (d / "tmp").mkdir()
        for who, cn in (("server", "h1"), ("client", "h2")):
            subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                            "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2", "-subj", f"/CN={cn}",
                            "-addext", f"subjectAltName=DNS:{cn}", "-keyout", str(d / f"{who}.key"),
                            "-out", str(d / f"{who}.crt")], check=True, capture_output=True, timeout=60)
        (d / "nginx.conf").write_text(self.CONF.format(d=d, addr=lab.addr("h1"), port=HTTPS_PORT))
        self.proc = lab.spawn("h1", "nginx", "-c", str(d / "nginx.conf"), "-p", str(d),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        (d / "www" / "ping").write_text("ok")
        wait_for("nginx to answer", lambda: self._curl("ping", self.out / "ping", False).rc == 0, 30)

    def _curl(self, name: str, dest: Path, resume: bool) -> Run:
        d = self.dir
        script = ('curl -sS --fail $RESUME --cert "$D/client.crt" --key "$D/client.key" '
                  '--cacert "$D/server.crt" --resolve "h1:$PORT:$ADDR" -o "$1" "https://h1:$PORT/$2" '
                  '&& sync "$1"')
        env = dict(os.environ, D=str(d), PORT=str(HTTPS_PORT), ADDR=self.lab.addr("h1"),
                   RESUME="-C -" if resume else "")
        return run(self.lab, "h2", ["sh", "-c", script, "sh", str(dest), name], env=env)

    def move(self, path: Path, again: bool = False) -> Moved:
        held = self.dir / "www" / path.name
        if not held.exists():
            os.link(path, held)
        cpu0, wire0 = tree_cpu(self.proc.pid), self.links.total("h2")
        r = self._curl(path.name, self.received(path), again).check("curl")
        return Moved(r.seconds, r.cpu + tree_cpu(self.proc.pid) - cpu0, self.links.total("h2") - wire0)


class Rsync(Tool):
    name = "rsync"

    def __init__(self, lab: Lab, root: Path, links: Links) -> None:
        super().__init__(lab, root, links)
        d = self.dir
        (d / "module").mkdir()
        (d / "rsyncd.conf").write_text(
            f"address = {lab.addr('h1')}\nport = {RSYNC_PORT}\nuse chroot = no\nuid = root\ngid = root\n"
            f"pid file = {d}/rsyncd.pid\nlog file = {d}/rsyncd.log\n"
            f"[bench]\npath = {d}/module\nread only = yes\n")
        self.proc = lab.spawn("h1", "rsync", "--daemon", "--no-detach", f"--config={d}/rsyncd.conf",
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for("rsyncd to answer", lambda: self._rsync("", None).rc == 0, 30)

    def _rsync(self, name: str, dest: Path | None) -> Run:
        src = f"rsync://{self.lab.addr('h1')}:{RSYNC_PORT}/bench/{name}"
        return run(self.lab, "h2", ["rsync", "-az", "--fsync", src, *([f"{dest}/"] if dest else [])])

    def move(self, path: Path, again: bool = False) -> Moved:
        held = self.dir / "module" / path.name
        if not held.exists():
            os.link(path, held)
        cpu0, wire0 = tree_cpu(self.proc.pid), self.links.total("h2")
        r = self._rsync(path.name, self.out).check("rsync")
        return Moved(r.seconds, r.cpu + tree_cpu(self.proc.pid) - cpu0, self.links.total("h2") - wire0)


ST_WAIT = textwrap.dedent("""
    import json, sys, time, urllib.request
    want, timeout = int(sys.argv[1]), float(sys.argv[2])
    url = "http://%s/rest/db/status?folder=%s" % (sys.argv[3], sys.argv[4])
    req = urllib.request.Request(url, headers={"X-API-Key": sys.argv[5]})
    print("ready", flush=True)
    sys.stdin.readline()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = json.load(urllib.request.urlopen(req, timeout=10))
        if s["localBytes"] == want == s["globalBytes"] and s["needBytes"] == 0 and s["needFiles"] == 0:
            print(time.monotonic(), flush=True)
            sys.exit(0)
        time.sleep(0.005)
    sys.exit(f"not in sync after {timeout} s: {s}")
""")


class Syncthing(Tool):
    """Two Syncthing devices (h1, h2), one folder; scans only when asked (REST)."""

    name = "syncthing"

    def __init__(self, lab: Lab, root: Path, links: Links) -> None:
        super().__init__(lab, root, links)
        self.folders = {"h1": self.dir / "h1-folder", "h2": self.out}
        self.homes = {h: self.dir / f"{h}-home" for h in ("h1", "h2")}
        ids = {}
        for h, home in self.homes.items():
            subprocess.run(["syncthing", "generate", f"--home={home}", "--no-default-folder",
                            "--skip-port-probing"], check=True, capture_output=True, timeout=120)
            ids[h] = subprocess.run(["syncthing", "serve", f"--home={home}", "--device-id"], check=True,
                                    capture_output=True, text=True, timeout=60).stdout.strip()
            (self.folders[h] / ".stfolder").mkdir(parents=True, exist_ok=True)
        self.ids = ids
        for h, home in self.homes.items():
            self._configure(home / "config.xml", h)
        self.procs = {h: lab.spawn(h, "syncthing", "serve", f"--home={home}", "--no-browser", "--no-restart",
                                   "--no-upgrade", f"--logfile={self.dir}/{h}.log",
                                   env=dict(os.environ, STNORESTART="1", STNOUPGRADE="1", HOME=str(home)),
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                      for h, home in self.homes.items()}
        other = {"h1": "h2", "h2": "h1"}
        wait_for("Syncthing devices to connect", lambda: all(
            self.rest(h, "GET", "/rest/system/connections").get("connections", {}).get(self.ids[other[h]], {})
            .get("connected") for h in self.homes), 90, every=0.5)

    def _configure(self, config: Path, host: str) -> None:
        tree = ET.parse(config)
        cfg = tree.getroot()
        gui = cfg.find("gui")
        assert gui is not None
        gui.find("address").text = ST_GUI  # type: ignore[union-attr]
        gui.find("apikey").text = ST_KEY  # type: ignore[union-attr]
        opts = cfg.find("options")
        assert opts is not None
        for key, value in (("listenAddress", f"tcp://{self.lab.addr(host)}:{ST_PORT}"),
                           ("globalAnnounceEnabled", "false"), ("localAnnounceEnabled", "false"),
                           ("relaysEnabled", "false"), ("natEnabled", "false"), ("startBrowser", "false"),
                           ("urAccepted", "-1"), ("autoUpgradeIntervalH", "0"),
                           ("crashReportingEnabled", "false"), ("setLowPriority", "false")):
            opts.find(key).text = value  # type: ignore[union-attr]
        for old in cfg.findall("device"):
            cfg.remove(old)
        folder = ET.SubElement(cfg, "folder", id=ST_FOLDER, label=ST_FOLDER, path=str(self.folders[host]),
                               type="sendreceive", rescanIntervalS="86400", fsWatcherEnabled="false")
        for h, device_id in self.ids.items():
            device = ET.SubElement(cfg, "device", id=device_id, name=h, compression="metadata",
                                   introducer="false")
            ET.SubElement(device, "address").text = f"tcp://{self.lab.addr(h)}:{ST_PORT}"
            ET.SubElement(folder, "device", id=device_id)
        tree.write(config)

    def rest(self, host: str, method: str, path: str) -> dict[str, Any]:
        r = self.lab.run(host, "curl", "-sS", "-X", method, "-H", f"X-API-Key: {ST_KEY}", f"http://{ST_GUI}{path}",
                         timeout=60)
        try:
            return json.loads(r.stdout) if r.stdout.strip() else {}
        except ValueError:
            return {}

    def cpu(self) -> float:
        return sum(tree_cpu(p.pid) for p in self.procs.values())

    def move(self, path: Path, again: bool = False) -> Moved:
        held = self.folders["h1"] / path.name
        if not held.exists():
            os.link(path, held)
        want = sum(f.stat().st_size for f in self.folders["h1"].iterdir() if f.is_file())
        waiter = self.lab.spawn("h2", sys.executable, "-c", ST_WAIT, str(want), "900", ST_GUI, ST_FOLDER,
                                ST_KEY, stdin=subprocess.PIPE)
        try:
            assert waiter.stdout is not None and waiter.stdin is not None
            if waiter.stdout.readline().strip() != "ready":
                raise RuntimeError("the Syncthing waiter did not start")
            cpu0, wire0 = self.cpu(), self.links.total("h2")
            t0 = time.monotonic()
            waiter.stdin.write("go\n")
            waiter.stdin.flush()
            self.rest("h1", "POST", f"/rest/db/scan?folder={ST_FOLDER}")
            out, err = waiter.communicate(timeout=960)
            if waiter.returncode:
                raise RuntimeError(f"Syncthing did not finish: {err.strip()[-800:]}")
            return Moved(float(out.split()[-1]) - t0, self.cpu() - cpu0, self.links.total("h2") - wire0)
        finally:
            if waiter.poll() is None:
                waiter.kill()
                waiter.communicate()


class P2p(Tool):
    """h1's `p2pnode serve` shares (CLI through the node); h2 fetches one-shot (CLI, no node),
    then again through its own `p2pnode serve` (the CLI hands the fetch to it)."""

    name = "p2pnode"

    def __init__(self, lab: Lab, root: Path, links: Links) -> None:
        super().__init__(lab, root, links)
        self.nodes = {h: LanNode(lab, h, self.dir / "nodes") for h in ("h1", "h2", "h3")}
        h1, h2, h3 = self.nodes.values()
        h1.trust(h2, h3)
        h3.trust(h1, h2)
        h2.trust(h1, h3)
        self.fetcher = self.home("main")
        self.homes = 0
        self.placed: dict[str, Path] = {}
        """Where the fetches placed each session (by the sent file's name)."""
        h1.start(P2P_PORT)
        h2.start(P2P_PORT)
        floor = [run(lab, "h1", [sys.executable, "-m", "p2pnode", "status", "--json"], env=h1.env).seconds
                 for _ in range(3)]
        self.cli_floor_s = median(floor)
        """A CLI command that asks the running node for nothing much: what any command costs."""

    def home(self, name: str) -> dict[str, str]:
        """A fetcher's state dir (h2's identity and trust list, no sessions) and its Pi dir."""
        template, home = self.nodes["h2"], self.dir / "fetchers" / name
        shutil.copytree(template.paths.identity, home / "node" / "identity")
        shutil.copy(template.paths.trust, home / "node" / "trust.json")
        (home / "agent").mkdir()
        return dict(template.env, P2PNODE_HOME=str(home / "node"), PI_CODING_AGENT_DIR=str(home / "agent"))

    def fresh(self) -> dict[str, str]:
        self.homes += 1
        return self.home(f"f{self.homes}")

    def share(self, path: Path, holder: str = "h1") -> tuple[str, Run]:
        node = self.nodes[holder]
        r = run(self.lab, holder, [sys.executable, "-m", "p2pnode", "share", str(path), "--json"],
                env=node.env).check("p2pnode share")
        return json.loads(r.out)["branch"], r

    def fetch(self, branch: str, env: dict[str, str], holders: tuple[str, ...] = ("h1",),
              on_poll: Callable[[subprocess.Popen[bytes]], None] | None = None,
              max_as: int | None = None) -> Run:
        froms = [a for h in holders for a in ("--from", f"{self.lab.addr(h)}:{P2P_PORT}")]
        return run(self.lab, "h2", [sys.executable, "-m", "p2pnode", "fetch", branch, *froms, "--json"],
                   env=env, on_poll=on_poll, max_as=max_as)

    def move(self, path: Path, again: bool = False, env: dict[str, str] | None = None) -> Moved:
        holder = self.nodes["h1"].proc
        assert holder is not None
        node_cpu0, wire0 = tree_cpu(holder.pid), self.links.total("h2")
        branch, shared = self.share(path)
        share_cpu = shared.cpu + tree_cpu(holder.pid) - node_cpu0  # the CLI and the node's import
        got = self.fetch(branch, env or self.fetcher).check("p2pnode fetch")
        placed = json.loads(got.out).get("path")
        if placed:
            self.placed[path.name] = Path(placed)
        cpu = shared.cpu + got.cpu + tree_cpu(holder.pid) - node_cpu0
        moved = Moved(shared.seconds + got.seconds, cpu, self.links.total("h2") - wire0,
                      {"share_s": shared.seconds, "fetch_s": got.seconds, "share_cpu_s": round(share_cpu, 3)})
        via = self._fetch_through_node(branch, path)
        moved.parts.update(node_fetch_s=via.seconds, node_total_s=shared.seconds + via.seconds,
                           node_cpu_s=share_cpu + via.cpu, node_wire_bytes=via.wire)
        return moved

    def _fetch_through_node(self, branch: str, path: Path) -> Moved:
        """The same fetch by h2's running node (the CLI hands it over), its file checked."""
        node, holder = self.nodes["h2"], self.nodes["h1"]
        assert node.proc is not None and holder.proc is not None
        pids = (node.proc.pid, holder.proc.pid)
        cpu0, wire0 = sum(tree_cpu(p) for p in pids), self.links.total("h2")
        r = run(self.lab, "h2", [sys.executable, "-m", "p2pnode", "fetch", branch, "--from",
                                 f"{self.lab.addr('h1')}:{P2P_PORT}", "--json"],
                env=node.env).check("p2pnode fetch through h2's node")
        placed = Path(json.loads(r.out)["path"])
        if hash_file(placed) != hash_file(path):
            raise RuntimeError(f"{placed} (placed by h2's node) differs from what was sent")
        via = Moved(r.seconds, r.cpu + sum(tree_cpu(p) for p in pids) - cpu0, self.links.total("h2") - wire0)
        log(f"  p2pnode   through h2's node: fetch {via.seconds:7.3f} s  {via.wire / MB:8.2f} MB on the "
            f"wire  cpu {via.cpu:6.2f} s")
        return via

    def received(self, path: Path) -> Path:
        return self.placed.get(path.name, path)


TOOL_CLASSES: dict[str, type[Tool]] = {"curl": Curl, "rsync": Rsync, "syncthing": Syncthing, "p2pnode": P2p}
NEEDS = {"curl": ("curl", "openssl", "nginx", "sync"), "rsync": ("rsync",),
         "syncthing": ("syncthing", "curl"), "p2pnode": ()}


def missing_programs() -> dict[str, str]:
    """{program: why} for each program a baseline needs that is not installed."""
    return {p: f"`{p}` not found and could not be installed (apt-get install {PACKAGES[p]})"
            for progs in NEEDS.values() for p in progs if shutil.which(p) is None}


def install_missing() -> dict[str, str]:
    """apt-get install the baselines' missing programs (root only); what is still missing."""
    missing = missing_programs()
    if missing and os.geteuid() == 0 and shutil.which("apt-get"):
        pkgs = sorted({PACKAGES[p] for p in missing})
        log(f"installing {' '.join(pkgs)} ...")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *pkgs]
        if subprocess.run(install, capture_output=True, env=env, timeout=900).returncode:
            subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, timeout=900)
            subprocess.run(install, capture_output=True, env=env, timeout=900)
    return missing_programs()


# --- the scenarios -----------------------------------------------------------------------------


class Bench:
    def __init__(self, lab: Lab, root: Path, quick: bool, reps: int) -> None:
        self.lab, self.root, self.quick, self.reps = lab, root, quick, reps
        self.links = Links(lab)
        self.sessions = Sessions(root)
        self.tools: dict[str, Tool] = {}
        self.why: dict[str, str] = {}
        """Why a tool (or a scenario, 'p2pnode:<scenario>') could not be measured."""
        self.result: dict[str, Any] = {}

    def start_tools(self, missing: dict[str, str], tools: Collection[str] = TOOLS) -> None:
        for name, cls in TOOL_CLASSES.items():
            if name not in tools:
                self.why[name] = "not run (--tools)"
                continue
            gone = [missing[p] for p in NEEDS[name] if p in missing]
            if gone:
                self.why[name] = "; ".join(gone)
                continue
            try:
                self.tools[name] = cls(self.lab, self.root, self.links)
            except Exception as exc:  # a baseline that cannot run is an unmet goal, never a crash
                self.why[name] = f"could not start: {exc}"
                log(f"{name}: {self.why[name]}")

    def close(self) -> None:
        p2p = self.tools.get("p2pnode")
        if isinstance(p2p, P2p):
            for node in p2p.nodes.values():
                with contextlib.suppress(Exception):
                    node.stop()
        self.links.close()

    @contextlib.contextmanager
    def throttled(self, *hosts: str, mbit: int = 100) -> Iterator[None]:
        try:
            for h in hosts:
                self.lab.rate(h, mbit)
            yield
        finally:
            for h in hosts:
                self.lab.rate(h, 0)

    def each_tool(self, scenario: str, path: Path, again: bool = False) -> dict[str, Moved]:
        """Every tool moves path once; a failure is recorded for that tool and scenario."""
        got: dict[str, Moved] = {}
        for name, tool in self.tools.items():
            try:
                got[name] = tool.move(path, again)
                if hash_file(tool.received(path)) != hash_file(path):
                    raise RuntimeError(f"{tool.received(path)} differs from what was sent")
            except Exception as exc:
                self.why.setdefault(f"{name}:{scenario}", str(exc)[-800:])
                log(f"  {name} {scenario}: FAILED {exc}")
                continue
            m = got[name]
            log(f"  {name:9s} {scenario}: {m.seconds:7.3f} s  {m.wire / MB:8.2f} MB on the wire  "
                f"cpu {m.cpu:6.2f} s")
        return got

    def first_transfers(self, scenario: str, size: int, seed0: int) -> list[Path]:
        runs: dict[str, list[Moved]] = {}
        paths = []
        for rep in range(self.reps):
            path = self.sessions.make(seed0 + rep, size)
            paths.append(path)
            log(f"{scenario} rep {rep + 1}/{self.reps} ({path.stat().st_size / MB:.0f} MB)")
            for name, m in self.each_tool(scenario, path).items():
                runs.setdefault(name, []).append(m)
        self.result[scenario] = {"size_bytes": paths[0].stat().st_size,
                                 "images": paths[0].read_bytes().count(b'"type":"image"'),
                                 **{n: summarize(ms, paths[0].stat().st_size) for n, ms in runs.items()}}
        return paths

    def once(self, scenario: str, path: Path, again: bool = False) -> None:
        got = self.each_tool(scenario, path, again)
        self.result[scenario] = {"size_bytes": path.stat().st_size,
                                 **{n: summarize([m], path.stat().st_size) for n, m in got.items()}}

    # p2pnode only: several holders, a cut holder, a killed fetch, memory ---------------------

    def holders(self, size: int, seed: int) -> None:
        p2p = self.tools.get("p2pnode")
        if not isinstance(p2p, P2p):
            return
        path = self.sessions.make(seed, size)
        h3 = p2p.nodes["h3"]
        copy = h3.agent / path.name
        shutil.copy(path, copy)
        h3.start(P2P_PORT)
        branch, _ = p2p.share(path)
        branch3, _ = p2p.share(copy, holder="h3")
        if branch3 != branch:
            raise RuntimeError(f"the same bytes shared on h3 gave another branch ({branch3} != {branch})")
        out: dict[str, Any] = {"size_bytes": path.stat().st_size}
        with self.throttled("h1", "h3"):
            for label, hosts in (("one_holder", ("h1",)), ("two_holders", ("h1", "h3"))):
                runs = []
                for _ in range(self.reps):
                    wire0 = self.links.total("h2")
                    r = p2p.fetch(branch, p2p.fresh(), hosts).check(f"fetch from {' and '.join(hosts)}")
                    runs.append({"seconds": r.seconds, "wire": self.links.total("h2") - wire0,
                                 "result": json.loads(r.out)})
                out[label] = {"seconds_median": round(median([x["seconds"] for x in runs]), 3),
                              "wire_bytes": runs[0]["wire"], "fetch_result": _short(runs[0]["result"])}
                log(f"  p2pnode {label}: {out[label]['seconds_median']} s")
            full_wire = out["one_holder"]["wire_bytes"]
            out["cut"] = self._cut_one(p2p, branch, full_wire)
            out["kill9"] = self._kill_and_rerun(p2p, branch, full_wire)
        self.result["holders_100mbit"] = out

    def _cut_one(self, p2p: P2p, branch: str, full_wire: int) -> dict[str, Any]:
        """Two holders, h1 unplugged when 40 % of the bytes have crossed; healed afterwards."""
        wire0 = self.links.total("h2")
        cut_at: list[float] = []
        t0 = time.monotonic()

        def cut(_proc: subprocess.Popen[bytes]) -> None:
            if not cut_at and self.links.total("h2") - wire0 >= 0.4 * full_wire:
                self.lab.cut("h1")
                cut_at.append(time.monotonic())

        try:
            r = p2p.fetch(branch, p2p.fresh(), ("h1", "h3"), on_poll=cut)
        finally:
            self.lab.heal("h1")
        log(f"  p2pnode two holders, h1 cut: {r.seconds:.3f} s (exit {r.rc})")
        return {"seconds": round(r.seconds, 3), "cpu": round(r.cpu, 3), "exit": r.rc,
                "cut": bool(cut_at), "cut_at_s": round(cut_at[0] - t0, 3) if cut_at else None,
                "error": r.err.strip()[-500:] if r.rc else None,
                "fetch_result": _short(json.loads(r.out)) if r.rc == 0 and r.out.strip() else None}

    def _kill_and_rerun(self, p2p: P2p, branch: str, full_wire: int) -> dict[str, Any]:
        """kill -9 of a one-shot fetch from h1 when half the bytes have crossed; then run it again."""
        env = p2p.fresh()
        wire0 = self.links.total("h2")

        def kill(proc: subprocess.Popen[bytes]) -> None:
            if self.links.total("h2") - wire0 >= 0.5 * full_wire:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)

        killed = p2p.fetch(branch, env, on_poll=kill)
        before = self.links.total("h2") - wire0
        wire1 = self.links.total("h2")
        again = p2p.fetch(branch, env)
        rerun = self.links.total("h2") - wire1
        log(f"  p2pnode kill -9 at {before / full_wire:.0%}, the rerun moved {rerun / full_wire:.0%} "
            f"(exit {again.rc})")
        out = {"killed_exit": killed.rc, "bytes_before_kill": before, "rerun_bytes": rerun,
               "rerun_exit": again.rc, "rerun_error": again.err.strip()[-500:] if again.rc else None,
               "full_fetch_bytes": full_wire, "rerun_over_full": round(rerun / full_wire, 4)}
        if again.rc == 0:  # why a rerun moved what it did: how much of the session, at what ratio
            got = json.loads(again.out)
            raw = sum(s["bytes"] for s in got["served"].values())
            out.update(rerun_raw_bytes=raw, rerun_body_per_raw=round(got["bytes_received"] / max(1, raw), 4))
        return out

    def memory(self, size: int, seed: int) -> None:
        """Peak RSS of share (one-shot), the serving node and fetch (one-shot) on a big session
        with ~5,000 image lines per 2 GB; the first holder's node is stopped first."""
        p2p = self.tools.get("p2pnode")
        if not isinstance(p2p, P2p):
            return
        for node in p2p.nodes.values():
            node.stop()
        path = self.sessions.make(seed, size, image_rate=0.125)
        holder = LanNode(self.lab, "h1", self.root / "rss")
        fetcher = LanNode(self.lab, "h2", self.root / "rss")
        holder.trust(fetcher)
        fetcher.trust(holder)
        cap = 12 << 30  # a runaway fails with MemoryError instead of taking the machine
        log(f"memory: {path.stat().st_size / MB:.0f} MB session, sharing ...")
        shared = run(self.lab, "h1", [sys.executable, "-m", "p2pnode", "share", str(path), "--json"],
                     env=holder.env, max_as=cap).check("share (memory)")
        branch = json.loads(shared.out)["branch"]
        holder.start(P2P_PORT)
        tries: list[Run] = []
        try:
            while len(tries) < 2 and (not tries or tries[-1].rc):  # once more if the first failed
                log("memory: fetching ...")
                tries.append(run(self.lab, "h2", [sys.executable, "-m", "p2pnode", "fetch", branch, "--from",
                                                  f"{self.lab.addr('h1')}:{P2P_PORT}", "--json"],
                                 env=fetcher.env, max_as=cap))
            assert holder.proc is not None
            node_mb = vm_hwm_mb(holder.proc.pid)
        finally:
            holder.stop()
        got = tries[-1]
        self.result["memory"] = {
            "size_bytes": path.stat().st_size, "images": path.read_bytes().count(b'"type":"image"'),
            "share_peak_rss_mb": round(shared.peak_rss_mb, 1), "share_s": round(shared.seconds, 2),
            "fetch_peak_rss_mb": round(max(t.peak_rss_mb for t in tries), 1),
            "fetch_s": round(got.seconds, 2), "fetch_exit": got.rc,
            "fetch_error": got.err.strip()[-500:] if got.rc else None,
            "fetch_tries": [{"exit": t.rc, "seconds": round(t.seconds, 2),
                             "peak_rss_mb": round(t.peak_rss_mb, 1),
                             "error": t.err.strip()[-300:] if t.rc else None} for t in tries],
            "serving_node_peak_rss_mb": round(node_mb, 1), "address_space_cap_gb": cap >> 30}
        log(f"  peak RSS: share {shared.peak_rss_mb:.0f}, node {node_mb:.0f}, fetch {got.peak_rss_mb:.0f} MB "
            f"({len(tries)} tries)")


def summarize(ms: list[Moved], size: int) -> dict[str, Any]:
    out = {"seconds_median": round(median([m.seconds for m in ms]), 3),
           "seconds": [round(m.seconds, 3) for m in ms],
           "wire_bytes_median": int(median([m.wire for m in ms])),
           "cpu_s_median": round(median([m.cpu for m in ms]), 3),
           "cpu_s_per_mb": round(median([m.cpu for m in ms]) / (size / MB), 5)}
    for key in ms[0].parts:
        out[f"{key}_median"] = round(median([m.parts[key] for m in ms]), 3)
    return out


def _short(result: dict[str, Any]) -> dict[str, Any]:
    """What a fetch --json said, without the long lists (but with who served what, who was dropped)."""
    return {k: v for k, v in result.items()
            if not isinstance(v, (list, dict)) or k in ("peers", "holders", "served", "dropped_peers")}


# --- goals -------------------------------------------------------------------------------------


def goals(res: dict[str, Any], why: dict[str, str], quick: bool) -> list[dict[str, Any]]:
    def value(scenario: str, tool: str, key: str = "seconds_median") -> float | str:
        """A measured figure, or why it is missing."""
        got = res.get(scenario, {}).get(tool)
        if got is not None:
            return float(got[key])
        return why.get(tool) or why.get(f"{tool}:{scenario}") or f"{tool} did not run {scenario}"

    def ratio(name: str, scenario: str, ours: str, theirs: str, target: float,
              key: str = "seconds_median") -> dict[str, Any]:
        """ours / theirs of one figure (lower is better), or unmet with why one is missing."""
        a, b = value(scenario, ours, key), value(scenario, theirs, key)
        if isinstance(a, str) or isinstance(b, str):
            return unmet(name, target, f"x {theirs}", a if isinstance(a, str) else str(b))
        if b <= 0:
            return unmet(name, target, f"x {theirs}", f"{theirs} measured {b} for {key}: no ratio")
        return goal(name, a / b, target, f"x {theirs}")

    size = "256 MB"
    if quick:
        size = f"{res.get('first_unthrottled', {}).get('size_bytes', 0) / MB:.0f} MB (quick)"
    out = [
        ratio(f"first transfer {size} unthrottled: share+fetch time / Syncthing's (faster)",
              "first_unthrottled", "p2pnode", "syncthing", 1.0),
        _fetch_vs_curl(res, why),
        ratio("first transfer at 100 Mbit/s: time / rsync -az's (faster)", "first_100mbit", "p2pnode",
              "rsync", 1.0),
        ratio("first transfer at 100 Mbit/s: wire bytes / rsync's", "first_100mbit", "p2pnode", "rsync", 1.0,
              key="wire_bytes_median"),
        ratio("+1 % appended: time / rsync's (faster)", "append_1pct", "p2pnode", "rsync", 1.0),
        ratio("+1 % appended: time / Syncthing's (faster)", "append_1pct", "p2pnode", "syncthing", 1.0),
    ]
    appended = value("append_1pct", "p2pnode")
    name = f"+1 % appended on {size}: share+fetch seconds"
    out.append(unmet(name, 0.5, "s", appended) if isinstance(appended, str)
               else goal(name, appended, 0.5, "s"))
    out += [
        ratio("+1 % appended: wire bytes / rsync's", "append_1pct", "p2pnode", "rsync", 1.5,
              key="wire_bytes_median"),
        ratio("fork with the parent held, unthrottled: time / Syncthing's (faster)", "fork_unthrottled",
              "p2pnode", "syncthing", 1.0),
        ratio("fork with the parent held, 100 Mbit/s: time / rsync's (faster)", "fork_100mbit", "p2pnode",
              "rsync", 1.0),
        ratio("CPU per MB of a first transfer / Syncthing's", "first_unthrottled", "p2pnode", "syncthing",
              3.0, key="cpu_s_per_mb"),
    ]
    mem = res.get("memory")
    label = "2 GB" if not quick else f"{(mem or {}).get('size_bytes', 0) / MB:.0f} MB (quick)"
    for who in ("fetch", "serving_node", "share"):
        name = f"peak RSS of {who.replace('_', ' ')} on a {label} session with image lines"
        if mem is None:
            out.append(unmet(name, 256, "MB", why.get("p2pnode:memory", "not measured")))
        elif who == "fetch" and mem["fetch_exit"]:
            out.append(unmet(name, 256, "MB", f"fetch failed (peak {mem['fetch_peak_rss_mb']} MB): "
                                              f"{mem['fetch_error']}"))
        else:
            out.append(goal(name, mem[f"{who}_peak_rss_mb"], 256, "MB"))
    hold = res.get("holders_100mbit")
    names = ("kill -9 at ~50 % then rerun: rerun bytes / a full fetch's",
             "two holders at 100 Mbit/s each: speed / one holder's",
             "a holder cut mid-transfer: seconds over an uncut fetch")
    if hold is None:
        reason = why.get("p2pnode:holders", "not measured")
        out += [unmet(names[0], 0.55, "x", reason), unmet(names[1], 1.7, "x", reason),
                unmet(names[2], 3, "s", reason)]
    else:
        k = hold["kill9"]
        out.append(goal(names[0], k["rerun_over_full"], 0.55, "x") if k["rerun_exit"] == 0
                   else unmet(names[0], 0.55, "x", f"the rerun failed: {k['rerun_error']}"))
        one, two = hold["one_holder"]["seconds_median"], hold["two_holders"]["seconds_median"]
        out.append(goal(names[1], one / two, 1.7, "x", higher_is_better=True))
        c = hold["cut"]
        out.append(goal(names[2], c["seconds"] - two, 3, "s") if c["exit"] == 0
                   else unmet(names[2], 3, "s", f"the fetch failed after the cut: {c['error']}"))
    out += node_goals(res, size)
    name = f"first share of {size} (CLI through the node), throughput"
    share = value("first_unthrottled", "p2pnode", "share_s_median")
    out.append(unmet(name, 200, "MB/s", share) if isinstance(share, str) else
               goal(name, res["first_unthrottled"]["size_bytes"] / MB / share, 200, "MB/s",
                    higher_is_better=True))
    return out


def node_goals(res: dict[str, Any], size: str) -> list[dict[str, Any]]:
    """The time goals again with h2's fetch through its running node (share + node fetch)."""
    out = []
    for scenario, theirs, target, what in (
            ("first_unthrottled", "syncthing", 1.0, f"first transfer {size} unthrottled"),
            ("first_100mbit", "rsync", 1.0, "first transfer at 100 Mbit/s"),
            ("append_1pct", "rsync", 1.0, "+1 % appended"),
            ("append_1pct", "syncthing", 1.0, "+1 % appended"),
            ("fork_unthrottled", "syncthing", 1.0, "fork with the parent held, unthrottled"),
            ("fork_100mbit", "rsync", 1.0, "fork with the parent held, 100 Mbit/s")):
        name = f"{what}, fetched through h2's running node: share+fetch time / {theirs}'s (faster)"
        ours = res.get(scenario, {}).get("p2pnode", {}).get("node_total_s_median")
        base = res.get(scenario, {}).get(theirs, {}).get("seconds_median")
        if ours is None or not base:
            out.append(unmet(name, target, f"x {theirs}", f"not measured: p2pnode {ours}, {theirs} {base}"))
        else:
            out.append(goal(name, ours / base, target, f"x {theirs}"))
    ours = res.get("append_1pct", {}).get("p2pnode", {}).get("node_total_s_median")
    name = f"+1 % appended on {size}, fetched through h2's running node: share+fetch seconds"
    out.append(goal(name, ours, 0.5, "s") if ours is not None else unmet(name, 0.5, "s", "not measured"))
    return out


def _fetch_vs_curl(res: dict[str, Any], why: dict[str, str]) -> dict[str, Any]:
    name = "first transfer unthrottled: fetch alone, speed / curl's"
    first = res.get("first_unthrottled", {})
    if "p2pnode" not in first or "curl" not in first:
        missing = "p2pnode" if "p2pnode" not in first else "curl"
        return unmet(name, 0.8, "x curl",
                     why.get(missing) or why.get(f"{missing}:first_unthrottled", "not measured"))
    return goal(name, first["curl"]["seconds_median"] / first["p2pnode"]["fetch_s_median"], 0.8, "x curl",
                higher_is_better=True)


@contextlib.contextmanager
def p2p_lab(name: str, seed: int, mb: int) -> Iterator[tuple[Bench, P2p, Path]]:
    """The lab with p2pnode alone and one generated session of `mb` MB (for the scripts that
    measure one scenario of it: bench_kill9.py, bench_cut.py); removed, with every process it
    started, on the way out.  Exits 2 where no lab can be built."""
    reason = unavailable_reason()
    if reason:
        log(f"{name}: cannot build a namespace lab: {reason}")
        raise SystemExit(2)
    root = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    lab = Lab.create(3)
    bench: Bench | None = None
    try:
        bench = Bench(lab, root, False, 1)
        p2p = P2p(lab, root, bench.links)
        bench.tools["p2pnode"] = p2p
        yield bench, p2p, bench.sessions.make(seed, mb * MB)
    finally:
        if bench is not None:
            bench.close()
        lab.down()
        shutil.rmtree(root, ignore_errors=True)


# --- main --------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sessions, one run each (about a minute)")
    ap.add_argument("--reps", type=int, help="runs per first-transfer scenario (default 3; --quick 1)")
    ap.add_argument("--only", action="append", choices=STEPS,
                    help="run only these parts (repeatable; goals of the others are unmet: not run)")
    ap.add_argument("--tools", help=f"comma-separated subset of {','.join(TOOLS)} (default all)")
    args = ap.parse_args()
    steps = set(args.only or STEPS)
    tools = set(args.tools.split(",")) if args.tools else set(TOOLS)
    if not tools <= set(TOOLS):
        ap.error(f"--tools: not tools: {', '.join(sorted(tools - set(TOOLS)))}")
    reason = unavailable_reason()
    if reason:
        log(f"bench_transfer: cannot build a namespace lab: {reason}")
        return 2
    reps = args.reps or (1 if args.quick else 3)
    size, big = (16 * MB, 96 * MB) if args.quick else (256 * MB, 2000 * MB)
    missing = install_missing()
    for package in ("p2pnode", "store", "sysio"):  # as `pip install` leaves it: every CLI start of an
        # editable checkout under PYTHONDONTWRITEBYTECODE would compile what it imports (~0.08 CPU-s)
        compileall.compile_dir(REPO / package, quiet=1)
    root = Path(tempfile.mkdtemp(prefix="bench_transfer-"))
    lab = Lab.create(3)
    bench: Bench | None = None

    def cleanup() -> None:
        if bench is not None:
            with contextlib.suppress(Exception):
                bench.close()
        lab.down()
        shutil.rmtree(root, ignore_errors=True)

    atexit.register(cleanup)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result: dict[str, Any] = {"benchmark": "transfer", "quick": args.quick, "reps": reps,
                              "cpus": os.cpu_count(), "loadavg_at_start": round(os.getloadavg()[0], 2),
                              "session_bytes": size, "memory_session_bytes": big,
                              "note": "quick: small sessions, one run; the goals' sizes are the issue's"
                              if args.quick else "full sizes", "only": sorted(steps), "tools": sorted(tools)}
    try:
        bench = Bench(lab, root, args.quick, reps)
        bench.start_tools(missing, tools)
        log(f"tools: {', '.join(bench.tools)}; missing: {bench.why or 'none'}")
        if "unthrottled" in steps:
            main_paths = bench.first_transfers("first_unthrottled", size, 100)
            log("+1 % appended")
            bench.sessions.grow(main_paths[0], 0.01)
            bench.once("append_1pct", main_paths[0], again=True)
            log("fork, unthrottled")
            bench.once("fork_unthrottled", bench.sessions.fork(main_paths[0], 200))
        if steps & {"100mbit", "first_100mbit"}:
            with bench.throttled("h1", "h2"):
                slow = bench.first_transfers("first_100mbit", size, 300)
                if "100mbit" in steps:
                    log("fork, 100 Mbit/s")
                    bench.once("fork_100mbit", bench.sessions.fork(slow[0], 400))
        for scenario, step in (("holders", lambda: bench.holders(size, 500)),
                               ("memory", lambda: bench.memory(big, 600))):
            if scenario not in steps:
                continue
            log(scenario)
            try:
                step()
            except Exception as exc:
                bench.why[f"p2pnode:{scenario}"] = str(exc)[-800:]
                log(f"  {scenario}: FAILED {exc}")
        result.update(bench.result)
        p2p = bench.tools.get("p2pnode")
        if isinstance(p2p, P2p):
            result["p2pnode_cli_floor_s"] = round(p2p.cli_floor_s, 3)
        result["not_measured"] = bench.why
    finally:
        cleanup()
        atexit.unregister(cleanup)
    result["loadavg_at_end"] = round(os.getloadavg()[0], 2)
    result["goals"] = goals(result, bench.why if bench else {}, args.quick)
    log(f"goals met: {goals_met(result['goals'])}")
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
