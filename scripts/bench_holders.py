#!/usr/bin/env python3
"""Benchmark of several holders at once and of the two batch formats (issue 12).

On one generated Pi-shaped session with image lines (bench_share's generator), two holders
(each its own node home, store and `p2pnode serve-peers` process) on loopback:

1. Batch formats, unthrottled, one holder: bytes on the wire, fetch seconds, and the serving
   process's CPU seconds per MB of session for per-line zstd-1 frames (as stored; the fetcher
   does not offer the stream) and for the adaptive format (the default: the server streams
   the first 4 MiB and slow links, docs/PROTOCOL.md "Adaptive batch format").
2. Holders behind a rate-limited relay (a token bucket per holder, shared by its
   connections, in its own process; default 100 Mbit/s): one holder (both batch formats)
   against two (the default, adaptive format).  Goal: two >= 1.7x one.
3. The same two holders, one of them cut after about half of its share: the cost over the
   uncut fetch.  Goal: <= 3 s.

Prints one JSON object on stdout; progress on stderr.  Medians of `--reps` runs.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _benchlib import emit, goal, goals_met, log, median, now, process_cpu, tree_env  # noqa: E402
from bench_share import SessionWriter, session_path  # noqa: E402

from p2pnode.library.api import Library  # noqa: E402
from p2pnode.paths import NodePaths  # noqa: E402
from p2pnode.peer import wire  # noqa: E402
from p2pnode.peer.address import PeerAddress  # noqa: E402
from p2pnode.peer.get import fetch_branch  # noqa: E402
from p2pnode.peer.identity import load_or_create_identity  # noqa: E402
from p2pnode.peer.trust import TrustStore  # noqa: E402

MB = 1_000_000
ROOT = Path(__file__).resolve().parents[1]


class Holder:
    """A node home holding the session, served by its own `p2pnode serve-peers` process."""

    def __init__(self, work: Path, name: str, data: bytes, session_id: str) -> None:
        self.home = work / name
        self.agent = work / f"{name}-agent"
        self.identity = load_or_create_identity(NodePaths(self.home).ensure().identity)
        self.trust = TrustStore(NodePaths(self.home).trust)
        path = session_path(self.agent, session_id)
        path.write_bytes(data)
        with Library.open(NodePaths(self.home), self.agent) as lib:
            self.branch = lib.share(str(path)).branch

    @contextlib.contextmanager
    def serving(self) -> Iterator[tuple[int, int]]:
        """(port, pid) of the running server."""
        cmd = [sys.executable, "-m", "p2pnode", "serve-peers", "--host", "127.0.0.1", "--port", "0"]
        proc = subprocess.Popen(cmd, env=dict(os.environ, **tree_env(ROOT), P2PNODE_HOME=str(self.home)),
                                stdout=subprocess.PIPE, text=True)
        try:
            line = proc.stdout.readline() if proc.stdout else ""
            if not line.startswith("listening on"):
                raise RuntimeError(f"serve-peers did not start: {line!r}")
            yield int(line.rsplit(":", 1)[1]), proc.pid
        finally:
            proc.terminate()
            proc.wait(timeout=30)


# --- a rate-limited, cuttable relay in its own process ---------------------------------------------


def _relay_main(target: int, rate: float, cut_after: int | None, ready: Any) -> None:
    """Relay 127.0.0.1:<new port> to `target`; toward the fetcher at most `rate` bytes/s in
    all (a token bucket shared by the connections: one link); after `cut_after` bytes, every
    connection is cut and new ones refused."""
    state = {"next": 0.0, "sent": 0, "cut": False}
    live: set[asyncio.StreamWriter] = set()

    async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, shaped: bool) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await r.read(16384 if shaped else 65536):
                if shaped and rate:
                    t = max(time.monotonic(), state["next"])
                    state["next"] = t + len(data) / rate
                    await asyncio.sleep(max(0.0, t - time.monotonic()))
                w.write(data)
                await w.drain()
                if shaped:
                    state["sent"] += len(data)
                    if cut_after is not None and state["sent"] >= cut_after:
                        state["cut"] = True
                        for x in list(live):
                            x.transport.abort()
        w.transport.abort()

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        if state["cut"]:
            cw.transport.abort()
            return
        sr, sw = await asyncio.open_connection("127.0.0.1", target)
        live.update((cw, sw))
        await asyncio.gather(pipe(cr, sw, False), pipe(sr, cw, True))
        live.difference_update((cw, sw))

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        ready.send(server.sockets[0].getsockname()[1])
        await asyncio.Event().wait()

    asyncio.run(main())


@contextlib.contextmanager
def relay(target: int, rate: float, cut_after: int | None = None) -> Iterator[int]:
    ours, theirs = multiprocessing.Pipe()
    proc = multiprocessing.Process(target=_relay_main, args=(target, rate, cut_after, theirs), daemon=True)
    proc.start()
    try:
        yield ours.recv()
    finally:
        proc.terminate()
        proc.join(10)


# --- fetches ----------------------------------------------------------------------------------------


def fetch(work: Path, branch: str, peers: list[PeerAddress], limits: wire.Limits) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix="fetcher-", dir=work))
    identity = load_or_create_identity(work / "client-identity")
    trust = TrustStore(work / "client-trust.json")
    with Library.open(NodePaths(home), home / "agent") as lib:
        t0, cpu0 = now(), time.process_time()
        result = asyncio.run(fetch_branch(lib, branch, peers, identity, trust, agent_dir=home / "agent",
                                          limits=limits))
        seconds, cpu = now() - t0, time.process_time() - cpu0
    subprocess.run(["rm", "-rf", str(home)], check=True)
    return {"seconds": seconds, "transfer_s": result.seconds_transfer, "store_s": result.seconds_store,
            "fetcher_cpu_s": cpu, "bytes_received": result.bytes_received, "served": result.served,
            "dropped": result.dropped_peers}


def addresses(holders: list[Holder], ports: tuple[int, int]) -> list[PeerAddress]:
    return [PeerAddress(h.identity.node_id, "127.0.0.1", p) for h, p in zip(holders, ports, strict=True)]


def repeat(reps: int, fn: Any) -> dict[str, Any]:
    runs = [fn() for _ in range(reps)]
    out = dict(runs[len(runs) // 2])
    for key in ("seconds", "transfer_s", "store_s", "fetcher_cpu_s"):
        out[key] = round(median([r[key] for r in runs]), 3)
    out["runs_s"] = [round(r["seconds"], 3) for r in runs]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 16 MB session instead of 64 MB")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--mbit", type=float, default=100.0, help="each holder's link, Mbit/s")
    parser.add_argument("--formats-only", action="store_true", help="only part 1 (the batch formats)")
    args = parser.parse_args()
    size_mb = 16 if args.quick else 64
    rate = args.mbit * 1e6 / 8
    adaptive, per_line = wire.Limits(), wire.Limits(stream_batches=False)
    result: dict[str, Any] = {"benchmark": "holders", "quick": args.quick, "cpus": os.cpu_count(),
                              "session_mb": size_mb, "link_mbit": args.mbit}
    with tempfile.TemporaryDirectory(prefix="bench-holders-") as tmp:
        work = Path(tmp)
        sid = str(uuid.UUID(int=11))
        data = SessionWriter(11).session(sid, size_mb * MB)
        holders = [Holder(work, f"h{i}", data, sid) for i in range(2)]
        client = load_or_create_identity(work / "client-identity")
        for h in holders:
            h.trust.trust(client.node_id)
            TrustStore(work / "client-trust.json").trust(h.identity.node_id)
        branch = holders[0].branch
        with holders[0].serving() as (p0, pid0), holders[1].serving() as (p1, _pid1):
            addr = addresses(holders, (p0, p1))
            modes: dict[str, Any] = {}
            for name, limits in (("per_line_zstd1", per_line), ("adaptive", adaptive)):
                log(f"one holder, unthrottled, {name}")
                cpu0 = process_cpu(pid0)
                run = repeat(args.reps, lambda limits=limits: fetch(work, branch, addr[:1], limits))
                cpu = (process_cpu(pid0) - cpu0) / args.reps
                modes[name] = {"seconds": run["seconds"], "transfer_s": run["transfer_s"],
                               "fetcher_cpu_s_per_mb": round(run["fetcher_cpu_s"] / (len(data) / MB), 5),
                               "wire_bytes": run["bytes_received"],
                               "wire_ratio": round(run["bytes_received"] / len(data), 4),
                               "server_cpu_s_per_mb": round(cpu / (len(data) / MB), 5)}
            result["batch_formats"] = modes
            per, strm = modes["per_line_zstd1"], modes["adaptive"]
            result["goals"] = [goal("adaptive batches, unthrottled: wire bytes / per-line frames",
                                    strm["wire_bytes"] / per["wire_bytes"], 1.0, "x")]
            if args.formats_only:
                emit(result)
                return
            via: dict[str, Any] = {}
            with relay(p0, rate) as r0, relay(p1, rate) as r1:
                slow = addresses(holders, (r0, r1))
                log(f"one holder at {args.mbit:g} Mbit/s, per-line frames")
                via["one_holder_per_line"] = repeat(args.reps,
                                                    lambda: fetch(work, branch, slow[:1], per_line))
                log(f"one holder at {args.mbit:g} Mbit/s")
                via["one_holder"] = repeat(args.reps, lambda: fetch(work, branch, slow[:1], adaptive))
                log(f"two holders at {args.mbit:g} Mbit/s each")
                via["two_holders"] = repeat(args.reps, lambda: fetch(work, branch, slow, adaptive))
            two = via["two_holders"]
            share = two["served"].get(str(slow[1]), {}).get("bytes", 0) / len(data)  # the second's part
            cut_after = int(two["bytes_received"] * share / 2)
            with relay(p0, rate) as r0, relay(p1, rate, cut_after=cut_after) as r1:
                cut = addresses(holders, (r0, r1))
                log("two holders, the second cut after about half of its share")
                via["two_holders_one_cut"] = fetch(work, branch, cut, adaptive)
            via["speedup"] = round(via["one_holder"]["seconds"] / two["seconds"], 3)
            via["speedup_transfer"] = round(via["one_holder"]["transfer_s"] / two["transfer_s"], 3)
            via["cut_cost_s"] = round(via["two_holders_one_cut"]["seconds"] - two["seconds"], 3)
            result["rate_limited"] = via
    result["goals"] += [
        goal(f"two holders vs one, {args.mbit:g} Mbit/s each", via["speedup"], 1.7, "x one holder",
             higher_is_better=True),
        goal("a holder cut mid-transfer: cost over an uncut fetch", via["cut_cost_s"], 3.0, "s"),
    ]
    log(f"goals met: {goals_met(result['goals'])}")
    emit(result)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
