"""SIGKILL campaign: a real writer process appends durably (several contexts, forks, batches,
payloads from 40 B to ~1 MB incompressible) and is killed with SIGKILL at random moments,
round after round on the same store.  After every kill the store must open, hold every
acknowledged turn with its payload, keep heads on existing turns at or after the last
acknowledged one with consistent depths, and pass fsck.  scripts/soak_store.py is the long
variant (`--rounds`); this test runs the same code for a bounded number of rounds.
"""
from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest

from store.fsck import fsck

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "soak_store.py"


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("soak_store", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["soak_store"] = mod
    spec.loader.exec_module(mod)
    return mod


ROUNDS = 16


def test_sigkill_campaign_loses_no_acknowledged_turn(soak, tmp_path: Path) -> None:
    path = tmp_path / "store"
    rng = random.Random(2026)
    acked = soak.Acked()
    hows = []
    for _ in range(ROUNDS):
        _n, how = soak.one_round(path, rng, acked)
        hows.append(how)
        soak.verify(path, acked)  # raises with the turn or context that went wrong
    # the campaign really ran: thousands of acknowledged durable appends, both kinds of kill
    assert len(acked.turns) >= 2000, f"only {len(acked.turns)} appends were acknowledged"
    assert {"after appends", "on a timer"} <= set(hows)
    assert acked.forks > 0 and acked.large > 0, "the mix lacked forks or ~1 MB payloads"
    report = fsck(path, full=True)  # re-hashes every blob in the pack
    assert report.ok, report.summary()
