"""The adaptive batch format (peer/pace.py): a real PeerServer behind a real loopback relay
that paces it, asked for batches the way the fetcher asks (FetchPace's offer and link
meter).  The format is read from the response header, never from timing assertions: the
slow link (100 KB/s per connection) and loopback are far either side of the threshold the
server is given (`THRESHOLD`)."""
from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import blake3
import pytest
import test_holders
from test_holders import World

from p2pnode.peer import wire
from p2pnode.peer.pace import BACKLOG_RUNS, READ_WAIT_SHARE, FetchPace, LinkPace, stream_level
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
                  fetch_bytes: int = 1 << 30, lines: int = 60) -> list[str | None]:
    """Serve the session from `holder` (behind a relay at `rate` if given), ask for its first
    `lines` lines in batches of 12 one after the other, as the fetcher does (declaring a fetch
    of `fetch_bytes`), and return each answer's format header; each answer is verified."""
    addr = await w.serve(holder, rate=rate, limits=limits)
    tls = client_context(w.me, w.trust, w.holders[holder].identity.fingerprint)
    hashes = list(dict.fromkeys(blake3.blake3(ln).digest() for ln in w.lines()))
    pace, seen = FetchPace(fetch_bytes), []
    link = pace.link(addr)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls)) as s:
        for i in range(0, min(len(hashes), lines), 12):
            group = hashes[i : i + 12]
            async with s.post(f"https://127.0.0.1:{addr.port}{wire.PATH_BATCH}", data=b"".join(group),
                              headers=pace.offer(addr, wire.Limits())) as r:
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
            stream = wire.BatchStreamDecoder()
            assert [blake3.blake3(wire.decode_blob(b, stream)).digest() for b in blobs] == group
    return seen


async def test_a_slow_link_gets_stream_batches_and_a_fast_one_per_line_frames(world: World) -> None:
    """A big fetch: the first answer is a stream (nothing is known of the link yet: the first
    few MB cost little either way); once the fetcher reports what its reads saw, the paced
    link keeps the stream and loopback gets the stored frames (once its reads waited long
    enough to measure it)."""
    limits = wire.Limits(stream_link_rate=THRESHOLD)
    slow = await formats(world, 0, 100_000, limits, lines=36)
    fast = await formats(world, 1, None, limits, lines=1000)
    assert slow == [wire.BATCH_FORMAT_STREAM] * len(slow)
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


def test_a_cpu_bound_fetcher_does_not_offer_the_stream() -> None:
    pace = FetchPace(5 << 20)
    assert pace.offer("a", wire.Limits()) == {wire.BATCH_FORMAT_HEADER: wire.BATCH_FORMAT_STREAM,
                                              wire.FETCH_BYTES_HEADER: str(5 << 20)}
    assert pace.offer("a", wire.Limits(stream_batches=False)) == {}
    pace.backlog = BACKLOG_RUNS + 1
    assert pace.offer("a", wire.Limits()) == {}
    pace.backlog = 0
    pace.link("a").share = READ_WAIT_SHARE / 2  # its reads found the data there: busy elsewhere
    assert pace.offer("a", wire.Limits()) == {}
    assert wire.BATCH_FORMAT_HEADER in pace.offer("b", wire.Limits())  # another holder: not measured yet


def test_a_cpu_bound_server_keeps_per_line_frames() -> None:
    """A slow link reported by the fetcher is a stream, unless the server's responses wait
    mostly on its own reading and encoding of lines (then the fetcher's slow reads are the
    server's doing)."""
    pace, limits, big = LinkPace(), wire.Limits(stream_link_rate=4_000_000), 1 << 30
    assert pace.choose(limits, big, 100_000).level == 6
    assert pace.choose(limits, big, 2_000_000).level == 6
    assert pace.choose(limits, big, 50_000_000).level is None
    assert LinkPace().choose(limits, None, None).level == 3  # nothing measured yet (an older fetcher)
    for _ in range(10):
        pace.sent(100_000, making=1.0)  # a second to make what the link carries in one
    assert pace.choose(limits, big, 100_000).level is None
    assert pace.choose(limits, 1 << 20, 100_000).level == 3  # a small transfer still streams


def test_the_level_is_the_highest_the_server_affords_at_the_links_pace() -> None:
    """Level 6 while compressing for the link takes at most COMPRESS_SHARE of a core (a
    100 Mbit/s link: about 0.35), level 3 on a faster link still under stream_link_rate."""
    limits, big = wire.Limits(), 1 << 30
    assert LinkPace().choose(limits, big, 12_500_000).level == 6
    assert LinkPace().choose(limits, big, 19_000_000).level == 3
    assert stream_level(1_000) == 6 and stream_level(10**9) == wire.STREAM_LEVEL


def test_bad_pace_headers_are_ignored() -> None:
    for text in (None, "", "abc", "-5", "1e9", "12.5", "٣", "9" * 16, " 5"):
        assert wire.parse_count_header(text) is None, text
    assert wire.parse_count_header("12500000") == 12_500_000
    pace, limits = LinkPace(), wire.Limits()
    assert pace.choose(limits, None, 0).level == 3  # a zero rate says nothing: not measured
