"""A persisted set of named tasks: what the node follows (node/follow.py) and shares live
(node/live.py), each item run by its own task and kept in a JSON list in the node's home, so a
restarted node takes them up again.  One place for loading, saving, stopping and listing them.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from sysio.files import atomic_write

log = logging.getLogger(__name__)


class Item(Protocol):
    task: asyncio.Task[None] | None

    def saved(self) -> dict[str, Any]: ...

    def status(self) -> dict[str, Any]: ...


T = TypeVar("T", bound=Item)


class PersistedTasks(Generic[T]):
    """Items by name, each with its task running `run(item)`; `file` holds their `saved()`."""

    def __init__(self, file: Path, run: Callable[[T], Awaitable[None]]) -> None:
        self.file = file
        self._run = run
        self.items: dict[str, T] = {}

    def load(self) -> list[dict[str, Any]]:
        """The saved entries (objects only); none when the file is missing or not JSON (logged)."""
        try:
            saved = json.loads(self.file.read_bytes())
        except FileNotFoundError:
            return []
        except ValueError as exc:
            log.warning("%s is not JSON (%s): ignored until it is replaced", self.file, exc)
            return []
        return [e for e in saved if isinstance(e, dict)] if isinstance(saved, list) else []

    def drop_saved(self, gone: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
        """With no node running (nothing begun here): remove the saved entries `gone` picks
        from the file, so that a node started later does not take them up; they are returned."""
        saved = self.load()
        dropped = [e for e in saved if gone(e)]
        if dropped:
            atomic_write(self.file, json.dumps([e for e in saved if not gone(e)]).encode())
        return dropped

    def change_saved(self, pick: Callable[[dict[str, Any]], bool],
                     change: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        """With no node running: each saved entry `pick` picks replaced by `change(entry)`."""
        saved = self.load()
        if any(pick(e) for e in saved):
            atomic_write(self.file, json.dumps([change(e) if pick(e) else e for e in saved]).encode())

    def begin(self, key: str, item: T) -> None:
        self.items[key] = item
        item.task = asyncio.ensure_future(self._run(item))

    def add(self, key: str, item: T) -> T:
        """Start `item` under `key` and save, unless `key` is already running: the one returned."""
        if key not in self.items:
            self.begin(key, item)
            self.save()
        return self.items[key]

    async def remove(self, key: str) -> T | None:
        """Stop the item under `key` and save; None when there is none."""
        item = self.items.pop(key, None)
        if item is None:
            return None
        await _stop([item])
        self.save()
        return item

    def forget(self, key: str) -> None:
        """An item whose task ends by itself: no longer listed, nor taken up after a restart."""
        if self.items.pop(key, None) is not None:
            self.save()

    def save(self) -> None:
        atomic_write(self.file, json.dumps([i.saved() for i in self.items.values()]).encode())

    def status(self) -> list[dict[str, Any]]:
        return [i.status() for i in self.items.values()]

    def get(self, key: str) -> T | None:
        return self.items.get(key)

    def __iter__(self) -> Iterator[T]:
        return iter(self.items.values())

    async def close(self) -> None:
        await _stop(list(self.items.values()))


async def _stop(items: list[T]) -> None:
    for item in items:
        if item.task is not None:
            item.task.cancel()
    for item in items:
        if item.task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await item.task
