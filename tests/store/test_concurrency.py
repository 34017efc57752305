"""Concurrency and model checks of the store: 16 real threads appending to and reading shared
contexts on one durable store (no lost turns, heads linearizable per context, a blob raced by
16 writers stored once), and a hypothesis state machine that drives the whole API (create, fork,
append with and without an expected parent, batches, last N, paging, depth ranges, chains,
patches as-of and latest, put_blob, delete, gc, reopen) against a plain in-memory model.
"""
from __future__ import annotations

import itertools
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import blake3
import pytest
import zstandard
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    precondition,
    rule,
)

from store import Store, StoreConfig, TurnInput
from store.errors import ParentConflict, StoreError, UnknownBlob, UnknownContext
from store.types import NO_TURN

THREADS = 16
CONTEXTS = 8  # two writer threads race on each context
OPS = 200


@dataclass(frozen=True)
class Ack:
    turn_id: int
    parent: int
    start: int
    end: int
    payload_hash: bytes


def run_workers(worker: Callable[[int], None], errors: list[BaseException]) -> None:
    """worker(0 .. THREADS-1) on as many threads; fails on a hung worker or the first error."""
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    if errors:
        raise errors[0]


def test_16_threads_no_lost_turns_and_linearizable_heads(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "s")
    ctxs = [store.create_context().context_id for _ in range(CONTEXTS)]
    acks: list[list[tuple[int, Ack]]] = [[] for _ in range(THREADS)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(THREADS)

    def worker(k: int) -> None:
        ctx = ctxs[k % CONTEXTS]
        seen_depth = {c: -1 for c in ctxs}
        try:
            barrier.wait()
            for i in range(OPS):
                payload = b"thread %d op %d " % (k, i) + bytes(i % 7) * (i * 37 % 5000)
                kind = i % 4
                t0 = time.monotonic_ns()
                if kind == 0:  # plain append: the store picks the current head as parent
                    turns = [store.append_turn(ctx, payload)]
                elif kind == 1:  # compare-and-append: a lost race is a ParentConflict, never a silent fork
                    expected = store.get_head(ctx).head_turn_id
                    try:
                        turns = [store.append_turn(ctx, payload, expected_parent=expected)]
                    except ParentConflict as exc:
                        assert exc.expected == expected and exc.actual != expected
                        continue
                    assert turns[0].parent_turn_id == expected
                elif kind == 2:  # one durable batch of three
                    turns = store.append_turns(ctx, [TurnInput(payload + b"%d" % j) for j in range(3)])
                    assert [t.parent_turn_id for t in turns[1:]] == [t.turn_id for t in turns[:-1]]
                else:  # readers see whole chains and heads that never move backwards
                    for c in (ctx, ctxs[(k + i) % CONTEXTS]):
                        head = store.get_head(c)
                        assert head.head_depth >= seen_depth[c], f"context {c}: head went backwards"
                        seen_depth[c] = head.head_depth
                        last = store.get_last(c, 8)
                        for a, b in itertools.pairwise(last):
                            assert b.parent_turn_id == a.turn_id and b.depth == a.depth + 1
                        if last:
                            assert last[-1].depth >= head.head_depth
                        assert all(blake3.blake3(p).digest() == t.payload_hash
                                   for t, p in zip(last, store.payloads(last), strict=True))
                        if head.head_turn_id:  # a window mid-chain, reached through the jump pointers
                            d = head.head_depth // 2
                            window = store.range_by_depth(c, d, 3)
                            assert window and [t.depth for t in window] == [d, d + 1, d + 2][: len(window)]
                            assert all(y.parent_turn_id == x.turn_id for x, y in itertools.pairwise(window))
                    continue
                t1 = time.monotonic_ns()
                for t in turns:
                    acks[k].append((ctx, Ack(t.turn_id, t.parent_turn_id, t0, t1, t.payload_hash)))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    run_workers(worker, errors)

    def check(s: Store) -> None:
        all_ids = [a.turn_id for per in acks for _, a in per]
        assert len(all_ids) == len(set(all_ids)), "a TurnID was handed out twice"
        for ctx in ctxs:
            mine = {a.turn_id: a for per in acks for c, a in per if c == ctx}
            chain = s.chain(s.get_head(ctx).head_turn_id)
            # no lost turns and no stray ones: the chain is exactly the acknowledged appends
            assert chain and {t.turn_id for t in chain} == set(mine), \
                f"context {ctx}: chain and acknowledged appends differ"
            for i, t in enumerate(chain):
                assert t.depth == i and t.payload_hash == mine[t.turn_id].payload_hash
                assert t.parent_turn_id == mine[t.turn_id].parent == (chain[i - 1].turn_id if i else NO_TURN)
            # linearizable: an append that returned before another started comes first on the chain
            latest_start = 0
            for t in chain:
                a = mine[t.turn_id]
                assert a.end >= latest_start, f"context {ctx}: turn {t.turn_id} ordered after a later append"
                latest_start = max(latest_start, a.start)

    check(store)
    store.close()
    reopened = Store.open(tmp_path / "s")
    try:
        check(reopened)
    finally:
        reopened.close()


def test_same_new_blob_raced_by_16_writers_is_stored_once(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "s")
    ctxs = [store.create_context().context_id for _ in range(THREADS)]
    payloads = [b"raced payload %d " % r * 500 for r in range(10)]
    barrier = threading.Barrier(THREADS)
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for p in payloads:
                barrier.wait()
                store.append_turn(ctxs[k], p)
        except BaseException as exc:
            errors.append(exc)

    run_workers(worker, errors)
    for c in ctxs:
        assert store.payloads(store.get_last(c, len(payloads))) == payloads
    store.close()
    pack = (tmp_path / "s" / "blobs.pack").read_bytes()
    for p in payloads:
        assert pack.count(blake3.blake3(p).digest()) == 1, "a raced blob was written more than once"


# --- the API against an in-memory model ----------------------------------------------------


MODEL_CONFIG = StoreConfig(durable=False)
"""The model checks the API's logic, not durability (the crash tests do): no fsyncs, so that
hypothesis can run and shrink many examples quickly."""


class StoreModel(RuleBasedStateMachine):
    """Turns are (parent, depth, payload); contexts map to heads; patches are (seq, target, payload|None)."""

    ctxs = Bundle("ctxs")
    turns = Bundle("turns")

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="store-model-"))
        self.store = Store.open(self.dir / "s", config=MODEL_CONFIG)
        self.turn: dict[int, tuple[int, int, bytes]] = {}
        self.head: dict[int, int] = {}
        self.patches: list[tuple[int, int, bytes | None]] = []
        self.collected = False
        self.put: dict[bytes, bytes] = {}

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def chain_of(self, tid: int) -> list[int]:
        out = []
        while tid != NO_TURN:
            out.append(tid)
            tid = self.turn[tid][0]
        return out[::-1]

    def depth_of(self, tid: int) -> int:
        return self.turn[tid][1] if tid != NO_TURN else 0

    payload_st = st.one_of(st.binary(max_size=200), st.sampled_from([b"", b"dup", b"dup" * 3000]))

    @rule(target=ctxs)
    def create_empty(self) -> int:
        h = self.store.create_context()
        assert (h.head_turn_id, h.head_depth) == (NO_TURN, 0)
        self.head[h.context_id] = NO_TURN
        return h.context_id

    def live_turns(self) -> set[int]:
        return {t for head in self.head.values() for t in self.chain_of(head)}

    @rule(target=ctxs, base=turns, as_fork=st.booleans())
    def create_from_turn(self, base: int, as_fork: bool):
        try:
            h = self.store.fork(base) if as_fork else self.store.create_context(base_turn_id=base)
        except StoreError:
            # a turn that only deleted contexts reached may be refused once GC has run; if it
            # is accepted, live_payloads_readable checks that its whole chain still reads back
            assert self.collected and base not in self.live_turns(), f"fork of live turn {base} refused"
            return multiple()
        assert (h.head_turn_id, h.head_depth) == (base, self.depth_of(base))
        assert h.context_id not in self.head
        self.head[h.context_id] = base
        return h.context_id

    def _appended(self, ctx: int, got: list, payloads: list[bytes]) -> None:
        for t, p in zip(got, payloads, strict=True):
            parent = self.head[ctx]
            assert t.parent_turn_id == parent
            assert t.depth == (self.depth_of(parent) + 1 if parent != NO_TURN else 0)
            assert t.payload_hash == blake3.blake3(p).digest()
            assert t.turn_id not in self.turn and all(t.turn_id > o for o in self.turn)
            self.turn[t.turn_id] = (parent, t.depth, p)
            self.head[ctx] = t.turn_id
            self.put.pop(t.payload_hash, None)  # a turn uses it now: its grace ends

    @rule(target=turns, ctx=ctxs, payload=payload_st, with_expected=st.booleans())
    def append(self, ctx: int, payload: bytes, with_expected: bool) -> int:
        expected = self.head[ctx] if with_expected else None
        t = self.store.append_turn(ctx, payload, expected_parent=expected)
        self._appended(ctx, [t], [payload])
        return t.turn_id

    @rule(ctx=ctxs, payloads=st.lists(payload_st, min_size=1, max_size=4))
    def append_many(self, ctx: int, payloads: list[bytes]) -> None:
        got = self.store.append_turns(ctx, [TurnInput(p) for p in payloads], expected_parent=self.head[ctx])
        self._appended(ctx, got, payloads)

    @rule(ctx=ctxs, stale=turns)
    def append_with_wrong_parent(self, ctx: int, stale: int) -> None:
        if stale == self.head[ctx]:
            return
        with pytest.raises(ParentConflict) as ei:
            self.store.append_turn(ctx, b"never stored", expected_parent=stale)
        assert (ei.value.context_id, ei.value.expected, ei.value.actual) == (ctx, stale, self.head[ctx])
        assert self.store.get_head(ctx).head_turn_id == self.head[ctx]

    @rule(ctx=ctxs, n=st.integers(0, 10))
    def get_last(self, ctx: int, n: int) -> None:
        want = self.chain_of(self.head[ctx])[-n:] if n else []
        got = self.store.get_last(ctx, n)
        assert [t.turn_id for t in got] == want
        assert self.store.payloads(got) == [self.turn[t][2] for t in want]

    @rule(ctx=ctxs, data=st.data(), limit=st.integers(1, 6))
    def page_before(self, ctx: int, data: st.DataObject, limit: int) -> None:
        chain = self.chain_of(self.head[ctx])
        if not chain:
            return
        i = data.draw(st.integers(0, len(chain) - 1))
        page = self.store.get_before(ctx, chain[i], limit)
        want = chain[max(0, i - limit) : i]
        assert [t.turn_id for t in page.turns] == want
        more = bool(want) and self.turn[want[0]][0] != NO_TURN
        assert page.next_cursor == (want[0] if more else NO_TURN)

    @rule(ctx=ctxs, start=st.integers(0, 12), limit=st.integers(1, 6))
    def range_by_depth(self, ctx: int, start: int, limit: int) -> None:
        want = self.chain_of(self.head[ctx])[start : start + limit]
        assert [t.turn_id for t in self.store.range_by_depth(ctx, start, limit)] == want

    @rule(tid=turns)
    def chain(self, tid: int) -> None:
        got = self.store.chain(tid)
        assert [t.turn_id for t in got] == self.chain_of(tid)
        assert [t.depth for t in got] == list(range(len(got)))

    @rule(tid=turns, payload=payload_st, tomb=st.booleans())
    def patch(self, tid: int, payload: bytes, tomb: bool) -> None:
        p = self.store.tombstone(tid) if tomb else self.store.patch(tid, payload)
        assert p.target_turn_id == tid
        assert all(p.seq > seq for seq, _, _ in self.patches), "patch seq is not monotonic"
        self.patches.append((p.seq, tid, None if tomb else payload))

    @rule(tid=turns, data=st.data())
    def payload_of(self, tid: int, data: st.DataObject) -> None:
        seqs = [s for s, _, _ in self.patches]
        as_of = data.draw(st.one_of(st.none(), st.sampled_from(seqs + [0]))) if seqs else None
        want: bytes | None = self.turn[tid][2]
        for seq, target, payload in self.patches:
            if target == tid and (as_of is None or seq <= as_of):
                want = payload
        try:
            got = self.store.payload_of(self.store.get_turn(tid), as_of_seq=as_of)
        except UnknownBlob:
            if self.collected and tid not in self.live_turns() and want == self.turn[tid][2]:
                return  # GC may drop a payload that only deleted contexts used
            raise
        assert got == want

    @rule(payload=payload_st)
    def put_blob(self, payload: bytes) -> None:
        """A blob put but not yet used by a turn survives GC for the grace period (an hour)."""
        h = self.store.put_blob(payload)
        assert h == blake3.blake3(payload).digest() and self.store.has_blob(h)
        self.put[h] = payload

    @rule()
    def gc(self) -> None:
        """Mark from live heads and patches, compact the pack; the invariant below and the
        read rules then check that nothing live went missing."""
        self.store.gc()
        self.collected = True

    @rule(ctx=consumes(ctxs))
    def delete(self, ctx: int) -> None:
        self.store.delete_context(ctx)
        del self.head[ctx]
        with pytest.raises(UnknownContext):
            self.store.get_head(ctx)
        with pytest.raises(UnknownContext):
            self.store.append_turn(ctx, b"x")

    @precondition(lambda self: bool(self.head))
    @rule()
    def reopen(self) -> None:
        self.store.close()
        self.store = Store.open(self.dir / "s", config=MODEL_CONFIG)
        self.put.clear()  # the GC grace of put_blob lives in the process: a restart ends it (bugs.md)

    @invariant()
    def heads_match(self) -> None:
        got = {h.context_id: (h.head_turn_id, h.head_depth) for h in self.store.list_contexts()}
        assert got == {c: (t, self.depth_of(t)) for c, t in self.head.items()}

    @invariant()
    def put_blobs_readable(self) -> None:
        for h, payload in self.put.items():
            assert self.store.get_blob(h, verify=True) == payload
            stored = self.store.get_stored_blob(h)
            raw = zstandard.ZstdDecompressor().decompress(stored.stored, max_output_size=stored.raw_len) \
                if stored.codec == 1 else stored.stored
            assert (stored.hash, stored.raw_len, raw) == (h, len(payload), payload)

    @invariant()
    def live_payloads_readable(self) -> None:
        for head in self.head.values():
            chain = self.chain_of(head)
            got = self.store.payloads([self.store.get_turn(t) for t in chain])
            assert got == [self.turn[t][2] for t in chain]


StoreModel.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
test_store_against_model = StoreModel.TestCase
