"""A walk towards the root (Store.chain) reads turn records in runs (TurnLog.read_run), on real
files: the same turns as one read per record, across contexts interleaved in the log; a damaged
record read ahead in a run but not on the chain does not matter, one on the chain is found.
The jump pointers such walks take are those of FORMAT.md's rule."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from store import CorruptRecord, Store, TurnInput
from store.api import WALK_RUN
from store.layout import TURN_SIZE


def _interleaved(path: Path, n: int) -> tuple[list[int], list[int]]:
    """Two contexts appended to in turn (their turns alternate in turns.log), then a long run of one."""
    with Store.open(path) as s:
        a, b = s.create_context().context_id, s.create_context().context_id
        ta, tb = [], []
        for i in range(n):
            ta.append(s.append_turn(a, b"a%d" % i).turn_id)
            tb.append(s.append_turn(b, b"b%d" % i).turn_id)
        ta += [t.turn_id for t in s.append_turns(a, [TurnInput(b"run %d" % i) for i in range(WALK_RUN * 2)])]
    return ta, tb


def test_a_chain_walked_in_runs_is_the_chain_read_one_by_one(tmp_path: Path) -> None:
    ta, tb = _interleaved(tmp_path / "s", 300)
    with Store.open(tmp_path / "s") as s:
        chain_a, chain_b = s.chain(ta[-1]), s.chain(tb[-1])
        assert [t.turn_id for t in chain_a] == ta and [t.turn_id for t in chain_b] == tb
        assert chain_a == [s._turns.read(t) for t in ta]
        assert [t.turn_id for t in s.get_last(s.list_contexts()[0].context_id, 7)] == ta[-7:]


def test_damage_read_ahead_off_the_chain_is_ignored_on_it_found(tmp_path: Path) -> None:
    ta, tb = _interleaved(tmp_path / "s", 50)
    log = tmp_path / "s" / "turns.log"
    data = bytearray(log.read_bytes())
    data[(tb[20] - 1) * TURN_SIZE + 3] ^= 0x10  # a turn of context b, inside a run of a's walk
    log.write_bytes(bytes(data))
    with Store.open(tmp_path / "s") as s:
        assert [t.turn_id for t in s.chain(ta[-1])] == ta
        with pytest.raises(CorruptRecord, match=f"turns.log at offset {(tb[20] - 1) * TURN_SIZE}: "):
            s.chain(tb[-1])  # where the record is in the file (it said offset 0: its place in the run)


def test_jump_pointers_follow_the_skew_binary_rule_across_batches_forks_and_reopening(tmp_path: Path) -> None:
    """Each turn's stored jump is FORMAT.md's rule over its parent's (computed here from the turn
    records alone), whether its batch wrote it (from the batch's depths) or recovery recomputed
    it at open after turns.skip lost its tail."""
    rng = random.Random(5)
    with Store.open(tmp_path / "s") as s:
        ctx = s.create_context().context_id
        heads = [ctx]
        for _ in range(40):
            at = rng.choice(heads)
            turns = s.append_turns(at, [TurnInput(b"t%d" % rng.random()) for _ in range(rng.randint(1, 90))])
            if rng.random() < 0.3:
                heads.append(s.fork(turns[rng.randrange(len(turns))].turn_id).context_id)
        count = s._turns.count
    skip = tmp_path / "s" / "turns.skip"
    skip.write_bytes(skip.read_bytes()[: 12 * (count // 2)])  # recovery recomputes the second half
    with Store.open(tmp_path / "s") as s:
        turns = {t: s._turns.read(t) for t in range(1, count + 1)}
        expected: dict[int, int] = {}
        for t in range(1, count + 1):  # parents come first: their jumps are known
            parent = turns[t].parent_turn_id
            if not parent:
                expected[t] = 0
                continue
            pj = expected[parent] or parent
            pjj = (expected[pj] or pj) if turns[pj].parent_turn_id else pj
            depth = {x: turns[x].depth for x in (parent, pj, pjj)}
            expected[t] = pjj if depth[parent] - depth[pj] == depth[pj] - depth[pjj] else parent
        assert {t: s._turns.jump(t) for t in turns} == expected
