#!/usr/bin/env python3
"""Run `p2pnode ARGS...` with wall-clock spans around the steps of a one-shot fetch.

    python scripts/fetch_spans.py fetch BRANCH --from HOST:PORT --json

The CLI runs as usual (stdout untouched); on exit one JSON object goes to stderr after the
line `fetch_spans:`: per step, its count, wall seconds and the thread's CPU seconds (a span on
a worker thread counts that thread's CPU), plus the process's start-up and imports.  Steps are
patched in by name (no change to p2pnode): a step renamed there is reported missing here.
bench_cli.py --spans runs each grown fetch through this.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import json
import os
import sys
import threading
import time
from collections import defaultdict
from typing import Any

T0 = time.perf_counter()
SPANS: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
_LOCK = threading.Lock()
MISSING: list[str] = []

STEPS = [  # module, attribute path
    ("p2pnode.peer.get", "OpenPerUse.__call__"), ("p2pnode.library.api", "Library.close"),
    ("p2pnode.cli.main", "_identity"), ("p2pnode.cli.main", "_trust"),
    ("p2pnode.peer.link", "PeerLink.catalog"), ("p2pnode.peer.link", "PeerLink.sidecar"),
    ("p2pnode.peer.link", "PeerLink.get_small"), ("p2pnode.peer.link", "PeerLink.close"),
    ("p2pnode.peer.get", "get_catalog"), ("p2pnode.node.follow", "newest_to_fetch"),
    ("p2pnode.peer.get", "fetch_branch"), ("p2pnode.peer.get", "_Fetch.walk"),
    ("p2pnode.peer.get", "_held_versions"), ("p2pnode.peer.get", "_Fetch._manifest"),
    ("p2pnode.peer.get", "_held_prefix"), ("p2pnode.peer.get", "prefix_hasher"),
    ("p2pnode.library.api", "Library.line_manifest"), ("p2pnode.library.api", "Library.version"),
    ("p2pnode.peer.get", "_Fetch._missing"), ("p2pnode.peer.batches", "get_lines"),
    ("p2pnode.library.api", "Library.stage_lines"), ("p2pnode.peer.get", "_Stream._open_out"),
    ("p2pnode.peer.get", "_Stream.flush"), ("p2pnode.peer.get", "_Stream._take"),
    ("p2pnode.peer.get", "_Stream._write"), ("p2pnode.peer.get", "_Lingering.release"),
    ("p2pnode.peer.get", "_commit"), ("p2pnode.library.api", "Library.add_staged"),
    ("p2pnode.peer.get", "_publish"), ("p2pnode.pi.placement", "SessionFile.append_to"),
    ("p2pnode.pi.placement", "SessionFile.publish"), ("p2pnode.pi.placement", "appendable"),
    ("p2pnode.peer.get", "_place"), ("p2pnode.node.follow", "_check_newest"),
    ("p2pnode.peer.downloader", "PeerPool.close"),
    ("sysio.flush", "flush_data"), ("sysio.files", "fsync_dir"),
]


def _add(name: str, wall: float, cpu: float) -> None:
    with _LOCK:
        row = SPANS[name]
        row[0] += 1
        row[1] += wall
        row[2] += cpu


def _wrap(name: str, fn: Any) -> Any:
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def awrapped(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return await fn(*a, **kw)
            finally:
                _add(name, time.perf_counter() - t, 0.0)  # awaits: other tasks' CPU is not its own
        return awrapped

    @functools.wraps(fn)
    def wrapped(*a: Any, **kw: Any) -> Any:
        t, c = time.perf_counter(), time.thread_time()
        try:
            return fn(*a, **kw)
        finally:
            _add(name, time.perf_counter() - t, time.thread_time() - c)
    return wrapped


def _patch() -> None:
    for mod_name, attr in STEPS:
        mod = importlib.import_module(mod_name)
        owner: Any = mod
        *path, last = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        fn = getattr(owner, last, None)
        if fn is None:
            MISSING.append(f"{mod_name}.{attr}")
            continue
        setattr(owner, last, _wrap(attr, fn))
        for other in list(sys.modules.values()):  # `from x import fn` copies elsewhere
            if not path and other is not None and other is not mod and getattr(other, last, None) is fn:
                setattr(other, last, getattr(owner, last))


def _report() -> None:
    end = time.perf_counter()
    usage = os.times()
    out = {"wall_s": round(end - START, 4), "cpu_s": round(usage.user + usage.system, 4),
           "imports_s": round(IMPORTED - T0, 4), "since_exec_s": round(end - T0, 4),
           "steps": {k: {"n": int(n), "wall": round(w, 4), "cpu": round(c, 4)}
                     for k, (n, w, c) in SPANS.items()},
           "missing": MISSING}
    print("fetch_spans: " + json.dumps(out), file=sys.stderr)


if __name__ == "__main__":
    _patch()
    IMPORTED = time.perf_counter()
    from p2pnode.cli.main import main

    START = T0
    sys.argv = ["p2pnode", *sys.argv[1:]]
    try:
        code = main()
    finally:
        _report()
    raise SystemExit(code)
