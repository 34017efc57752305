"""Which batch format a response takes (docs/PROTOCOL.md, "Adaptive batch format"): decided per
response, as `zstd --adapt` decides its level, by the server, from what both sides measure.

Stored per-line frames cost neither side's CPU anything (the store's bytes go out as they
are); a zstd stream costs the server a decode and a compression of every line and the
fetcher a compression for its store (about 0.01 CPU-s per MB in all) and saves a quarter of
the bytes.  So the stream is used where the bytes cost more than that CPU:

- a small transfer (at most `Limits.stream_small_bytes` of raw lines in all, as the fetcher
  declares in FETCH_BYTES_HEADER, e.g. a +1 % append): its CPU cost is negligible;
- a link slower than `Limits.stream_link_rate` bytes per second, by the slower of two
  measures of it: the server's (bytes written over the time its writes waited on the socket:
  the write buffer above its high-water mark) and the fetcher's (bytes received over the time
  its reads waited, sent in LINK_RATE_HEADER).  The server's alone is blind to a response
  that fits in the socket buffers (behind a 300 KB/s loopback relay, 500 KB responses never
  waited: the kernel took them at once); the fetcher's alone would read a
  server that is itself slow as a slow link, so the server keeps the cheap frames while it is
  CPU-bound (BUSY_SHARE).  The level is the highest the server can afford at the link's
  pace (LEVELS, COMPRESS_SHARE);
- the first answers of a fetch, before anything is measured (a few MB: cheap either way).

A fetcher whose own CPU limits it (its socket fills too) does not offer the stream at all
(peer/batches.py), so a slow reader is not mistaken for a slow link.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from p2pnode.peer import wire

RATE_WEIGHT = 0.3
"""Weight of the newest sample in the moving averages."""
MIN_SAMPLE = 0.02
MIN_SAMPLE_BYTES = 1 << 20
"""A link's rate is measured once its transfers waited MIN_SAMPLE seconds on the socket in all
(a few ms of waits measure nothing), or moved MIN_SAMPLE_BYTES with less waiting than that:
then it is at least MIN_SAMPLE_BYTES / MIN_SAMPLE (52 MB/s; the data was there before it was
asked for)."""
BACKLOG_RUNS = 4
"""A fetcher with more received runs of lines than this waiting to be decoded and verified is
CPU-bound: it does not offer the stream (which would cost it a decode and a compression more
per line) until it catches up."""
READ_WAIT_SHARE = 0.5
"""A fetcher whose reads from a holder waited on the socket for less than this share of the
time (a moving average) is busy with its CPU, not waiting on the link: it does not offer the
stream (the bytes it would save are not what holds it back)."""
BUSY_SHARE = 0.8
"""A server that takes more than this share of the link's time for a response's bytes to read
and encode its lines is CPU-bound, or nearly: per-line frames, whatever the link (the stream
would only slow it further).  When the server is what the fetcher waits on, the fetcher's
measured rate is the server's own pace and the share comes out near 1; a link-bound server
with CPU to spare stays well under it."""
LEVELS = ((6, 0.271, 0.0077), (wire.STREAM_LEVEL, 0.292, 0.0034))
"""(zstd level, wire bytes per raw byte, compression CPU-s per raw MB), flushed per line, as
measured on Pi-shaped sessions (docs/BENCHMARKS.md, "Several holders and stream batches"),
highest level first."""
COMPRESS_SHARE = 0.5
"""A stream takes the highest level whose compression, at the pace the link takes its
output, needs at most this share of one of the server's cores (a 100 Mbit/s link: level 6,
0.35 of a core; 20 MB/s: level 3, 0.23)."""


def stream_level(rate: float) -> int:
    """The zstd level for a link that carries `rate` bytes per second."""
    for level, ratio, cpu_per_mb in LEVELS:
        if rate / ratio / 1e6 * cpu_per_mb <= COMPRESS_SHARE:
            return level
    return LEVELS[-1][0]


@dataclass
class Choice:
    """A response's format: per-line frames (level None) or a zstd stream at `level`."""

    level: int | None
    reason: str


class WaitMeter:
    """Bytes moved over the time at least one of several concurrent transfers waited on its
    socket (union of the waits): a link's rate, all its connections together, that a CPU
    which is itself the bottleneck (no waits) does not lower."""

    def __init__(self) -> None:
        self.rate: float | None = None
        """Moving average of bytes per second of waiting."""
        self.share: float | None = None
        """Moving average of the share of the time the transfers waited on the socket (near 1:
        the link is what they wait for; low: the data was there, the CPU is what limits)."""
        self._waiters = 0
        self._since = 0.0
        self._bytes = 0
        self._waited = 0.0
        self._start: float | None = None

    def waiting(self) -> None:
        """A wait on the socket starts (end it with `moved`)."""
        if not self._waiters:
            self._since = time.monotonic()
        if self._start is None:
            self._start = self._since
        self._waiters += 1

    def moved(self, nbytes: int) -> None:
        self._waiters -= 1
        if not self._waiters:
            self._waited += time.monotonic() - self._since
        self._bytes += nbytes

    def fold(self) -> None:
        """A transfer ended: the bytes and waits since the last fold go into the moving rate
        (once there are enough of them, MIN_SAMPLE_BYTES)."""
        if self._waiters:  # another transfer is mid-wait: its wait so far counts
            now = time.monotonic()
            self._waited += now - self._since
            self._since = now
        if self._waited < MIN_SAMPLE and self._bytes < MIN_SAMPLE_BYTES:
            return
        rate = self._bytes / max(self._waited, MIN_SAMPLE)  # at least: the waits were that short
        self.rate = rate if self.rate is None else (1 - RATE_WEIGHT) * self.rate + RATE_WEIGHT * rate
        elapsed = time.monotonic() - (self._start if self._start is not None else 0.0)
        share = min(1.0, self._waited / elapsed) if elapsed > 0 else 1.0
        self.share = share if self.share is None else (1 - RATE_WEIGHT) * self.share + RATE_WEIGHT * share
        self._bytes, self._waited, self._start = 0, 0.0, None


class LinkPace:
    """The server's view of one peer: what it sent in the current transfer, how its writes
    waited on the socket (`link`), the rate the fetcher last said it receives at, and `busy`:
    how long the server took to read and encode its lines over how long the link takes to
    carry them (over 1: the server's CPU, not the link, is what the fetcher waits for)."""

    def __init__(self) -> None:
        self.link = WaitMeter()
        self.reported: float | None = None
        self.busy = 0.0

    def rate(self) -> float | None:
        """The link's rate: the slower of the server's and the fetcher's measures of it."""
        rates = [r for r in (self.link.rate, self.reported) if r is not None and r > 0]
        return min(rates) if rates else None

    def choose(self, limits: wire.Limits, fetch_bytes: int | None, reported: float | None) -> Choice:
        """The format of the next response to this peer: the fetcher offered the stream, said
        how many raw bytes it fetches in all (`fetch_bytes`) and what rate it receives at
        (`reported`), where it knows."""
        self.reported = reported if reported is not None else self.reported
        if fetch_bytes is not None and fetch_bytes <= limits.stream_small_bytes:
            return Choice(wire.STREAM_LEVEL, "small transfer")
        if self.busy > BUSY_SHARE:
            return Choice(None, f"server CPU-bound (lines made at {self.busy:.1f}x the link's time)")
        rate = self.rate()
        if rate is None:  # the first answers of a fetch, a few MB: cheap either way
            return Choice(wire.STREAM_LEVEL, "link not measured yet")
        if rate < limits.stream_link_rate:
            return Choice(stream_level(rate), f"link at {rate / 1e6:.2f} MB/s")
        return Choice(None, "link keeps up")

    def sent(self, nbytes: int, making: float) -> None:
        """A response ended: `nbytes` written, `making` seconds of it spent waiting for its
        own lines to be read and encoded."""
        self.link.fold()
        rate = self.rate()
        if rate is not None and nbytes > 0:
            share = making * rate / nbytes
            self.busy = (1 - RATE_WEIGHT) * self.busy + RATE_WEIGHT * share


class FetchPace:
    """The fetcher's side, for one fetch: each holder's link as its reads saw it, and its own
    backlog of received lines not yet verified (its CPU)."""

    def __init__(self, fetch_bytes: int) -> None:
        self.fetch_bytes = fetch_bytes
        """Raw bytes of the lines this fetch asks for, from all holders."""
        self.links: dict[object, WaitMeter] = {}
        self.backlog = 0

    def track(self, run: asyncio.Future[None]) -> None:
        """A received run of lines waits to be decoded and verified until `run` is done."""
        self.backlog += 1
        run.add_done_callback(self._ran)

    def _ran(self, _run: asyncio.Future[None]) -> None:
        self.backlog -= 1

    def link(self, holder: object) -> WaitMeter:
        return self.links.setdefault(holder, WaitMeter())

    def offer(self, holder: object, limits: wire.Limits) -> dict[str, str]:
        """The headers of a batch request to `holder`: the stream offered (with the size of the
        fetch and the rate this fetcher receives at, once measured) unless the stream is off
        or the fetcher's CPU is what limits it: runs wait to be verified, or its reads from
        this holder found the data there for most of the time (READ_WAIT_SHARE)."""
        meter = self.link(holder)
        if not limits.stream_batches or self.backlog > BACKLOG_RUNS:
            return {}
        if meter.share is not None and meter.share < READ_WAIT_SHARE:
            return {}
        headers = {wire.BATCH_FORMAT_HEADER: wire.BATCH_FORMAT_STREAM,
                   wire.FETCH_BYTES_HEADER: str(self.fetch_bytes)}
        rate = meter.rate
        if rate is not None:
            headers[wire.LINK_RATE_HEADER] = str(max(1, int(rate)))
        return headers
