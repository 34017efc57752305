"""`browse` and `fetch <prefix>` through running nodes that found each other over real mDNS in
the namespace lab: no address is typed anywhere.  h1 and h2 trust each other; h3 trusts h1,
but h1 does not trust h3 (what h3 offers is never listed on h1)."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lab import Lab
from lannode import LanNode, place, running, wait_for

BETA = "sessions/--tmp-pi-harness-work-beta--/"
B1 = BETA + "2026-11-21T19-26-46-592Z_01a1ff93-4f3f-74a0-8c1a-0b533764bed8.jsonl"
A3 = ("sessions/--tmp-pi-harness-work-alpha--/"
      "2026-11-21T19-26-32-251Z_01a1ff93-173a-7744-89ad-bbc16c12cc22.jsonl")
D1 = ("sessions/--tmp-pi-harness-work-delta-tui--/"
      "2026-11-21T19-26-55-757Z_01a1ff93-730c-767b-bab6-cae6e6ba784f.jsonl")

pytestmark = pytest.mark.lab


@pytest.fixture
def trio(lab: Lab, tmp_path: Path) -> Iterator[dict[str, LanNode]]:
    nodes = {h: LanNode(lab, h, tmp_path) for h in ("h1", "h2", "h3")}
    h1, h2, h3 = nodes.values()
    h1.trust(h2)
    h2.trust(h1)
    h3.trust(h1)
    with running(nodes.values()):
        yield nodes


def _offers(node: LanNode) -> list[dict[str, Any]]:
    """What `browse --json` lists; none while the node has confirmed no trusted peer online yet
    (exit 6: the peers' mDNS records and HTTPS probes come in their own time)."""
    r = node.cli("browse", "--json")
    if r.returncode == 6 and "no trusted peer is online" in r.stderr:
        return []
    assert r.returncode == 0, r.stderr
    return list(json.loads(r.stdout)["branches"])


def test_browse_and_fetch_by_prefix_over_mdns(trio: dict[str, LanNode], corpus_dir: Path) -> None:
    h1, h2, h3 = trio.values()
    mine = h1.share(place(corpus_dir, B1, h1.agent))
    theirs = h2.share(place(corpus_dir, A3, h2.agent))
    h3.share(place(corpus_dir, D1, h3.agent))

    seen = wait_for("h2 to list what h1 offers", lambda: [r for r in _offers(h2) if r["branch"] == mine], 30)
    assert seen[0]["name"] == "h1" and seen[0]["node_id"] == h1.node_id and seen[0]["project"] == "beta"
    on_h1 = wait_for("h1 to list what h2 offers", lambda: _offers(h1), 30)
    assert [r["branch"] for r in on_h1] == [theirs]  # never h3's: h1 does not trust h3
    text = h2.cli("ls", "--peers").stdout
    assert f"h1 ({h1.node_id[:7]})" in text and mine[:12] in text

    r = h2.cli("fetch", mine[:12], "--json")  # resolved against the catalogs of trusted peers online
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["branch"] == mine and Path(got["path"]).read_bytes() == (corpus_dir / B1).read_bytes()
    assert h2.status()["transfers"] == []
