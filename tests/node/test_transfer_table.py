"""The node's transfer table on its own: what `status` keeps of ended background transfers
(bounded in number and in time), and a waiting command's stream that closes early cancelling
its transfer.  The fetch is a stand-in the test ends at will (the real fetch through a real
node, Ctrl-C included: test_transfers.py); the table, its tasks and events are the real ones."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

from p2pnode.node import transfers
from p2pnode.node.transfers import Transfers
from p2pnode.peer.progress import ProgressMeter


class StandInNode:
    """Fetches that report half their bytes, then wait until the test lets them end."""

    identity: Any = None
    trust: Any = None

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.cancelled = 0

    def trusted_online(self) -> list:
        return []

    async def _c_fetch(self, body: dict[str, Any], progress: ProgressMeter | None = None) -> dict[str, Any]:
        assert progress is not None
        progress(50, 100)
        try:
            await self.go.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        progress(100, 100)
        return {"branch": body["branch"]}


def branch(i: int) -> str:
    return f"{i:064x}"


async def test_ended_background_transfers_are_kept_briefly_and_few(monkeypatch: pytest.MonkeyPatch) -> None:
    node = StandInNode()
    table = Transfers(node)
    count = transfers.MAX_RECENT + 3
    started = [await table.fetch({"branch": branch(i), "background": True}) for i in range(count)]
    assert {s["id"] for s in started} == {t["id"] for t in table.listed()}
    await asyncio.sleep(0)
    assert {(t["bytes_done"], t["state"]) for t in table.listed()} == {(50, "running")}
    node.go.set()
    await asyncio.gather(*(t.task for t in table.running.values() if t.task))
    ended = table.listed()
    assert len(ended) == transfers.MAX_RECENT and {t["state"] for t in ended} == {"done"}
    assert {t["bytes_done"] for t in ended} == {100}
    monkeypatch.setattr(transfers, "RECENT_SECONDS", 0.0)
    await asyncio.sleep(0.01)
    assert table.listed() == []


async def test_a_background_fetch_that_could_not_place_its_file_says_so() -> None:
    """Fetched and stored, but the file was not placed (a foreground fetch exits 7): `status`
    must not call that done, and says why and what was fetched."""
    node = StandInNode()
    table = Transfers(node)
    conflict = "/s/x.jsonl already exists with different content: it was kept"

    async def placed_nothing(body: dict[str, Any], progress: ProgressMeter | None = None) -> dict[str, Any]:
        return {"branch": branch(9), "path": None, "conflict": conflict}

    node._c_fetch = placed_nothing  # type: ignore[method-assign]
    started = await table.fetch({"branch": branch(3), "background": True})
    await asyncio.gather(*(t.task for t in table.running.values() if t.task))
    [listed] = table.listed()
    assert listed["id"] == started["id"] and listed["state"] == "conflict"
    assert listed["conflict"] == conflict and listed["fetched"] == branch(9) and listed["path"] is None


async def test_a_stream_closed_early_cancels_its_transfer() -> None:
    node = StandInNode()
    table = Transfers(node)
    events = await table.fetch({"branch": branch(1), "stream": True})
    assert (await events.__anext__())["event"] == "started"
    progress = await events.__anext__()
    assert progress["event"] == "progress" and progress["bytes_done"] == 50
    await events.aclose()  # the command went away (Ctrl-C): the control connection closed
    await asyncio.sleep(0)
    assert node.cancelled == 1 and table.listed() == []


async def test_cancel_by_id_ends_a_background_transfer_and_says_so() -> None:
    node = StandInNode()
    table = Transfers(node)
    started = await table.fetch({"branch": branch(2), "background": True})
    await asyncio.sleep(0)
    assert await table.cancel({"id": started["id"]}) == {"id": started["id"], "state": "cancelled"}
    assert [(t["state"], t["error"]) for t in table.listed()] == [("cancelled", "cancelled")]
    with pytest.raises(Exception, match="no transfer 'nope'"):
        await table.cancel({"id": "nope"})


async def test_the_end_is_streamed_at_once_not_after_a_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    """Progress events are spaced EVENT_INTERVAL apart, but the result is not held behind that
    pause (it was: every fetch through the node answered up to 0.2 s late).  With an interval of
    an hour, the result still comes as soon as the fetch ends."""
    monkeypatch.setattr(transfers, "EVENT_INTERVAL", 3600.0)
    node = StandInNode()
    table = Transfers(node)
    events = await table.fetch({"branch": branch(3), "stream": True})
    assert (await events.__anext__())["event"] == "started"
    assert (await events.__anext__())["event"] == "progress"
    node.go.set()
    async with asyncio.timeout(10):
        end = await events.__anext__()
    assert end == {"event": "result", "result": {"branch": branch(3)}}
    await events.aclose()


async def test_a_node_that_stops_tells_the_waiting_command_so_not_cancelled() -> None:
    """SIGTERM of the node while a command waits for its fetch: the command hears that the
    node stopped (exit 6, run it again), not "cancelled" (exit 1: it cancelled nothing)."""
    node = StandInNode()
    table = Transfers(node)
    events = await table.fetch({"branch": branch(4), "stream": True})
    assert (await events.__anext__())["event"] == "started"
    assert (await events.__anext__())["event"] == "progress"
    await table.close()
    end = await events.__anext__()
    assert end["event"] == "error" and end["exit_code"] == 6 and "node stopped" in end["message"]


async def test_a_placed_path_the_system_refuses_is_bad_input_not_the_nodes_failure(
        caplog: pytest.LogCaptureFixture) -> None:
    """A fetch whose placed path is too long for the system (a deep PI_CODING_AGENT_DIR): exit 4
    with the path, as the CLI says it without a node; not exit 1 and a traceback in the log."""
    import errno
    import logging

    class TooDeep(StandInNode):
        async def _c_fetch(self, body: dict[str, Any],
                           progress: ProgressMeter | None = None) -> dict[str, Any]:
            raise OSError(errno.ENAMETOOLONG, "File name too long", "/deep/" + "e" * 300)

    table = Transfers(TooDeep())
    with caplog.at_level(logging.ERROR):
        started = await table.fetch({"branch": branch(1), "background": True})
        await asyncio.gather(*(t.task for t in table.running.values() if t.task), return_exceptions=True)
    [ended] = [t for t in table.listed() if t["id"] == started["id"]]
    assert ended["state"] == "failed" and ended["error"].startswith("file name too long: /deep/eee")
    assert table.running[started["id"]].error.exit_code == 4  # type: ignore[union-attr]
    assert not caplog.records
