"""Shared helpers for the benchmarks in scripts/: timing, percentiles, goals, JSON output.

Every benchmark prints exactly one JSON object on stdout (progress goes to stderr) with a
`goals` list; each goal is `{"name", "value", "target", "unit", "met"}`.  Import it from a
script in scripts/ with `from _benchlib import ...` (the script's directory is on sys.path).
This module is a stable interface: add to it, do not change what is here.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

now = time.perf_counter
"""The clock every benchmark measures with (seconds, monotonic, high resolution)."""


def percentile(xs: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100) by linear interpolation between closest ranks."""
    if not xs:
        raise ValueError("percentile of an empty sequence")
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def median(xs: Sequence[float]) -> float:
    return percentile(xs, 50)


def ms(seconds: float) -> float:
    """Seconds to milliseconds, rounded to a microsecond for readable JSON."""
    return round(seconds * 1000.0, 3)


def summary_ms(xs: Sequence[float]) -> dict[str, float]:
    """p50/p99/max in milliseconds of a list of seconds, with the sample count."""
    return {"p50_ms": ms(median(xs)), "p99_ms": ms(percentile(xs, 99)), "max_ms": ms(max(xs)), "n": len(xs)}


def goal(name: str, value: float, target: float, unit: str, higher_is_better: bool = False) -> dict[str, Any]:
    """One entry of the `goals` list: met when value is at or beyond target in the good direction."""
    met = value >= target if higher_is_better else value <= target
    return {"name": name, "value": round(value, 4), "target": target, "unit": unit, "met": bool(met)}


def unmet(name: str, target: float, unit: str, why: str) -> dict[str, Any]:
    """The goal of a baseline that could not run: reported unmet with the reason, never dropped."""
    return {"name": name, "value": None, "target": target, "unit": unit, "met": False, "why": why}


def disk_bytes(path: str | os.PathLike[str]) -> int:
    """Allocated bytes (st_blocks × 512) of every file under path: what the disk really holds."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            total += os.lstat(os.path.join(root, f)).st_blocks * 512
    return total


def process_cpu(pid: int, reaped_children: bool = False) -> float:
    """CPU seconds another process has used, all its threads (exited ones too), exact to the
    nanosecond: /proc's utime+stime count 10 ms ticks, and a small transfer can cost less
    than one.  Linux names a process's CPU-time clock (~pid << 3) | CPUCLOCK_SCHED; Python
    does not wrap clock_getcpuclockid(3).  With reaped_children, the children it has waited
    for are added from /proc, which only keeps them in ticks.  0 if the process is gone."""
    try:
        own = time.clock_gettime((~pid << 3) | 2)
        if not reaped_children:
            return own
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return own + (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def tree_env(repo: os.PathLike[str] | str) -> dict[str, str]:
    """What makes `python -m p2pnode` run the p2pnode of the checkout `repo`, whatever the
    working directory: `python -m` puts the working directory first on sys.path, so a benchmark
    run from one checkout compared it with itself (PYTHONSAFEPATH keeps it off)."""
    return {"PYTHONPATH": str(repo), "PYTHONSAFEPATH": "1"}


def log(*parts: object) -> None:
    """Human-readable progress, on stderr so that stdout stays one JSON object."""
    print(*parts, file=sys.stderr, flush=True)


def emit(result: dict[str, Any]) -> None:
    """Print the result as the benchmark's single JSON object; it must carry a `goals` list."""
    if not isinstance(result.get("goals"), list):
        raise ValueError("a benchmark result needs a 'goals' list")
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    sys.stdout.flush()


def goals_met(goals: Iterable[dict[str, Any]]) -> str:
    """'met/total' for a progress line."""
    gs = list(goals)
    return f"{sum(g['met'] for g in gs)}/{len(gs)}"
