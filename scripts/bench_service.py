#!/usr/bin/env python3
"""Benchmark of the store service (issue 3) against the engine called directly and Redis.

In one run, with 10 KB text payloads and durable writes everywhere:
  * APPEND_TURN round trip over the Unix socket, p50/p99, one request at a time;
  * pipelined appends/s with 16 contexts (16 requests in flight on one connection);
  * GET_LAST(64) round trip (with payloads, warm), p50;
the same operations as direct engine calls (16 threads for the pipelined case), and Redis
(`appendonly yes`, `appendfsync always`, over a Unix socket too) doing XADD and
XREVRANGE COUNT 64 through redis-py's asyncio client.  The service runs as its own process
(`python -m store serve`), as it does for a real agent; this process runs on the event loop
the project uses (sysio/eventloop.py: uvloop when installed), Redis's client included.  The calls
of the systems alternate so that noise from other tenants of the machine falls on all alike.

GET_LAST(64) with payloads moves ~660 KB between processes, which a direct engine call (64
cached objects handed over) never does; so that round trip is also set beside the floor for
moving those bytes at all: one request byte out and the reply's size back over a Unix socket
from another process, blocking sockets, no framing or decoding, interleaved with the rest.

Prints one JSON object on stdout (progress on stderr).  `--quick` takes about a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _benchlib import emit, goal, goals_met, log, median, ms, now, summary_ms, unmet  # noqa: E402

from store import Store  # noqa: E402
from store.service import messages as m  # noqa: E402
from store.service.client import StoreClient  # noqa: E402
from store.service.frames import HEADER_SIZE  # noqa: E402
from sysio import eventloop  # noqa: E402

PAYLOAD = 10 * 1024
CONTEXTS = 16
WORDS = [
    w.encode()
    for w in [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "while",
        "tool",
        "output",
        "and",
        "code",
        "diff",
        "lines",
        "scroll",
    ]
]


def payload(rng: random.Random) -> bytes:
    """~10 KB of unique, text-like bytes (zstd-3 makes ~2.3 KB of them; never deduplicated)."""
    head = b'{"role":"tool","id":"%032x","text":"' % rng.getrandbits(128)
    body = b" ".join(rng.choice(WORDS) for _ in range(PAYLOAD // 5))
    return (head + body)[: PAYLOAD - 2] + b'"}'


class Redis:
    """redis-server in a temp dir on a Unix socket, durable (every write fsynced before the reply)."""

    def __init__(self, workdir: Path) -> None:
        self.sock = workdir / "redis.sock"
        self.proc = subprocess.Popen(
            ["redis-server", "--port", "0", "--unixsocket", str(self.sock), "--unixsocketperm", "700",
             "--dir", str(workdir), "--appendonly", "yes", "--appendfsync", "always", "--save", "",
             "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while not self.sock.exists():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


FLOOR_CHILD = """
import socket, sys
s = socket.socket(fileno=int(sys.argv[1]))
ask, reply = memoryview(bytearray(int(sys.argv[2]))), bytes(int(sys.argv[3]))
while True:
    got = 0
    while got < len(ask):
        n = s.recv_into(ask[got:])
        if not n:
            sys.exit()
        got += n
    s.sendall(reply)
"""


class RawTransfer:
    """The floor of any out-of-process service on this machine: a request of ask bytes to
    another process over a Unix socket and a reply of reply bytes back (blocking sockets,
    no framing, no decoding, no work)."""

    def __init__(self, ask: int, reply: int) -> None:
        self.sock, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", FLOOR_CHILD, str(theirs.fileno()), str(ask), str(reply)],
            pass_fds=[theirs.fileno()],
        )
        theirs.close()
        self.ask = bytes(ask)
        self.buf = memoryview(bytearray(reply))

    def fetch(self) -> None:
        self.sock.sendall(self.ask)
        got = 0
        while got < len(self.buf):
            got += self.sock.recv_into(self.buf[got:])

    def close(self) -> None:
        self.sock.close()
        self.proc.wait(10)


def start_service(store_dir: Path, sock: Path) -> subprocess.Popen[str]:
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "store", "serve", str(store_dir), "--socket", str(sock)],
        cwd=repo, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("listening"):
        proc.kill()
        raise RuntimeError(f"the store service did not start: {line!r}")
    return proc


async def interleaved(ops: dict[str, Callable[[], Any]], reps: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per call of each op, the ops taking turns call by call (rotating who goes first),
    so that a disk or CPU stall from another tenant hits every system alike."""
    names = list(ops)
    out: dict[str, list[float]] = {n: [] for n in names}
    for i in range(warmup + reps):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            t0 = now()
            result = ops[name]()
            if inspect.isawaitable(result):
                await result
            if i >= warmup:
                out[name].append(now() - t0)
    return out


async def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    rng = random.Random(1)
    reps, rate_reps, per_ctx = (300, 3, 40) if args.quick else (2000, 5, 150)

    proc = start_service(work / "service-store", work / "service.sock")
    engine = Store.open(work / "engine-store")
    redis_note = None
    rcli: Any = None
    redis_server: Redis | None = None
    try:
        import redis.asyncio as aioredis

        if shutil.which("redis-server") is None:
            raise ImportError("redis-server is not installed")
        redis_server = Redis(work)
        rcli = aioredis.Redis(unix_socket_path=str(redis_server.sock), max_connections=CONTEXTS)
        redis_note = (
            f"redis-server {(await rcli.info('server'))['redis_version']}, appendonly yes, appendfsync always"
        )
    except ImportError as exc:
        redis_note = f"Redis column skipped: {exc}"
        log(redis_note)
    try:
        client = await StoreClient.connect(work / "service.sock")
        svc_ctx = [(await client.create_context()).context_id for _ in range(CONTEXTS)]
        eng_ctx = [engine.create_context().context_id for _ in range(CONTEXTS)]
        bodies = iter([payload(rng) for _ in range(3 * (reps + 20))])

        log(f"APPEND_TURN round trip, {reps} per system, interleaved")
        ping = RawTransfer(HEADER_SIZE + m.APPEND_TURN.size + PAYLOAD, HEADER_SIZE + m.TURN.size)
        ops: dict[str, Callable[[], Any]] = {
            "service": lambda: client.append_turn(svc_ctx[0], next(bodies)),
            "engine": lambda: engine.append_turn(eng_ctx[0], next(bodies)),
            "raw_round_trip": ping.fetch,
        }
        if rcli is not None:
            ops["redis"] = lambda: rcli.xadd("ctx:0", {"p": next(bodies)})
        try:
            appends = await interleaved(ops, reps, warmup=20)
        finally:
            ping.close()

        log(f"pipelined appends, {CONTEXTS} contexts x {per_ctx}, {rate_reps} reps")
        rates: dict[str, list[float]] = {name: [] for name in ops if name != "raw_round_trip"}
        total = CONTEXTS * per_ctx
        for _ in range(rate_reps):
            fresh = [[payload(rng) for _ in range(per_ctx)] for _ in range(CONTEXTS)]  # no dedup across reps
            t0 = now()
            await asyncio.gather(*(_append_all(client, c, bs) for c, bs in zip(svc_ctx, fresh, strict=True)))
            rates["service"].append(total / (now() - t0))
            threads = [
                threading.Thread(target=_engine_all, args=(engine, c, bs))
                for c, bs in zip(eng_ctx, fresh, strict=True)
            ]
            t0 = now()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            rates["engine"].append(total / (now() - t0))
            if rcli is not None:
                t0 = now()
                await asyncio.gather(*(_xadd_all(rcli, f"ctx:{i}", bs) for i, bs in enumerate(fresh)))
                rates["redis"].append(total / (now() - t0))

        log(f"GET_LAST(64) with payloads, {reps} per system, interleaved")
        sample = await client.get_last(svc_ctx[0], 64, payloads=True)
        reply_bytes = len(m.TurnList(sample.turns, sample.payloads).encode())
        floor = RawTransfer(1, reply_bytes)
        ops = {
            "service": lambda: client.get_last(svc_ctx[0], 64, payloads=True),
            "engine": lambda: engine.payloads(engine.get_last(eng_ctx[0], 64)),
            "raw_transfer": floor.fetch,
        }
        if rcli is not None:
            ops["redis"] = lambda: rcli.xrevrange("ctx:0", count=64)
        try:
            gets = await interleaved(ops, reps, warmup=20)
        finally:
            floor.close()
        meta_ops: dict[str, Callable[[], Any]] = {
            "service": lambda: client.get_last(svc_ctx[0], 64),
            "engine": lambda: engine.get_last(eng_ctx[0], 64),
        }
        meta = await interleaved(meta_ops, reps, warmup=20)
        await client.close()
        if rcli is not None:
            await rcli.aclose()
    finally:
        engine.close()
        proc.terminate()
        proc.wait(20)
        if redis_server is not None:
            redis_server.stop()

    svc_p50, eng_p50 = median(appends["service"]), median(appends["engine"])
    get_svc, get_eng = median(gets["service"]), median(gets["engine"])
    get_floor = median(gets["raw_transfer"])
    goals = [
        goal(
            "APPEND_TURN p50 added by the service over a direct engine call", ms(svc_p50 - eng_p50), 0.1, "ms"
        ),
    ]
    vs_redis = {"service durable APPEND_TURN p50 / Redis durable XADD p50": appends,
                "service GET_LAST(64) with payloads p50 / Redis XREVRANGE COUNT 64 p50": gets}
    for name, samples in vs_redis.items():
        if "redis" in samples:
            goals.append(goal(name, median(samples["service"]) / median(samples["redis"]), 1.0, "ratio"))
        else:
            goals.append(unmet(name, 1.0, "ratio", redis_note or "Redis did not run"))
    return {
        "benchmark": "store service (scripts/bench_service.py)",
        "quick": args.quick,
        "setup": {
            "payload_bytes": PAYLOAD,
            "durable": True,
            "transport": "Unix socket (service and Redis)",
            "service": "python -m store serve, separate process; asyncio StoreClient",
            "event_loop": eventloop.loop_name(),
            "get_last_64_reply_bytes": reply_bytes,
            "redis": redis_note,
            "cpus": os.cpu_count(),
            "samples_per_system": reps,
        },  # fmt: skip
        "append_turn_rtt": {k: summary_ms(v) for k, v in appends.items()},
        "append_turn_p50_paired_difference_ms": ms(
            median([a - b for a, b in zip(appends["service"], appends["engine"], strict=True)])
        ),
        "pipelined_appends_per_s_16_contexts": {k: round(median(v)) for k, v in rates.items()},
        "pipelined_appends_per_s_reps": {k: [round(x) for x in v] for k, v in rates.items()},
        "get_last_64_rtt": {k: summary_ms(v) for k, v in gets.items()},
        "get_last_64_metadata_only_rtt": {k: summary_ms(v) for k, v in meta.items()},
        "added_over_engine_p50_ms": {
            "append_turn": ms(svc_p50 - eng_p50),
            "append_turn_beyond_a_raw_round_trip": ms(svc_p50 - eng_p50 - median(appends["raw_round_trip"])),
            "get_last_64_metadata_only": ms(median(meta["service"]) - median(meta["engine"])),
            "get_last_64_with_payloads": ms(get_svc - get_eng),
            "get_last_64_with_payloads_beyond_the_raw_transfer": ms(get_svc - get_eng - get_floor),
        },
        "service_vs_engine_p50_ratio": {
            "append_turn": round(svc_p50 / eng_p50, 3),
            "get_last_64": round(get_svc / get_eng, 3),
        },
        "goals": goals,
    }


async def _append_all(client: StoreClient, ctx: int, bodies: list[bytes]) -> None:
    for body in bodies:
        await client.append_turn(ctx, body)


def _engine_all(engine: Store, ctx: int, bodies: list[bytes]) -> None:
    for body in bodies:
        engine.append_turn(ctx, body)


async def _xadd_all(rcli: Any, key: str, bodies: list[bytes]) -> None:
    for body in bodies:
        await rcli.xadd(key, {"p": body})


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer samples, about a minute")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-service-"))
    try:
        result = eventloop.run(run(args, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(f"goals met: {goals_met(result['goals'])}")
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
