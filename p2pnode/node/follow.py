"""Following a teammate's growing session live (`p2pnode follow`), and the newest version of a
session for `fetch` (a session id, or an older version's hash, fetches the latest version).

The versions of a session are told apart in a peer's catalog by their `previous` and
`version` fields (library/versions.py on the peer; an older peer without them: the same
header, at least as large).  A follow keeps one long-poll open to a peer that offers the
session (`GET /v1/catalog?wait=<generation>`, answered when the catalog changes or after
`Limits.catalog_wait` seconds: docs/PROTOCOL.md, "Change notification"); each newer version
it announces is fetched through the ordinary verified fetch (peer/get.py: only the lines this
node lacks), and the placed file is updated in place when it is still exactly what a fetch
placed there (pi/placement.py).  A peer that goes away, or a node restart on either side, is
retried with a growing pause (up to RETRY_MAX seconds); what is followed is kept in
`<home>/follows.json`, so a restarted node follows on.  What arrives is kept per follow as
events (the last EVENTS_KEPT) that `p2pnode follow` prints.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from p2pnode.errors import InvalidInput, NotFound, P2PNodeError, PeerUnavailable, VerificationFailed, naming
from p2pnode.node.answers import callers_path_error
from p2pnode.node.tasks import PersistedTasks
from p2pnode.paths import PiDirs
from p2pnode.peer import offers, wire
from p2pnode.peer.address import PeerAddress
from p2pnode.peer.get import FetchResult, OpenPerUse, fetch_branch, get_catalog
from p2pnode.peer.identity import Identity
from p2pnode.peer.interfaces import FetchTarget
from p2pnode.peer.link import Connections, PeerLink
from p2pnode.peer.trust import TrustStore
from p2pnode.pi.lines import ref_runs
from p2pnode.pi.session import is_session_id
from p2pnode.pi.sidecar import Sidecar

if TYPE_CHECKING:
    from p2pnode.library.api import BranchInfo
    from p2pnode.node.daemon import Node

log = logging.getLogger(__name__)

FOLLOWS_FILE = "follows.json"
RETRY_MAX = 10.0
"""Longest pause between attempts to reach a session's peers again."""
EVENTS_KEPT = 200
ENDED_KEPT = 16
"""Follows that ended by themselves kept for their command to read why (the oldest dropped)."""
EVENTS_WAIT = 20.0
"""The longest `/v1/follow-events` holds a request open waiting for something to report."""
CATALOG_TIMEOUT = 5.0
POLL_TIMEOUT = wire.DEFAULT_LIMITS.catalog_wait + 20.0
"""Seconds one catalog poll may take in all (the wait, then the body): a peer that trickles its
answer, a byte now and then, is given up for the next one rather than followed forever."""
MIN_POLL_INTERVAL = 0.5
"""Seconds at least between the starts of two catalog polls of one follow: a peer that answers
every `?wait=` at once (ignoring it, or bumping its generation) is not polled in a busy loop."""
"""How long `fetch` waits for one peer's catalog when it looks for the newest version."""
ATTACHED_GRACE = 30.0
"""Seconds an attached follow (one its `follow` command prints, not --detach) lasts after
that command last asked for events: a command killed or whose terminal closed says nothing,
and the node must not follow for it for good."""
ATTACHED_CHECK = 5.0
WORDS = 12
SUMMARY_RUN = 8 << 20
"""Raw bytes of a new version's lines read from the store at a time for its event's summary: a
first version is the whole session, never in memory at once (a 2 GB one was)."""
_HEX = re.compile(r"[0-9a-f]{4,64}")


def _descends(entry: wire.CatalogEntry, start: wire.CatalogEntry,
              by_branch: dict[str, wire.CatalogEntry]) -> bool:
    """Whether `entry` is `start` or a later version of it, by the `previous` links; a peer that
    does not send them: the same header and at least as many bytes."""
    if entry.branch == start.branch:
        return True
    if entry.version is None or start.version is None:
        return entry.header == start.header and entry.size >= start.size
    current: wire.CatalogEntry | None = entry
    for _ in range(len(by_branch)):
        if current is None or current.previous is None:
            return False
        if current.previous == start.branch:
            return True
        current = by_branch.get(current.previous)
    return False


def newest_entry(entries: Sequence[wire.CatalogEntry], target: str) -> wire.CatalogEntry | None:
    """The newest version in a catalog of the session `target` names: a branch hash (that
    version or a later one of the same session) or a Pi session id (any of its versions).  A
    branch hash the catalog does not list has none here, whatever header ids the catalog shows
    (a peer's header `id` equal to a hash asked for does not make its branch a version of it)."""
    by_branch = {e.branch: e for e in entries}
    start = by_branch.get(target)
    if start is not None:
        same = [e for e in entries
                if e.header.get("id") == start.header.get("id") and _descends(e, start, by_branch)]
    elif is_session_id(target):
        same = [e for e in entries if e.header.get("id") == target]
    else:
        return None
    return max(same, key=lambda e: (e.version or 0, e.size, e.lines), default=None)


@dataclass(frozen=True)
class Newest:
    branch: str
    peers: list[PeerAddress]
    """Peers that offer it (empty: the caller looks for holders itself)."""
    note: str | None
    """What the user is told when this is not what was asked for."""
    session: str | None = None
    """The Pi session id the fetched version must have (it was asked for by that id)."""
    extends: tuple[str, int] | None = None
    """(src, size) of the version asked for, whose bytes the fetched one must start with."""
    header_id: str | None = None
    """The Pi session id a catalog gives the version fetched: the held versions of that
    session are the only ones named to its holders (fetch_branch's `session_id`)."""
    asked: Newest | None = None
    """The version asked for, fetched instead when the newer one cannot be had (a catalog
    listed it, but no holder serves it: it expired or was unshared meanwhile, or the catalog lied)."""

    def named(self) -> tuple[str, str]:
        """How a failure of its fetch names it and what the user asked for: (the words, the
        name the message must hold)."""
        if self.session is not None:
            return f"branch {self.branch}, the latest version of session {self.session}", self.session
        asked = self.asked.branch if self.asked is not None else None
        if asked is not None:
            return f"branch {self.branch}, the latest version of branch {asked}", asked
        return f"branch {self.branch}", self.branch


FindPeers = Callable[[str], Awaitable[list[PeerAddress]]]


async def newest_to_fetch(target: str, peers: list[PeerAddress], identity: Identity, trust: TrustStore,
                          find_peers: FindPeers, *, exact: bool = False,
                          known: dict[PeerAddress, wire.CatalogMessage] | None = None,
                          connections: Connections | None = None) -> Newest:
    """What `fetch <target>` fetches: with `exact` and a branch hash, that branch; else the newest
    version of its session among the catalogs of `peers` (or of `find_peers(target)`).  A hash
    no catalog lists is fetched as it is (the fetch then says who has it); a session id nobody
    offers is NotFound.  `known`: catalogs this fetch already read (offers.resolve_prefix's),
    not asked again.  `connections`: the command's HTTPS sessions (link.Connections), kept for
    the fetch that follows."""
    session = is_session_id(target)
    if exact and not session:
        return Newest(target, peers, None, header_id=_header_id(target, (known or {}).values()))
    candidates = peers or await find_peers(target)
    catalogs = await asyncio.gather(*(_catalog(p, identity, trust, known or {}, connections)
                                      for p in candidates), return_exceptions=True)
    answered = [(p, c) for p, c in zip(candidates, catalogs, strict=True)
                if isinstance(c, wire.CatalogMessage)]
    if session:
        target = _session_id(target, [c for _, c in answered])
    found = [(p, e) for p, c in answered if (e := newest_entry(c.branches, target)) is not None]
    if not found:
        if session:
            raise NotFound(f"no trusted peer offers a session with id {target}"
                           + ("" if candidates else " (none found on the LAN; give one with --from)"))
        return Newest(target, candidates, None)
    best = max((e for _, e in found), key=lambda e: (e.version or 0, e.size, e.lines))
    offering = [p for p, c in answered if any(e.branch == best.branch for e in c.branches)]
    header_id = _header_id(best.branch, [c for _, c in answered])
    if best.branch == target:
        return Newest(target, offering, None, header_id=header_id)
    extends = fallback = None
    if not session:  # the catalog's src of the version named, checked against its branch hash
        asked = next(e for _, c in answered for e in c.branches if e.branch == target)
        if Sidecar(asked.src, asked.parent).branch != target:
            return Newest(target, candidates, None)  # a sidecar not in canonical form: fetch it as named
        extends = (asked.src, asked.size)
        holders = [p for p, c in answered if any(e.branch == target for e in c.branches)]
        fallback = Newest(target, holders, f"{target[:16]} is an older version of session "
                          f"{best.header.get('id')}, whose latest version {best.branch} no peer served: "
                          "fetched the one asked for", header_id=_header_id(target, [c for _, c in answered]))
    what = f"session {target}" if session else f"{target[:16]} is an older version of session " \
                                               f"{best.header.get('id')}; its"
    note = (f"{what} latest version{f' (v{best.version})' if best.version else ''} is {best.branch}: "
            f"fetching that{'' if session else ' (--exact fetches the one asked for)'}")
    return Newest(best.branch, offering, note, target if session else None, extends, header_id, fallback)


def _header_id(branch: str, catalogs: Iterable[wire.CatalogMessage]) -> str | None:
    """The Pi session id the catalogs give `branch` (None: none lists it, or not as a string)."""
    ids = {e.header.get("id") for c in catalogs for e in c.branches if e.branch == branch}
    found = ids.pop() if len(ids) == 1 else None
    return found if isinstance(found, str) else None


def _session_id(text: str, catalogs: Sequence[wire.CatalogMessage]) -> str:
    """The Pi session id `text` names: itself, or the one offered id that starts with it;
    NotFound when several do."""
    ids = {i for c in catalogs for e in c.branches
           if isinstance(i := e.header.get("id"), str) and i.startswith(text)}
    if text in ids or len(ids) < 2:
        return ids.pop() if len(ids) == 1 else text
    raise NotFound(f"{text!r} starts the ids of {len(ids)} offered sessions: {', '.join(sorted(ids)[:8])}; "
                   "give more of it")


async def _catalog(peer: PeerAddress, identity: Identity, trust: TrustStore,
                   known: dict[PeerAddress, wire.CatalogMessage],
                   connections: Connections | None) -> wire.CatalogMessage:
    if peer in known:
        return known[peer]
    return await asyncio.wait_for(get_catalog(peer, identity, trust, connections=connections),
                                  CATALOG_TIMEOUT)


async def fetch_newest(lib: FetchTarget | OpenPerUse, newest: Newest, identity: Identity, trust: TrustStore,
                       *, agent_dir: Path | None, **options: Any) -> FetchResult:
    """Fetch `newest.branch` (peer/get.py) and, when it is not what was named, check that it is
    what it claims before it is placed: a version of the session id asked for, or a version
    whose bytes start with those of the version asked for (a peer's catalog is not trusted
    for that; VerificationFailed, nothing placed): checked by fetch_branch, the second as the
    fetch hashes those bytes where it can, else between the commit and the placement, so that
    a grown version is appended to the placed file as any other."""
    check = None if newest.session is None else functools.partial(_check_newest, newest=newest)
    try:
        result = await fetch_branch(lib, newest.branch, newest.peers, identity, trust, agent_dir=agent_dir,
                                    check=check, starts_with=newest.extends, session_id=newest.header_id,
                                    **options)
    except P2PNodeError as exc:
        if isinstance(exc, NotFound | PeerUnavailable) and newest.asked is not None and newest.asked.peers:
            log.info("%s; fetching %s, the version asked for", exc, newest.asked.branch)
            return await fetch_newest(lib, newest.asked, identity, trust, agent_dir=agent_dir, **options)
        naming(exc, *newest.named())
        raise
    result.note = "; ".join(n for n in (newest.note, result.note) if n) or None
    return result


def _check_newest(held: FetchTarget, branch: str, newest: Newest) -> None:
    """The version fetched for a session id is a version of that session (get.py checks
    what a version fetched in place of an older one starts with: fetch_branch's `starts_with`)."""
    info = held.branch(branch)
    if newest.session is not None and info.header.get("id") != newest.session:
        raise VerificationFailed(f"branch {branch}, offered as a version of session "
                                 f"{newest.session}, is a version of session {info.header.get('id')}; "
                                 "not placed")


def new_lines(lib: FetchTarget, src: str, skip: int) -> Iterator[bytes]:
    """A held version's lines after its first `skip`, read from the store in runs of about
    SUMMARY_RUN bytes."""
    for run in ref_runs(lib.line_manifest(src)[skip:], SUMMARY_RUN):
        yield from lib.lines([r.hash for r in run])


def summary(lines: Iterable[bytes]) -> tuple[int, str | None]:
    """(message entries among `lines`, the first words of the last one that has text)."""
    turns, words = 0, None
    for line in lines:
        if b'"type":"message"' not in line:
            continue
        turns += 1
        try:
            message = json.loads(line).get("message")
        except (ValueError, RecursionError, AttributeError):
            continue
        content = message.get("content") if isinstance(message, dict) else None
        texts = [content] if isinstance(content, str) else [
            b.get("text") for b in content or [] if isinstance(b, dict) and isinstance(b.get("text"), str)
        ] if isinstance(content, list) else []
        text = " ".join(t for t in texts if t).split()
        if text:
            role = message.get("role") if isinstance(message.get("role"), str) else "?"
            words = f"{role}: {' '.join(text[:WORDS])}{' …' if len(text) > WORDS else ''}"
    return turns, words


# --- the node's follows -----------------------------------------------------------------------


@dataclass
class Follow:
    key: str
    """What was asked for: a session id or a branch hash."""
    peers: list[str] = field(default_factory=list)
    """Peers given (a ticket's addresses, --from); empty: found on the LAN."""
    pi: dict[str, Any] | None = None
    """The follower's Pi dirs (PiDirs.as_dict) at the time of `follow`: where to place."""
    branch: str | None = None
    """The newest version fetched here so far."""
    size: int = 0
    """Its size: only a larger version is fetched next."""
    session: str | None = None
    path: str | None = None
    attached: bool = False
    """Followed for a `follow` command that prints its events (ends ATTACHED_GRACE after it
    stopped asking); False: --detach, the node follows until `follow --stop`."""
    state: str = "starting"
    events: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=EVENTS_KEPT))
    task: asyncio.Task[None] | None = None
    asking: int = 0
    """Event requests of its command open now."""
    asked: float = field(default_factory=time.monotonic)
    """When its command's last event request ended (or the follow began)."""

    def saved(self) -> dict[str, Any]:
        return {"key": self.key, "peers": self.peers, "pi": self.pi, "branch": self.branch, "size": self.size,
                "session": self.session, "path": self.path, "attached": self.attached}

    def status(self) -> dict[str, Any]:
        return dict(self.saved(), state=self.state)


class Follows:
    """The sessions this node follows, each in its own task; persisted in follows.json."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.follows: PersistedTasks[Follow] = PersistedTasks(node.paths.home / FOLLOWS_FILE, self._run)
        self.epoch = f"{os.getpid()}-{time.time_ns()}"
        """Changes when the node restarts: a `follow` printing events starts over from 0."""
        self._seq = 0
        self._arrived = asyncio.Event()
        self._reaper: asyncio.Task[None] | None = None
        self._ended: dict[str, Follow] = {}
        """Follows that ended by themselves (`_end`), the last ENDED_KEPT: their command is yet
        to read the event that says why."""

    def routes(self) -> dict[str, Callable[[dict[str, Any]], Awaitable[Any]]]:
        return {"follow": self._c_follow, "follow-events": self._c_events, "unfollow": self._c_unfollow}

    async def start(self) -> None:
        fields = {f.name for f in dataclasses.fields(Follow)} - {"events", "task", "state", "asking", "asked"}
        for entry in self.follows.load():
            if isinstance(entry.get("key"), str):
                self.follows.begin(entry["key"], Follow(**{k: v for k, v in entry.items() if k in fields}))
        self._reaper = asyncio.create_task(self._end_unattended())

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        await self.follows.close()

    async def _end_unattended(self) -> None:
        """End each attached follow whose command stopped asking for its events ATTACHED_GRACE
        ago (a restarted node gives the command that long to come back)."""
        while True:
            await asyncio.sleep(ATTACHED_CHECK)
            now = time.monotonic()
            gone = [f for f in self.follows if f.attached and not f.asking and now - f.asked > ATTACHED_GRACE]
            for f in gone:
                await self.follows.remove(f.key)
                log.info("follow %s: ended, its `follow` command went away %g s ago without stopping it",
                         f.key[:16], ATTACHED_GRACE)

    def status(self) -> list[dict[str, Any]]:
        return self.follows.status()

    async def stop_holding(self, branches: Collection[str]) -> list[str]:
        """`p2pnode rm` of what a follow fetched (or asked for): the follow ends first, else it
        would fetch the session again, whole, at its next version.  The keys of those ended."""
        ended = [f.key for f in self.follows if _follows_one_of(f.saved(), branches)]
        for key in ended:
            await self.follows.remove(key)
            log.info("follow %s: ended, `p2pnode rm` removed what it fetched", key[:16])
        return ended

    def _event(self, f: Follow, kind: str, **fields: Any) -> None:
        self._seq += 1
        f.events.append(dict(fields, seq=self._seq, kind=kind, time=time.time(), key=f.key))
        self._arrived.set()
        self._arrived = asyncio.Event()

    # -- control endpoints ------------------------------------------------------------------

    async def _c_follow(self, body: dict[str, Any]) -> dict[str, Any]:
        key = body.get("target")
        peers = body.get("peers") or []
        if not isinstance(key, str) or not (is_session_id(key) or wire.is_ticket(key) or _HEX.fullmatch(key)):
            raise InvalidInput(f"follow: {str(key)[:80]!r} is not a session id, branch hash or ticket")
        if not isinstance(peers, list) or not all(isinstance(p, str) for p in peers):
            raise InvalidInput("follow: 'peers' must be a list of [NODEID@]HOST:PORT")
        parsed = [PeerAddress.parse(p) for p in peers]
        if wire.is_ticket(key):
            ticket = wire.decode_ticket(key)
            from p2pnode.peer.nodeid import format_node_id

            parsed += [PeerAddress(format_node_id(ticket.node), h, port) for h, port in ticket.addresses]
            key = ticket.branch.hex()
        if offers.is_prefix(key):  # as `fetch` takes one: the branch the peers offer that starts so
            asked = parsed or self.node.trusted_online()
            key, _ = await offers.resolve_prefix(key, asked, self.node.identity, self.node.trust)
        elif is_session_id(key):  # as `fetch`: the one offered id that starts so (several: NotFound)
            key = await self._session_id(key, parsed or self.node.trusted_online())
        if not is_session_id(key):
            key = wire.check_hex_hash(key, "branch hash")
        pi = body.get("pi")
        if pi is not None:
            try:
                PiDirs.from_dict(pi if isinstance(pi, dict) else {})
            except ValueError as exc:
                raise InvalidInput(f"follow: pi: {exc}") from None
        attached = body.get("attached") is True
        f = self.follows.add(key, Follow(key, [str(p) for p in parsed], pi, attached=attached))
        if f.attached and not attached:  # --detach of a follow a command prints: the node's now
            f.attached = False
            self.follows.save()
        f.asked = time.monotonic()
        return {"key": key, "epoch": self.epoch, **f.status()}

    async def _session_id(self, text: str, peers: list[PeerAddress]) -> str:
        """The session id `text` starts among what the peers answering now offer; `text` itself
        when none does (a session not shared yet is followed from when it is: _poll)."""
        answers = await offers.ask_catalogs(offers.by_node(peers), self.node.identity, self.node.trust)
        return _session_id(text, [a.catalog for a in answers if a.catalog is not None])

    async def _c_unfollow(self, body: dict[str, Any]) -> dict[str, Any]:
        key = body.get("key")
        if isinstance(key, str) and wire.is_ticket(key):
            key = wire.decode_ticket(key).branch.hex()
        f = await self.follows.remove(key) if isinstance(key, str) else None
        if f is None:
            raise NotFound(f"not following {str(key)[:80]!r}")
        return f.status()

    async def _c_events(self, body: dict[str, Any]) -> dict[str, Any]:
        """Events of one follow after `after` (its seq), waiting up to EVENTS_WAIT s for one."""
        key, after = body.get("key"), body.get("after", 0)
        if not isinstance(after, int) or isinstance(after, bool):
            raise InvalidInput("follow-events: 'after' must be an integer")
        wait = body.get("wait")
        wait = min(float(wait), EVENTS_WAIT) if isinstance(wait, int | float) and wait >= 0 else EVENTS_WAIT
        deadline = asyncio.get_running_loop().time() + wait
        asker = self.follows.get(key) if isinstance(key, str) else None
        if asker is not None:
            asker.asking += 1
        try:
            while True:
                f = self.follows.get(key) if isinstance(key, str) else None
                told = f or (self._ended.get(key) if isinstance(key, str) else None)  # why it ended
                new = [e for e in told.events if e["seq"] > after] if told else []
                left = deadline - asyncio.get_running_loop().time()
                if new or f is None or left <= 0:
                    return {"events": new, "epoch": self.epoch, "following": f is not None,
                            "state": f.state if f else None}
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._arrived.wait(), left)
        finally:
            if asker is not None:
                asker.asking -= 1
                asker.asked = time.monotonic()

    # -- one follow -------------------------------------------------------------------------

    async def _run(self, f: Follow) -> None:
        delay = 1.0
        while True:
            try:
                await self._watch(f)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the peer went away, or a fetch failed: try again later
                if (final := _final(exc)) is not None:
                    return self._end(f, final)
                why = str(exc) or type(exc).__name__
                f.state = f"waiting: {why}"
                self._event(f, "waiting", message=f"{why}; trying again in {delay:g} s")
                log.info("follow %s: %s; again in %g s", f.key[:16], why, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX)
            else:
                delay = 1.0

    def _end(self, f: Follow, error: P2PNodeError) -> None:
        """End follow `f` for `error`, which trying again cannot mend: its command is told (a
        `failed` event with the error's exit code) and it is no longer followed, nor after a restart."""
        f.state = f"failed: {error}"
        self._event(f, "failed", message=f"{error} (the follow ended: trying again cannot mend that)",
                    exit_code=error.exit_code)
        self.follows.forget(f.key)
        self._ended[f.key] = f
        while len(self._ended) > ENDED_KEPT:
            del self._ended[next(iter(self._ended))]
        log.warning("follow %s: ended: %s", f.key[:16], error)

    async def _peers(self, f: Follow) -> list[PeerAddress]:
        if f.peers:
            return [PeerAddress.parse(p) for p in f.peers]
        if f.branch is not None or not is_session_id(f.key):
            found = await self.node.holders(f.branch or f.key)
        else:
            found = lan_peers(self.node)
        if not found:
            raise PeerUnavailable("no trusted peer on the LAN offers it now")
        return found

    async def _watch(self, f: Follow) -> None:
        """Long-poll one peer's catalog after another until one answers; fetch what is new."""
        failures = []
        for address in await self._peers(f):
            limits = dataclasses.replace(wire.DEFAULT_LIMITS,
                                         slow_reader_timeout=wire.DEFAULT_LIMITS.catalog_wait + 10)
            connections = Connections()
            link = PeerLink(address, self.node.identity, self.node.trust, limits, connections)
            try:
                await self._poll(f, link, connections)
            except Exception as exc:  # this peer is gone or refuses: the next one
                if _final(exc) is not None:  # not the peer's doing: no other peer does better
                    raise
                failures.append(f"{address}: {exc or type(exc).__name__}")
            finally:
                await connections.close()
        raise PeerUnavailable("; ".join(failures) or "no peer answered")

    async def _poll(self, f: Follow, link: PeerLink, connections: Connections) -> None:
        """The first catalog as `fetch` reads one (a peer that hangs up on each handshake does
        not trust this node: Refused, saying what its user must run), then long polls on the
        same connection."""
        generation: int | None = None
        loop = asyncio.get_running_loop()
        last = -MIN_POLL_INTERVAL
        while True:
            await asyncio.sleep(max(0.0, last + MIN_POLL_INTERVAL - loop.time()))
            last = loop.time()
            try:
                if generation is None:
                    node = self.node
                    first = get_catalog(link.addr, node.identity, node.trust, link.limits, connections)
                    catalog = await asyncio.wait_for(first, POLL_TIMEOUT)
                else:
                    path = f"{wire.PATH_CATALOG}?wait={generation}"
                    body = link.get_small(path, link.limits.max_catalog_bytes, "catalog")
                    catalog = wire.decode_catalog(await asyncio.wait_for(body, POLL_TIMEOUT), link.limits)
            except TimeoutError:
                raise PeerUnavailable(f"peer {link.addr}: its catalog was not in within {POLL_TIMEOUT:g} s") \
                    from None
            offered = {e.branch for e in catalog.branches}
            target = f.branch if f.branch in offered else f.session or f.key
            if f.session is None and target == f.key and is_session_id(target):  # the start of an id
                target = _session_id(target, [catalog])
            newest = newest_entry(catalog.branches, target)
            if newest is None:
                raise NotFound(f"peer {link.addr} does not offer {f.key}")
            if f.state != "following":
                f.state = "following"
                self._event(f, "following", peer=str(link.addr), branch=newest.branch, title=newest.title)
            if newest.branch != f.branch and (f.branch is None or newest.size > f.size):
                await self._fetch(f, newest, link.addr)
            generation = catalog.generation

    async def _fetch(self, f: Follow, entry: wire.CatalogEntry, address: PeerAddress) -> None:
        from p2pnode.node.daemon import FETCH_LIMITS

        lib = self.node.lib
        pi = PiDirs.from_dict(f.pi) if f.pi else lib.pi_dirs(os.getcwd())
        def held_here() -> BranchInfo | None:  # what this follow has, else that version itself if held
            known = f.branch if f.branch and lib.has_branch(f.branch) else entry.branch
            return lib.branch(known) if lib.has_branch(known) else None

        held = await asyncio.to_thread(held_here)  # what is new is counted from it
        before = held.lines if held else 0
        session_id = entry.header.get("id")
        newest = Newest(entry.branch, [address], None, f.session if f.session and held is None else None,
                        (held.src, held.size) if held else None,  # checked before it is placed
                        session_id if isinstance(session_id, str) else None)
        result = await fetch_newest(lib, newest, self.node.identity, self.node.trust, agent_dir=pi.agent,
                                    limits=FETCH_LIMITS, session_dir=pi.sessions)
        info = await asyncio.to_thread(lib.branch, entry.branch)
        turns, words = await asyncio.to_thread(lambda: summary(new_lines(lib, info.src, before)))
        f.branch, f.size, f.session, f.path = entry.branch, info.size, info.header.get("id"), result.path
        self.follows.save()
        self._event(f, "version", branch=entry.branch, version=entry.version, lines=info.lines,
                    new_lines=info.lines - before, turns=turns, words=words, path=result.path,
                    written=result.written, conflict=result.conflict, from_peer=str(address))
        log.info("follow %s: version %s (%d lines, +%d) from %s", f.key[:16], entry.branch[:16], info.lines,
                 info.lines - before, address)
        self.node.announce_soon()  # the catalog's generation moved (the fetched branch is not offered)


def _final(exc: BaseException) -> P2PNodeError | None:
    """The error that ends a follow, for a failure trying again cannot mend: a path of this
    node's that the system refuses (too long, not a directory, not this user's, a name the file
    system does not take: CALLERS_PATH_ERRNOS), exit 4.  None for one that may pass: a peer
    offline or lying, a directory Pi has not made yet (ENOENT), a full disk."""
    return callers_path_error(exc) if isinstance(exc, OSError) and exc.filename is not None else None


def _follows_one_of(saved: dict[str, Any], branches: Collection[str]) -> bool:
    return saved.get("key") in branches or saved.get("branch") in branches


def unfollow_saved(home: Path, branches: Collection[str]) -> list[str]:
    """Follows.stop_holding with no node running: those follows are dropped from follows.json
    (a node started later would take them up).  The keys of those dropped."""
    saved = PersistedTasks[Follow](home / FOLLOWS_FILE, lambda f: asyncio.sleep(0))
    return [str(e.get("key")) for e in saved.drop_saved(lambda e: _follows_one_of(e, branches))]


def lan_peers(node: Node) -> list[PeerAddress]:
    """Every trusted peer the node sees on the LAN that has not failed its last probe."""
    if node.discovery is None:
        return []
    return [PeerAddress(p.node_id, host, p.port) for p in node.discovery.peers.values()
            if p.online is not False and node.is_trusted(p.node_id) for host in p.addresses]
