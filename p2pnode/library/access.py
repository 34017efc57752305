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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2pnode.errors import InvalidInput

UNITS = {"m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
NEVER = "never"
CONFIG_NAME = "config.json"
"""The node's settings file in its home: {"share_expires": "7d" or "never"} (docs/FORMAT.md)."""
DEFAULT_EXPIRES = NEVER
"""Without a config file (or without `share_expires` in it), shares do not expire."""
_DURATION = re.compile(r"([1-9][0-9]{0,5})([mhdw])")


def parse_expires(text: str, what: str = "expiry") -> int | None:
    """Seconds from a duration like 30m, 12h, 7d, 2w; None for "never".  `what` names where
    the text came from in the error (--expires, or config.json's key)."""
    text = text.strip().lower()
    if text == NEVER:
        return None
    match = _DURATION.fullmatch(text)
    if match is None:
        raise InvalidInput(f"{what} {text!r}: a number and a unit m, h, d or w (like 7d), or 'never'")
    return int(match.group(1)) * UNITS[match.group(2)]


def _duration(what: str, value: object) -> str:
    if not isinstance(value, str):
        raise InvalidInput(f"{what} {json.dumps(value)}: a string like \"7d\" or \"never\"")
    parse_expires(value, what)
    return value


CONFIG_KEYS: dict[str, Callable[[str, object], object]] = {"share_expires": _duration}
"""Each key config.json may have, and its check (given how to name it in an error: the file
and the key): a key or value the node does not know fails with both named, not ignored."""


def node_config(home: Path) -> dict[str, Any]:
    """config.json's settings, every key checked (no file: none set)."""
    path = home / CONFIG_NAME
    try:
        config = json.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    except ValueError as exc:
        raise InvalidInput(f"{path} is not JSON ({exc}); fix it or move it aside") from None
    if not isinstance(config, dict):
        raise InvalidInput(f"{path} is not a JSON object of settings (like {{\"share_expires\": \"7d\"}})")
    for key, value in config.items():
        check = CONFIG_KEYS.get(key)
        if check is None:
            raise InvalidInput(f"{path}: unknown key {key!r} (the keys are {', '.join(CONFIG_KEYS)})")
        check(f"{path}: {key}", value)
    return config


def default_expires(home: Path) -> str:
    """The node's default for `share` without --expires (config.json's share_expires); a bad
    config fails every share with the file, the key and the value named."""
    return str(node_config(home).get("share_expires", DEFAULT_EXPIRES))


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
