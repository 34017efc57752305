"""node/routing.py's `routed`: a command that writes goes through the running node, else acts
on the store; a node that starts between the two is asked after all (a share racing the
node's start met its read-only library: an AttributeError, exit 1).  The node's side is a
stand-in (an `ask` that finds no node, then one, and `open_library` finding it up): the real
window is a few milliseconds of a node's start, which no test can hit on purpose."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from p2pnode.errors import PeerUnavailable
from p2pnode.node import routing
from p2pnode.node.control_client import NodeLibrary
from p2pnode.paths import NodePaths


def test_a_node_starting_between_the_ask_and_the_open_is_asked_again(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    paths = NodePaths(tmp_path / "home")
    asked: list[str] = []

    def ask(p: NodePaths, op: str, payload: dict[str, Any]) -> dict[str, Any] | None:
        asked.append(op)
        return None if len(asked) == 1 else {"by": "node"}  # no node yet; then it answers

    def node_up(p: NodePaths, *, read_only: bool = False) -> Any:
        return NodeLibrary(p)  # the node holds the store by now: its read-only library

    monkeypatch.setattr(routing, "open_library", node_up)
    assert routing.routed(paths, "share", {}, lambda lib: {"by": "here"}, ask) == {"by": "node"}
    assert asked == ["share", "share"]
    with pytest.raises(PeerUnavailable, match="started and stopped"):  # up, then gone again: say so
        routing.routed(paths, "gc", {}, lambda lib: {"by": "here"}, lambda p, op, body: None)


def test_with_no_node_the_command_acts_on_the_store(tmp_path: Path) -> None:
    paths = NodePaths(tmp_path / "home")
    got = routing.routed(paths, "gc", {}, lambda lib: {"store": str(lib.paths.store)},
                         lambda p, op, body: None)
    assert got == {"store": str(paths.store)}


def test_a_write_done_and_recorded_is_not_reported_failed_when_the_store_then_fails_to_close(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """EIO at the final flush of the close after a share had committed: the command said it had
    failed and recorded nothing (exit 1) while the branch was offered.  Its answer stands, with a
    warning; a failure of the work itself is still the one reported."""
    import errno

    from p2pnode.library.api import Library
    from store.errors import StoreFailed

    paths = NodePaths(tmp_path / "home")
    real_close = Library.close

    def failing_close(self: Library) -> None:
        real_close(self)
        raise StoreFailed.of(str(paths.store), OSError(errno.EIO, "Input/output error"))

    monkeypatch.setattr(Library, "close", failing_close)
    no_node = lambda p, op, body: None  # noqa: E731
    assert routing.routed(paths, "share", {}, lambda lib: {"done": True}, no_node) == {"done": True}
    assert "share: done and recorded, but closing the store then failed" in caplog.text

    def broken(lib: Any) -> dict[str, Any]:
        raise PeerUnavailable("the work failed")

    with pytest.raises(PeerUnavailable, match="the work failed"):
        routing.routed(paths, "share", {}, broken, no_node)


def test_a_command_waiting_for_the_store_reads_through_a_node_that_came_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node holds the store from its first moments and answers a little later: a command
    started in between (it waited the whole lock timeout, then said "stop that node first",
    exit 7) looks for the node again between short tries for the store.  The store is really
    held (by this process, as the starting node would); the node's answering is the stand-in."""
    import time

    from p2pnode.library.api import Library
    from store.config import StoreConfig

    paths = NodePaths(tmp_path / "home")
    looks: list[float] = []

    def running(p: NodePaths) -> bool:
        looks.append(time.monotonic())
        return len(looks) > 3  # up at the fourth look

    monkeypatch.setattr(routing, "node_running", running)
    with Library.open(paths):
        started = time.monotonic()
        lib = routing.open_library(paths)
    assert isinstance(lib, NodeLibrary) and len(looks) == 4
    assert time.monotonic() - started < StoreConfig().lock_timeout  # it did not wait it out


def test_a_one_shot_fetch_meeting_a_node_that_started_goes_on_through_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A node started while a fetch ran in the command's own process: the fetch's next step
    finds the store kept (it waited 10 s, then "verified bytes were not stored", exit 7) and
    the command hands the fetch to the node (the staged lines are the node's to take up).  The
    store is really held (by this process, as the node would); the node's answer is a stand-in."""
    import argparse

    from p2pnode.cli import fetching
    from p2pnode.cli import main as cli
    from p2pnode.library.api import Library
    from p2pnode.peer.get import OpenPerUse, StoreTaken

    paths = NodePaths(tmp_path / "home")
    with Library.open(paths), pytest.raises(StoreTaken, match="a node started"):
        OpenPerUse(paths, taken=lambda: True)()
    args = argparse.Namespace(home=str(paths.home))

    def here(*_: Any) -> dict[str, Any]:
        raise StoreTaken("a node started for it while this fetch ran here, and holds the store now")

    monkeypatch.setattr(cli, "_fetch_here", here)
    monkeypatch.setattr(fetching, "fetch_via_node", lambda p, payload: {"by": "node", **payload})
    assert cli._fetch_here_or_via_node(args, "ab" * 32, [], {"branch": "ab" * 32}) == {
        "by": "node", "branch": "ab" * 32}
    assert "the fetch goes on through it" in capsys.readouterr().err
