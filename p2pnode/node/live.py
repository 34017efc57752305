"""Live shares (`p2pnode share --live`): the node shares a session file again whenever it grows.

Each live file is watched by stat polling every POLL_SECONDS (no inotify: the same code runs
on macOS); when its (inode, size, mtime) change, the node shares it again.  The incremental
hasher (pi/hashing.py) reads only the bytes added since the last share and the store appends
only the new lines, so an update costs O(new bytes).  A line Pi is still writing is left for
the next share, as always.  A new version changes the catalog: the peers waiting for a
change are answered at once (node/follow.py, docs/PROTOCOL.md), and the mDNS records are
announced again at most every daemon.ANNOUNCE_EVERY seconds (`Node.announce_soon`).  Live files
are kept in `<home>/live.json` and watched again when the node restarts.

Each share of a grown file goes to the audience the live share began with (`--to`), until the
moment its first share set (`--expires 1h`: an hour after `share --live`, not after each line);
past that moment the live share ends.  `unshare` and `rm` of what a live share offers end it
first (`stop_offering`; `unlive_saved` without a node), else Pi's next line would offer it again.
A share of the file by a command of its own (`share F --to bob`) sets them anew (`restate`;
`restate_saved` without a node).
"""
from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from p2pnode.errors import InvalidInput, NotFound
from p2pnode.library import access
from p2pnode.library.api import BranchInfo, Library
from p2pnode.node.tasks import PersistedTasks
from p2pnode.paths import PiDirs

if TYPE_CHECKING:
    from p2pnode.node.daemon import Node

log = logging.getLogger(__name__)

LIVE_FILE = "live.json"
POLL_SECONDS = 0.5
"""How often a live file is stat'ed: a new line is shared within this long of being written."""


@dataclass
class Live:
    path: str
    pi: dict[str, Any] | None
    cwd: str | None
    allow_secrets: bool = False
    branch: str | None = None
    """The branch of the last version shared."""
    to: list[str] | None = None
    """The node ids each share offers it to (`share --to`; None: every trusted peer)."""
    expires_at: int | None = None
    """Unix milliseconds its first share ends at (None: never): each later share ends then too."""
    error: str | None = None
    """Why the last share failed (shown by `status`; tried again when the file changes)."""
    task: asyncio.Task[None] | None = None

    def saved(self) -> dict[str, Any]:
        return {"path": self.path, "pi": self.pi, "cwd": self.cwd, "allow_secrets": self.allow_secrets,
                "branch": self.branch, "to": self.to, "expires_at": self.expires_at}

    def expired(self) -> bool:
        return access.expired(self.expires_at, access.now_ms())

    def status(self) -> dict[str, Any]:
        return dict(self.saved(), error=self.error)


class LiveShares:
    """The files this node shares live, each watched by its own task."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.live: PersistedTasks[Live] = PersistedTasks(node.paths.home / LIVE_FILE, self._watch)

    def routes(self) -> dict[str, Callable[[dict[str, Any]], Awaitable[Any]]]:
        return {"live": self._c_live, "unlive": self._c_unlive}

    async def start(self) -> None:
        for entry in self.live.load():
            if isinstance(entry.get("path"), str):
                if "to" not in entry and isinstance(entry.get("branch"), str):  # saved by an older p2pnode
                    entry = dict(entry, **await asyncio.to_thread(self._audience_of, entry["branch"]))
                self.live.begin(entry["path"], Live(entry["path"], entry.get("pi"), entry.get("cwd"),
                                                    bool(entry.get("allow_secrets")), entry.get("branch"),
                                                    _to(entry.get("to")), _moment(entry.get("expires_at"))))

    async def close(self) -> None:
        await self.live.close()

    def _audience_of(self, branch: str) -> dict[str, Any]:
        """The audience of the branch a live share offered last, for a live.json entry that an
        older p2pnode saved without it: its growth goes on to whom that branch went, not to
        every trusted peer (an entry naming no branch held here keeps that default)."""
        try:
            info = self.node.lib.branch(branch)
        except NotFound:
            return {}
        return {"to": info.to, "expires_at": info.expires_at}

    def status(self) -> list[dict[str, Any]]:
        return self.live.status()

    async def _c_live(self, body: dict[str, Any]) -> dict[str, Any]:
        path, pi, cwd = body.get("path"), body.get("pi"), body.get("cwd")
        if not isinstance(path, str) or not os.path.isabs(path):
            raise InvalidInput("live: 'path' must be an absolute path")
        if not Path(path).is_file():
            raise NotFound(f"live: {path} is not a file")
        if pi is not None:
            try:
                PiDirs.from_dict(pi if isinstance(pi, dict) else {})
            except ValueError as exc:
                raise InvalidInput(f"live: pi: {exc}") from None
        branch, to, expires_at = body.get("branch"), body.get("to"), body.get("expires_at")
        if to is not None and _to(to) is None:
            raise InvalidInput("live: 'to' must be a list of node ids, or null")
        if expires_at is not None and _moment(expires_at) is None:
            raise InvalidInput("live: 'expires_at' must be Unix milliseconds, or null")
        asked = Live(path, pi, cwd if isinstance(cwd, str) else None, body.get("allow_secrets") is True,
                     branch if isinstance(branch, str) else None, _to(to), _moment(expires_at))
        live = self.live.add(path, asked)
        if live is not asked:  # `share --live` again: its options replace the running one's
            live.pi, live.cwd, live.allow_secrets = asked.pi, asked.cwd, asked.allow_secrets
            live.to, live.expires_at, live.branch = asked.to, asked.expires_at, asked.branch or live.branch
            self.live.save()
        return live.status()

    async def _c_unlive(self, body: dict[str, Any]) -> dict[str, Any]:
        path = body.get("path")
        live = await self.live.remove(os.path.abspath(path)) if isinstance(path, str) else None
        if live is None:
            raise NotFound(f"{str(path)[:200]} is not shared live")
        return live.status()

    async def stop_offering(self, branches: Collection[str]) -> list[str]:
        """`unshare` or `rm` of what a live share offers: the live share ends first (a share in
        progress finishing), else the next line Pi writes would offer it again.  Their paths."""
        ended = [live.path for live in self.live if live.branch in branches]
        for path in ended:
            await self.live.remove(path)
            log.info("live: stopped sharing %s live, its session is unshared or removed", path)
        return ended

    def restate(self, result: BranchInfo) -> None:
        """A share of a file shared live, by a command of its own (not the watcher's): its
        audience and end are the live share's from now on, as sharing again replaces them;
        else Pi's next line would offer the file to the audience it had before."""
        live = self.live.get(result.path) if result.path else None
        if live is not None and (live.to, live.expires_at) != (result.to, result.expires_at):
            live.to, live.expires_at = result.to, result.expires_at
            self.live.save()
            log.info("live: %s is now shared to %s, until %s", live.path, live.to or "every trusted peer",
                     live.expires_at or "it is unshared")

    async def _watch(self, live: Live) -> None:
        seen: tuple[int, int, int] | None = None
        while True:
            if live.expired():  # its offer ended: nothing to share again
                self.live.forget(live.path)
                log.info("live: the share of %s expired; no longer shared live", live.path)
                return
            try:
                st = os.stat(live.path)
                key = (st.st_ino, st.st_size, st.st_mtime_ns)
            except OSError as exc:
                live.error = f"cannot read the file: {exc.strerror or exc}"
                key = None
            if key is not None and key != seen:
                seen = key
                await self._share(live)
            await asyncio.sleep(POLL_SECONDS)

    async def _share(self, live: Live) -> None:
        lib = self.node.lib
        pi = PiDirs.from_dict(live.pi) if live.pi else None
        audience = access.Audience(live.expires_at, live.to)
        sharing = asyncio.ensure_future(asyncio.to_thread(
            lib.share, live.path, cwd=live.cwd, pi=pi, allow_secrets=live.allow_secrets, audience=audience))
        try:
            result = await asyncio.shield(sharing)
        except asyncio.CancelledError:  # stopped (`unshare`, `rm`): what it offers after this is theirs
            await asyncio.wait([sharing])
            raise
        except Exception as exc:  # a secret found, Pi rewriting the file...: said in status, tried again
            live.error = str(exc) or type(exc).__name__
            log.info("live share of %s failed: %s", live.path, live.error)
            return
        live.error = None
        if result.branch != live.branch:
            live.branch = result.branch
            self.live.save()
            log.info("live: shared %s again (%s, %d lines)", live.path, result.branch[:16], result.lines)
            self.node.announce_soon()


def _to(value: object) -> list[str] | None:
    return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else None


def _moment(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def unlive_saved(home: Path, branches: Collection[str]) -> list[str]:
    """LiveShares.stop_offering with no node running: those live shares are dropped from
    live.json (a node started later would take them up).  Their paths."""
    saved = PersistedTasks[Live](home / LIVE_FILE, lambda live: asyncio.sleep(0))
    return [str(e.get("path")) for e in saved.drop_saved(lambda e: e.get("branch") in branches)]


def restate_saved(home: Path, shared: dict[str, Any]) -> None:
    """LiveShares.restate with no node running: the live.json entry of the file shared (a node
    started later shares its growth to the audience and until the end this share set)."""
    saved = PersistedTasks[Live](home / LIVE_FILE, lambda live: asyncio.sleep(0))
    saved.change_saved(lambda e: shared.get("path") is not None and e.get("path") == shared["path"],
                       lambda e: dict(e, to=shared.get("to"), expires_at=shared.get("expires_at")))


def unshare_live(lib: Library, branch: str, unlive: Callable[[list[str]], list[str]]) -> dict[str, Any]:
    """`p2pnode unshare`: end the live shares of what it withdraws (`unlive(branches)`, the
    paths of those ended), then unshare."""
    stopped = unlive(lib.unsharing(branch))
    return dict(lib.unshare(branch).as_dict(), live_stopped=stopped)
