"""What a fetch reports while it runs, and the meter that turns its reports into what a user
reads (bytes, rate, ETA, peers, lines verified).

A fetch calls `progress(done, total)` (get.py's Progress); it may pass a third argument, a
`ProgressInfo`, with what it knows besides bytes.  Every callback here accepts both forms, so a
fetch that passes only two arguments keeps working and one that passes more is shown more.
The node streams `TransferProgress.as_dict()` to a waiting CLI and lists it in `status`.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

RATE_WINDOW = 5.0
"""Seconds of recent reports the rate is measured over: fast enough to follow a slowing peer,
long enough not to jump with every batch."""


@dataclass(frozen=True)
class ProgressInfo:
    """Optional third argument of progress(done, total, info): what the fetch knows besides bytes."""

    lines_verified: int | None = None
    lines_total: int | None = None
    peers: tuple[str, ...] | None = None
    """The peers serving now (addresses or names); None: the fetch does not say."""


@dataclass(frozen=True)
class TransferProgress:
    """One snapshot of a transfer, as the node streams it and `status` shows it."""

    bytes_done: int = 0
    bytes_total: int | None = None
    rate: float | None = None
    """Bytes per second over the last RATE_WINDOW seconds; None before two reports."""
    eta: float | None = None
    """Seconds left at that rate; None when unknown."""
    lines_verified: int | None = None
    lines_total: int | None = None
    peers: list[str] = field(default_factory=list)
    seconds: float = 0.0
    """Since the transfer started."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TransferProgress:
        """From the node's JSON: unknown keys are ignored, so either side may add some."""
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**known)


class ProgressMeter:
    """A progress callback (two or three arguments) that keeps a snapshot with rate and ETA."""

    def __init__(self, peers: list[str] | None = None, clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[TransferProgress], None] | None = None) -> None:
        self._clock = clock
        self._started = clock()
        self._samples: deque[tuple[float, int]] = deque()
        self._on_change = on_change
        self.current = TransferProgress(peers=list(peers or []))

    def __call__(self, done: int, total: int, info: ProgressInfo | None = None) -> None:
        now = self._clock()
        if self._samples and done < self._samples[-1][1]:  # a new session of the lineage began
            self._samples.clear()
        self._samples.append((now, done))
        while len(self._samples) > 2 and now - self._samples[0][0] > RATE_WINDOW:
            self._samples.popleft()
        rate = self._rate()
        eta = (total - done) / rate if rate and total >= done else None
        cur, info = self.current, info or ProgressInfo()
        self.current = TransferProgress(
            bytes_done=done, bytes_total=total, rate=rate, eta=eta,
            lines_verified=cur.lines_verified if info.lines_verified is None else info.lines_verified,
            lines_total=cur.lines_total if info.lines_total is None else info.lines_total,
            peers=cur.peers if info.peers is None else list(info.peers),
            seconds=now - self._started)
        if self._on_change:
            self._on_change(self.current)

    def _rate(self) -> float | None:
        (t0, d0), (t1, d1) = self._samples[0], self._samples[-1]
        return (d1 - d0) / (t1 - t0) if t1 > t0 else None
