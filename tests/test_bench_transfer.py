"""scripts/bench_transfer.py's machinery on a tiny session, in a lab of its own: every baseline
that is installed, and p2pnode (one-shot, then through h2's node), moves a session and then its
grown version from h1 to h2 byte for byte (each_tool compares the received file with the sent
one), the link counters and the CPU accounting see the work, and the lab is gone afterwards.
Nothing about speed is asserted."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from lab import Lab, unavailable_reason

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_transfer as bt  # noqa: E402

pytestmark = pytest.mark.lab


def test_every_tool_moves_a_session_and_its_growth(tmp_path: Path) -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    lab = Lab.create(3)
    bench: bt.Bench | None = None
    try:
        bench = bt.Bench(lab, tmp_path / "bench", quick=True, reps=1)
        bench.start_tools(bt.missing_programs())
        assert "p2pnode" in bench.tools, bench.why
        assert set(bench.tools) | set(bench.why) == set(bt.TOOLS)  # a baseline missing says why
        path = bench.sessions.make(1, bt.MB)
        for scenario, again in (("first", False), ("grown", True)):
            if again:
                bench.sessions.grow(path, 0.05)
            moved = bench.each_tool(scenario, path, again)
            assert set(moved) == set(bench.tools), bench.why
            for name, m in moved.items():
                assert m.wire > 0 and m.cpu > 0 and m.seconds > 0, (name, m)
            via = moved["p2pnode"].parts  # the same fetch again, through h2's running node
            assert via["node_fetch_s"] > 0 and via["node_cpu_s"] > 0 and via["node_wire_bytes"] > 0, via
        assert bench.result == {} and not [k for k in bench.why if ":" in k]
    finally:
        if bench is not None:
            bench.close()
        lab.down()
    assert lab.exists() == []
