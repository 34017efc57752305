"""Argument types whose bad values argparse reports as usage errors (exit 2) with the rule,
rather than a command failing later with an unexpected error."""
from __future__ import annotations

import argparse

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def port(text: str) -> int:
    """A TCP port, 0 to 65535 (0: any free one)."""
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text} is not a TCP port (0 to 65535)")
    return value


def count(text: str) -> int:
    """A number of things, 1 or more."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a count (1 or more)")
    return value


def seconds(text: str) -> float:
    """A duration over 0 seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a duration (more than 0 seconds)")
    return value


def directory(text: str) -> str:
    """A directory's path, not empty (an empty one fell back to the default home unsaid)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path names no directory")
    return text


def log_level(text: str) -> str:
    """One of LOG_LEVELS, in any case."""
    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(LOG_LEVELS)}")
    return text.upper()


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
