#!/usr/bin/env python3
"""LAN benchmark (issue 6), in a lab of 3 host namespaces on one bridge (root, Linux).

    .venv/bin/python scripts/bench_lan.py [--quick]

Measures, each against a baseline run in the same lab and the same run:
  * announce -> resolved by a running browser: p2pnode's registration (no probing, names
    unique by construction) against zeroconf's default registration (probing);
  * `p2pnode fetch <hash>` with no address, one-shot (no node running) into a fresh state
    dir, end to end as a process, against the same fetch given `--from HOST:PORT`; and
    in-process: hash -> peer found by mDNS -> first session byte -> done;
  * fetch throughput h3 <- h1 (mTLS, verified, stored) against curl downloading the same
    session bytes over the same kind of mTLS connection;
  * time for a node to notice a peer that vanished without a goodbye (its link cut), and
    whether mDNS alone still lists it at that moment.
Prints one JSON object (goals: resolved <= 0.2 s median, fetch by hash of a small session
<= 1.5 s end to end cold, vanished peer noticed <= 15 s); progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO / "tests"), str(REPO)]

from _benchlib import emit, goal, log, median, tree_env  # noqa: E402
from lab import Lab, unavailable_reason  # noqa: E402
from lannode import LanNode, grow, place, wait_for  # noqa: E402

from p2pnode.node.control_client import call_node  # noqa: E402

CORPUS = REPO.parent / "shared" / "pi-corpus"
SMALL = ("sessions/--tmp-pi-harness-work-beta--/"
         "2026-11-21T19-26-46-592Z_01a1ff93-4f3f-74a0-8c1a-0b533764bed8.jsonl")
BIG_BASE = ("sessions/--tmp-pi-harness-work-alpha--/"
            "2026-11-21T19-26-31-001Z_01a1ff93-1258-73ae-a9a4-6ce4a586df6a.jsonl")
PORT = 47470

BROWSER = textwrap.dedent("""
    import asyncio, json, sys, time
    from p2pnode.discovery.mdns import Discovery
    async def main():
        seen = asyncio.Queue()
        d = Discovery(None, on_change=lambda what, p: what == "seen" and seen.put_nowait(p.node_id))
        await d.start()
        print(json.dumps({"ready": True}), flush=True)
        try:
            for _ in range(int(sys.argv[1])):
                node_id = await asyncio.wait_for(seen.get(), 30)
                print(json.dumps({"id": node_id, "t": time.monotonic()}), flush=True)
        finally:
            await d.close()
    asyncio.run(main())
""")

ANNOUNCER = textwrap.dedent("""
    import asyncio, base64, json, os, sys, time
    from zeroconf import IPVersion
    from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf
    from p2pnode.discovery.mdns import Discovery
    from p2pnode.discovery.records import SERVICE_TYPE, Announcement, instance_label, instance_name
    mode, n, addr = sys.argv[1], int(sys.argv[2]), os.environ["LAB_ADDR"]
    async def one():
        raw = base64.b32encode(os.urandom(35)).decode()
        node_id = "-".join(raw[i:i + 7] for i in range(0, 56, 7))
        if mode == "p2pnode":
            d = Discovery(node_id)
            await d.start()
            t0 = time.monotonic()
            await d.announce(47470, 1, [])
            stop = d.close
        else:  # zeroconf's default: probe for name conflicts first
            azc = AsyncZeroconf(ip_version=IPVersion.V4Only)
            info = AsyncServiceInfo(SERVICE_TYPE, instance_name(node_id), port=47470,
                                    properties=Announcement(node_id, 47470, 1).txt(),
                                    server=instance_label(node_id) + ".local.", parsed_addresses=[addr])
            t0 = time.monotonic()
            await (await azc.async_register_service(info))
            stop = azc.async_close
        print(json.dumps({"id": node_id, "t0": t0}), flush=True)
        await asyncio.sleep(0.8)
        await stop()
        await asyncio.sleep(0.2)
    async def main():
        for _ in range(n):
            await one()
    asyncio.run(main())
""")

FETCH_TIMED = textwrap.dedent("""
    import asyncio, json, sys, time
    from p2pnode.peer.address import PeerAddress
    from p2pnode.peer.get import fetch_branch
    from p2pnode.peer.identity import load_identity
    from p2pnode.peer.nodeid import parse_node_id
    from p2pnode.library.api import Library
    from p2pnode.discovery.mdns import lan_peers
    from p2pnode.paths import NodePaths
    from p2pnode.peer.trust import TrustStore
    branch, source = sys.argv[1], sys.argv[2]
    async def main():
        paths = NodePaths.default()
        ident, trust = load_identity(paths.identity), TrustStore(paths.trust)
        marks = {}
        t0 = time.perf_counter()
        if source == "mdns":
            peers = await lan_peers(branch, lambda n: trust.is_trusted(parse_node_id(n)))
        else:
            peers = [PeerAddress.parse(source)]
        marks["peer"] = time.perf_counter() - t0
        def progress(done, total):
            marks.setdefault("first_byte", time.perf_counter() - t0)
        with Library.open(paths) as lib:
            result = await fetch_branch(lib, branch, peers, ident, trust, progress=progress)
            marks["done"] = time.perf_counter() - t0
            marks["size"] = lib.branch(branch).size
        marks["fetched"] = len(result.fetched)
        print(json.dumps(marks), flush=True)
    asyncio.run(main())
""")


def python(lab: Lab, host: str, code: str, *args: str, env: dict[str, str] | None = None,
           timeout: float = 120) -> str:
    r = lab.run(host, sys.executable, "-c", code, *args, env=env or bench_env(), timeout=timeout)
    if r.returncode:
        raise RuntimeError(f"{host}: program failed: {r.stderr[-2000:]}")
    return r.stdout


def bench_env() -> dict[str, str]:
    """The environment of the commands run in the lab: this tree's p2pnode."""
    return dict(os.environ, **tree_env(REPO))


# --- announce -> resolved --------------------------------------------------------------------


def resolve_latencies(lab: Lab, mode: str, n: int) -> list[float]:
    browser = lab.spawn("h2", sys.executable, "-c", BROWSER, str(n), env=bench_env())
    try:
        assert browser.stdout is not None
        assert json.loads(browser.stdout.readline()) == {"ready": True}
        sent = {d["id"]: d["t0"] for d in map(json.loads, python(lab, "h1", ANNOUNCER, mode, str(n),
                                                                 timeout=30 + 5 * n).splitlines())}
        out, _ = browser.communicate(timeout=30)
    finally:
        if browser.poll() is None:
            browser.kill()
            browser.wait(5)
    got = [json.loads(line) for line in out.splitlines()]
    return [g["t"] - sent[g["id"]] for g in got if g["id"] in sent]


# --- fetch by hash ---------------------------------------------------------------------------


def fresh_home(template: LanNode, root: Path, name: str) -> dict[str, str]:
    """A state dir with template's identity and trust list but no sessions: a cold fetcher."""
    home = root / name
    shutil.copytree(template.paths.identity, home / "identity")
    shutil.copy(template.paths.trust, home / "trust.json")
    (root / f"{name}-agent").mkdir()
    return dict(bench_env(), P2PNODE_HOME=str(home), PI_CODING_AGENT_DIR=str(root / f"{name}-agent"))


def cli_fetch_seconds(lab: Lab, template: LanNode, root: Path, branch: str, extra: list[str], n: int,
                      tag: str) -> list[float]:
    times = []
    for i in range(n):
        env = fresh_home(template, root, f"{tag}{i}")
        t0 = time.perf_counter()
        r = lab.run("h3", sys.executable, "-m", "p2pnode", "fetch", branch, *extra, env=env, timeout=60)
        times.append(time.perf_counter() - t0)
        if r.returncode:
            raise RuntimeError(f"fetch {tag} failed: {r.stderr}")
    return times


def timed_fetches(lab: Lab, template: LanNode, root: Path, branch: str, source: str, n: int,
                  tag: str) -> list[dict[str, Any]]:
    return [json.loads(python(lab, "h3", FETCH_TIMED, branch, source,
                              env=fresh_home(template, root, f"{tag}{i}"))) for i in range(n)]


def curl_seconds(lab: Lab, fetcher: LanNode, host: str, src: str) -> tuple[float, int]:
    ident = fetcher.paths.identity
    r = lab.run("h3", "curl", "-sS", "-o", "/dev/null", "-w", "%{time_total} %{size_download} %{http_code}",
                "--cert", str(ident / "node.crt"), "--key", str(ident / "node.key"),
                "--cacert", str(ident / "open-ca.crt"), "--resolve", f"p2pnode:{PORT}:{lab.addr(host)}",
                f"https://p2pnode:{PORT}/v1/object/{src}", timeout=300)
    seconds, size, code = r.stdout.split()
    if r.returncode or code != "200":
        raise RuntimeError(f"curl failed ({code}): {r.stderr}")
    return float(seconds), int(size)


# --- vanished peer ---------------------------------------------------------------------------


def notice_seconds(lab: Lab, watcher: LanNode, gone: LanNode) -> tuple[float, bool]:
    """Cut `gone`'s link; seconds until `watcher` marks it offline, and whether mDNS still lists it."""
    def peer() -> dict[str, Any] | None:
        status = call_node(watcher.paths, "status", {}) or {}
        return next((p for p in status.get("peers", []) if p["node_id"] == gone.node_id), None)

    wait_for("the peer to be online", lambda: (p := peer()) and p["online"], 30)
    lab.cut(gone.host)
    t0 = time.perf_counter()
    try:
        p = wait_for("the vanished peer to be noticed", lambda: (q := peer()) and q["online"] is False and q,
                     60, every=0.05)
        seconds = time.perf_counter() - t0
    finally:
        lab.heal(gone.host)
    return seconds, bool(p["addresses"])  # addresses come from mDNS: still listed there


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and a smaller session (~1 min)")
    args = ap.parse_args()
    reason = unavailable_reason()
    if reason:
        log(f"bench_lan: cannot build a namespace lab: {reason}")
        return 2
    n_resolve, n_probe, n_fetch, big_mb, n_big, n_vanish = (
        (10, 3, 3, 16, 2, 1) if args.quick else (20, 10, 10, 96, 3, 3))
    result: dict[str, Any] = {"bench": "lan", "quick": args.quick, "hosts": 3,
                              "load_avg_at_start": os.getloadavg()[0], "cpus": os.cpu_count()}
    root = Path(tempfile.mkdtemp(prefix="bench_lan-"))
    lab = Lab.create(3)
    nodes: list[LanNode] = []
    try:
        log("announce -> resolved ...")
        fast = resolve_latencies(lab, "p2pnode", n_resolve)
        probing = resolve_latencies(lab, "probe", n_probe)
        result["resolve"] = {"p2pnode_median_s": round(median(fast), 4), "n": len(fast),
                             "zeroconf_probing_median_s": round(median(probing), 4),
                             "n_probing": len(probing), "speedup": round(median(probing) / median(fast), 1)}

        h1, h2, h3 = (LanNode(lab, h, root) for h in ("h1", "h2", "h3"))
        nodes = [h1, h2]
        h1.trust(h2, h3)
        h2.trust(h1)
        h3.trust(h1)
        h1.start()
        h2.start()
        small = h1.share(place(CORPUS, SMALL, h1.agent))
        big_path = place(CORPUS, BIG_BASE, h1.agent)
        grow(big_path, big_mb)
        shared = json.loads(h1.cli("share", str(big_path), "--json", timeout=300).stdout)
        big, big_src = shared["branch"], shared["src"]

        log("fetch <hash> with no address ...")
        by_hash = cli_fetch_seconds(lab, h3, root, small, [], n_fetch, "cold")
        from_h1 = ["--from", f"{lab.addr('h1')}:{PORT}"]
        by_addr = cli_fetch_seconds(lab, h3, root, small, from_h1, n_fetch, "addr")
        inproc = timed_fetches(lab, h3, root, small, "mdns", n_fetch, "inproc")
        result["fetch_by_hash"] = {
            "session_bytes": (CORPUS / SMALL).stat().st_size,
            "cli_by_hash_median_s": round(median(by_hash), 4),
            "cli_with_address_median_s": round(median(by_addr), 4),
            "discovery_overhead_s": round(median(by_hash) - median(by_addr), 4),
            "in_process_peer_found_median_s": round(median([m["peer"] for m in inproc]), 4),
            "in_process_first_byte_median_s": round(median([m["first_byte"] for m in inproc]), 4),
            "in_process_done_median_s": round(median([m["done"] for m in inproc]), 4),
            "n": n_fetch}

        log(f"throughput ({big_mb} MiB session) ...")
        ours = timed_fetches(lab, h3, root, big, f"{lab.addr('h1')}:{PORT}", n_big, "big")
        curls = [curl_seconds(lab, h3, "h1", big_src) for _ in range(n_big)]
        size = ours[0]["size"]
        ours_mbs = median([size / m["done"] / 1e6 for m in ours])
        curl_mbs = median([n / s / 1e6 for s, n in curls])
        result["throughput"] = {"session_bytes": size, "p2pnode_fetch_MBps": round(ours_mbs, 1),
                                "curl_MBps": round(curl_mbs, 1),
                                "ratio_vs_curl": round(ours_mbs / curl_mbs, 3),
                                "n": n_big, "note": "fetch = mTLS + per-line verify + durable store; "
                                "curl = the same session bytes, one mTLS GET to /dev/null"}

        log("vanished peer ...")
        notices = []
        for _ in range(n_vanish):
            seconds, still_listed = notice_seconds(lab, h1, h2)
            notices.append(seconds)
        result["vanished_peer"] = {"noticed_median_s": round(median(notices), 3), "n": n_vanish,
                                   "how": "h2's bridge port set down (no goodbye)",
                                   "mdns_still_lists_it_then": still_listed}
    finally:
        for node in nodes:
            node.stop()
        lab.down()
        shutil.rmtree(root, ignore_errors=True)

    result["goals"] = [
        goal("announce_to_resolved_median", result["resolve"]["p2pnode_median_s"], 0.2, "s"),
        goal("fetch_by_hash_small_cold_end_to_end", result["fetch_by_hash"]["cli_by_hash_median_s"],
             1.5, "s"),
        goal("vanished_peer_noticed", result["vanished_peer"]["noticed_median_s"], 15.0, "s"),
    ]
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
