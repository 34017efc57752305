#!/usr/bin/env python3
"""Benchmark of `share` (issue 4), against its baselines in the same run.

1. First share of generated Pi-like sessions of 1, 10, 100 and 256 MB into a fresh node,
   secret scan included (in the importing thread, as it reads), against raw BLAKE3 of the same
   file (memory-mapped, all cores).  Goals: >= 150 MB/s on 100 MB (issue 4), >= 200 MB/s on
   256 MB (issue 12).
2. Re-share after +1 % growth, by the running node (the same Library: live hasher state),
   against the first share's time.  Goal: <= 5 %.  A cold re-share (a new process: stat
   cache miss, prefix re-hashed, only new lines stored) is reported too.
3. Store bytes for a session and 10 forks of it (each a new header, a copy of a prefix of
   the parent's lines and a few new lines, as Pi's /fork and --fork write them), against
   the same store holding the session alone and against 11 whole-file copies.  Goal:
   <= 1.2x the one session, counted without the store's fixed-size pre-allocated head WAL
   (with it, on disk, the ratio is smaller still and is reported too).
4. The secret scan `share` runs first (p2pnode/pi/secrets.py) over a 100 MB session with
   image lines, whole and fed in 4 MiB pieces as the import feeds it, against one trivial
   `re` pattern over the same bytes.  Goal: >= 50 MB/s.

`share_MB_per_cpu_s` (MB per CPU second of the process, all threads, and of any waited-for
child process) is reported beside the
wall-clock figures because this machine's two cores are shared: it says what the code
costs, whatever else is running.  Prints one JSON object on stdout; progress on stderr.
`--quick` takes about a minute.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import random
import re
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _benchlib import disk_bytes, emit, goal, goals_met, log, median, now  # noqa: E402

from p2pnode.library.api import Library  # noqa: E402
from p2pnode.paths import NodePaths  # noqa: E402
from p2pnode.pi import secrets  # noqa: E402
from p2pnode.pi.hashing import hash_file  # noqa: E402

MB = 1_000_000
CWD = "/home/dev/projects/bench"
STDLIB = Path(sysconfig.get_paths()["stdlib"])
POOL = "".join(p.read_text(errors="replace") for p in sorted(STDLIB.glob("*.py")))
"""Text for prompts, replies and tool output: real source code (Python's standard library),
as an agent reads, writes and runs it."""


class SessionWriter:
    """Pi-like JSONL: header, model/thinking changes, then user / assistant+toolCall /
    toolResult / assistant turns with text from POOL and, now and then, an image."""

    def __init__(self, seed: int, image_rate: float = 0.02) -> None:
        self.rng = random.Random(seed)
        self.image_rate = image_rate
        """The share of tool results that are an image (base64 PNG-sized bytes)."""
        self.pool = POOL
        self.last_id: str | None = None
        self.clock = 1_790_000_000_000

    def text(self, lo: int, hi: int) -> str:
        n = self.rng.randint(lo, hi)
        start = self.rng.randrange(0, len(self.pool) - n)
        return self.pool[start:start + n]

    def entry(self, obj: dict) -> bytes:
        entry_id = f"{self.rng.getrandbits(32):08x}"
        self.clock += self.rng.randint(10, 5000)
        minute, second = (self.clock // 60000) % 60, (self.clock // 1000) % 60
        line = {"type": obj.pop("type"), "id": entry_id, "parentId": self.last_id,
                "timestamp": f"2026-11-21T19:{minute:02d}:{second:02d}.000Z"}
        line.update(obj)
        self.last_id = entry_id
        return json.dumps(line, separators=(",", ":")).encode() + b"\n"

    def header(self, session_id: str, parent: str | None = None) -> bytes:
        obj = {"type": "session", "version": 3, "id": session_id, "timestamp": "2026-11-21T19:00:00.000Z",
               "cwd": CWD}
        if parent:
            obj["parentSession"] = parent
        return json.dumps(obj, separators=(",", ":")).encode() + b"\n"

    def turn(self) -> bytes:
        """One user prompt and the agent's work on it: several lines."""
        msg = lambda role, content, **kw: {"type": "message",  # noqa: E731
                                           "message": {"role": role, "content": content,
                                                       "timestamp": self.clock, **kw}}
        out = [self.entry(msg("user", [{"type": "text", "text": self.text(20, 600)}]))]
        for _ in range(self.rng.randint(1, 4)):
            call = {"type": "toolCall", "id": f"call_{self.rng.getrandbits(40):x}", "name": "bash",
                    "arguments": {"command": self.text(10, 2000)}}
            out.append(self.entry(msg("assistant", [{"type": "text", "text": self.text(20, 800)}, call],
                                      api="openai-completions", provider="fake", model="fake-coder",
                                      usage={"input": 1200, "output": 300, "totalTokens": 1500},
                                      stopReason="toolUse")))
            if self.rng.random() < self.image_rate:
                image = base64.b64encode(self.rng.randbytes(self.rng.randint(50_000, 300_000))).decode()
                content = [{"type": "image", "data": image, "mimeType": "image/png"}]
            else:
                content = [{"type": "text", "text": self.text(100, 40_000)}]
            out.append(self.entry(msg("toolResult", content, toolCallId=call["id"], toolName="bash",
                                      isError=False)))
        out.append(self.entry(msg("assistant", [{"type": "text", "text": self.text(20, 1500)}],
                                  stopReason="stop")))
        return b"".join(out)

    def session(self, session_id: str, size: int) -> bytes:
        parts = [self.header(session_id),
                 self.entry({"type": "model_change", "provider": "fake", "modelId": "fake-coder"}),
                 self.entry({"type": "thinking_level_change", "thinkingLevel": "off"})]
        total = sum(map(len, parts))
        while total < size:
            parts.append(self.turn())
            total += len(parts[-1])
        return b"".join(parts)

    def growth(self, size: int) -> bytes:
        parts: list[bytes] = []
        while sum(map(len, parts)) < size:
            parts.append(self.turn())
        return b"".join(parts)


def session_path(agent: Path, name: str) -> Path:
    d = agent / "sessions" / ("--" + CWD.strip("/").replace("/", "-") + "--")
    d.mkdir(parents=True, exist_ok=True)
    return d / f"2026-11-21T19-00-00-000Z_{name}.jsonl"


def cpu_seconds() -> float:
    """CPU time of this process (all threads) and of its waited-for children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def bench_first_share(work: Path, agent: Path, size_mb: int, reps: int) -> dict:
    writer = SessionWriter(size_mb)
    path = session_path(agent, f"01a1ff93-0000-7000-8000-{size_mb:012d}")
    path.write_bytes(writer.session(f"01a1ff93-0000-7000-8000-{size_mb:012d}", size_mb * MB))
    size = path.stat().st_size
    expected = hash_file(path)
    raw, share, cpu = [], [], []
    for rep in range(reps):
        t0 = now()
        assert hash_file(path) == expected
        raw.append(now() - t0)
        home = work / f"node-first-{size_mb}-{rep}"
        with Library.open(NodePaths(home), agent_dir=agent) as lib:
            t0, c0 = now(), cpu_seconds()
            result = lib.share(str(path))
            share.append(now() - t0)
            cpu.append(cpu_seconds() - c0)
            assert result.src == expected
        shutil.rmtree(home)
    row = {"size_bytes": size, "lines": result.lines, "share_s_median": round(median(share), 4),
           "share_MBps": round(size / MB / median(share), 1),
           "share_cpu_s_median": round(median(cpu), 4),
           "share_MB_per_cpu_s": round(size / MB / median(cpu), 1),
           "blake3_s_median": round(median(raw), 4),
           "blake3_MBps": round(size / MB / median(raw), 1),
           "share_time_over_blake3": round(median(share) / median(raw), 2), "reps": reps}
    log(f"first share {size_mb} MB: {row['share_MBps']} MB/s (blake3 {row['blake3_MBps']} MB/s)")
    return row


def bench_reshare(work: Path, agent: Path, size_mb: int, reps: int) -> dict:
    writer = SessionWriter(1000 + size_mb)
    session_id = f"01a1ff93-1111-7000-8000-{size_mb:012d}"
    path = session_path(agent, session_id)
    path.write_bytes(writer.session(session_id, size_mb * MB))
    home = work / "node-reshare"
    warm, cold, first = [], [], []
    with Library.open(NodePaths(home), agent_dir=agent) as lib:
        t0 = now()
        lib.share(str(path))
        first.append(now() - t0)
        for _ in range(reps):
            with open(path, "ab") as f:
                f.write(writer.growth(path.stat().st_size // 100))
            t0 = now()
            result = lib.share(str(path))
            warm.append(now() - t0)
            assert result.src == hash_file(path)
    for _ in range(reps):  # a new process each time: the stat cache, no live hasher state
        with open(path, "ab") as f:
            f.write(writer.growth(path.stat().st_size // 100))
        with Library.open(NodePaths(home), agent_dir=agent) as lib:
            t0 = now()
            result = lib.share(str(path))
            cold.append(now() - t0)
            assert result.src == hash_file(path)
            assert lib.session_bytes(result.src) == path.read_bytes()
    shutil.rmtree(home)
    row = {"size_bytes": path.stat().st_size, "first_share_s": round(first[0], 4),
           "reshare_warm_s_median": round(median(warm), 4), "reshare_cold_s_median": round(median(cold), 4),
           "warm_over_first_pct": round(100 * median(warm) / first[0], 2),
           "cold_over_first_pct": round(100 * median(cold) / first[0], 2), "reps": reps}
    log(f"re-share +1% of {size_mb} MB: warm {row['warm_over_first_pct']} %, "
        f"cold {row['cold_over_first_pct']} % of the first share")
    return row


def content_bytes(store_dir: Path) -> int:
    """Bytes the store holds for its content: every file but the fixed-size, pre-allocated
    head table and WAL (heads.*), which would flatter a ratio against one session."""
    return sum(f.stat().st_size for f in store_dir.iterdir() if not f.name.startswith("heads"))


def bench_forks(work: Path, agent: Path, size_mb: int, forks: int) -> dict:
    writer = SessionWriter(2000 + size_mb)
    base_id = "01a1ff93-2222-7000-8000-000000000000"
    base = session_path(agent, base_id)
    base.write_bytes(writer.session(base_id, size_mb * MB))
    header, body = base.read_bytes().split(b"\n", 1)
    lines = body.splitlines(keepends=True)
    fork_paths = []
    for i in range(forks):
        cut = writer.rng.randint(len(lines) // 2, len(lines))
        fork_id = f"01a1ff93-2222-7000-8000-{i + 1:012d}"
        p = session_path(agent, fork_id)
        writer.last_id = None
        p.write_bytes(writer.header(fork_id, str(base)) + b"".join(lines[:cut]) + writer.turn())
        fork_paths.append(p)
    home = work / "node-forks"
    with Library.open(NodePaths(home), agent_dir=agent) as lib:
        lib.share(str(base))
    one, one_content = disk_bytes(home / "store"), content_bytes(home / "store")
    with Library.open(NodePaths(home), agent_dir=agent) as lib:
        for p in fork_paths:
            assert lib.share(str(p)).parent is not None
    all_, all_content = disk_bytes(home / "store"), content_bytes(home / "store")
    copies = sum(f.stat().st_blocks * 512 for f in [base, *fork_paths])
    shutil.rmtree(home)
    row = {"session_bytes": base.stat().st_size, "forks": forks,
           "store_disk_one_session": one, "store_disk_with_forks": all_,
           "store_content_one_session": one_content, "store_content_with_forks": all_content,
           "whole_file_copies_disk": copies,
           "disk_with_forks_over_one": round(all_ / one, 3),
           "with_forks_over_one": round(all_content / one_content, 3),
           "with_forks_over_copies": round(all_ / copies, 3)}
    log(f"{forks} forks: store {row['with_forks_over_one']}x one session, "
        f"{row['with_forks_over_copies']}x of {forks + 1} whole copies")
    return row


def bench_secret_scan(size_mb: int, reps: int) -> dict:
    """The scan over a session held in memory, and in 4 MiB pieces as the import feeds it
    (`Scanner`: a copy of each piece, line counting), in CPU seconds of this thread (the
    machine is shared); against the floor any regex pass pays: one literal pattern."""
    data = SessionWriter(size_mb + 7).session("01a1ff93-0000-7000-8000-5ec7e75ca000", size_mb * MB)
    trivial = re.compile(rb"sk-ant-")
    view = memoryview(data)
    scan, pieces, raw = [], [], []
    for _ in range(reps):
        t0 = time.thread_time()
        findings = secrets.scan(data)
        scan.append(time.thread_time() - t0)
        t0 = time.thread_time()
        scanner = secrets.Scanner()
        for at in range(0, len(data), PIECE):
            scanner.feed(view[at:at + PIECE])
        assert scanner.finish() == findings
        pieces.append(time.thread_time() - t0)
        t0 = time.thread_time()
        sum(1 for _ in trivial.finditer(data))
        raw.append(time.thread_time() - t0)
    assert not findings, findings
    row = {"size_bytes": len(data), "images": data.count(b'"type":"image"'),
           "scan_cpu_s_median": round(median(scan), 4), "scan_MBps": round(len(data) / MB / median(scan), 1),
           "in_pieces_cpu_s_median": round(median(pieces), 4),
           "in_pieces_MBps": round(len(data) / MB / median(pieces), 1),
           "one_pattern_MBps": round(len(data) / MB / median(raw), 1), "patterns": len(secrets.PATTERNS),
           "reps": reps}
    log(f"secret scan {size_mb} MB: {row['scan_MBps']} MB/s, in pieces {row['in_pieces_MBps']} MB/s "
        f"(one pattern {row['one_pattern_MBps']} MB/s)")
    return row


PIECE = 4 * 1024 * 1024
"""What the import feeds the scan at a time (pi/hashing.py's read size)."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (about a minute)")
    ap.add_argument("--dir", help="work directory (default: a new temp dir, removed at the end)")
    args = ap.parse_args()
    reps = 3 if args.quick else 5
    work = Path(tempfile.mkdtemp(prefix="bench_share_", dir=args.dir))
    load_before = os.getloadavg()
    agent = work / "agent"
    try:
        first = {f"{mb}MB": bench_first_share(work, agent, mb, reps) for mb in (1, 10, 100, 256)}
        reshare = bench_reshare(work, agent, 100, reps)
        forks = bench_forks(work, agent, 10, 10)
        scan = bench_secret_scan(100, reps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    goals = [
        goal("first share of 100 MB, throughput", first["100MB"]["share_MBps"], 150, "MB/s",
             higher_is_better=True),
        goal("first share of 256 MB, throughput", first["256MB"]["share_MBps"], 200, "MB/s",
             higher_is_better=True),
        goal("re-share after +1% growth, share of the first share's time",
             reshare["warm_over_first_pct"], 5, "%"),
        goal("store bytes on disk, session + 10 forks over one session",
             forks["with_forks_over_one"], 1.2, "x"),
        goal("secret scan throughput", scan["scan_MBps"], 50, "MB/s", higher_is_better=True),
    ]
    log(f"goals met: {goals_met(goals)}")
    emit({"benchmark": "share", "quick": args.quick, "cpus": os.cpu_count(),
          "loadavg_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
          "first_share": first, "reshare": reshare, "forks": forks, "secret_scan": scan,
          "goals": goals})


if __name__ == "__main__":
    main()
