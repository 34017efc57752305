"""The sans-IO parts of what the user sees: resolving a hash prefix against peers'
catalogs, the shortest unique prefix `share` prints, browse rows, and the progress meter and
the live bar it feeds (rich, drawn on a forced terminal into a buffer)."""
from __future__ import annotations

import io

import pytest
from rich.console import Console

from p2pnode.cli.progress import TransferBar
from p2pnode.errors import InvalidInput, NotFound, PeerUnavailable, Refused
from p2pnode.peer import wire
from p2pnode.peer.address import PeerAddress
from p2pnode.peer.offers import PeerOffer, check_target, offered_rows, resolve, unique_prefix
from p2pnode.peer.progress import ProgressInfo, ProgressMeter, TransferProgress

P1, P2 = PeerAddress(None, "10.0.0.1", 1), PeerAddress(None, "10.0.0.2", 2)


def entry(branch: str, sid: str = "01a1ff93-0000", lines: int = 1, title: str = "t") -> wire.CatalogEntry:
    return wire.CatalogEntry(branch=branch, src="c" * 64, parent=None, size=10 * lines, lines=lines,
                             header={"id": sid, "cwd": "/home/me/proj", "timestamp": "2026-11-21T19:00:00Z"},
                             title=title)


def offer(addr: PeerAddress, *entries: wire.CatalogEntry, node: str = "N") -> PeerOffer:
    return PeerOffer([addr], wire.CatalogMessage(1, node, list(entries)))


def test_a_unique_prefix_resolves_to_the_branch_and_every_holder() -> None:
    a, b = "abcd0" + "0" * 59, "abcd1" + "1" * 59
    offers = [offer(P1, entry(a), entry(b)), offer(P2, entry(a))]
    assert resolve("ABCD00", offers) == (a, [P1, P2])
    assert resolve(b, offers) == (b, [P1])
    with pytest.raises(NotFound, match=r"'abcd' matches 2 offered branches: abcd0000.*abcd1111.*more of"):
        resolve("abcd", offers)
    with pytest.raises(NotFound, match=r"no branch matching 'ffff' is offered by the 1 peer\(s\) asked; "
                                       r"not asked: 10.0.0.2:2: refused"):
        resolve("ffff", [offer(P1, entry(a)), PeerOffer([P2], error="refused")])
    with pytest.raises(InvalidInput, match="at least 4 hex"):
        check_target("abc")
    # no peer answered: why, by its exit code (README: 6 unreachable, 8 refused), not "not found"
    with pytest.raises(PeerUnavailable, match="no peer could be asked for 'ffff': 10.0.0.2:2: refused"):
        resolve("ffff", [PeerOffer([P2], error="refused")])
    with pytest.raises(Refused, match="no peer could be asked"):
        resolve("ffff", [PeerOffer([P1], error="no", failure=Refused),
                         PeerOffer([P2], error="no", failure=Refused)])
    with pytest.raises(PeerUnavailable):
        resolve("ffff", [PeerOffer([P1], error="no", failure=Refused), PeerOffer([P2], error="timed out")])
    with pytest.raises(InvalidInput):
        check_target("xyz")
    assert check_target("01A1ff93-69EF") == "01A1ff93-69EF"  # a Pi session id, case kept


def test_unique_prefix_is_at_least_twelve_and_long_enough() -> None:
    mine = "abcdef0123456789" + "0" * 48
    assert unique_prefix(mine, [mine]) == mine[:12]
    near = "abcdef0123456789ab" + "1" * 46
    assert unique_prefix(mine, [mine, near]) == mine[:17]
    assert unique_prefix(mine, [near], minimum=4) == mine[:17]


def test_browse_rows_one_per_session_with_its_versions() -> None:
    from dataclasses import replace

    v1 = replace(entry("1" * 64, "sess-a", lines=3), version=1)
    v2 = replace(entry("2" * 64, "sess-a", lines=5), version=2, previous="1" * 64)
    other = entry("3" * 64, "sess-b")
    rows = offered_rows([offer(P1, v1, other, v2, node="NODE123-XYZ"), PeerOffer([P2], error="timed out")],
                        {"NODE123-XYZ": "alice"})
    got = sorted((r["branch"][0], r["versions"], r["name"], r["short_id"], r["project"])
                 for r in rows["branches"])
    assert got == [("2", 2, "alice", "NODE123", "proj"), ("3", 1, "alice", "NODE123", "proj")]
    assert rows["peers"][0]["offers"] == 3
    assert rows["peers"][1] == {"node_id": None, "name": None, "short_id": None, "addresses": ["10.0.0.2:2"],
                                "error": "timed out", "exit_code": 6, "offers": None}


def test_meter_rate_eta_and_optional_info() -> None:
    now = [100.0]
    seen: list[TransferProgress] = []
    meter = ProgressMeter(["p1"], clock=lambda: now[0], on_change=seen.append)
    meter(0, 10_000_000)
    now[0] += 2.0
    meter(4_000_000, 10_000_000)  # the two-argument form get.py uses
    assert meter.current.rate == 2_000_000 and meter.current.eta == 3.0 and meter.current.peers == ["p1"]
    now[0] += 1.0
    meter(6_000_000, 10_000_000, ProgressInfo(lines_verified=30, lines_total=50, peers=("p1", "p2")))
    cur = meter.current
    assert (cur.lines_verified, cur.lines_total, cur.peers, cur.seconds) == (30, 50, ["p1", "p2"], 3.0)
    assert len(seen) == 3 and TransferProgress.from_dict(dict(cur.as_dict(), extra=1)) == cur


def test_the_bar_draws_on_a_terminal_and_stays_silent_elsewhere() -> None:
    tty = io.StringIO()
    with TransferBar(["127.0.0.1:4747"], Console(file=tty, force_terminal=True, width=160)) as view:
        view(0, 8_000_000)
        view(2_000_000, 8_000_000, ProgressInfo(lines_verified=12, lines_total=40))
        view.event({"event": "progress", "bytes_done": 4_000_000, "bytes_total": 8_000_000, "rate": 1.5e6,
                    "eta": 2.7, "lines_verified": 20, "lines_total": 40, "peers": ["a", "b"]})
        view.event({"event": "started", "id": "x"})
    drawn = tty.getvalue()
    assert "1.5 MB/s" in drawn and "ETA 0:03" in drawn and "20/40 lines verified" in drawn
    assert "2 peers" in drawn
    assert "2.0/8.0 MB" in drawn and "12/40 lines verified" in drawn and "(127.0.0.1:4747)" in drawn
    pipe = io.StringIO()
    with TransferBar([], Console(file=pipe, force_terminal=False)) as view:
        view(4_000_000, 8_000_000)
    assert pipe.getvalue() == ""
