#!/usr/bin/env python3
"""Benchmark the turn and blob store against a SQLite baseline, in one run, on one workload.

Both engines are durable (the store's default; SQLite WAL with synchronous=FULL), both
compress with zstd-3 (raw when that does not shrink the payload) and both get exactly the
same generated payloads in the same order.  Phases, each run for both engines:

  build    fork-heavy scenario: C contexts x T turns, half of them forked from a random turn
           of an earlier context; single writer (figures reported, goals come from below)
  single   1 writer round-robin over 16 contexts, durable AppendTurn latency; the engines
           take turns op by op, so the shared disk's slow spells hit both alike
  conc16   16 threads, one context each, closed loop: latency and appends/s (the engines
           alternate which goes first from rep to rep)
  reads    GetLast(64) turns+payloads warm (16 active contexts, after a warm-up pass),
           GetBefore(64) paging head->root, full replay root->head
  size     bytes on disk of the scenario store against the dedup+zstd-3 floor
  open     Store.open -> first read on a store of 1M small turns (bulk-built, non-durable)

`single` and `conc16` run for several reps; goals use the median over reps.  Latencies are
over all appends, the ~1 MB images included.
Prints one JSON object on stdout; progress on stderr.  `--quick` finishes in about a minute.
"""
from __future__ import annotations

import argparse
import itertools
import os
import random
import shutil
import sqlite3
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import blake3
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _benchlib import disk_bytes, emit, goal, goals_met, log, median, ms, now, percentile, summary_ms  # noqa: E402

from store import Store, StoreConfig, TurnInput  # noqa: E402

IMAGE_SIZE = 1 << 20
ZSTD_LEVEL = 3


# --- workload -----------------------------------------------------------------------------


class Workload:
    """Deterministic agent-like payloads: pseudo-text of 2-20 KB from a Zipf vocabulary, tool
    outputs that recur (so dedup hits happen across contexts), and ~2 % incompressible ~1 MB
    images.  payload(i) depends only on (seed, i), so both engines see identical bytes."""

    def __init__(self, seed: int = 1, image_share: float = 0.02, repeat_share: float = 0.09) -> None:
        rng = random.Random(seed)
        letters = "abcdefghijklmnopqrstuvwxyz"
        vocab = ["".join(rng.choices(letters, k=rng.randint(2, 10))) for _ in range(4000)]
        cum = list(itertools.accumulate(1.0 / (r + 1) for r in range(len(vocab))))
        punct = [" "] * 6 + [", ", ". ", "(", ") ", " = ", "_", "/", ": "]
        self.lines = []
        for _ in range(20000):
            n = rng.randint(4, 18)
            words = rng.choices(vocab, cum_weights=cum, k=n)
            seps = rng.choices(punct, k=n)
            self.lines.append("".join(w + s for w, s in zip(words, seps, strict=True)))
        self.seed = seed
        self.image_share = image_share
        self.repeat_share = repeat_share
        self.tool_outputs = [self._text(random.Random(f"{seed}/tool/{k}"), f"tool {k}") for k in range(300)]

    def _text(self, rng: random.Random, header: str) -> bytes:
        size = rng.randint(2048, 20480)
        out, total = [header], len(header)
        while total < size:
            line = self.lines[rng.randrange(len(self.lines))]
            out.append(line)
            total += len(line) + 1
        return "\n".join(out).encode()[:size]

    def payload(self, i: int) -> bytes:
        rng = random.Random(f"{self.seed}/{i}")
        r = rng.random()
        if r < self.image_share:
            return rng.randbytes(IMAGE_SIZE - rng.randrange(4096))
        if r < self.image_share + self.repeat_share:
            return self.tool_outputs[rng.randrange(len(self.tool_outputs))]
        return self._text(rng, f'{{"turn": {i}, "role": "assistant"}}')


class Floor:
    """The dedup+zstd-3 floor: sum over unique payloads of min(raw, zstd-3 size)."""

    def __init__(self) -> None:
        self.seen: set[bytes] = set()
        self.floor = 0
        self.raw = 0
        self.unique = 0
        self._zc = zstandard.ZstdCompressor(level=ZSTD_LEVEL)

    def add(self, payload: bytes) -> None:
        self.raw += len(payload)
        h = blake3.blake3(payload).digest()
        if h not in self.seen:
            self.seen.add(h)
            self.unique += len(payload)
            self.floor += min(len(payload), len(self._zc.compress(payload)))


# --- the two engines behind one small interface ------------------------------------------


class Engine(Protocol):
    """What the benchmark times, implemented by both engines; payloads come back decoded."""

    def create(self) -> int: ...
    def fork(self, turn_id: int) -> int: ...
    def append(self, ctx: int, payload: bytes) -> int: ...
    def get_last(self, ctx: int, n: int) -> list[bytes]: ...
    def get_before(self, ctx: int, before: int, limit: int) -> tuple[list[bytes], int]: ...
    def replay(self, ctx: int) -> list[bytes]: ...
    def head(self, ctx: int) -> int: ...
    def close(self) -> None: ...


class StoreEngine:
    """This project's store (store.Store), durable unless told otherwise."""

    def __init__(self, path: Path, durable: bool = True) -> None:
        self.store = Store.open(path, config=StoreConfig(durable=durable))

    def create(self) -> int:
        return self.store.create_context().context_id

    def fork(self, turn_id: int) -> int:
        return self.store.fork(turn_id).context_id

    def append(self, ctx: int, payload: bytes) -> int:
        return self.store.append_turn(ctx, payload).turn_id

    def get_last(self, ctx: int, n: int) -> list[bytes]:
        return self.store.payloads(self.store.get_last(ctx, n))

    def get_before(self, ctx: int, before: int, limit: int) -> tuple[list[bytes], int]:
        page = self.store.get_before(ctx, before, limit)
        return self.store.payloads(page.turns), page.next_cursor

    def replay(self, ctx: int) -> list[bytes]:
        return self.store.payloads(self.store.chain(self.store.get_head(ctx).head_turn_id))

    def head(self, ctx: int) -> int:
        return self.store.get_head(ctx).head_turn_id

    def close(self) -> None:
        self.store.close()


SQLITE_SCHEMA = """
CREATE TABLE IF NOT EXISTS blobs(hash BLOB PRIMARY KEY, codec INTEGER, raw_len INTEGER, data BLOB);
CREATE TABLE IF NOT EXISTS turns(id INTEGER PRIMARY KEY, parent INTEGER, depth INTEGER,
    type_tag INTEGER, codec INTEGER, payload_hash BLOB, flags INTEGER, created_at INTEGER);
CREATE TABLE IF NOT EXISTS heads(ctx INTEGER PRIMARY KEY, head INTEGER, depth INTEGER, created_at INTEGER);
"""

# The chain from a start turn towards the root, at most :n turns, joined to the blobs.  A
# recursive CTE beat an iterative parent walk in every rep of the baselines note.
SQLITE_WALK = """
WITH RECURSIVE chain(id, parent, depth, payload_hash, k) AS (
    SELECT id, parent, depth, payload_hash, 1 FROM turns WHERE id = :start
    UNION ALL
    SELECT t.id, t.parent, t.depth, t.payload_hash, chain.k + 1
    FROM turns t JOIN chain ON t.id = chain.parent WHERE chain.k < :n
)
SELECT chain.id, chain.depth, blobs.codec, blobs.data FROM chain JOIN blobs ON blobs.hash = chain.payload_hash
ORDER BY chain.depth
"""


class SqliteEngine:
    """The baseline: stdlib sqlite3, WAL, synchronous=FULL, one shared connection behind a lock
    (the fast Python pattern measured in the baselines note), zstd-3 outside the lock."""

    def __init__(self, path: Path, durable: bool = True) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.db_path = path / "store.sqlite"
        self.conn = sqlite3.connect(self.db_path, check_same_thread=False, isolation_level=None)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute(f"PRAGMA synchronous={'FULL' if durable else 'OFF'}")
        self.conn.execute("PRAGMA mmap_size=1073741824")
        self.conn.executescript(SQLITE_SCHEMA)
        self.lock = threading.Lock()
        self.local = threading.local()

    def _zc(self) -> zstandard.ZstdCompressor:
        zc = getattr(self.local, "zc", None)
        if zc is None:
            zc = self.local.zc = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        return zc

    def _zd(self) -> zstandard.ZstdDecompressor:
        zd = getattr(self.local, "zd", None)
        if zd is None:
            zd = self.local.zd = zstandard.ZstdDecompressor()
        return zd

    def create(self) -> int:
        with self.lock:
            cur = self.conn.execute("INSERT INTO heads(head, depth, created_at) VALUES (0, 0, ?)",
                                    (int(time.time() * 1000),))
            return int(cur.lastrowid or 0)

    def fork(self, turn_id: int) -> int:
        with self.lock:
            row = self.conn.execute("SELECT depth FROM turns WHERE id = ?", (turn_id,)).fetchone()
            cur = self.conn.execute("INSERT INTO heads(head, depth, created_at) VALUES (?, ?, ?)",
                                    (turn_id, row[0], int(time.time() * 1000)))
            return int(cur.lastrowid or 0)

    def append(self, ctx: int, payload: bytes) -> int:
        h = blake3.blake3(payload).digest()
        with self.lock:
            exists = self.conn.execute("SELECT 1 FROM blobs WHERE hash = ?", (h,)).fetchone()
        blob = None
        if exists is None:
            comp = self._zc().compress(payload)
            blob = (h, 1, len(payload), comp) if len(comp) < len(payload) else (h, 0, len(payload), payload)
        with self.lock:
            c = self.conn
            c.execute("BEGIN")
            try:
                if blob is not None:
                    c.execute("INSERT OR IGNORE INTO blobs VALUES (?, ?, ?, ?)", blob)
                head, depth = c.execute("SELECT head, depth FROM heads WHERE ctx = ?", (ctx,)).fetchone()
                new_depth = depth + 1 if head else 0
                cur = c.execute(
                    "INSERT INTO turns(parent, depth, type_tag, codec, payload_hash, flags, created_at)"
                    " VALUES (?, ?, 0, 0, ?, 0, ?)", (head, new_depth, h, int(time.time() * 1000)))
                tid = int(cur.lastrowid or 0)
                c.execute("UPDATE heads SET head = ?, depth = ? WHERE ctx = ?", (tid, new_depth, ctx))
                c.execute("COMMIT")
            except BaseException:
                c.execute("ROLLBACK")
                raise
            return tid

    def _walk(self, start: int, n: int) -> list[tuple[int, int, int, bytes]]:
        with self.lock:
            return self.conn.execute(SQLITE_WALK, {"start": start, "n": n}).fetchall()

    def _decode(self, rows: list[tuple[int, int, int, bytes]]) -> list[bytes]:
        zd = self._zd()
        return [zd.decompress(data) if codec == 1 else bytes(data) for _id, _d, codec, data in rows]

    def head(self, ctx: int) -> int:
        with self.lock:
            return int(self.conn.execute("SELECT head FROM heads WHERE ctx = ?", (ctx,)).fetchone()[0])

    def get_last(self, ctx: int, n: int) -> list[bytes]:
        return self._decode(self._walk(self.head(ctx), n))

    def get_before(self, ctx: int, before: int, limit: int) -> tuple[list[bytes], int]:
        with self.lock:
            parent = self.conn.execute("SELECT parent FROM turns WHERE id = ?", (before,)).fetchone()[0]
        rows = self._walk(parent, limit) if parent else []
        next_cursor = rows[0][0] if rows and rows[0][1] > 0 else 0
        return self._decode(rows), next_cursor

    def replay(self, ctx: int) -> list[bytes]:
        return self._decode(self._walk(self.head(ctx), 1 << 62))

    def checkpoint(self) -> None:
        with self.lock:
            self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def close(self) -> None:
        self.checkpoint()
        self.conn.close()


# --- phases -------------------------------------------------------------------------------


@dataclass
class Scenario:
    """One engine's view of the fork scenario: context ids and each context's turn ids."""

    contexts: list[int] = field(default_factory=list)
    turns: dict[int, list[int]] = field(default_factory=dict)


class Counter:
    """Hands out payload indices; the same sequence for both engines."""

    def __init__(self) -> None:
        self.i = 0

    def take(self, n: int) -> range:
        r = range(self.i, self.i + n)
        self.i += n
        return r


def fork_plan(n_contexts: int, n_turns: int, seed: int) -> list[tuple[int, int] | None]:
    """Per context: None (fresh) or (earlier context, depth to fork at).  Odd contexts fork."""
    rng = random.Random(f"forks/{seed}")
    return [None if c % 2 == 0 else (rng.randrange(c), rng.randrange(n_turns)) for c in range(n_contexts)]


def turn_order(engines: dict[str, Engine], k: int) -> list[str]:
    """Engines take turns op by op, swapping who goes first, so that the shared disk's slow
    spells and the page cache's state hit both alike."""
    names = list(engines)
    return names if k % 2 == 0 else names[::-1]


def build(engines: dict[str, Engine], wl: Workload, plan: list[tuple[int, int] | None], n_turns: int,
          counter: Counter, floor: Floor) -> tuple[dict[str, Scenario], dict[str, list[float]], list[int]]:
    """Build the fork scenario in every engine, one writer, interleaved op by op.  Returns each
    engine's scenario, its append latencies and the payload sizes (aligned with the latencies)."""
    scen = {name: Scenario() for name in engines}
    lat: dict[str, list[float]] = {name: [] for name in engines}
    sizes: list[int] = []
    for c, fork_at in enumerate(plan):
        ctx: dict[str, int] = {}
        for name, eng in engines.items():
            sc = scen[name]
            if fork_at is None:
                ctx[name] = eng.create()
                sc.turns[ctx[name]] = []
            else:
                base = sc.turns[sc.contexts[fork_at[0]]][: fork_at[1] + 1]
                ctx[name] = eng.fork(base[-1])
                sc.turns[ctx[name]] = list(base)
            sc.contexts.append(ctx[name])
        for i in counter.take(n_turns):
            p = wl.payload(i)
            floor.add(p)
            sizes.append(len(p))
            for name in turn_order(engines, i):
                t0 = now()
                tid = engines[name].append(ctx[name], p)
                lat[name].append(now() - t0)
                scen[name].turns[ctx[name]].append(tid)
        if c % 20 == 19:
            log(f"  built {c + 1}/{len(plan)} contexts")
    return scen, lat, sizes


def single_writer(engines: dict[str, Engine], active: dict[str, list[int]], payloads: list[bytes]
                  ) -> dict[str, list[float]]:
    """One writer, round-robin over the active contexts, the engines interleaved op by op."""
    lat: dict[str, list[float]] = {name: [] for name in engines}
    for k, p in enumerate(payloads):
        for name in turn_order(engines, k):
            ctxs = active[name]
            t0 = now()
            engines[name].append(ctxs[k % len(ctxs)], p)
            lat[name].append(now() - t0)
    return lat


def concurrent(engine: Engine, contexts: list[int], batches: list[list[bytes]]) -> tuple[list[float], float]:
    """One thread per context, closed loop over its pre-generated batch: (latencies, appends/s);
    the latencies are in the order of the batches' payloads, flattened."""
    lats: list[list[float]] = [[] for _ in contexts]
    barrier = threading.Barrier(len(contexts) + 1)
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            barrier.wait()
            for p in batches[k]:
                t0 = now()
                engine.append(contexts[k], p)
                lats[k].append(now() - t0)
        except BaseException as exc:  # reported after join
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(contexts))]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = now()
    for t in threads:
        t.join()
    wall = now() - t0
    if errors:
        raise errors[0]
    flat = [x for lat in lats for x in lat]
    return flat, len(flat) / wall


def latency_split(lat: list[float], sizes: list[int]) -> dict[str, float]:
    """p50/p99 in ms over all appends, and over the text payloads alone (the ~1 MB images out)."""
    text = [x for x, n in zip(lat, sizes, strict=True) if n < IMAGE_SIZE // 2]
    return {"p50_ms": ms(median(lat)), "p99_ms": ms(percentile(lat, 99)),
            "text_p50_ms": ms(median(text)), "text_p99_ms": ms(percentile(text, 99)), "n": len(lat)}


def median_of_reps(reps: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over the reps (the p99 goals are judged this way, not on one rep)."""
    return {k: round(median([r[k] for r in reps]), 3) for k in reps[0] if k != "n"}


def reads(engine: Engine, active: list[int], sample: list[int], passes: int) -> dict[str, Any]:
    """GetLast(64) warm on the active contexts, GetBefore(64) paging of each from its head back
    to the root, and full replays of the sample; every read returns decoded payloads."""
    for ctx in active:  # warm-up pass
        engine.get_last(ctx, 64)
    last = []
    for _ in range(passes):
        for ctx in active:
            t0 = now()
            engine.get_last(ctx, 64)
            last.append(now() - t0)
    pages = []
    for ctx in active:
        cursor = engine.head(ctx)
        while cursor:  # each page holds the turns strictly older than the cursor
            t0 = now()
            _payloads, cursor = engine.get_before(ctx, cursor, 64)
            pages.append(now() - t0)
    replay, replay_turns, replay_bytes = [], 0, 0
    for ctx in sample:
        t0 = now()
        ps = engine.replay(ctx)
        replay.append(now() - t0)
        replay_turns += len(ps)
        replay_bytes += sum(map(len, ps))
    return {
        "get_last64": summary_ms(last),
        "get_before64_page": summary_ms(pages),
        "replay_context": summary_ms(replay),
        "replay_turns_per_s": round(replay_turns / sum(replay)),
        "replay_mb_per_s": round(replay_bytes / sum(replay) / 1e6, 1),
    }


def build_large(path: Path, kind: str, n_turns: int, per_ctx: int) -> float:
    """A store of n_turns small unique turns (bulk, non-durable); returns build seconds."""
    t0 = now()
    if kind == "store":
        st = Store.open(path, config=StoreConfig(durable=False))
        for c in range(n_turns // per_ctx):
            ctx = st.create_context().context_id
            for start in range(0, per_ctx, 500):
                st.append_turns(ctx, [TurnInput(f"ctx {c} turn {start + k}: ok".encode())
                                      for k in range(min(500, per_ctx - start))])
        st.close()
    else:
        eng = SqliteEngine(path, durable=False)
        conn = eng.conn
        tid = 0
        conn.execute("BEGIN")
        for ctx in range(1, n_turns // per_ctx + 1):
            parent = 0
            blobs, turns = [], []
            for k in range(per_ctx):
                p = f"ctx {ctx - 1} turn {k}: ok".encode()
                h = blake3.blake3(p).digest()
                tid += 1
                blobs.append((h, 0, len(p), p))
                turns.append((tid, parent, k, h))
                parent = tid
            conn.executemany("INSERT OR IGNORE INTO blobs VALUES (?, ?, ?, ?)", blobs)
            conn.executemany("INSERT INTO turns VALUES (?, ?, ?, 0, 0, ?, 0, 0)", turns)
            conn.execute("INSERT INTO heads VALUES (?, ?, ?, 0)", (ctx, tid, per_ctx - 1))
        conn.execute("COMMIT")
        eng.close()
    return now() - t0


def open_time(path: Path, kind: str, reps: int, ctx: int) -> list[float]:
    """Seconds from open to the first read (the head context's last turn with its payload)."""
    out = []
    for _ in range(reps):
        t0 = now()
        eng: Engine = StoreEngine(path) if kind == "store" else SqliteEngine(path)
        got = eng.get_last(ctx, 1)
        out.append(now() - t0)
        assert got and got[0].startswith(b"ctx "), "first read returned the wrong payload"
        eng.close()
    return out


# --- main ---------------------------------------------------------------------------------


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    q = args.quick
    n_ctx, n_turns = (40, 50) if q else (200, 200)
    reps = 5
    single_n, conc_per = (400, 40) if q else (1000, 100)
    large_turns = 100_000 if q else 1_000_000
    wl = Workload(seed=args.seed)
    plan = fork_plan(n_ctx, n_turns, args.seed)
    factories: dict[str, Callable[[Path], Engine]] = {"store": StoreEngine, "sqlite": SqliteEngine}
    engines = {name: make(tmp / name) for name, make in factories.items()}
    floor = Floor()
    counter = Counter()
    log(f"build: {n_ctx} contexts x {n_turns} turns, half forked, both engines interleaved")
    t0 = now()
    scen, build_lat, sizes = build(engines, wl, plan, n_turns, counter, floor)
    out: dict[str, Any] = {"build_seconds_both": round(now() - t0, 1), "engines": {}}
    for name in engines:
        out["engines"][name] = {"build": latency_split(build_lat[name], sizes)}

    active = {name: scen[name].contexts[-16:] for name in engines}
    runs: dict[str, dict[str, list[Any]]] = {n: {"single": [], "conc": []} for n in engines}
    for rep in range(reps):
        payloads = [wl.payload(i) for i in counter.take(single_n)]
        batches = [[wl.payload(i) for i in counter.take(conc_per)] for _ in range(16)]
        conc_sizes = [len(p) for b in batches for p in b]
        for p in payloads + [p for b in batches for p in b]:
            floor.add(p)
        for name, lat in single_writer(engines, active, payloads).items():
            runs[name]["single"].append(latency_split(lat, [len(p) for p in payloads]))
        for name in turn_order(engines, rep):
            lat, rate = concurrent(engines[name], active[name], batches)
            runs[name]["conc"].append({**latency_split(lat, conc_sizes), "appends_per_s": rate})
        log(f"rep {rep + 1}/{reps}: " + "; ".join(
            f"{n} single p50 {r['single'][-1]['p50_ms']} ms p99 {r['single'][-1]['p99_ms']} ms,"
            f" conc16 {r['conc'][-1]['appends_per_s']:.0f}/s p99 {r['conc'][-1]['p99_ms']} ms"
            for n, r in runs.items()))

    digests: dict[str, str] = {}
    for name, eng in engines.items():
        r = runs[name]
        e = out["engines"][name]
        e["single"] = {**median_of_reps(r["single"]), "reps": reps, "appends_per_rep": single_n}
        e["conc16"] = {**median_of_reps(r["conc"]), "reps": reps, "appends_per_rep": 16 * conc_per}
        e["conc16"]["appends_per_s"] = round(e["conc16"]["appends_per_s"])
        log(f"reads: {name}")
        sample = random.Random(args.seed).sample(scen[name].contexts, min(32, n_ctx))
        e["reads"] = reads(eng, scen[name].contexts[-16:], sample, passes=10 if q else 20)
        seen = blake3.blake3()
        for ctx in scen[name].contexts:  # both engines must hold the same history
            for p in eng.get_last(ctx, 64):
                seen.update(blake3.blake3(p).digest())
        digests[name] = seen.hexdigest()
        eng.close()
        e["disk_bytes"] = disk_bytes(tmp / name)
        e["disk_over_floor"] = round(e["disk_bytes"] / floor.floor, 4)
    if len(set(digests.values())) != 1:
        raise AssertionError(f"the engines returned different payloads: {digests}")
    out["workload"] = {
        "contexts": n_ctx, "turns_per_context": n_turns, "appends_per_engine": counter.i,
        "raw_bytes": floor.raw, "unique_bytes": floor.unique, "floor_bytes": floor.floor,
        "image_share": wl.image_share, "seed": args.seed,
    }
    shutil.rmtree(tmp / "store")
    shutil.rmtree(tmp / "sqlite")

    per_ctx = 200
    out["open"] = {"turns": large_turns, "turns_per_context": per_ctx,
                   "note": "quick mode: a 100k-turn store, not 1M" if q else "1M turns"}
    for kind in ("store", "sqlite"):
        path = tmp / f"large-{kind}"
        log(f"open: building {large_turns} turns in {kind}")
        secs = build_large(path, kind, large_turns, per_ctx)
        times = open_time(path, kind, reps=5, ctx=large_turns // per_ctx // 2)
        out["open"][kind] = {"build_s": round(secs, 1), "open_first_read_ms": ms(median(times)),
                             "disk_bytes": disk_bytes(path)}
        shutil.rmtree(path)

    s, b = out["engines"]["store"], out["engines"]["sqlite"]
    open_label = ("open 100k-turn store -> first read (quick; 1M in the full run)" if q
                  else "open 1M-turn store -> first read")
    sr, br = s["reads"]["get_last64"], b["reads"]["get_last64"]
    out["goals"] = [
        goal("durable AppendTurn p50, 1 writer, vs SQLite-FULL",
             s["single"]["p50_ms"] / b["single"]["p50_ms"], 0.8, "ratio"),
        goal("durable AppendTurn p99, 1 writer", s["single"]["p99_ms"], 2.0, "ms"),
        goal("16 concurrent contexts appends/s vs SQLite-FULL",
             s["conc16"]["appends_per_s"] / b["conc16"]["appends_per_s"], 2.5, "ratio",
             higher_is_better=True),
        goal("16 concurrent contexts AppendTurn p99", s["conc16"]["p99_ms"], 10.0, "ms"),
        goal("GetLast(64) warm p50 vs SQLite", sr["p50_ms"] / br["p50_ms"], 0.25, "ratio"),
        goal("GetLast(64) warm p50", sr["p50_ms"], 0.4, "ms"),
        goal(open_label, out["open"]["store"]["open_first_read_ms"] / 1000, 0.5, "s"),
        goal("bytes on disk vs dedup+zstd-3 floor", s["disk_over_floor"], 1.03, "ratio"),
    ]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller counts; about a minute")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tmp", default="/tmp", help="where the temporary stores go (removed afterwards)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_store-", dir=args.tmp))
    t0 = now()
    try:
        result = run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result["mode"] = "quick" if args.quick else "full"
    result["seconds"] = round(now() - t0, 1)
    result["machine"] = {"cpus": os.cpu_count(), "python": sys.version.split()[0],
                         "sqlite": sqlite3.sqlite_version}
    log(f"goals met: {goals_met(result['goals'])}")
    emit(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
