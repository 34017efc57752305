"""A holder cut mid-transfer (issue 12's goal: it costs <= 3 s over an uncut fetch), on
bench_transfer's namespace lab: h1 and h3 share the same Pi-shaped session and serve at
100 Mbit/s each, h2 fetches from both; in the cut runs h1 is unplugged once 40 % of a
one-holder fetch's bytes have crossed (Bench._cut_one), and healed after.

Uncut and cut fetches alternate, so that a busy machine weighs on both alike.  Besides the
goal's difference of medians it reports each pair's difference (cut minus the uncut fetch
just before it), the fetcher's CPU seconds of each fetch (the cut's extra CPU, e.g. lines
read back from the store, shows there however busy the machine is), each cut fetch's body
bytes per raw byte (the batch format the holder left took: ~0.23 a zstd stream, ~0.42
per-line frames), when the cut came and the split of the lines between the holders.

Needs root (network namespaces).  Usage:
    .venv/bin/python scripts/bench_cut.py [--reps 3] [--mb 256]
Run it from another checkout's scripts/ to measure that tree (PYTHONPATH follows the script).
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from statistics import median
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent)]
import bench_transfer as bt  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3, help="uncut + cut pairs (default 3)")
    ap.add_argument("--mb", type=int, default=256, help="session size in MB (default 256)")
    args = ap.parse_args()
    with bt.p2p_lab("bench_cut", 600, args.mb) as (bench, p2p, path):
        size = path.stat().st_size
        h3 = p2p.nodes["h3"]
        shutil.copy(path, h3.agent / path.name)
        h3.start(bt.P2P_PORT)
        branch, _ = p2p.share(path)
        p2p.share(h3.agent / path.name, holder="h3")
        uncut: list[float] = []
        uncut_cpu: list[float] = []
        cuts: list[dict[str, Any]] = []
        with bench.throttled("h1", "h3"):
            wire0 = bench.links.total("h2")
            p2p.fetch(branch, p2p.fresh()).check("a one-holder fetch")
            full_wire = bench.links.total("h2") - wire0
            for _ in range(args.reps):
                whole = p2p.fetch(branch, p2p.fresh(), ("h1", "h3")).check("uncut")
                uncut.append(round(whole.seconds, 3))
                uncut_cpu.append(round(whole.cpu, 3))
                cut = bench._cut_one(p2p, branch, full_wire)
                got = cut["fetch_result"] or {}
                cuts.append({"seconds": cut["seconds"], "cpu": cut["cpu"], "cut_at_s": cut["cut_at_s"],
                             "exit": cut["exit"], "over_uncut": round(cut["seconds"] - uncut[-1], 3),
                             "body_per_raw": round(got.get("bytes_received", 0) / size, 4),
                             "served": got.get("served"), "dropped": got.get("dropped_peers")})
                bt.log(f"  uncut {uncut[-1]} s, cut {cuts[-1]}")
        cost = median(c["seconds"] for c in cuts) - median(uncut)
        bt.emit({"benchmark": "cut", "session_bytes": size, "one_holder_wire": full_wire,
                 "uncut_seconds": uncut, "uncut_cpu": uncut_cpu, "cuts": cuts, "cost_seconds": round(cost, 3),
                 "pairs_median_seconds": round(median(c["over_uncut"] for c in cuts), 3),
                 "cpu_cost": round(median(c["cpu"] for c in cuts) - median(uncut_cpu), 3),
                 "goals": [bt.goal("a holder cut mid-transfer, seconds over uncut (medians)",
                                   round(cost, 3), 3.0, "s")]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
