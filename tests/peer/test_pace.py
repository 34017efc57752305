"""The adaptive batch format (peer/pace.py): a real PeerServer behind a real loopback relay
that paces it, asked for batches the way the fetcher asks (FetchPace's offer and link
meter).  The format is read from the response header, never from timing assertions: the
slow link (100 KB/s per connection) and loopback are far either side of the threshold the
server is given (`THRESHOLD`)."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import blake3
import pytest
import test_holders
from test_holders import World

from p2pnode.peer import wire
from p2pnode.peer.pace import (
    HYSTERESIS,
    LINES_DECODE,
    MIN_COST_BYTES,
    STREAM_DECODE,
    FetchPace,
    LinkPace,
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
    link = pace.link(addr)
    stream = wire.BatchStreamDecoder()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls)) as s:
        for i in range(0, min(len(hashes), lines), 12):
            group = hashes[i : i + 12]
            async with s.post(f"https://127.0.0.1:{addr.port}{wire.PATH_BATCH}", data=b"".join(group),
                              headers={**pace.offer(addr, wire.Limits()), wire.STREAM_LANE_HEADER: "0",
                                       wire.STREAM_CONTINUE_HEADER: str(stream.answers)}) as r:
                seen.append(r.headers.get(wire.BATCH_FORMAT_HEADER))
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


def priced(rate: float, stream: tuple[float, float], lines: tuple[float, float]) -> FetchPace:
    """A fetcher that received 100 MB of raw lines in each format from holder "a", whose link
    carries `rate` bytes per second: (wire bytes per raw byte, decoding CPU-s per raw MB) of
    the stream and of per-line frames."""
    pace = FetchPace(1 << 30)
    pace.link("a").rate = rate
    for streamed, (ratio, cpu) in ((True, stream), (False, lines)):
        pace.decoded(streamed, 100 * MB, cpu * 100)
        pace.answered(streamed, int(ratio * 100 * MB), 100 * MB)
    return pace


def test_the_fetcher_offers_the_stream_while_it_costs_less_time() -> None:
    """Time per raw MB = max(CPU, wire / rate) in each format: at 100 Mbit/s the stream's
    third fewer bytes win over its CPU; over loopback (the link costs nothing) the per-line
    frames' lower CPU wins; nothing measured yet: the stream is offered."""
    offered = {wire.BATCH_FORMAT_HEADER: wire.BATCH_FORMAT_STREAM, wire.FETCH_BYTES_HEADER: str(1 << 30)}
    assert FetchPace(1 << 30).offer("a", wire.Limits()) == offered
    assert FetchPace(1 << 30).offer("a", wire.Limits(stream_batches=False)) == {}
    slow = priced(12_500_000, stream=(0.27, 0.004), lines=(0.42, 0.0015))
    assert slow.offer("a", wire.Limits()) == {**offered, wire.LINK_RATE_HEADER: "12500000"}
    assert slow.offer("b", wire.Limits())[wire.BATCH_FORMAT_HEADER] == wire.BATCH_FORMAT_STREAM
    assert priced(10**9, stream=(0.27, 0.004), lines=(0.42, 0.0015)).offer("a", wire.Limits()) == {}
    # a fetcher whose CPU is what limits it even at 100 Mbit/s: 30 ms per raw MB in either format
    cpu_bound = priced(12_500_000, stream=(0.27, 0.045), lines=(0.42, 0.03))
    assert cpu_bound.offer("a", wire.Limits()) == {}


def test_cpu_no_received_byte_causes_is_not_charged_to_them() -> None:
    """A resumed fetch first reads its held half back (CPU the received lines do not cause).
    Charged per received byte it made the fetcher look CPU-bound at 100 Mbit/s and withhold
    the stream (a rerun after kill -9 took 0.30 wire bytes per raw byte against 0.22); as
    `not_shared`, it is left out."""
    pace = priced(12_500_000, stream=(0.27, 0.02), lines=(0.42, 0.002))
    pace.started = time.process_time() - pace.decode_cpu - 6.0  # 6 CPU-s beyond the decoding
    assert pace.offer("a", wire.Limits()) == {}  # 30 ms a received MB more: looks CPU-bound
    pace.not_shared = lambda: 6.0  # that was reading held lines back
    assert pace.offer("a", wire.Limits())[wire.BATCH_FORMAT_HEADER] == wire.BATCH_FORMAT_STREAM


def test_a_dropped_holders_link_no_longer_counts() -> None:
    """Two links at 100 Mbit/s each carry per-line frames faster than this fetcher's CPU makes
    the stream; once one holder is dropped (cut), the one left is the bottleneck and the stream
    is offered again (counting the dropped link's rate kept a cut fetch on per-line frames:
    0.41 body bytes per raw byte against 0.24)."""
    dropped: set[str] = set()
    pace = priced(12_500_000, stream=(0.27, 0.02), lines=(0.42, 0.004))
    pace.live = lambda holder: holder not in dropped
    pace.link("b").rate = 12_500_000
    assert pace.offer("a", wire.Limits()) == {}
    dropped.add("b")
    assert pace.offer("a", wire.Limits())[wire.BATCH_FORMAT_HEADER] == wire.BATCH_FORMAT_STREAM


def test_a_format_not_measured_yet_is_priced_at_this_machines_speed() -> None:
    """The priors come from one machine: where the stream's decoding measures 2.6 times its
    prior, the per-line frames' prior is taken 2.6 times too, until they are measured."""
    pace = FetchPace(1 << 30)
    assert pace.decode(pace.lines) == LINES_DECODE / 1e6
    pace.decoded(True, 100 * MB, 100 * STREAM_DECODE * 2.6)
    assert pace.decode(pace.lines) == pytest.approx(LINES_DECODE * 2.6 / 1e6)
    pace.decoded(False, 100 * MB, 0.5)
    assert pace.decode(pace.lines) == 0.5 / (100 * MB)


def test_the_fetchers_choice_does_not_flap_near_break_even() -> None:
    """Within HYSTERESIS of each other the current choice stays, either way round; beyond
    it, the cheaper format is taken."""
    rate = 10_000_000
    lines = (0.40, 0.001)  # 40 ms per raw MB on the wire
    near = (0.40 * (1 - HYSTERESIS / 2), 0.001)  # 5 % cheaper
    pace = priced(rate, stream=near, lines=lines)
    assert pace.offer("a", wire.Limits())  # streaming from the start: stays
    pace.streaming = False
    assert pace.offer("a", wire.Limits()) == {}  # per-line frames: stay too
    far = priced(rate, stream=(0.40 * (1 - 2 * HYSTERESIS), 0.001), lines=lines)
    far.streaming = False
    assert far.offer("a", wire.Limits())


def test_the_fetcher_measures_what_it_decodes() -> None:
    """Runs too small to measure CPU (MIN_COST_BYTES) leave the priors; answers in a format
    replace its wire prior with what came."""
    pace = FetchPace(1 << 30)
    prior = pace.stream.decode
    pace.decoded(True, MIN_COST_BYTES - 1, 1.0)
    assert pace.stream.decode == prior and not pace.stream.decode_measured
    pace.answered(True, 30 * MB, 100 * MB)
    pace.decoded(True, 100 * MB, 0.5)
    assert pace.stream.wire == 0.3 and pace.stream.decode == 0.5 / (100 * MB)
    assert not pace.lines.wire_measured and not pace.lines.decode_measured  # per-line: the priors


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
