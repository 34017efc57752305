"""Which batch format a response takes (docs/PROTOCOL.md, "Adaptive batch format"): decided per
response, as `zstd --adapt` decides its level, from what both sides measure.

Stored per-line frames cost neither side's CPU anything (the store's bytes go out as they
are); a zstd stream costs the server a decode and a compression of every line and the
fetcher a compression for its store, and takes a third of the bytes off the wire.  Which one
is faster is a question of what limits the transfer, so each side prices both:

- the fetcher (FetchPace) offers the stream while its time per raw MB in that format,
  max(its CPU per raw MB, wire bytes per raw MB / the links' rate), is below the per-line
  frames' (with a margin against flapping, HYSTERESIS).  Its CPU per raw MB in each format
  is measured (the decoding threads' CPU exactly, the rest of the process shared by both),
  as are the wire bytes per raw MB and the rate its reads see while they wait on the socket
  (a CPU-bound fetcher waits little, so its links look fast and its CPU decides);
- the server (LinkPace) answers an offer with a stream when the fetch is small (its CPU
  cost is negligible: at most `Limits.stream_small_bytes` of raw lines in all, as the
  fetcher declares in FETCH_BYTES_HEADER) or when the link is slower than
  `Limits.stream_link_rate` and one of LEVELS fits its CPU: the highest level whose measured
  CPU per raw MB, at the raw pace the link carries that level's output, needs at most
  COMPRESS_SHARE of one core (none: level 3 up to CONTINUE_SHARE).  The link's rate is the
  slower of the server's measure (bytes written over the time its writes waited on the
  socket) and the fetcher's (its reads', sent in LINK_RATE_HEADER): the server's alone is
  blind to answers that fit in the socket buffers.  A server slow to make the stream slows
  the fetcher's reads to its own pace, and its measured CPU per MB at that pace comes out
  near a whole core: per-line frames;
- the first answers of a fetch, before anything is measured (a few MB: cheap either way):
  stream at wire.STREAM_LEVEL.
On a slow link a stream goes on across the answers of the fetcher's lane (one zstd frame per
lane, 8 MiB window: peer/batches.py's Lanes, PeerServer's lanes).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from p2pnode.peer import wire

log = logging.getLogger(__name__)

RATE_WEIGHT = 0.3
"""Weight of the newest sample in the moving averages."""
MIN_SAMPLE = 0.02
MIN_SAMPLE_BYTES = 1 << 20
"""A link's rate is measured once its transfers waited MIN_SAMPLE seconds on the socket in all
(a few ms of waits measure nothing), or moved MIN_SAMPLE_BYTES with less waiting than that:
then it is at least MIN_SAMPLE_BYTES / MIN_SAMPLE (52 MB/s; the data was there before it was
asked for)."""
MIN_COST_BYTES = 256 << 10
"""Raw bytes a response (or a run of decoded lines) needs before its CPU per byte is a sample:
a few lines' worth of thread time is mostly clock granularity."""
LEVELS = ((6, 0.271, 0.0092), (wire.STREAM_LEVEL, 0.292, 0.0047))
"""(zstd level, wire bytes per raw byte, the server's CPU-s per raw MB to decode a stored
line and compress it into the stream, flushed per line): the priors, as measured on Pi-shaped
sessions (docs/BENCHMARKS.md, "Several holders and stream batches" and wire5's section),
highest level first.  The CPU is then measured per level and peer (LinkPace.cpu)."""
COMPRESS_SHARE = 0.5
"""A stream takes the highest level whose compression, at the pace the link takes its
output, needs at most this share of one of the server's cores (a 100 Mbit/s link: level 6,
about 0.43 of a core; 20 MB/s: level 3, 0.32); none fits: per-line frames."""
CONTINUE_SHARE = 0.8
"""A lane's stream (wire.STREAM_LANE_HEADER) goes on at its level while that level needs at
most this share of a core at the link's pace, even where a new stream would take another
level: a new frame loses the history that makes the stream small (a level 3 frame with
8 MiB of history beats a level 6 one without), and the rates measured from answer to
answer would otherwise flip the level back and forth.  Where no level fits COMPRESS_SHARE,
level 3 is still taken up to this share: only a server that nears a whole core for the
stream is what the link waits on (per-line frames then)."""
HYSTERESIS = 0.1
"""The fetcher switches format only when the other one is priced at least this share below
the current one: near the break-even point, measurement noise does not flip every answer."""
LINES_WIRE, STREAM_WIRE = 0.43, 0.29
"""The fetcher's priors for wire bytes per raw byte, until an answer in that format is
measured: per-line zstd-1 frames (issue 12: 0.426) and a stream at level 3."""
LINES_DECODE, STREAM_DECODE = 0.0014, 0.0038
"""The fetcher's priors for its decoding threads' CPU-s per raw MB: a per-line frame's
decompression and hash; a stream segment's, plus the compression of the line for its store
(docs/BENCHMARKS.md, wire5's section)."""


def stream_level(rate: float, cpu: dict[int, float] | None = None) -> int | None:
    """The zstd level for a link that carries `rate` bytes per second: the highest of LEVELS
    whose CPU per raw byte (`cpu`, measured, else the prior) at that pace needs at most
    COMPRESS_SHARE of a core; None if none does (the server's CPU cannot keep up)."""
    for level, ratio, prior in LEVELS:
        per_byte = (cpu or {}).get(level, prior / 1e6)
        if rate / ratio * per_byte <= COMPRESS_SHARE:
            return level
    return None


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - RATE_WEIGHT) * old + RATE_WEIGHT * new


@dataclass
class Choice:
    """A response's format: per-line frames (level None) or a zstd stream at `level`."""

    level: int | None
    reason: str
    continues: bool = False
    """The stream may go on across the answers of the fetcher's lane (a slow link, where
    the bytes are what counts and the encoder's memory is worth it)."""


class WaitMeter:
    """Bytes moved over the time at least one of several concurrent transfers waited on its
    socket (union of the waits): a link's rate, all its connections together, that a CPU
    which is itself the bottleneck (no waits) does not lower."""

    def __init__(self) -> None:
        self.rate: float | None = None
        """Moving average of bytes per second of waiting."""
        self._waiters = 0
        self._since = 0.0
        self._bytes = 0
        self._waited = 0.0

    def waiting(self) -> None:
        """A wait on the socket starts (end it with `moved`)."""
        if not self._waiters:
            self._since = time.monotonic()
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
        self.rate = _average(self.rate, self._bytes / max(self._waited, MIN_SAMPLE))  # at least that
        self._bytes, self._waited = 0, 0.0


class LinkPace:
    """The server's view of one peer: how its writes waited on the socket (`link`), the rate
    the fetcher last said it receives at, and the server's own CPU per raw byte to make a
    stream at each level for it (`cpu`, from the worker threads' CPU clocks)."""

    def __init__(self) -> None:
        self.link = WaitMeter()
        self.reported: float | None = None
        self.cpu: dict[int, float] = {}

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
        rate = self.rate()
        if rate is None:  # the first answers of a fetch, a few MB: cheap either way
            return Choice(wire.STREAM_LEVEL, "link not measured yet")
        if rate >= limits.stream_link_rate:
            return Choice(None, "link keeps up")
        level = stream_level(rate, self.cpu)
        if level is None and self.keeps(wire.STREAM_LEVEL):  # over its share, still far from a core
            level = wire.STREAM_LEVEL
        if level is None:
            level, ratio, prior = LEVELS[-1]
            need = rate / ratio * self.cpu.get(level, prior / 1e6)
            return Choice(None, f"server CPU-bound (a stream at {rate / 1e6:.2f} MB/s needs "
                                f"{need:.2f} of a core)")
        costs = ", ".join(f"level {lv} {c * 1e9:.1f} ms" for lv, c in sorted(self.cpu.items()))
        return Choice(level, f"link at {rate / 1e6:.2f} MB/s; CPU per raw MB: {costs or 'not measured'}",
                      continues=True)

    def keeps(self, level: int) -> bool:
        """Whether a lane's stream at `level` may go on (CONTINUE_SHARE) on this link."""
        rate = self.rate()
        ratio, prior = next((r, c) for lv, r, c in LEVELS if lv == level)  # the levels choose() takes
        return rate is not None and rate / ratio * self.cpu.get(level, prior / 1e6) <= CONTINUE_SHARE

    def sent(self, level: int | None, raw: int, cpu: float) -> None:
        """A response ended: `raw` bytes of lines made into the stream at `level` (None:
        per-line frames) with `cpu` seconds of the worker threads' CPU."""
        self.link.fold()
        if level is not None and raw >= MIN_COST_BYTES:
            self.cpu[level] = _average(self.cpu.get(level), cpu / raw)


@dataclass
class FormatCost:
    """What one batch format has cost the fetcher, per raw byte (moving averages)."""

    wire: float
    """Bytes on the wire (the frames as received)."""
    decode: float
    """CPU seconds of the decoding threads (decompression, hash, and for a stream segment
    the compression of the line for the store)."""
    wire_measured: bool = False
    decode_measured: bool = False
    """Whether `wire` and `decode` are measured yet, or still the priors."""
    prior: float = field(init=False)
    """`decode`'s prior."""

    def __post_init__(self) -> None:
        self.prior = self.decode


@dataclass
class FetchPace:
    """The fetcher's side, for one fetch: each holder's link as its reads saw it, and what
    each format costs its CPU, which together decide whether it offers the stream."""

    fetch_bytes: int
    """Raw bytes of the lines this fetch asks for, from all holders."""
    links: dict[object, WaitMeter] = field(default_factory=dict)
    lines: FormatCost = field(default_factory=lambda: FormatCost(LINES_WIRE, LINES_DECODE / 1e6))
    stream: FormatCost = field(default_factory=lambda: FormatCost(STREAM_WIRE, STREAM_DECODE / 1e6))
    streaming: bool = True
    """The current choice: the stream is offered (until the per-line frames are priced
    HYSTERESIS below it, and back)."""
    raw: int = 0
    """Raw bytes decoded so far, in both formats."""
    decode_cpu: float = 0.0
    """The decoding threads' CPU seconds so far."""
    started: float = field(default_factory=time.process_time)
    not_shared: Callable[[], float] = lambda: 0.0
    """CPU seconds of this process, since it began, spent on work no received byte causes
    (reading held lines back from the store or the parent's file: a resumed fetch's first
    half), which must not be charged per received byte."""
    live: Callable[[object], bool] = lambda holder: True
    """Whether a holder still serves this fetch: a dropped or stalled one's link carries
    nothing more (counted on, a cut holder's rate kept the fetch on per-line frames from the
    one left; downloader.Share.delivering)."""

    def link(self, holder: object) -> WaitMeter:
        return self.links.setdefault(holder, WaitMeter())

    def decoded(self, stream: bool, raw: int, cpu: float) -> None:
        """A run of `raw` bytes of lines that came in one format was decoded and verified
        with `cpu` seconds of its worker thread's CPU."""
        self.raw += raw
        self.decode_cpu += cpu
        if raw >= MIN_COST_BYTES:
            cost = self.stream if stream else self.lines
            cost.decode = _average(cost.decode if cost.decode_measured else None, cpu / raw)
            cost.decode_measured = True

    def answered(self, stream: bool, wire_bytes: int, raw: int) -> None:
        """An answer in one format ended: `wire_bytes` received for `raw` bytes of lines."""
        if raw >= MIN_COST_BYTES:
            cost = self.stream if stream else self.lines
            cost.wire = _average(cost.wire if cost.wire_measured else None, wire_bytes / raw)
            cost.wire_measured = True

    def seconds_per_byte(self, cost: FormatCost) -> float | None:
        """A format's time per raw byte, max(CPU, wire / the links' rate), or None before the
        links' rate and the CPU are measured.  The CPU is the decoding threads' for that format
        plus the rest of the process's (reading, TLS, the store) per raw byte so far, which
        both formats share, less `not_shared`; the rate is the sum of the `live` holders'."""
        rates = [m.rate for h, m in self.links.items() if m.rate is not None and self.live(h)]
        if not rates or self.raw < MIN_COST_BYTES:
            return None
        shared = max(0.0, time.process_time() - self.started - self.decode_cpu - self.not_shared()) / self.raw
        return max(shared + self.decode(cost), cost.wire / sum(rates))

    def decode(self, cost: FormatCost) -> float:
        """A format's decoding CPU per raw byte: measured, else its prior scaled as the other
        format's measure is to that one's prior.  The priors come from one machine; on a CPU
        that decodes the stream at 2.6 times its prior, the per-line frames' unscaled prior
        made them look a third as costly as they are (0.0014 against 0.004 CPU-s per MB)."""
        other = self.lines if cost is self.stream else self.stream
        if cost.decode_measured or not other.decode_measured:
            return cost.decode
        return cost.prior * other.decode / other.prior

    def offer(self, holder: object, limits: wire.Limits) -> dict[str, str]:
        """The headers of a batch request to `holder`: the stream offered (with the size of the
        fetch and the rate this fetcher receives at, once measured) while it is priced below
        the per-line frames (seconds_per_byte, HYSTERESIS), or nothing."""
        if not limits.stream_batches:
            return {}
        stream, lines = self.seconds_per_byte(self.stream), self.seconds_per_byte(self.lines)
        if stream is not None and lines is not None and (
                lines < stream * (1 - HYSTERESIS) if self.streaming else stream < lines * (1 - HYSTERESIS)):
            self.streaming = not self.streaming
            log.debug("batch format offered: %s (per raw MB: stream %.1f ms, per-line %.1f ms; %d MB "
                      "decoded)", "stream" if self.streaming else "per-line frames", stream * 1e9,
                      lines * 1e9, self.raw // 1_000_000)
        if not self.streaming:
            return {}
        headers = {wire.BATCH_FORMAT_HEADER: wire.BATCH_FORMAT_STREAM,
                   wire.FETCH_BYTES_HEADER: str(self.fetch_bytes)}
        rate = self.link(holder).rate
        if rate is not None:
            headers[wire.LINK_RATE_HEADER] = str(max(1, int(rate)))
        return headers
