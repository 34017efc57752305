"""Which batch format a response takes (docs/PROTOCOL.md, "Adaptive batch format"): decided per
response, as `zstd --adapt` decides its level, from what both sides measure.

Stored per-line frames cost neither side's CPU anything (the store's bytes go out as they
are); a zstd stream costs the server a decode and a compression of every line and the
fetcher a compression for its store, and takes a third of the bytes off the wire.  Which one
is faster is a question of what limits the transfer, so each side prices both:

- the fetcher (FetchPace) measures what each offer delivers: the whole fetch's raw bytes
  per second over windows (WINDOW_SHARE of the fetch) in which every request in flight had
  that offer.  It starts with the stream, offers per-line frames after a warm-up window,
  then the stream again, keeps the stream unless per-line frames delivered LINES_MARGIN
  more, and tries the other one again every REPROBE windows and whenever the holders
  delivering change.  A fetch run again after it was stopped (kill -9) starts from what the
  stopped run measured with the same holders (Measures, kept beside its line manifest:
  get.KeptManifests), so it does not try per-line frames again where the stream led.  Only a
  measure of the whole fetch in each format sees what limits it in that format: the
  fetcher's CPU, the holders' CPU to make the stream (on a busy machine a holder made its
  stream at 5 MB/s where the link carried 12.5), the links.  Priced with one rate measured
  in whichever format came, a fetch stayed on the format it settled on (docs/BENCHMARKS.md,
  2026-11-27 (4)).  The link rate it reports to a holder was measured on per-line frames
  where it was (the holder sends those as stored: the link's pace, not the holder's);
- the server (LinkPace) answers an offer with a stream when the fetch is small (its CPU
  cost is negligible: at most `Limits.stream_small_bytes` of raw lines in all, as the
  fetcher declares in FETCH_BYTES_HEADER) or when the link is slower than
  `Limits.stream_link_rate` and one of LEVELS fits its CPU: the highest level whose measured
  CPU per raw MB, at the raw pace the link carries that level's output, needs at most
  COMPRESS_SHARE of one core (none: level 3 up to CONTINUE_SHARE).  The link's rate is the
  slower of the server's measure (bytes written over the time its writes waited on the
  socket) and the fetcher's (its reads', sent in LINK_RATE_HEADER): the server's alone is
  blind to answers that fit in the socket buffers;
- the first answers of a fetch, before anything is measured (a few MB: cheap either way):
  stream at wire.STREAM_LEVEL.
On a slow link a stream goes on across the answers of the fetcher's lane (one zstd frame per
lane, its window named by the fetcher, 8 or 16 MiB: peer/batches.py's Lanes, PeerServer's
lanes).
"""
from __future__ import annotations

import json
import logging
import math
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
LINES_MARGIN = 0.25
"""The fetcher takes per-line frames only where they delivered at least this share more than
the stream: within it the two are a tie (one holder at 100 Mbit/s on a busy machine: windows
of either format from 20 to 46 MB/s of lines), and the stream carries 0.55 of per-line
frames' bytes (issue 12: no more on the wire than rsync).  Two holders' per-line frames
delivered 45-60 MB/s where the stream made 25-35, on a fetcher whose CPU the stream's
decoding takes."""
WINDOW_SHARE, MIN_WINDOW, MAX_WINDOW = 1 / 16, 4 << 20, 32 << 20
"""The fetcher measures a format over windows of this share of the fetch's raw bytes, within
[MIN_WINDOW, MAX_WINDOW]: a window is a few tenths of a second at 100 Mbit/s, long enough
that the answers' pace evens out, short enough that trying the other format costs little."""
REPROBE = 8
"""Windows after which the format not taken is tried again (what limits a fetch can change:
another process's load, the holders' CPU); per-line frames not while the stream delivers
LINES_MARGIN more than they did: to be taken they would need (1 + LINES_MARGIN)² of their
rate, a change of that size comes with a change of holders (both measured anew), and each
try cost a window at 1.7 times the stream's bytes (a 100 Mbit/s link: 5 % more wire bytes)."""
PROBE_ROOM = 3
"""Per-line frames are tried only while this many windows of the fetch are left: one to
measure them, two to go on in them if they are faster.  The stream, the default, is offered
again whenever the rules say so: held back near the end ("too little left"), a late try's
per-line frames ran to the end of a resumed fetch, at 0.48 wire bytes per raw byte where
its stream took 0.2."""


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


KEPT_HOLDERS, KEPT_BYTES = 16, 16 << 10
"""Bounds of kept Measures: a fetch with more holders keeps none (a rerun measures anew),
and a kept file longer than KEPT_BYTES is not read."""


@dataclass(frozen=True)
class Measures:
    """What a fetch measured, kept for a rerun of it: a hint, not trusted (a file in the node's
    `fetching/`, get.KeptManifests).  Its rates stand in for the rerun's own until it
    measures them, where the holders are the same (by their names, `str`: a PeerLink's
    address; the link to a holder may differ between runs, a hint may be wrong): a rerun
    after a kill -9 had tried per-line frames again, a window at 1.7 times the stream's
    bytes, where the stopped run had found the stream faster (docs/BENCHMARKS.md, 2026-11-29
    (14) and (15))."""

    holders: frozenset[str]
    """The holders delivering when the rates were measured."""
    stream: float
    lines: float
    """Raw bytes per second the whole fetch received with each offer (FetchPace.delivered)."""
    links: dict[str, float]
    """Each holder's link rate as measured on per-line frames (FetchPace.link_rate)."""

    def encode(self) -> bytes:
        return json.dumps({"holders": sorted(self.holders), "stream": self.stream, "lines": self.lines,
                           "links": self.links}).encode()

    @classmethod
    def decode(cls, data: bytes) -> Measures:
        """Measures from `encode`'s bytes; ValueError for anything else (a torn or foreign file)."""
        if len(data) > KEPT_BYTES:
            raise ValueError(f"{len(data)} bytes")
        try:
            got = json.loads(data)
        except RecursionError:
            raise ValueError("nested too deep") from None
        if not isinstance(got, dict) or set(got) != {"holders", "stream", "lines", "links"}:
            raise ValueError("not kept measures")
        holders, links = got["holders"], got["links"]
        if (not isinstance(holders, list) or not 0 < len(holders) <= KEPT_HOLDERS
                or not all(isinstance(h, str) for h in holders)):
            raise ValueError("bad holders")
        if not isinstance(links, dict) or not set(links) <= set(holders):
            raise ValueError("bad link rates")
        return cls(frozenset(holders), _rate(got["stream"]), _rate(got["lines"]),
                   {h: _rate(r) for h, r in links.items()})


def _rate(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(f"bad rate {value!r}")
    return float(value)


@dataclass
class Delivered:
    """What the fetch received while one format was offered."""

    rate: float | None = None
    """Raw bytes per second, all holders together (moving average of the windows of one
    phase), or None: not measured with the holders now delivering."""
    phase: int = -1
    """The phase (a run of answers to one offer) it was measured in."""
    at: int = 0
    """The fetch's raw bytes decoded when it was measured last."""


@dataclass
class Window:
    """The raw bytes decoded since `start`, while every request in flight had the same offer."""

    start: float
    not_shared: float
    """`FetchPace.not_shared()` at the start: a window in which it grew is no sample."""
    raw: int = 0
    wire: int = 0
    cpu: float = 0.0


@dataclass
class FetchPace:
    """The fetcher's side, for one fetch: whether it offers the stream, chosen by what each
    offer delivered (raw bytes per second of the whole fetch), and each holder's link as its
    reads saw it (reported to the holder: LinkPace)."""

    fetch_bytes: int
    """Raw bytes of the lines this fetch asks for, from all holders."""
    links: dict[tuple[object, bool], WaitMeter] = field(default_factory=dict)
    """By holder and format received (True: a stream)."""
    streaming: bool = True
    """The current offer: the stream, or per-line frames."""
    raw: int = 0
    """Raw bytes decoded so far, in both formats."""
    delivered: dict[bool, Delivered] = field(default_factory=lambda: {True: Delivered(), False: Delivered()})
    """By offer (True: the stream was offered)."""
    asked: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    """Requests in flight, by offer."""
    phase: int = 0
    holders: frozenset[object] = frozenset()
    """The holders delivering when `delivered` was measured."""
    window: Window | None = None
    warm: bool = False
    """Whether the fetch's first window went by.  It measures nothing (the connections' start,
    TCP's slow start, the holders' first answers, made before they measured anything), and
    per-line frames come next: the link rate measured on them is what a holder then makes
    its stream for (link_rate).  Measured first, the stream was made for its own slow start's
    pace, at level 6: 13-17 MB/s of lines where it made 21-26 after per-line frames."""
    not_shared: Callable[[], float] = lambda: 0.0
    """CPU seconds of this process, since it began, spent on work no received byte causes
    (reading held lines back from the store or the parent's file: a resumed fetch's first
    half): a window in which it grew measured that work, not a format."""
    live: Callable[[object], bool] = lambda holder: True
    """Whether a holder still serves this fetch (downloader.Share.delivering): one dropped or
    stalled changes what either format can deliver (a cut holder's rate had kept the fetch on
    per-line frames from the one left)."""
    clock: Callable[[], float] = time.monotonic
    hint: Measures | None = None
    """What a stopped run of this fetch measured: its rates are this fetch's own until the
    warm-up ends, where the holders are the same; its link rates until measured here."""
    keep: Callable[[Measures], None] = lambda measures: None
    """Called with what is measured, each time a format's measure after a change of offer
    gives both rates (a few times a fetch): kept for a rerun."""

    def link(self, holder: object, stream: bool) -> WaitMeter:
        """The meter of the answers from `holder` in one format."""
        return self.links.setdefault((holder, stream), WaitMeter())

    def link_rate(self, holder: object) -> float | None:
        """The rate `holder`'s link carries: measured on per-line frames where it was (the
        holder sends those as they are stored), else on its stream, which it may make slower
        than the link carries it.  Measured on the stream alone, the holder's own pace came back
        to it as the link's: at 100 Mbit/s it then took level 6, which made it slower still
        (22-26 MB/s of lines where level 3 made 35-39)."""
        lines = self._lines_rate(holder)
        meter = self.links.get((holder, True))
        return lines if lines is not None or meter is None else meter.rate

    def _lines_rate(self, holder: object) -> float | None:
        """`holder`'s link rate measured on per-line frames, here or else by the stopped run."""
        meter = self.links.get((holder, False))
        if meter is not None and meter.rate is not None:
            return meter.rate
        return None if self.hint is None else self.hint.links.get(str(holder))

    def window_bytes(self) -> int:
        return min(MAX_WINDOW, max(MIN_WINDOW, int(self.fetch_bytes * WINDOW_SHARE)))

    def offer(self, holder: object, limits: wire.Limits) -> dict[str, str]:
        """The headers of a batch request to `holder`: the stream offered (with the size of the
        fetch and the rate this fetcher receives at, once measured), or nothing.  The request
        is in flight until `ended`."""
        offered = self.streaming and limits.stream_batches
        self.asked[offered] += 1
        if not offered:
            return {}
        headers = {wire.BATCH_FORMAT_HEADER: wire.BATCH_FORMAT_STREAM,
                   wire.FETCH_BYTES_HEADER: str(self.fetch_bytes)}
        rate = self.link_rate(holder)
        if rate is not None:
            headers[wire.LINK_RATE_HEADER] = str(max(1, int(rate)))
        return headers

    def ended(self, headers: dict[str, str]) -> None:
        """The request `offer` gave these headers for ended (answered in full or not)."""
        self.asked[wire.BATCH_FORMAT_HEADER in headers] -= 1

    def answered(self, wire_bytes: int) -> None:
        """An answer ended with `wire_bytes` received (reported with the window's rate)."""
        if self.window is not None:
            self.window.wire += wire_bytes

    def decoded(self, stream: bool, raw: int, cpu: float) -> None:
        """A run of `raw` bytes of lines was decoded and verified with `cpu` seconds of its
        worker thread's CPU (`stream`: they came as a stream segment).  Once a window of them
        came while every request in flight had the current offer, that offer's rate is
        measured (per-line frames after the warm-up, unless a stopped run measured them:
        `hint`), and the next requests get the other
        offer if it was not measured with these holders or was REPROBE windows ago (tried once
        more), else the stream unless per-line frames delivered LINES_MARGIN more."""
        self.raw += raw
        now = self.clock()
        holders = frozenset(h for h, _ in self.links if self.live(h))
        if holders != self.holders:
            self.holders, self.delivered, self.window = holders, self._measured_before(holders), None
        if self.asked[not self.streaming]:  # answers to the other offer are still coming: no sample
            self.window = None
            return
        w = self.window
        if w is None or w.not_shared != self.not_shared():
            self.window = Window(now, self.not_shared())
            return
        w.raw += raw
        w.cpu += cpu
        if w.raw >= self.window_bytes():
            self.window = Window(now, self.not_shared())
            if self.warm:
                self._measured(w, w.raw / max(now - w.start, 1e-6))
            else:  # nothing measured: per-line frames next, unless a stopped run measured them (hint)
                self.warm = True
                self._choose(keep=False)

    def _measured_before(self, holders: frozenset[object]) -> dict[bool, Delivered]:
        """What each offer delivered with `holders`, as the holders change: nothing (measured
        anew), but for the stopped run's rates (`hint`) while this fetch has measured nothing."""
        hint = self.hint
        if self.warm or hint is None or hint.holders != {str(h) for h in holders}:
            return {True: Delivered(), False: Delivered()}
        log.debug("batch format: a stopped run of this fetch measured the stream at %.1f MB/s raw, "
                  "per-line frames at %.1f", hint.stream / 1e6, hint.lines / 1e6)
        return {True: Delivered(hint.stream, at=self.raw), False: Delivered(hint.lines, at=self.raw)}

    def _measured(self, w: Window, rate: float) -> None:
        current = self.delivered[self.streaming]
        first = current.phase != self.phase
        current.rate = _average(current.rate if not first else None, rate)
        current.phase, current.at = self.phase, self.raw
        log.debug("batch format %s: %.1f MB/s raw (window of %.1f MB: %.3f wire bytes per raw byte, "
                  "%.1f ms decoding CPU per raw MB; %d MB decoded)", self._name(self.streaming), rate / 1e6,
                  w.raw / 1e6, w.wire / w.raw, w.cpu / w.raw * 1e9, self.raw // 1_000_000)
        self._choose(keep=first)

    def _choose(self, keep: bool) -> None:
        """The next offer from what both delivered (`keep`: a new measure, kept for a rerun):
        the one not measured yet, the other one again after REPROBE windows (per-line frames
        not while the stream leads by LINES_MARGIN), else the stream unless per-line frames
        delivered LINES_MARGIN more."""
        other = self.delivered[not self.streaming]
        stream, lines = self.delivered[True].rate, self.delivered[False].rate
        if stream is None or lines is None:
            self._try_other("to measure it")
            return
        if keep and len(self.holders) <= KEPT_HOLDERS:
            self.keep(Measures(frozenset(str(h) for h in self.holders), stream, lines,
                               {str(h): r for h in self.holders if (r := self._lines_rate(h)) is not None}))
        if (self.raw - other.at > REPROBE * self.window_bytes()
                and not (self.streaming and stream >= lines * (1 + LINES_MARGIN))):
            self._try_other("to measure it again")
            return
        if (lines > stream * (1 + LINES_MARGIN)) == self.streaming:
            self._switch(f"stream {stream / 1e6:.1f} MB/s raw, per-line frames {lines / 1e6:.1f}")

    def _try_other(self, why: str) -> None:
        """The other offer for a window, to measure it: per-line frames only while PROBE_ROOM
        windows are left."""
        if not self.streaming or self.fetch_bytes - self.raw >= PROBE_ROOM * self.window_bytes():
            self._switch(why)

    def _switch(self, why: str) -> None:
        """The other offer from the next request on."""
        self.streaming, self.phase = not self.streaming, self.phase + 1
        log.debug("batch format offered: %s (%s)", self._name(self.streaming), why)

    @staticmethod
    def _name(stream: bool) -> str:
        return "stream" if stream else "per-line frames"
