#!/usr/bin/env python3
"""SIGKILL campaign against the store: a writer process appends durably and is killed, again
and again, on one store; after each kill the store must hold every acknowledged turn.

    soak_store.py [--rounds N] [--seed S] [--dir D]    run the campaign (default 200 rounds)
    soak_store.py writer STORE SEED [bulk]              the writer (the campaign starts it);
                                                        bulk: StoreConfig(durable=False)

The writer prints one line per acknowledged operation, *after* the call returned:
    R                                    the store is open
    C ctx head                           create_context
    F ctx base                           fork(base)
    A ctx turn parent depth hash size    append_turn / append_turns (one line per turn)
A line cut short by the kill is not an acknowledgement.  tests/store/test_crash.py runs a
short campaign with these functions; this script is the long variant.
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import blake3

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from store import Store, StoreConfig, TurnInput  # noqa: E402
from store.fsck import fsck  # noqa: E402
from store.types import NO_TURN  # noqa: E402

IMAGE = 1 << 20


# --- the writer (runs in the child process) ----------------------------------------------


def payload(rng: random.Random, recent: list[bytes]) -> bytes:
    """Mixed sizes: mostly small text, some 4-64 KB, ~1.5 % incompressible ~1 MB, some repeats."""
    r = rng.random()
    if r < 0.015:
        return rng.randbytes(IMAGE - rng.randrange(1024))
    if r < 0.10 and recent:
        return rng.choice(recent)  # dedup: the same bytes again, maybe in another context
    size = rng.randint(4096, 65536) if r < 0.20 else rng.randint(40, 4096)
    words = [b"tool", b"read_file", b"ok", b"error", b"def", b"return", b"turn", b"\n"]
    text = b" ".join(rng.choice(words) for _ in range(size // 5 + 1))
    return b"%d:" % rng.getrandbits(48) + text[:size]


def writer(path: Path, seed: int, durable: bool = True) -> None:
    rng = random.Random(seed)
    st = Store.open(path, config=StoreConfig(durable=durable))
    heads = {h.context_id: h.head_turn_id for h in st.list_contexts()}
    known = [t for t in heads.values() if t != NO_TURN]
    recent: list[bytes] = []

    def say(line: str) -> None:
        os.write(1, (line + "\n").encode())

    say("R")
    while True:
        r = rng.random()
        if len(heads) < 4 or r < 0.02:
            h = st.create_context()
            heads[h.context_id] = h.head_turn_id
            say(f"C {h.context_id} {h.head_turn_id}")
            continue
        if r < 0.05 and known:
            base = rng.choice(known)
            h = st.fork(base)
            heads[h.context_id] = base
            say(f"F {h.context_id} {base}")
            continue
        ctx = rng.choice(list(heads))
        ps = [payload(rng, recent) for _ in range(rng.randint(2, 5) if r < 0.10 else 1)]
        recent = (recent + [p for p in ps if len(p) < IMAGE // 2])[-20:]
        if len(ps) == 1:
            turns = [st.append_turn(ctx, ps[0], expected_parent=heads[ctx])]
        else:
            turns = st.append_turns(ctx, [TurnInput(p) for p in ps], expected_parent=heads[ctx])
        for t, p in zip(turns, ps, strict=True):
            heads[ctx] = t.turn_id
            known.append(t.turn_id)
            say(f"A {ctx} {t.turn_id} {t.parent_turn_id} {t.depth} {blake3.blake3(p).hexdigest()} {len(p)}")


# --- the campaign (runs in the parent) -----------------------------------------------------


@dataclass
class Acked:
    """Everything a writer acknowledged, over all rounds."""

    turns: dict[int, tuple[int, int, int, str]] = field(default_factory=dict)
    """turn -> (context, parent, depth, payload hash hex)"""
    last: dict[int, int] = field(default_factory=dict)  # ctx -> last acknowledged turn (or base)
    forks: int = 0
    large: int = 0  # acknowledged payloads of 512 KiB or more

    def take(self, line: str) -> None:
        kind, *f = line.split()
        if kind == "A":
            ctx, turn, parent, depth = map(int, f[:4])
            self.turns[turn] = (ctx, parent, depth, f[4])
            self.last[ctx] = turn
            self.large += int(f[5]) >= IMAGE // 2
        elif kind in ("C", "F"):
            self.last[int(f[0])] = int(f[1])
            self.forks += kind == "F"


def one_round(path: Path, rng: random.Random, acked: Acked, durable: bool = True) -> tuple[int, str]:
    """Start a writer, kill it with SIGKILL, collect its acknowledgements.

    Most rounds kill right after a random number of acknowledged appends (plus up to 2 ms);
    one in five kills on a timer that may fire while the writer is still opening (recovery).
    Returns (appends acknowledged this round, how it was killed)."""
    args = ["writer", str(path), str(rng.getrandbits(32))] + ([] if durable else ["bulk"])
    proc = subprocess.Popen([sys.executable, __file__, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    assert proc.stdout is not None and proc.stderr is not None

    def kill() -> None:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)

    how = "after appends"
    timer = None
    if rng.random() < 0.2:
        how = "on a timer"
        timer = threading.Timer(rng.uniform(0.0, 0.6), kill)
        timer.start()
    kill_after = rng.randint(20, 600)
    appends = 0
    try:
        for raw in proc.stdout:
            if not raw.endswith(b"\n"):
                break  # cut short by the kill: not acknowledged
            line = raw.decode()
            acked.take(line)
            if line.startswith("A"):
                appends += 1
                if timer is None and appends == kill_after:
                    threading.Event().wait(rng.uniform(0, 0.002))
                    kill()
        err = proc.stderr.read().decode()
    finally:
        if timer is not None:
            timer.cancel()
        kill()
        proc.wait()
    if proc.returncode != -signal.SIGKILL:
        raise AssertionError(f"writer exited with {proc.returncode} before the kill:\n{err}")
    return appends, how


def verify(path: Path, acked: Acked) -> None:
    """The store opens; every acknowledged turn is there with its payload; each context's head
    is an existing turn at or after the last acknowledged one, with consistent depths; fsck is clean."""
    st = Store.open(path)
    try:
        for tid, (_ctx, parent, depth, hexhash) in acked.turns.items():
            t = st.get_turn(tid)
            assert (t.parent_turn_id, t.depth, t.payload_hash.hex()) == (parent, depth, hexhash), \
                f"turn {tid} changed: {t} (acknowledged parent {parent}, depth {depth}, hash {hexhash})"
            assert blake3.blake3(st.get_blob(t.payload_hash)).hexdigest() == hexhash, f"payload of turn {tid}"
        for ctx, last in acked.last.items():
            head = st.get_head(ctx)
            chain = st.chain(head.head_turn_id) if head.head_turn_id != NO_TURN else []
            for i, t in enumerate(chain):
                parent = chain[i - 1].turn_id if i else NO_TURN
                assert (t.depth, t.parent_turn_id) == (i, parent), \
                    f"context {ctx}: turn {t.turn_id} (depth {t.depth}, parent {t.parent_turn_id}) at {i}"
            if chain:
                assert head.head_depth == chain[-1].depth, f"context {ctx}: head depth {head.head_depth}"
            assert last == NO_TURN or last in {t.turn_id for t in chain}, \
                f"context {ctx}: acknowledged turn {last} is not on the chain of head {head.head_turn_id}"
    finally:
        st.close()
    report = fsck(path)
    assert report.ok, report.summary()


def campaign(path: Path, rounds: int, seed: int, progress: bool = False) -> Acked:
    rng = random.Random(seed)
    acked = Acked()
    for r in range(rounds):
        n, how = one_round(path, rng, acked)
        verify(path, acked)
        if progress:
            print(f"round {r + 1}/{rounds}: killed {how} with {n} appends acknowledged;"
                  f" {len(acked.turns)} turns in {len(acked.last)} contexts verified", file=sys.stderr)
    return acked


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "writer":
        writer(Path(sys.argv[2]), int(sys.argv[3]), durable=sys.argv[4:] != ["bulk"])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dir", default=None, help="keep the store here instead of a removed temp dir")
    args = ap.parse_args()
    if args.dir:
        campaign(Path(args.dir), args.rounds, args.seed, progress=True)
    else:
        with tempfile.TemporaryDirectory(prefix="soak_store-") as d:
            acked = campaign(Path(d) / "store", args.rounds, args.seed, progress=True)
            report = fsck(Path(d) / "store", full=True)
            assert report.ok, report.summary()
            print(f"ok: {args.rounds} rounds, {len(acked.turns)} acknowledged turns survived",
                  file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
