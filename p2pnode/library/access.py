"""Who may fetch a shared branch and until when: `share --expires` and `--to`, the node's
default expiry (`<home>/config.json`), and the one rule the provider applies per request
(docs/SECURITY.md, "Who sees what").

A peer P may be served a branch B at time t when B is offered, B has not expired at t
(`expires_at` is None or later than t), B's `to` is None or names P, and B's secret scan
found nothing or B was shared with --allow-secrets.  B's ancestors go with it (the lineage
`share` said it offers): each one while it is itself offered, unexpired and clean or allowed;
its own `to` is not consulted, since the user shared the child with its lineage to P.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

from p2pnode.errors import InvalidInput

UNITS = {"m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
NEVER = "never"
CONFIG_NAME = "config.json"
"""The node's settings file in its home: {"share_expires": "7d" or "never"} (docs/FORMAT.md)."""
DEFAULT_EXPIRES = NEVER
"""Without a config file (or without `share_expires` in it), shares do not expire."""
_DURATION = re.compile(r"([1-9][0-9]{0,5})([mhdw])")


def parse_expires(text: str) -> int | None:
    """Seconds from a duration like 30m, 12h, 7d, 2w; None for "never"."""
    text = text.strip().lower()
    if text == NEVER:
        return None
    match = _DURATION.fullmatch(text)
    if match is None:
        raise InvalidInput(f"expiry {text!r}: a number and a unit m, h, d or w (like 7d), or 'never'")
    return int(match.group(1)) * UNITS[match.group(2)]


def default_expires(home: Path) -> str:
    """The node's default for `share` without --expires (config.json's share_expires)."""
    path = home / CONFIG_NAME
    try:
        config = json.loads(path.read_bytes())
    except FileNotFoundError:
        return DEFAULT_EXPIRES
    except ValueError as exc:
        raise InvalidInput(f"{path} is not JSON ({exc}); fix it or move it aside") from None
    value = config.get("share_expires", DEFAULT_EXPIRES) if isinstance(config, dict) else None
    if not isinstance(value, str):
        raise InvalidInput(f"{path}: share_expires must be a string like \"7d\" or \"never\"")
    parse_expires(value)  # a bad default fails every share with the file named
    return value


def expires_at(expires: str | None, home: Path, now_ms: int | None = None) -> int | None:
    """Unix milliseconds a share made now with `expires` (None: the node's default) ends at."""
    seconds = parse_expires(expires if expires is not None else default_expires(home))
    now = int(time.time() * 1000) if now_ms is None else now_ms
    return None if seconds is None else now + seconds * 1000


def now_ms() -> int:
    return int(time.time() * 1000)


def expired(expires: int | None, now: int) -> bool:
    return expires is not None and expires <= now


@dataclass(frozen=True)
class Audience:
    """Who a share offers a branch to, and until when."""

    expires_at: int | None
    to: list[str] | None

    def widened(self, old_expires: int | None, old_to: list[str] | None) -> Audience:
        """This audience joined with one a branch already had (an ancestor offered again with a
        new child): the later expiry and the union of peers, so sharing a child never takes
        its lineage away from anyone it was offered to."""
        later = None if self.expires_at is None or old_expires is None else max(self.expires_at, old_expires)
        to = None if self.to is None or old_to is None else sorted(set(self.to) | set(old_to))
        return Audience(later, to)
