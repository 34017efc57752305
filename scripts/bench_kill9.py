"""kill -9 of a one-shot fetch at ~50 % of the bytes, then the same fetch again (issue 12's goal:
the rerun moves <= 55 % of a full fetch's bytes), on bench_transfer's namespace lab: h1 shares a
Pi-shaped session and serves at 100 Mbit/s, h2 fetches.

Besides the goal's ratio (wire bytes at h2's eth0, both directions) it says what moved the
ratio, so that runs can be compared like with like:
- `rerun_raw_share`: the raw bytes of the lines the rerun fetched over the session's: above
  0.5 by what had crossed the wire but was not staged when the fetch was killed;
- `body_per_raw` of the full fetches and of each rerun: HTTP body bytes per raw byte, which
  the batch format decides (per-line zstd-1 frames or a zstd stream, chosen per response by
  the server from both sides' CPU and the link: peer/pace.py); a rerun whose answers took
  another format than the full fetch's moves more or fewer bytes for the same lines;
- `rx_queue_at_kill`: bytes waiting in h2's sockets when it was killed.

Needs root (network namespaces).  Usage:
    .venv/bin/python scripts/bench_kill9.py [--reps 3] [--mb 256] [--quick]
Run it from another checkout's scripts/ to measure that tree (PYTHONPATH follows the script).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from statistics import median
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent)]
import bench_transfer as bt  # noqa: E402


def rx_queue(links: bt.Links, host: str) -> int:
    """Bytes received by `host`'s TCP sockets and not read yet by their processes."""
    total = 0
    for name in ("tcp", "tcp6"):
        table = Path(f"/proc/{links.anchors[host].pid}/net/{name}")
        if table.exists():
            for row in table.read_text().splitlines()[1:]:
                total += int(row.split()[4].split(":")[1], 16)
    return total


def kill_and_rerun(bench: bt.Bench, p2p: bt.P2p, branch: str, full: int, size: int) -> dict[str, Any]:
    """As bench_transfer's _kill_and_rerun, with what the rerun moved and why."""
    env = p2p.fresh()
    wire0 = bench.links.total("h2")
    queued: list[int] = []

    def kill(proc: subprocess.Popen[bytes]) -> None:
        if not queued and bench.links.total("h2") - wire0 >= 0.5 * full:
            queued.append(rx_queue(bench.links, "h2"))
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)

    p2p.fetch(branch, env, on_poll=kill)
    before = bench.links.total("h2") - wire0
    wire1 = bench.links.total("h2")
    again = p2p.fetch(branch, env).check("the rerun")
    rerun = bench.links.total("h2") - wire1
    got = json.loads(again.out)
    raw = sum(s["bytes"] for s in got["served"].values())
    return {"killed_at": round(before / full, 4), "rerun_over_full": round(rerun / full, 4),
            "rerun_raw_share": round(raw / size, 4), "rerun_lines": got["lines_fetched"],
            "body_per_raw": round(got["bytes_received"] / max(1, raw), 4),
            "rx_queue_at_kill": queued[0] if queued else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3, help="kill -9 + rerun pairs (default 3)")
    ap.add_argument("--mb", type=int, default=256, help="session size in MB (default 256)")
    ap.add_argument("--quick", action="store_true", help="a 32 MB session, one pair (about a minute)")
    args = ap.parse_args()
    if args.quick:
        args.mb, args.reps = 32, 1
    with bt.p2p_lab("bench_kill9", 500, args.mb) as (bench, p2p, path):
        size = path.stat().st_size
        branch, _ = p2p.share(path)
        fulls: list[dict[str, Any]] = []
        with bench.throttled("h1"):
            for _ in range(2):
                wire0 = bench.links.total("h2")
                got = json.loads(p2p.fetch(branch, p2p.fresh()).check("a full fetch").out)
                fulls.append({"wire": bench.links.total("h2") - wire0,
                              "body_per_raw": round(got["bytes_received"] / size, 4)})
            full = int(median(f["wire"] for f in fulls))
            runs = []
            for _ in range(args.reps):
                runs.append(kill_and_rerun(bench, p2p, branch, full, size))
                bt.log(f"  {runs[-1]}")
        ratio = median(r["rerun_over_full"] for r in runs)
        bt.emit({"benchmark": "kill9", "quick": args.quick, "session_bytes": size, "full": fulls,
                 "runs": runs,
                 "rerun_over_full_median": ratio,
                 "rerun_raw_share_median": median(r["rerun_raw_share"] for r in runs),
                 "goals": [bt.goal("kill -9 at ~50 %, rerun bytes / full fetch (median)", ratio, 0.55, "x")]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
