"""Stream answers that go on across a lane of batch requests (wire.STREAM_LANE_HEADER): one zstd
frame per lane and holder, decoded answer after answer.  A real PeerServer behind a real
loopback relay slow enough for the stream (at most 300 KB/s per connection against a threshold
of 2 MB/s, far below what loopback TLS moves); what the answers carry is read from their
headers and the server's log, never from timing."""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import blake3
import pytest
import test_holders
import zstandard
from test_holders import World, placed

from p2pnode.peer import wire
from p2pnode.peer.address import PeerAddress
from p2pnode.peer.batches import Lane, Lanes, lane_window_log
from p2pnode.peer.tls import client_context

SLOW = wire.Limits(stream_link_rate=2_000_000, stream_small_bytes=1 << 10)
"""The server's limits: a link under 2 MB/s is slow, and no fetch is small enough to be a
stream of its own."""


@pytest.fixture
async def world(tmp_path: Path, corpus_dir: Path) -> AsyncIterator[World]:
    """test_holders' holders of one 3 MB session (a real Pi session with generated lines)."""
    async for w in test_holders.world.__wrapped__(tmp_path, corpus_dir):  # type: ignore[attr-defined]
        yield w


async def test_a_fetch_over_a_slow_link_continues_each_lanes_frame(world: World,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Once the link is measured slow, every stream answer in a lane goes on with that lane's
    frame; the session arrives whole and verified."""
    caplog.set_level(logging.DEBUG, logger="p2pnode.peer.provider")
    addr = await world.serve(0, rate=300_000, limits=SLOW)
    result = await world.fetch([addr], wire.Limits(batch_target_bytes=64 << 10))
    assert placed(world, result) == world.data
    lanes = [r.getMessage() for r in caplog.records if ", lane " in r.getMessage()]
    assert lanes and any(" after 0 answers" not in m for m in lanes), lanes


def connect(w: World) -> aiohttp.ClientSession:
    """A client of the world's first holder (one connection at a time: the lanes it makes stay
    until its last connection closes)."""
    tls = client_context(w.me, w.trust, w.holders[0].identity.fingerprint)
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls, limit=1))


async def answers(s: aiohttp.ClientSession, w: World, addr: PeerAddress, claims: list[int], lane: int = 0,
                  window: str | None = None, windows: list[int] | None = None,
                  decode_as: str | None = None) -> list[str | None]:
    """Batches of 12 lines in `lane`, one after the other, each claiming `claims[i]` answers
    decoded in the lane (and offering `window`, wire.STREAM_WINDOW_HEADER, where given); each
    answer decoded (a fresh decoder where it says 0, else the lane's; its window the one
    offered, or `decode_as`) and verified; their STREAM_CONTINUE_HEADER values.  `windows`
    gets the window of each new frame."""
    hashes = list(dict.fromkeys(blake3.blake3(ln).digest() for ln in w.lines()))
    window_log = wire.parse_window_header(window if decode_as is None else decode_as)
    stream, seen = wire.BatchStreamDecoder(window_log), []
    for i, claim in enumerate(claims):
        group = hashes[12 * i : 12 * (i + 1)]
        headers = {wire.BATCH_FORMAT_HEADER: wire.BATCH_FORMAT_STREAM,
                   wire.FETCH_BYTES_HEADER: str(1 << 30), wire.LINK_RATE_HEADER: "100000",
                   wire.STREAM_LANE_HEADER: str(lane),
                   wire.STREAM_CONTINUE_HEADER: str(claim)}
        if window is not None:
            headers[wire.STREAM_WINDOW_HEADER] = window
        async with s.post(f"https://127.0.0.1:{addr.port}{wire.PATH_BATCH}", data=b"".join(group),
                          headers=headers) as r:
            going_on = r.headers.get(wire.STREAM_CONTINUE_HEADER)
            body = await r.read()
        seen.append(going_on)
        decoder = wire.BatchDecoder(group, stream=True)
        blobs = decoder.feed(body)
        decoder.finish()
        if going_on == "0":
            stream = wire.BatchStreamDecoder(window_log)
            if windows is not None:
                windows.append(zstandard.get_frame_parameters(blobs[0].stored).window_size)
        assert [blake3.blake3(wire.decode_blob(b, stream)).digest() for b in blobs] == group
        stream.answers += 1
    return seen


async def test_the_server_goes_on_only_from_what_the_fetcher_decoded(world: World) -> None:
    """A lane continues where the fetcher's count matches the answers the server's frame
    carried; any other count (a fetcher that lost an answer, or lies) gets a new frame."""
    addr = await world.serve(0, rate=100_000, limits=SLOW)
    async with connect(world) as s:
        assert await answers(s, world, addr, [0, 1, 2]) == ["0", "1", "2"]
        assert await answers(s, world, addr, [0, 5, 1]) == ["0", "0", "1"]


async def test_a_lanes_window_is_the_one_the_fetcher_offered_within_the_servers_budget(
        world: World, caplog: pytest.LogCaptureFixture) -> None:
    """A lane's frame has the window the fetcher offered (up to 16 MiB), 8 MiB where it offered
    none or something that is no number; past WIDE_WINDOWS_BYTES of wide windows held for all
    lanes, a new lane gets 8 MiB, and a lane whose frame is replaced gives its window back.
    A frame wider than 8 MiB is level 3, where this slow link has the others at level 6."""
    caplog.set_level(logging.DEBUG, logger="p2pnode.peer.provider")
    addr = await world.serve(0, rate=100_000, limits=SLOW)
    windows: list[int] = []
    async with connect(world) as s:
        for lane, window in [(0, None), (1, "x"), (2, "40"), (3, "24"), (4, "25"),  # 3 x 16 MiB
                             (5, "24"),  # over 48 MiB: 8
                             (2, "22"), (6, "24")]:  # lane 2's new frame gives its 16 MiB back
            assert await answers(s, world, addr, [0], lane, window, windows) == ["0"]
    assert windows == [8 << 20, 8 << 20, 16 << 20, 16 << 20, 16 << 20, 8 << 20, 4 << 20, 16 << 20]
    levels = [m.split()[2] for r in caplog.records if ", lane " in (m := r.getMessage())]
    assert levels == ["zstd-6", "zstd-6", "zstd-3", "zstd-3", "zstd-3", "zstd-6", "zstd-6", "zstd-3"]


async def test_a_fetcher_refuses_a_frame_wider_than_it_offered(world: World) -> None:
    """A server that makes a lane's frame wider than the fetcher's STREAM_WINDOW_HEADER (a bad
    one): the fetcher's decoder refuses its header, before any memory for it is taken."""
    addr = await world.serve(0, rate=100_000, limits=SLOW)
    async with connect(world) as s:
        with pytest.raises(wire.WireError, match="too much memory"):
            await answers(s, world, addr, [0], window="24", decode_as="23")


def test_a_fetchs_lanes_share_one_memory_budget() -> None:
    """One holder's three lanes at 16 MiB; 8 MiB from two holders on, as a lane always had."""
    assert [lane_window_log(n) for n in (0, 1, 2, 3, 9)] == [24, 24, 23, 23, 23]
    with Lanes(24).take("a") as lane:
        assert lane.headers()[wire.STREAM_WINDOW_HEADER] == "24"


def test_a_lane_refuses_an_answer_that_continues_what_it_does_not_hold() -> None:
    lane = Lane(0)
    assert lane.headers() == {wire.STREAM_LANE_HEADER: "0", wire.STREAM_CONTINUE_HEADER: "0",
                              wire.STREAM_WINDOW_HEADER: "23"}
    with pytest.raises(wire.WireError, match="continues after 2 answers in lane 0, which holds 0"):
        lane.decoder(2)
    fresh = lane.decoder(0)
    fresh.answers = 2
    lane.stream = fresh
    assert lane.decoder(2) is fresh and lane.decoder(None) is not fresh
    assert lane.headers()[wire.STREAM_CONTINUE_HEADER] == "2"
    with pytest.raises(wire.WireError):
        lane.decoder(1)
    assert Lane(wire.MAX_STREAM_LANES).headers() == {}  # beyond the server's lanes: streams of their own


def test_a_failed_request_leaves_its_lanes_frame_behind() -> None:
    lanes = Lanes()
    with lanes.take("a") as first, lanes.take("a") as second, lanes.take("b") as other:
        assert (first.number, second.number, other.number) == (0, 1, 0)
        first.stream = second.stream = wire.BatchStreamDecoder()
    with pytest.raises(RuntimeError), lanes.take("a") as again:
        assert again is first or again is second
        raise RuntimeError("cut")
    assert again.stream is None  # its next answer opens a new frame
    with lanes.take("a") as x, lanes.take("a") as y:
        assert {x.number, y.number} == {0, 1}  # no third lane: both came back
        assert (x.stream is None) != (y.stream is None)  # the other one's frame goes on
