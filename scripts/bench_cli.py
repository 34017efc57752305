#!/usr/bin/env python3
"""The fixed costs of the +1 % path on loopback (no lab, no root): each CLI's own start included.

    .venv/bin/python scripts/bench_cli.py [--repo DIR] [--mb 16] [--rounds 5]

Node "a" runs `p2pnode serve` (no mDNS, 127.0.0.1); "b" has no node.  A generated Pi-shaped
session (bench_share.py's generator) is shared by a (`p2pnode share FILE --json`, through its
node) and fetched one-shot by b (`p2pnode fetch BRANCH --from 127.0.0.1:PORT --json`), then
grown by 1 % and shared and fetched again, `--rounds` times.  `--repo`: the tree whose p2pnode
runs (PYTHONPATH), to compare a base checkout against this one back to back.  Reports medians of
wall seconds and CPU seconds (user+sys of the CLI process; the node's CPU during each share
from /proc), and `status --json` alone, as one JSON object on stdout.
"""
from __future__ import annotations

import argparse
import compileall
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchlib import median, process_cpu, tree_env  # noqa: E402
from bench_share import SessionWriter  # noqa: E402

MB = 1_000_000


class Home:
    """One node's state dir and Pi agent dir, and running `p2pnode` as that node."""

    def __init__(self, root: Path, name: str, repo: Path) -> None:
        self.env = dict(os.environ, **tree_env(repo), P2PNODE_HOME=str(root / name / "node"),
                        PI_CODING_AGENT_DIR=str(root / name / "agent"))
        (root / name / "agent").mkdir(parents=True)

    profile: Path | None = None
    """Where the next command's cProfile (wall-clock timer) goes, if anywhere."""
    spans = False
    """Run the next command through fetch_spans.py (its steps' wall and CPU seconds)."""
    last_spans: dict[str, Any] | None = None

    def argv(self, *args: str) -> list[str]:
        prof = ["-m", "cProfile", "-o", str(self.profile)] if self.profile else []
        how = [str(Path(__file__).with_name("fetch_spans.py"))] if self.spans else ["-m", "p2pnode"]
        return [sys.executable, *prof, *how, *args]

    def run(self, *args: str) -> tuple[str, float, float]:
        """stdout, wall seconds, CPU seconds of the command."""
        before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
        proc = subprocess.run(self.argv(*args), env=self.env, capture_output=True, text=True, timeout=600)
        wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode:
            raise SystemExit(f"p2pnode {' '.join(args)}: exit {proc.returncode}: {proc.stderr}")
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        marked = [line for line in proc.stderr.splitlines() if line.startswith("fetch_spans: ")]
        self.last_spans = json.loads(marked[-1].split(" ", 1)[1]) if marked else None
        return proc.stdout, wall, cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    ap.add_argument("--mb", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", type=Path, help="write cProfile files (wall clock) of each grown fetch "
                    "here (fetch-N.prof); profiling adds CPU, so its times are not the medians'")
    ap.add_argument("--spans", action="store_true", help="run each grown fetch through fetch_spans.py and "
                    "report its steps (the patching adds imports: the medians are then not the plain CLI's)")
    args = ap.parse_args()
    for package in ("p2pnode", "store", "sysio"):  # as `pip install` leaves it (see bench_transfer.py)
        compileall.compile_dir(args.repo / package, quiet=1)
    root = Path(tempfile.mkdtemp(prefix="bench_cli-"))
    spans: list[dict[str, Any]] = []
    a, b = Home(root, "a", args.repo), Home(root, "b", args.repo)
    ids = [json.loads(h.run("id", "--json")[0])["node_id"] for h in (a, b)]
    a.run("trust", ids[1])
    b.run("trust", ids[0])
    port = 40000 + os.getpid() % 20000
    with open(root / "serve.log", "w") as log:
        node = subprocess.Popen(a.argv("serve", "--no-mdns", "--host", "127.0.0.1", "--port", str(port)),
                                env=a.env, stdout=log, stderr=log)
    try:
        for _ in range(300):
            if (root / "a" / "node" / "control.sock").exists():
                break
            time.sleep(0.1)
        writer, session_id = SessionWriter(7), str(uuid.UUID(int=(0x01A1FF93 << 96) | 7))
        path = root / f"2026-11-21T19-00-00-000Z_{session_id}.jsonl"
        with open(path, "wb") as f:
            f.write(writer.session(session_id, min(args.mb * MB, 4 * MB)))
            while f.tell() < args.mb * MB:
                f.write(writer.growth(min(64 * MB, args.mb * MB - f.tell())))
        status = [a.run("status", "--json")[1:] for _ in range(3)]
        rows: list[dict[str, float]] = []
        for n in range(args.rounds + 1):  # the first is the first transfer, not counted
            if n:
                with open(path, "ab") as f:
                    f.write(writer.growth(path.stat().st_size // 100))
            if args.profile and n:
                args.profile.mkdir(parents=True, exist_ok=True)
                b.profile = args.profile / f"fetch-{n}.prof"
            b.spans = args.spans and n > 0
            node0 = process_cpu(node.pid)
            out, share_s, share_cpu = a.run("share", str(path), "--json")
            node_cpu = process_cpu(node.pid) - node0
            fetched, fetch_s, fetch_cpu = b.run("fetch", json.loads(out)["branch"], "--from",
                                                f"127.0.0.1:{port}", "--json")
            b.profile = None
            if b.last_spans is not None:
                spans.append(dict(b.last_spans, fetch_s=round(fetch_s, 4), fetch_cpu=round(fetch_cpu, 4)))
            got = json.loads(fetched)  # the fetch's own split: until the last line, then commit + place
            rows.append({"share_s": share_s, "share_cpu": share_cpu, "node_cpu": node_cpu,
                         "fetch_s": fetch_s, "fetch_cpu": fetch_cpu,
                         "fetch_transfer_s": got["seconds_transfer"], "fetch_store_s": got["seconds_store"]})
    finally:
        node.terminate()
        node.wait(30)
        shutil.rmtree(root, ignore_errors=True)
    grown = rows[1:]
    result = {"repo": str(args.repo), "mb": args.mb, "rounds": args.rounds,
              "loadavg": round(os.getloadavg()[0], 2),
              "status_s": median([s for s, _ in status]), "status_cpu": median([c for _, c in status]),
              "first": rows[0], **{k: round(median([r[k] for r in grown]), 4) for k in grown[0]}}
    if spans:
        result["spans"] = spans
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
