"""A fetch's commit writes its turns without the library's lock, as a share's import does: the
node goes on answering peers and commands meanwhile (a 2 GB session's commit held the lock for
seconds), and `rm` (which deletes every store context the state does not name, the commit's
until it is recorded) waits for it.  Real libraries, a real peer server on loopback; the
commit is held in the middle by wrapping the fetcher's Store.append_turns (no timing)."""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from test_stream_engine import PROJECT, Duo, duo  # noqa: F401  (the fixture)
from test_stream_fetch import SESSION_ID, pi_session

from p2pnode.pi.lines import split_lines
from store.api import Store

BOUND = 10.0


def _another_session() -> bytes:
    """A session with another id than pi_session's (placed and stored apart)."""
    header, rest = pi_session(300_000, seed=30).split(b"\n", 1)
    return header.replace(SESSION_ID.encode(), b"0c0ffee0-0000-4000-8000-000000000031") + b"\n" + rest


@pytest.mark.parametrize("grown", [False, True])
async def test_readers_are_answered_while_a_fetch_commits(duo: Duo, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
                                                          grown: bool) -> None:
    """`grown`: the version fetched extends one held (extend_staged), else it is the session's
    first (add_staged)."""
    other_path = duo.share_agent / PROJECT / "other.jsonl"
    other_path.parent.mkdir(parents=True, exist_ok=True)
    other_path.write_bytes(_another_session())
    other = duo.sharer.share(str(other_path)).branch
    held = await duo.fetch(other)
    lines = split_lines(pi_session(800_000, seed=31))
    before = [other]
    if grown:
        first = duo.sharer.share(str(duo.write(b"".join(lines[:len(lines) // 2])))).branch
        await duo.fetch(first)
        before.append(first)
    path = duo.write(b"".join(lines))
    branch = duo.sharer.share(str(path)).branch

    reached, go = threading.Event(), threading.Event()
    append_turns = Store.append_turns

    def holding(self: Store, *args: Any, **kwargs: Any) -> Any:
        if self is duo.fetcher.store and not go.is_set():
            reached.set()
            assert go.wait(BOUND)
        return append_turns(self, *args, **kwargs)

    monkeypatch.setattr(Store, "append_turns", holding)
    fetching = asyncio.ensure_future(duo.fetch(branch))
    assert await asyncio.to_thread(reached.wait, BOUND)  # the commit writes its turns
    with ThreadPoolExecutor(1) as ex:
        listed = ex.submit(duo.fetcher.branches, True).result(timeout=BOUND)
        assert sorted(b.branch for b in listed) == sorted(before)
        assert len(ex.submit(duo.fetcher.line_manifest, held.src).result(timeout=BOUND)) == held.lines_total
        assert ex.submit(duo.fetcher.catalog).result(timeout=BOUND).branches == []  # fetched: not offered on
        removing = ex.submit(duo.fetcher.remove, other)  # waits for the commit
        await asyncio.sleep(0.3)
        assert not removing.done() and not fetching.done()
        go.set()
        result = await asyncio.wait_for(fetching, BOUND)
        assert [b.branch for b in removing.result(timeout=BOUND)] == [other]
    assert result.written and duo.fetcher.session_bytes(result.src) == path.read_bytes()
    assert sorted(b.branch for b in duo.fetcher.branches(True)) == sorted([*before[1:], branch])
