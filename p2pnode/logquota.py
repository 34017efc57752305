"""A bound on log lines any host on the LAN can cause (malformed announcements, connections
turned away): a few a minute, then one line with how many more, instead of one each."""
from __future__ import annotations

import logging
import time


class LogQuota:
    """At most `per_minute` lines of one kind a minute at `level`; the rest are counted and
    said in one line once the minute is over."""

    def __init__(self, logger: logging.Logger, level: int, what: str, per_minute: int = 10) -> None:
        self.logger, self.level, self.what, self.per_minute = logger, level, what, per_minute
        self._start = time.monotonic()
        self._logged = self._dropped = 0

    def roll(self) -> None:
        """A minute over: say how many were not logged (called at each line and now and then,
        so that a flood's count is said when the flood stops too)."""
        now = time.monotonic()
        if now - self._start >= 60.0:
            if self._dropped:
                self.logger.log(self.level, "%d more %s in the last minute, not logged one by one",
                                self._dropped, self.what)
            self._start, self._logged, self._dropped = now, 0, 0

    def log(self, message: str, *args: object) -> None:
        self.roll()
        if self._logged < self.per_minute:
            self._logged += 1
            self.logger.log(self.level, message, *args)
        else:
            self._dropped += 1
