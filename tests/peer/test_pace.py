"""The adaptive batch format (peer/pace.py): a real PeerServer behind a real loopback relay
that paces it, asked for batches the way the fetcher asks (FetchPace's offer and link
meter).  The format is read from the response header, never from timing assertions: the
slow link (100 KB/s per connection) and loopback are far either side of the threshold the
server is given (`THRESHOLD`)."""
from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import blake3
import pytest
import test_holders
from test_holders import World, placed

from p2pnode.peer import batches, pace, wire
from p2pnode.peer.get import KeptManifests
from p2pnode.peer.pace import (
    KEPT_BYTES,
    KEPT_HOLDERS,
    LINES_MARGIN,
    MIN_COST_BYTES,
    MIN_WINDOW,
    PROBE_ROOM,
    FetchPace,
    LinkPace,
    Measures,
    stream_level,
)
from p2pnode.peer.tls import client_context

THRESHOLD = 500_000
"""The server's `stream_link_rate` in these tests: five times the slow relay's 100 KB/s per
connection, and far below what loopback TLS moves even on a loaded machine (500 KB/s is a
300 KB answer in 0.6 s)."""


@pytest.fixture
async def world(tmp_path: Path, corpus_dir: Path) -> AsyncIterator[World]:
    """test_holders' holders of one 3 MB session (a real Pi session with generated lines)."""
    async for w in test_holders.world.__wrapped__(tmp_path, corpus_dir):  # type: ignore[attr-defined]
        yield w


async def formats(w: World, holder: int, rate: int | None, limits: wire.Limits,
                  fetch_bytes: int = 1 << 30, lines: int = 60,
                  continued: list[int] | None = None) -> list[str | None]:
    """Serve the session from `holder` (behind a relay at `rate` if given), ask for its first
    `lines` lines in batches of 12 one after the other, as the fetcher does (declaring a fetch
    of `fetch_bytes`, all in lane 0), and return each answer's format header; each answer is
    verified.  `continued` gets each stream answer's STREAM_CONTINUE_HEADER."""
    continued = [] if continued is None else continued
    addr = await w.serve(holder, rate=rate, limits=limits)
    tls = client_context(w.me, w.trust, w.holders[holder].identity.fingerprint)
    hashes = list(dict.fromkeys(blake3.blake3(ln).digest() for ln in w.lines()))
    pace, seen = FetchPace(fetch_bytes), []
    stream = wire.BatchStreamDecoder()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls)) as s:
        for i in range(0, min(len(hashes), lines), 12):
            group = hashes[i : i + 12]
            async with s.post(f"https://127.0.0.1:{addr.port}{wire.PATH_BATCH}", data=b"".join(group),
                              headers={**pace.offer(addr, wire.Limits()), wire.STREAM_LANE_HEADER: "0",
                                       wire.STREAM_CONTINUE_HEADER: str(stream.answers)}) as r:
                seen.append(r.headers.get(wire.BATCH_FORMAT_HEADER))
                link = pace.link(addr, seen[-1] == wire.BATCH_FORMAT_STREAM)
                decoder, body = wire.BatchDecoder(group, stream=True), bytearray()
                while True:
                    link.waiting()
                    chunk = await r.content.readany()
                    link.moved(len(chunk))
                    if not chunk:
                        break
                    body += chunk
                link.fold()
            blobs = decoder.feed(bytes(body))
            decoder.finish()
            going_on = r.headers.get(wire.STREAM_CONTINUE_HEADER)
            if going_on is not None:
                continued.append(int(going_on))
                if going_on == "0":  # else the answer goes on with lane 0's frame
                    stream = wire.BatchStreamDecoder()
                stream.answers += 1
            assert [blake3.blake3(wire.decode_blob(b, stream)).digest() for b in blobs] == group
    return seen


async def test_a_slow_link_gets_stream_batches_and_a_fast_one_per_line_frames(world: World) -> None:
    """A big fetch: the first answer is a stream (nothing is known of the link yet: the first
    few MB cost little either way); once the fetcher reports what its reads saw, the paced
    link keeps the stream and loopback gets the stored frames (once its reads waited long
    enough to measure it)."""
    limits = wire.Limits(stream_link_rate=THRESHOLD)
    continued: list[int] = []
    slow = await formats(world, 0, 100_000, limits, lines=36, continued=continued)
    fast = await formats(world, 1, None, limits, lines=1000)
    assert slow == [wire.BATCH_FORMAT_STREAM] * len(slow)
    # the first answer (link not measured) is a stream of its own; once the link is measured
    # slow, the lane's frame goes on from answer to answer (each decoded as it came)
    assert continued[:2] == [0, 0] and continued[2:] == list(range(1, len(continued) - 1))
    # loopback: streams until its link is measured (MIN_SAMPLE or MIN_SAMPLE_BYTES), then per-line
    measured = fast.index(None)
    assert fast[0] == wire.BATCH_FORMAT_STREAM and fast[measured:] == [None] * (len(fast) - measured)


async def test_a_small_transfer_takes_the_stream_on_any_link(world: World) -> None:
    """A fetch of at most `stream_small_bytes` (a +1 % append is a few MB) gets the stream even
    over loopback, from its first answer on."""
    limits = wire.Limits(stream_link_rate=THRESHOLD)
    got = await formats(world, 1, None, limits, fetch_bytes=limits.stream_small_bytes)
    assert got == [wire.BATCH_FORMAT_STREAM] * len(got)


async def test_no_stream_unless_offered_or_served(world: World) -> None:
    """A server with the stream off answers per-line frames even to an offer."""
    assert set(await formats(world, 0, None, wire.Limits(serve_stream_batches=False))) == {None}


MB = 1_000_000
LIMITS = wire.Limits()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fetch(pace: FetchPace, rates: dict[bool, float], mb: int, holder: object = "a") -> list[bool]:
    """Drive `pace` as batches.py does, one request of a raw MB at a time from `holder`, each
    delivered at `rates[offered]` raw bytes per second on the pace's clock; the offers made."""
    clock = pace.clock
    assert isinstance(clock, Clock)
    offers = []
    for _ in range(mb):
        pace.link(holder, False)
        headers = pace.offer(holder, LIMITS)
        offered = wire.BATCH_FORMAT_HEADER in headers
        offers.append(offered)
        clock.now += MB / rates[offered]
        pace.decoded(offered, MB, 0.005)
        pace.answered(MB // 4)
        pace.ended(headers)
    return offers


def paced(fetch_bytes: int = 256 * MB) -> FetchPace:
    return FetchPace(fetch_bytes, clock=Clock())


def switches(offers: list[bool]) -> list[int]:
    """The MB at which the offer changed."""
    return [i for i in range(1, len(offers)) if offers[i] != offers[i - 1]]


def test_the_offer_is_the_stream_with_what_the_server_needs_to_choose() -> None:
    """The stream is offered from the start, with the fetch's size and, once measured, the
    link's rate: the per-line frames' where measured (the holder's own pace to make a stream
    is not the link's), else the stream's.  A fetcher with the stream off offers nothing."""
    pace = paced()
    offered = {wire.BATCH_FORMAT_HEADER: wire.BATCH_FORMAT_STREAM, wire.FETCH_BYTES_HEADER: str(256 * MB)}
    assert pace.offer("a", LIMITS) == offered
    assert pace.offer("a", wire.Limits(stream_batches=False)) == {}
    pace.link("a", True).rate = 5_000_000
    assert pace.offer("a", LIMITS) == {**offered, wire.LINK_RATE_HEADER: "5000000"}
    pace.link("a", False).rate = 12_500_000
    assert pace.offer("a", LIMITS)[wire.LINK_RATE_HEADER] == "12500000"
    assert wire.LINK_RATE_HEADER not in pace.offer("b", LIMITS)


def test_each_format_is_measured_and_the_faster_one_kept() -> None:
    """The stream's first window is the warm-up; then per-line frames are measured for a
    window, then the stream, and the faster format is kept, the other tried again every
    REPROBE windows.  Where the per-line frames are faster (two holders at 100 Mbit/s on a
    fetcher whose CPU makes the stream slowly), most of the fetch comes per-line."""
    pace = paced()
    window = pace.window_bytes() // MB
    offers = fetch(pace, {True: 30 * MB, False: 50 * MB}, 256)
    assert offers[: window + 1] == [True] * (window + 1)
    assert offers[window + 1 : 2 * window + 1] == [False] * window
    assert offers[2 * window + 1 : 3 * window + 1] == [True] * window  # measured
    assert offers.count(False) > 0.75 * len(offers)
    assert True in offers[4 * window:]  # the stream tried again later
    assert pace.delivered[False].rate == pytest.approx(50 * MB)
    assert pace.delivered[True].rate == pytest.approx(30 * MB)


def test_the_stream_is_kept_unless_per_line_frames_are_clearly_faster() -> None:
    """Within LINES_MARGIN the stream stays (half the bytes); beyond it, per-line frames."""
    near = fetch(paced(), {True: 30 * MB, False: 30 * MB * (1 + LINES_MARGIN / 2)}, 256)
    assert near.count(True) > 0.75 * len(near)
    far = fetch(paced(), {True: 30 * MB, False: 30 * MB * (1 + 2 * LINES_MARGIN)}, 256)
    assert far.count(False) > 0.75 * len(far)


def test_per_line_frames_are_not_tried_again_while_the_stream_leads_by_the_margin() -> None:
    """Per-line frames measured once at 30 MB/s against a stream at 50 (a 100 Mbit/s link:
    their bytes take it 1.7 times as long) are not tried again: each try was a window at 1.7 times
    the stream's wire bytes.  A stream that leads by less than LINES_MARGIN is still
    checked against them every REPROBE windows."""
    pace = paced()
    window = pace.window_bytes() // MB
    offers = fetch(pace, {True: 50 * MB, False: 30 * MB}, 256)
    assert offers.count(False) == window and switches(offers) == [window + 1, 2 * window + 1]
    close = fetch(paced(), {True: 33 * MB, False: 30 * MB}, 256)
    assert close.count(False) >= 2 * window


def test_a_format_that_got_faster_is_taken_again() -> None:
    """What limits a fetch changes (another process's load ends): the format not taken is
    tried again and taken once it delivers more.  Priced once at the start, a fetch stayed
    on the format it settled on (9.6 to 12.0 s for the same 256 MB)."""
    pace = paced()
    first = fetch(pace, {True: 20 * MB, False: 30 * MB}, 100)
    assert first[-1] is False
    rest = fetch(pace, {True: 60 * MB, False: 30 * MB}, 156)
    assert True in rest and all(rest[rest.index(True):])


def test_a_holder_dropped_or_joining_makes_both_formats_measured_anew() -> None:
    """Two holders' per-line frames were faster than the stream; once one is dropped, what
    was measured with both no longer holds: the other format is tried again at once (a cut
    holder's rate had kept the fetch on per-line frames from the one left)."""
    dropped: set[str] = set()
    pace = paced()
    pace.live = lambda holder: holder not in dropped
    pace.link("b", False)
    fetch(pace, {True: 30 * MB, False: 50 * MB}, 80)
    assert not pace.streaming and pace.delivered[True].rate is not None
    dropped.add("b")
    offers = fetch(pace, {True: 30 * MB, False: 25 * MB}, 60)
    assert pace.holders == {"a"}
    assert offers[0] is False and switches(offers)[0] <= pace.window_bytes() // MB + 1
    assert offers[-1] is True


def test_no_sample_while_answers_to_the_other_offer_come() -> None:
    """Until every request made with the other offer ended, the bytes decoded are no
    format's sample (they came in both)."""
    pace = paced()
    fetch(pace, {True: 30 * MB, False: 50 * MB}, 60)
    assert not pace.streaming
    late = pace.offer("a", LIMITS)  # a request to the per-line offer
    pace.streaming = True  # the stream is being tried again meanwhile
    measured = pace.delivered[True].rate
    for _ in range(40):
        pace.clock.now += MB / (1 * MB)  # type: ignore[attr-defined]
        pace.decoded(True, MB, 0.005)
    assert pace.delivered[True].rate == measured and pace.window is None
    pace.ended(late)


def test_a_window_while_held_lines_were_read_back_is_no_sample() -> None:
    """A resumed fetch reads its held half back (the process's CPU, `not_shared`): a window in
    which that happened measured the reading, not a format (it had made a resumed fetch
    withhold the stream: 0.30 wire bytes per raw byte against 0.22)."""
    held = [0.0]
    pace = paced()
    pace.not_shared = lambda: held[0]
    window = pace.window_bytes() // MB
    fetch(pace, {True: 30 * MB, False: 30 * MB}, window + 2)  # the warm-up, into the next window
    held[0] = 1.0
    pace.clock.now += 10.0  # type: ignore[attr-defined]  # the reading took 10 s
    fetch(pace, {True: 30 * MB, False: 30 * MB}, window)
    assert pace.delivered[False].rate is None  # not 1.6 MB/s
    fetch(pace, {True: 30 * MB, False: 30 * MB}, window + 1)
    assert pace.delivered[False].rate == pytest.approx(30 * MB)


@pytest.mark.parametrize("mb", range(20, 300, 7))
def test_no_try_in_the_last_windows_and_the_faster_format_taken_back_at_once(mb: int) -> None:
    """Wherever the tries fall in a fetch of any size, per-line frames that the stream beats
    never run on past their one window (a resumed fetch had tried them again 15 MB before
    its end and then kept them to the end: "too little left" to switch back), and none is
    tried within the last PROBE_ROOM windows."""
    pace = paced(mb * MB)
    window = pace.window_bytes() // MB
    offers = fetch(pace, {True: 50 * MB, False: 30 * MB}, mb)
    runs = [len(list(run)) for offered, run in itertools.groupby(offers) if not offered]
    assert all(n <= window + 1 for n in runs), (runs, window)
    tries = [i for i in switches(offers) if not offers[i]]
    assert all(mb - i >= PROBE_ROOM * window - 1 for i in tries), (tries, window)


def test_a_rerun_does_not_try_per_line_frames_where_the_stopped_run_found_the_stream_ahead() -> None:
    """A fetch killed at about half (kill -9) kept what it measured: per-line frames at 30 MB/s
    against a stream at 50.  Run again, the fetch does not try them again (a window at 1.7
    times the stream's bytes: 0.02 of a whole fetch's, on a rerun of half of it); without the
    kept measures it does."""
    kept: list[Measures] = []
    first = paced()
    first.keep = kept.append
    rates = {True: 50 * MB, False: 30 * MB}
    fetch(first, rates, 128)
    assert kept and kept[-1].holders == {"a"}
    assert kept[-1].stream == pytest.approx(50 * MB) and kept[-1].lines == pytest.approx(30 * MB)
    hint = Measures.decode(kept[-1].encode())
    assert fetch(FetchPace(128 * MB, clock=Clock(), hint=hint), rates, 128) == [True] * 128
    assert False in fetch(paced(128 * MB), rates, 128)


def test_a_rerun_takes_per_line_frames_at_once_where_the_stopped_run_found_them_ahead() -> None:
    """The kept measures say per-line frames delivered clearly more: the rerun takes them after
    its warm-up, without a window of the stream first; the kept measures are its until it
    measures each format itself, and what it measures is kept in turn."""
    kept: list[Measures] = []
    hint = Measures(frozenset({"a"}), 30 * MB, 50 * MB, {})
    rerun = FetchPace(128 * MB, clock=Clock(), hint=hint, keep=kept.append)
    window = rerun.window_bytes() // MB
    offers = fetch(rerun, {True: 30 * MB, False: 50 * MB}, 128)
    assert offers[: window + 1] == [True] * (window + 1)
    assert offers[window + 1 : 3 * window + 1] == [False] * 2 * window  # no stream window first
    assert kept[0].lines == pytest.approx(50 * MB)


def test_measures_of_other_holders_are_not_taken() -> None:
    """A rerun from another holder (or the same one at another address) measures both formats
    anew; the kept link rate of a holder is what it reports to it until its reads measure one."""
    hint = Measures(frozenset({"b"}), 50 * MB, 30 * MB, {"b": 12_500_000})
    rerun = FetchPace(128 * MB, clock=Clock(), hint=hint)
    window = rerun.window_bytes() // MB
    offers = fetch(rerun, {True: 50 * MB, False: 30 * MB}, 128)
    assert offers[window + 1 : 2 * window + 1] == [False] * window  # tried after the warm-up
    assert rerun.offer("b", LIMITS)[wire.LINK_RATE_HEADER] == "12500000"
    assert wire.LINK_RATE_HEADER not in rerun.offer("a", LIMITS)
    rerun.link("b", False).rate = 9_000_000
    assert rerun.offer("b", LIMITS)[wire.LINK_RATE_HEADER] == "9000000"


def test_a_fetch_with_more_holders_than_kept_keeps_no_measures() -> None:
    kept: list[Measures] = []
    many = paced()
    many.keep = kept.append
    for h in range(KEPT_HOLDERS):
        many.link(f"h{h}", False)
    fetch(many, {True: 50 * MB, False: 30 * MB}, 64)
    assert len(many.holders) == KEPT_HOLDERS + 1 and not kept


GOOD = {"holders": ["a"], "stream": 5e7, "lines": 3e7, "links": {"a": 1.25e7}}


@pytest.mark.parametrize("data", [
    b"", b"{", b"\xff\xfe", b"[]", b"[" * 10_000 + b"]" * 10_000, json.dumps({**GOOD, "x": 1}).encode(),
    json.dumps({**GOOD, "holders": []}).encode(), json.dumps({**GOOD, "holders": "a"}).encode(),
    json.dumps({**GOOD, "holders": [1]}).encode(),
    json.dumps({**GOOD, "holders": [f"h{i}" for i in range(KEPT_HOLDERS + 1)]}).encode(),
    json.dumps({**GOOD, "stream": -1}).encode(), json.dumps({**GOOD, "lines": True}).encode(),
    json.dumps({**GOOD, "lines": "3e7"}).encode(), json.dumps({**GOOD, "stream": float("nan")}).encode(),
    json.dumps({**GOOD, "stream": float("inf")}).encode(), json.dumps({**GOOD, "links": {"b": 1.0}}).encode(),
    json.dumps({**GOOD, "links": []}).encode(), json.dumps({**GOOD, "links": {"a": 0}}).encode(),
    json.dumps({**GOOD, "holders": ["a" * KEPT_BYTES]}).encode(),
])
def test_kept_measures_are_not_trusted(data: bytes, tmp_path: Path) -> None:
    """Kept measures are a file in the node's home, read back by a later run: anything but
    what `encode` writes is refused, and a fetch removes the file and measures anew."""
    assert Measures.decode(json.dumps(GOOD).encode()) == Measures(frozenset({"a"}), 5e7, 3e7, {"a": 1.25e7})
    with pytest.raises(ValueError):
        Measures.decode(data)
    kept = KeptManifests(tmp_path)
    kept.pace_path("c" * 64).write_bytes(data)
    assert kept.load_pace("c" * 64) is None and not kept.pace_path("c" * 64).exists()


async def test_a_fetch_run_again_starts_from_what_the_stopped_run_measured(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real fetch, stopped once it kept its measures beside its line manifest (windows made
    small enough for the 3 MB session), then run again: the rerun reports the kept link rate
    from its first request and, the kept rates putting the stream far ahead, never offers
    per-line frames (it had tried them after its warm-up); the verified version removes the
    kept files."""
    monkeypatch.setattr(pace, "MIN_WINDOW", 64 << 10)
    kept = KeptManifests(world.lib.paths.fetching)
    saved = asyncio.Event()
    save = KeptManifests.save_pace

    def saving(self: KeptManifests, src: str, measures: Measures) -> None:
        save(self, src, measures)
        saved.set()

    monkeypatch.setattr(KeptManifests, "save_pace", saving)
    addr = await world.serve(0)
    first = asyncio.ensure_future(world.fetch([addr]))
    await asyncio.wait_for(saved.wait(), 30)
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    src = blake3.blake3(world.data).hexdigest()
    measured = kept.load_pace(src)
    assert measured is not None and measured.holders == {str(addr)}
    kept.save_pace(src, Measures(measured.holders, 100 * MB, 1.0, {str(addr): 12_500_000}))

    offers: list[dict[str, str]] = []

    class Watched(FetchPace):
        def offer(self, holder: object, limits: wire.Limits) -> dict[str, str]:
            offers.append(super().offer(holder, limits))
            return offers[-1]

    monkeypatch.setattr(batches, "FetchPace", Watched)
    result = await world.fetch([addr])
    assert placed(world, result) == world.data and 0 < result.lines_fetched < len(world.lines())
    assert offers[0][wire.LINK_RATE_HEADER] == "12500000"
    assert all(wire.BATCH_FORMAT_HEADER in o for o in offers)
    assert not kept.path(src).exists() and not kept.pace_path(src).exists()


def test_a_small_fetch_keeps_the_stream() -> None:
    """A fetch of fewer than four windows (a +1 % append, a fork's new lines) has no room to
    try the per-line frames: the stream throughout."""
    pace = paced(12 * MB)
    assert pace.window_bytes() == MIN_WINDOW
    assert fetch(pace, {True: 1 * MB, False: 100 * MB}, 12) == [True] * 12


def test_a_cpu_bound_server_keeps_per_line_frames() -> None:
    """A slow link reported by the fetcher is a stream, unless the server's own CPU to make
    it (measured per level on its worker threads) would take more than COMPRESS_SHARE of a
    core at the link's pace: then a cheaper level, or per-line frames."""
    pace, limits, big = LinkPace(), wire.Limits(stream_link_rate=20_000_000), 1 << 30
    assert pace.choose(limits, big, 100_000).level == 6
    assert pace.choose(limits, big, 12_500_000).level == 6
    assert pace.choose(limits, big, 50_000_000).level is None  # the link keeps up
    assert LinkPace().choose(limits, None, None).level == 3  # nothing measured yet (an older fetcher)
    pace.sent(None, 100 * MB, 10.0)  # per-line frames' CPU is not the stream's
    assert pace.choose(limits, big, 12_500_000).level == 6
    for _ in range(10):  # a slow server: 20 ms per raw MB at level 6
        pace.sent(6, 10 * MB, 0.2)
    assert pace.choose(limits, big, 12_500_000).level == 3
    for _ in range(10):  # and 15 ms at level 3: 0.64 of a core, over COMPRESS_SHARE but not near a core
        pace.sent(3, 10 * MB, 0.15)
    assert pace.choose(limits, big, 12_500_000).level == 3
    for _ in range(10):  # 25 ms at level 3: 1.07 of a core at 12.5 MB/s of its output
        pace.sent(3, 10 * MB, 0.25)
    choice = pace.choose(limits, big, 12_500_000)
    assert choice.level is None and "CPU-bound" in choice.reason
    assert pace.choose(limits, big, 1_000_000).level == 6  # a slow enough link: affordable again
    assert pace.choose(limits, 1 << 20, 12_500_000).level == 3  # a small transfer still streams
    pace.sent(6, MIN_COST_BYTES - 1, 100.0)  # too few bytes to be a sample
    assert pace.cpu[6] < 1e-6


def test_the_level_is_the_highest_the_server_affords_at_the_links_pace() -> None:
    """Level 6 while compressing for the link takes at most COMPRESS_SHARE of a core (a
    100 Mbit/s link: about 0.43), level 3 on a faster link still under stream_link_rate."""
    limits, big = wire.Limits(), 1 << 30
    assert LinkPace().choose(limits, big, 12_500_000).level == 6
    assert LinkPace().choose(limits, big, 19_000_000).level == 3
    assert stream_level(1_000) == 6 and stream_level(10**9) is None  # no level keeps up with 1 GB/s


def test_bad_pace_headers_are_ignored() -> None:
    for text in (None, "", "abc", "-5", "1e9", "12.5", "٣", "9" * 16, " 5"):
        assert wire.parse_count_header(text) is None, text
    assert wire.parse_count_header("12500000") == 12_500_000
    pace, limits = LinkPace(), wire.Limits()
    assert pace.choose(limits, None, 0).level == 3  # a zero rate says nothing: not measured
