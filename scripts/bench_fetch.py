#!/usr/bin/env python3
"""Benchmark of `fetch` (issue 5), against curl over the same kind of mutual-TLS connection.

1. Unthrottled, loopback: a generated Pi-like session (256 MB; `--quick` 24 MB) fetched into
   a fresh node (every line verified, the whole re-hashed, stored, written to Pi's sessions
   dir) against `curl --cert/--key/--cacert` downloading the same bytes (the session object)
   from the same `p2pnode serve-peers` process.  Goal: >= 0.8x curl.
2. Throttled to 100 Mbit/s: the same comparison between two network namespaces made here (a
   veth pair with tc tbf on both ends; netem is missing on this kernel), server in one, fetcher
   and curl in the other.  Compressed transfer should beat the raw copy.  Goal: >= 2x curl.
   Reported as skipped, with the reason, where namespaces cannot be made.
3. Bytes on the wire (HTTP bodies) for a grown version (+5 %) fetched after the older one, and
   for a fork (a Pi /fork: new header, a copy of a prefix of the parent's lines, new lines)
   when its parent is already held; against the compressed new lines and the whole file.
   Goal: <= 1.1x the compressed new bytes + 40 bytes per line of the version.

Prints one JSON object on stdout; progress on stderr.  Medians of `--reps` runs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zstandard  # noqa: E402
from _benchlib import emit, goal, goals_met, log, median, now, tree_env  # noqa: E402
from bench_share import SessionWriter, session_path  # noqa: E402  (the same Pi-like generator)

from p2pnode.library.api import Library  # noqa: E402
from p2pnode.paths import NodePaths  # noqa: E402
from p2pnode.peer.address import PeerAddress  # noqa: E402
from p2pnode.peer.get import fetch_branch  # noqa: E402
from p2pnode.peer.identity import Identity, load_or_create_identity  # noqa: E402
from p2pnode.peer.trust import TrustStore  # noqa: E402
from p2pnode.pi.lines import split_lines  # noqa: E402

MB = 1_000_000
ROOT = Path(__file__).resolve().parents[1]
NS_SUBNET = "10.78.0"


# --- the serving node --------------------------------------------------------------------------


class Server:
    """A node home with generated sessions shared in it, served by `p2pnode serve-peers`."""

    def __init__(self, work: Path) -> None:
        self.home = work / "server"
        self.agent = work / "server-agent"
        self.identity = load_or_create_identity(NodePaths(self.home).ensure().identity)
        self.trust = TrustStore(NodePaths(self.home).trust)
        self.branches: dict[str, Any] = {}
        self.new_lines: dict[str, list[bytes]] = {}

    def prepare(self, main_mb: int, throttled_mb: int, delta_mb: int) -> None:
        with Library.open(NodePaths(self.home), self.agent) as lib:
            for name, size, seed in (("main", main_mb, 1), ("throttled", throttled_mb, 2)):
                path = session_path(self.agent, str(uuid.UUID(int=seed)))
                path.write_bytes(SessionWriter(seed).session(str(uuid.UUID(int=seed)), size * MB))
                self.branches[name] = lib.share(str(path))
            writer = SessionWriter(3)
            v1 = session_path(self.agent, str(uuid.UUID(int=3)))
            v1.write_bytes(writer.session(str(uuid.UUID(int=3)), delta_mb * MB))
            self.branches["v1"] = lib.share(str(v1))
            growth = writer.growth(delta_mb * MB // 20)  # +5 %
            with open(v1, "ab") as f:
                f.write(growth)
            self.branches["v2"] = lib.share(str(v1))
            self.new_lines["v2"] = split_lines(growth)
            parent_lines = split_lines(v1.read_bytes())
            fork_id = str(uuid.UUID(int=4))
            fork_new = [writer.header(fork_id, parent=str(v1))]
            tail = writer.growth(delta_mb * MB // 100)
            fork = session_path(self.agent, fork_id)
            fork.write_bytes(fork_new[0] + b"".join(parent_lines[1 : len(parent_lines) * 9 // 10]) + tail)
            self.branches["fork"] = lib.share(str(fork))
            self.new_lines["fork"] = fork_new + split_lines(tail)

    @contextmanager
    def serving(self, host: str = "127.0.0.1", netns: str | None = None):
        cmd = [sys.executable, "-m", "p2pnode", "serve-peers", "--host", host, "--port", "0"]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        proc = subprocess.Popen(cmd, env=dict(os.environ, **tree_env(ROOT), P2PNODE_HOME=str(self.home)),
                                stdout=subprocess.PIPE, text=True)
        try:
            line = proc.stdout.readline() if proc.stdout else ""
            if not line.startswith("listening on"):
                raise RuntimeError(f"serve-peers did not start: {line!r}")
            yield int(line.rsplit(":", 1)[1])
        finally:
            proc.terminate()
            proc.wait(timeout=30)


# --- one fetch, one curl -------------------------------------------------------------------------


def fetch_once(work: Path, identity_dir: Path, trust_path: Path, branch: str, peer: PeerAddress,
               home: Path | None = None, session_id: str | None = None) -> dict[str, Any]:
    """Fetch into a node (a fresh one unless `home` is given); seconds and bytes on the wire.
    `session_id`: the branch's Pi session id, as `fetch` has it from the catalog (held
    versions of that session are named with `?after=`)."""
    home = home or Path(tempfile.mkdtemp(prefix="node-", dir=work))
    identity = load_or_create_identity(identity_dir)
    trust = TrustStore(trust_path)
    with Library.open(NodePaths(home), home / "agent") as lib:
        t0 = now()
        result = asyncio.run(fetch_branch(lib, branch, [peer], identity, trust, agent_dir=home / "agent",
                                          session_id=session_id))
        seconds = now() - t0
    return {"seconds": seconds, "bytes_received": result.bytes_received, "lines": result.lines_total,
            "transfer_s": result.seconds_transfer, "store_s": result.seconds_store, "home": str(home)}


def curl_once(identity: Identity, host: str, port: int, src: str, out: Path,
              netns: str | None = None) -> float:
    cmd = ["curl", "-sS", "--fail", "-o", str(out), "-w", "%{time_total}", "--cert", str(identity.cert_path),
           "--key", str(identity.key_path), "--cacert", str(identity.ca_path),
           "--resolve", f"p2pnode:{port}:{host}", f"https://p2pnode:{port}/v1/object/{src}"]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    seconds = float(subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600).stdout)
    out.unlink()
    return seconds


def compare(work: Path, server: Server, client: Identity, name: str, host: str, port: int, reps: int,
            netns: str | None = None) -> dict[str, Any]:
    info = server.branches[name]
    peer = PeerAddress(server.identity.node_id, host, port)
    trust_path = work / "client-trust.json"
    curl_once(client, host, port, info.src, work / "curl.out", netns)  # warm the server's session cache
    fetches, curls = [], []
    for rep in range(reps):
        if netns:
            fetches.append(_fetch_in_netns(netns, work, client, trust_path, info.branch, peer))
        else:
            fetches.append(fetch_once(work, client.directory, trust_path, info.branch, peer))
        shutil.rmtree(fetches[-1]["home"])
        curls.append(curl_once(client, host, port, info.src, work / "curl.out", netns))
        log(f"  {name} rep {rep + 1}: fetch {info.size / MB / fetches[-1]['seconds']:.0f} MB/s, "
            f"curl {info.size / MB / curls[-1]:.0f} MB/s")
    fetch_s, curl_s = median([f["seconds"] for f in fetches]), median(curls)
    return {"size_bytes": info.size, "lines": info.lines, "fetch_median_s": round(fetch_s, 3),
            "curl_median_s": round(curl_s, 3), "fetch_mb_s": round(info.size / MB / fetch_s, 1),
            "fetch_transfer_median_s": round(median([f["transfer_s"] for f in fetches]), 3),
            "fetch_store_median_s": round(median([f["store_s"] for f in fetches]), 3),
            "curl_mb_s": round(info.size / MB / curl_s, 1), "ratio_vs_curl": round(curl_s / fetch_s, 3),
            "fetch_bytes_on_wire": fetches[0]["bytes_received"], "reps": reps}


def _fetch_in_netns(netns: str, work: Path, client: Identity, trust_path: Path, branch: str,
                    peer: PeerAddress) -> dict[str, Any]:
    spec = json.dumps({"work": str(work), "identity": str(client.directory), "trust": str(trust_path),
                       "branch": branch, "peer": str(peer)})
    out = subprocess.run(["ip", "netns", "exec", netns, sys.executable, __file__, "--fetch-once", spec],
                         check=True, capture_output=True, text=True, timeout=600).stdout
    return json.loads(out)


# --- 100 Mbit/s between two namespaces ----------------------------------------------------------


@contextmanager
def throttled_link(rate_mbit: int):
    """Namespaces <p>a (server, .1) and <p>b (client, .2) joined by a veth made inside <p>a (the
    root namespace is never touched), tbf at `rate_mbit` on both ends; deleted afterwards."""
    prefix = f"bf{uuid.uuid4().hex[:6]}"
    a, b = f"{prefix}a", f"{prefix}b"
    made: list[str] = []
    try:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
            made.append(ns)
        run = lambda *cmd: subprocess.run(cmd, check=True, capture_output=True)  # noqa: E731
        run("ip", "-n", a, "link", "add", "va", "type", "veth", "peer", "name", "vb", "netns", b)
        for ns, dev, ip in ((a, "va", f"{NS_SUBNET}.1"), (b, "vb", f"{NS_SUBNET}.2")):
            run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            run("ip", "-n", ns, "link", "set", dev, "up")
            run("ip", "-n", ns, "link", "set", "lo", "up")
            run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit",
                "burst", "64kb", "latency", "50ms")
        yield a, b
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


# --- bytes on the wire for deltas ---------------------------------------------------------------


def deltas(work: Path, server: Server, client: Identity, port: int) -> dict[str, Any]:
    peer = PeerAddress(server.identity.node_id, "127.0.0.1", port)
    trust_path = work / "client-trust.json"
    home = work / "delta-node"
    first = fetch_once(work, client.directory, trust_path, server.branches["v1"].branch, peer, home)
    out: dict[str, Any] = {"v1_bytes_on_wire": first["bytes_received"]}
    for name in ("v2", "fork"):
        info = server.branches[name]
        got = fetch_once(work, client.directory, trust_path, info.branch, peer, home, info.header.get("id"))
        compressed = sum(len(zstandard.ZstdCompressor(level=3).compress(ln)) for ln in server.new_lines[name])
        target = 1.1 * compressed + 40 * info.lines
        wire_bytes = got["bytes_received"]
        out[name] = {"bytes_on_wire": wire_bytes, "compressed_new_bytes": compressed,
                     "new_lines": len(server.new_lines[name]), "lines": info.lines,
                     "whole_file_bytes": info.size, "target_bytes": round(target),
                     "ratio_to_target": round(wire_bytes / target, 4),
                     "fraction_of_whole_file": round(wire_bytes / info.size, 5)}
    return out


# --- main -------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sessions, about a minute")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--fetch-once", help=argparse.SUPPRESS)  # internal: one fetch inside a namespace
    args = parser.parse_args()
    if args.fetch_once:
        spec = json.loads(args.fetch_once)
        once = fetch_once(Path(spec["work"]), Path(spec["identity"]), Path(spec["trust"]), spec["branch"],
                          PeerAddress.parse(spec["peer"]))
        print(json.dumps(once))
        return
    main_mb, throttled_mb, delta_mb = (24, 8, 8) if args.quick else (256, 48, 32)
    with tempfile.TemporaryDirectory(prefix="bench-fetch-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)
        server = Server(work)
        t0 = now()
        server.prepare(main_mb, throttled_mb, delta_mb)
        log(f"generated and shared {main_mb + throttled_mb + delta_mb} MB of sessions in {now() - t0:.1f} s")
        client = load_or_create_identity(work / "client-identity")
        server.trust.trust(client.node_id)
        TrustStore(work / "client-trust.json").trust(server.identity.node_id)
        result: dict[str, Any] = {"benchmark": "fetch", "quick": args.quick, "cpus": os.cpu_count()}
        with server.serving() as port:
            log(f"unthrottled loopback, {main_mb} MB session")
            result["unthrottled_loopback"] = compare(work, server, client, "main", "127.0.0.1", port,
                                                     args.reps)
            log("deltas")
            result["delta"] = deltas(work, server, client, port)
        try:
            with throttled_link(100) as (ns_a, ns_b), server.serving(f"{NS_SUBNET}.1", ns_a) as port:
                log(f"100 Mbit/s between namespaces, {throttled_mb} MB session")
                result["throttled_100mbit"] = compare(work, server, client, "throttled", f"{NS_SUBNET}.1",
                                                      port, args.reps, ns_b)
        except (subprocess.CalledProcessError, FileNotFoundError) as exc:
            reason = f"network namespaces or tc tbf unavailable ({exc}); only loopback was measured"
            result["throttled_100mbit"] = {"skipped": reason}
            log(reason)
    unthrottled, throttled = result["unthrottled_loopback"], result["throttled_100mbit"]
    delta = result["delta"]
    result["goals"] = [
        goal("fetch vs curl, mTLS loopback", unthrottled["ratio_vs_curl"], 0.8, "x curl",
             higher_is_better=True),
        goal("fetch vs curl, mTLS at 100 Mbit/s", throttled.get("ratio_vs_curl", 0.0), 2.0, "x curl",
             higher_is_better=True),
        goal("grown version (+5%) bytes on wire / (1.1 x compressed new + 40 B/line)",
             delta["v2"]["ratio_to_target"], 1.0, "x target"),
        goal("fork with parent held: bytes on wire / (1.1 x compressed new + 40 B/line)",
             delta["fork"]["ratio_to_target"], 1.0, "x target"),
    ]
    log(f"goals met: {goals_met(result['goals'])}")
    emit(result)


if __name__ == "__main__":
    with suppress(KeyboardInterrupt):
        main()
