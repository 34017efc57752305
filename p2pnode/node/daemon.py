"""The always-on node behind `p2pnode serve`, with the server side of its control channel.

One process owns the node's state while it runs (the store lock): it opens the session
library, serves the store on its Unix socket, serves peers over HTTPS (mutual TLS), announces
itself and its branches over mDNS and browses for peers.  mDNS only says who claims to be
there; a trusted peer counts as online when it answered over HTTPS within the last probe
(every LIVENESS_INTERVAL s, so a peer that vanished without a goodbye is noticed within
LIVENESS_INTERVAL + LIVENESS_TIMEOUT s).

The CLI's `share`, `unshare`, `fetch`, `status`, `peers`, `ls`, `show` and `cat` go through
the running node when there is one (node/control_client.py: JSON over HTTP on
`<home>/control.sock`, mode 0600) and act on their own when there is not (a one-shot fetch
browses mDNS itself with `discovery.lan_peers`).  Control endpoints (all POST, JSON in and
out; errors carry the CLI exit code):
    /v1/status {}                                     -> await Node.status()
    /v1/share {"target", "latest", "no_lineage", "cwd", "pi", "allow_secrets", "redact", "expires", "to"}
                                                      -> ShareResult.as_dict() + "fetch", "ticket"
                                (with "stream": true, NDJSON: {"event": "progress", bytes_done,
                                bytes_total, rate, eta, ...} while it runs, then the result or an
                                error: node/answers.py; the command going away does not stop it)
    /v1/unshare {"branch"}                            -> Unshared.as_dict() + "live_stopped": [path...]
    /v1/fetch {"branch", "peers": ["[ID@]HOST:PORT"], "pi", "exact"} -> FetchResult.as_dict() + "note"
                                (streamed, in the background, cancelled: node/transfers.py)
    /v1/cancel, /v1/browse                            -> node/transfers.py
`pi` is the caller's `PiDirs.as_dict()` ({"agent_dir", "session_dir"}): the CLI's own Pi
environment and --session-dir count, not the node's (without it: the node's).
    /v1/read {"call": one of READ_CALLS, "args": [...]} -> {"value": ...} or {"b64": ...}
                                                     (control.NodeLibrary: `ls`, `show`, `cat`)
    /v1/cat {"src"}                                   -> NDJSON: {"event": "data", "b64"} per run of
                                                     the session, then a result or an error (`cat`,
                                                     `cat --json`)
    /v1/gc, /v1/rm                                    node/upkeep.py (with background GC; streamed
                                                     like share with "stream": true)
    /v1/follow, /v1/follow-events, /v1/unfollow      -> node/follow.py (`p2pnode follow`)
    /v1/live, /v1/unlive                              -> node/live.py (`share --live`, `live --stop`)
    /v1/pair/start, /v1/pair/wait, /v1/pending,        -> node/pairing.py (`pair`, `peers --pending`,
    /v1/trust/reload                                     `trust`, `untrust`)
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import errno
import functools
import gc
import json
import logging
import os
import signal
import stat
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from p2pnode.discovery.mdns import Discovery, Peer, listen_addresses
from p2pnode.errors import InvalidInput, P2PNodeError, PeerUnavailable, Refused, from_store, listen_failed
from p2pnode.library.api import Library, ShareResult
from p2pnode.node import upkeep
from p2pnode.node.answers import known_error, streamed
from p2pnode.node.control_client import READ_CALLS, socket_answers, store_in_use
from p2pnode.node.follow import Follows, fetch_newest, lan_peers, newest_to_fetch
from p2pnode.node.live import LiveShares, unshare_live
from p2pnode.node.pairing import NodePairing
from p2pnode.node.routing import share_handoff, ticket_addresses
from p2pnode.node.status import build_status, trusted_peer
from p2pnode.node.transfers import Transfers
from p2pnode.paths import NodePaths, PiDirs
from p2pnode.peer.address import PeerAddress
from p2pnode.peer.get import get_catalog
from p2pnode.peer.identity import load_or_create_identity, own_name
from p2pnode.peer.nodeid import parse_node_id
from p2pnode.peer.progress import ProgressInfo, ProgressMeter
from p2pnode.peer.provider import PeerServer
from p2pnode.peer.trust import TrustStore
from p2pnode.peer.wire import DEFAULT_LIMITS
from p2pnode.pi.session import is_session_id
from p2pnode.pi.sidecar import is_hash_hex
from store.errors import StoreError
from store.service.server import StoreServer
from sysio.memory import one_arena

log = logging.getLogger("p2pnode.node")

DEFAULT_PORT = 47470
LIVENESS_INTERVAL = 5.0
LIVENESS_TIMEOUT = 4.0
HOLDER_QUERY_SECONDS = 2.0
ANNOUNCE_EVERY = 5.0
"""Versions come fast while Pi writes a live file: peers waiting for a change hear of each at
once, mDNS (three multicasts per record) of the latest at most this often."""
CONTROL_MAX_BODY = 1 << 20
"""Largest control request body (bytes); more is answered 413.  Real ones are under 1 KiB."""
CAT_EVENT = 512 << 10
"""Session bytes per event of /v1/cat: base64 within the client's CONTROL_MAX_EVENT (1 MiB)."""
FETCH_LIMITS = dataclasses.replace(DEFAULT_LIMITS, slow_reader_timeout=8.0)
"""A holder whose link stalls this long is left for the next one (a LAN peer is near or gone)."""


@dataclass(frozen=True)
class NodeConfig:
    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT        # 0: any free port; the default falls back to a free one if taken
    mdns: bool = True
    agent_dir: Path | None = None


# --- the node --------------------------------------------------------------------------------


class Node:
    def __init__(self, paths: NodePaths, config: NodeConfig = NodeConfig()):
        self.paths = paths.ensure()
        self.config = config
        self.port = 0
        self.transfers = Transfers(self)
        self._stack = contextlib.AsyncExitStack()
        self._tasks: list[asyncio.Task[None]] = []
        self._announce_lock = asyncio.Lock()
        self._announcer: asyncio.Task[None] | None = None
        self._announce_again = False
        self.discovery: Discovery | None = None

    async def start(self) -> None:
        """Bring every part up; on failure, close what was started and re-raise."""
        try:
            await self._start()
        except BaseException:
            await self.close()
            raise

    async def _start(self) -> None:
        one_arena()  # before the library's threads: the node moves whole sessions (sysio/memory.py)
        if socket_answers(self.paths.control_socket):  # before waiting on the store's lock
            raise await asyncio.to_thread(store_in_use, self.paths, "start a node")
        self.identity = load_or_create_identity(self.paths.identity)
        self.trust = TrustStore(self.paths.trust)
        self.lib = await asyncio.to_thread(Library.open, self.paths, self.config.agent_dir)
        self._stack.callback(self.lib.close)
        self.follows, self.live = Follows(self), LiveShares(self)
        store_server = StoreServer(self.lib.store, str(self.paths.store_socket))
        await store_server.start()
        self._stack.push_async_callback(store_server.close)
        await asyncio.to_thread(self.lib.scan_unrecorded)  # shares from before scans were recorded
        self._warm(None)  # the newest offered versions
        peers = await self._listen()
        self._stack.push_async_callback(peers.close)
        self.port = peers.port
        self.peer_server = peers
        await self._start_control()
        self._stack.push_async_callback(self.transfers.close)
        if self.config.mdns:
            self.discovery = Discovery(self.identity.node_id, on_change=self._peer_event,
                                       name=own_name(self.paths.identity))
            await self.discovery.start()
            self._stack.push_async_callback(self.discovery.close)  # closes first: the goodbye
            await self.announce()
            self._tasks.append(asyncio.ensure_future(self._liveness()))
            upkeep.announce_on_change(self)
        self._tasks.append(asyncio.ensure_future(upkeep.background_gc(self.lib, peers.served_within)))
        for part in (self.follows, self.live):  # node/follow.py, node/live.py: resumed after a restart
            await part.start()
            self._stack.push_async_callback(part.close)
        gc.freeze()  # what start-up made lives as long as the node: no collection walks it again
        log.info("node %s serving on port %d (store %s)", self.identity.node_id, self.port,
                 self.paths.store_socket)

    async def close(self) -> None:
        if self._announcer is not None:
            self._tasks.append(self._announcer)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        await self._stack.aclose()

    async def _listen(self) -> PeerServer:
        """The peer server on the configured port; a taken default port falls back to a free one."""
        host, port = self.config.host, self.config.port
        while True:
            server = PeerServer(self.lib, self.identity, self.trust, DEFAULT_LIMITS)
            try:
                await server.start(host, port)
                return server
            except OSError as exc:
                await server.close()
                if exc.errno != errno.EADDRINUSE or port != DEFAULT_PORT:
                    raise listen_failed(host, port, exc) from exc
                log.warning("port %d is taken; listening on a free port instead", DEFAULT_PORT)
                port = 0

    async def _start_control(self) -> None:
        path = self.paths.control_socket
        app = web.Application(middlewares=[_errors_as_json], client_max_size=CONTROL_MAX_BODY)
        routes: dict[str, Callable[[dict[str, Any]], Awaitable[Any]]] = {
            "status": self._c_status, "share": self._c_share, "unshare": self._c_unshare,
            "read": self._c_read, "cat": self._c_cat, **self.transfers.routes(), **upkeep.routes(self),
            **self.follows.routes(), **self.live.routes()}
        pairing = NodePairing(self)  # pair/start, pair/wait, pending (node/pairing.py)
        self._stack.push_async_callback(pairing.close)
        routes.update(pairing.routes())
        for name, fn in routes.items():
            app.router.add_post(f"/v1/{name}", _json_handler(fn))
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)  # a caller gone: stop
        await runner.setup()
        self._stack.push_async_callback(runner.cleanup)
        self._stack.callback(lambda: path.unlink(missing_ok=True))
        site, bound = await _bind_control(runner, path)
        self._tasks.append(asyncio.ensure_future(_keep_control(runner, path, site, bound)))

    # -- mDNS and liveness ------------------------------------------------------------------

    async def announce(self) -> None:
        """(Re-)announce the catalog: generation and the most recently shared branches first."""
        self.peer_server.notify_changed()  # peers waiting for a change ask again (node/follow.py)
        if self.discovery is None:
            return
        async with self._announce_lock:
            catalog = await asyncio.to_thread(self.lib.catalog)  # what every trusted peer may see
            newest = sorted(catalog.branches, key=lambda b: b.shared_at or 0, reverse=True)
            recent = [b.branch for b in newest]
            await self.discovery.announce(self.port, catalog.generation, recent)

    def announce_soon(self) -> None:
        """Answer the peers waiting for a change now; announce the catalog over mDNS in the
        background.  A registration is three broadcasts 225 ms apart (a new branch's subtype is
        probed first, ~1 s), so no control answer waits for it; changes that come while one is
        sent (a live file Pi is writing) coalesce into one more, at most every ANNOUNCE_EVERY s."""
        self.peer_server.notify_changed()
        self._announce_again = True
        if self._announcer is None or self._announcer.done():
            self._announcer = asyncio.ensure_future(self._announce_pending())

    async def _announce_pending(self) -> None:
        while self._announce_again:
            self._announce_again = False
            try:
                await self.announce()
            except Exception as exc:  # mDNS trouble must not fail what was already shared
                log.warning("announcing the catalog failed: %s", exc)
            if self._announce_again:
                await asyncio.sleep(ANNOUNCE_EVERY)

    def is_trusted(self, node_id: str) -> bool:
        try:
            return self.trust.is_trusted(parse_node_id(node_id))
        except InvalidInput:
            return False

    def _peer_event(self, what: str, peer: Peer) -> None:
        if what == "seen" and not self.is_trusted(peer.node_id):
            log.info("peer %s is not trusted: listed, never fetched from or served "
                     "(`p2pnode trust %s` to allow it)", peer.node_id, peer.node_id)

    async def _liveness(self) -> None:
        while True:
            await asyncio.to_thread(self.trust.reload_if_changed)
            assert self.discovery is not None
            trusted = [p for p in self.discovery.peers.values() if self.is_trusted(p.node_id)]
            await asyncio.gather(*(self._probe(p) for p in trusted))
            await asyncio.sleep(LIVENESS_INTERVAL)

    async def _probe(self, peer: Peer) -> None:
        """Ask a trusted peer for its catalog over HTTPS at each of its addresses; an answer at
        any of them, not mDNS, is liveness."""
        async def ask(address: PeerAddress) -> None:
            await asyncio.wait_for(get_catalog(address, self.identity, self.trust), LIVENESS_TIMEOUT)

        addresses = self._addresses(peer, every=True)  # where it is announced too: it may have moved
        outcomes = await asyncio.gather(*(ask(a) for a in addresses), return_exceptions=True)
        failures = [o for o in outcomes if isinstance(o, BaseException)]
        ok = len(failures) < len(outcomes)
        answered = [a for a, o in zip(addresses, outcomes, strict=True) if not isinstance(o, BaseException)]
        if answered:  # its key, proven there: kept whatever is announced later
            peer.proven = (answered[0].host, answered[0].port)
        why = "; ".join(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__ for e in failures)
        was = peer.online
        peer.online = ok
        # one-sided trust: every address hung up after the handshake (downloader._one_sided)
        peer.trusts_us = True if ok else False if all(
            isinstance(e, Refused) and "does not trust this node" in str(e) for e in failures) else None
        if ok and was is not True:
            log.info("peer online id=%s at %s", peer.node_id, ", ".join(str(a) for a in answered))
        elif not ok and was is not False:
            log.info("peer %s id=%s (no answer over HTTPS: %s)", "lost" if was else "unreachable",
                     peer.node_id, why)
        if not ok and self.discovery is not None:  # the announcement may be a forged one: ask again
            await self.discovery.resolve_again(peer.node_id)

    def _addresses(self, peer: Peer, every: bool = False) -> list[PeerAddress]:
        """Where to reach `peer`: where it proved its key at the last probe that answered, alone
        while it is online (addresses announced beside it may be forged: each would take a
        share of a fetch and cost it a connect timeout), else (or `every`) that first, then
        where it is announced.  A peer found by a subtype query: the table's entry knows it."""
        known = self.discovery.peers.get(peer.node_id) if self.discovery is not None else None
        if known is not None and peer is not known:
            peer = dataclasses.replace(peer, proven=known.proven, online=known.online)
        endpoints = peer.endpoints()
        if peer.proven is not None and peer.online and not every:
            endpoints = endpoints[:1]
        return [PeerAddress(peer.node_id, host, port) for host, port in endpoints]

    async def holders(self, branch_hex: str) -> list[PeerAddress]:
        """Trusted peers to fetch branch_hex from: announced holders first, then other online peers."""
        if self.discovery is None:
            return []
        found = await self.discovery.find_holders(branch_hex, HOLDER_QUERY_SECONDS)
        refused = [p.node_id for p in found if not self.is_trusted(p.node_id)]
        if refused:
            log.info("fetch %s: not asking untrusted holders %s", branch_hex[:16], ", ".join(refused))
        holders = [p for p in found if self.is_trusted(p.node_id)]
        ids = {p.node_id for p in holders}
        others = [p for p in self.discovery.peers.values()
                  if p.node_id not in ids and p.online and self.is_trusted(p.node_id)]
        # holders that failed the last probe go last: the fetch then says why they failed
        ordered = sorted(holders, key=lambda p: p.online is False) + others
        return [address for p in ordered for address in self._addresses(p)]

    # -- what the CLI asks for --------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        catalog, branches, space = await asyncio.to_thread(
            lambda: (self.lib.catalog(), self.lib.branches(), self.lib.space()))
        peers = list(self.discovery.peers.values()) if self.discovery else []
        seen = {p.node_id for p in peers}
        listed = [dict(p.as_dict(), trusted=True) if self.is_trusted(p.node_id)
                  else dict(p.as_dict(), trusted=False, online=None) for p in peers]
        connected = self.peer_server.connected_peers()  # online, mDNS or not
        unseen = False if self.discovery else None  # with mDNS off, not seen says nothing
        listed += [trusted_peer(t, True if t.node_id in connected else unseen)
                   for t in self.trust.peers() if t.node_id not in seen]
        names = {t.node_id: t.name for t in self.trust.peers()}
        for entry in listed:
            entry.setdefault("name", names.get(str(entry["node_id"])))
        return build_status(node_id=self.identity.node_id, running=True, home=str(self.paths.home),
                            catalog=catalog, branches=branches,
                            peers=sorted(listed, key=lambda e: (not e["trusted"], e["node_id"])),
                            addresses=await asyncio.to_thread(listen_addresses, self.config.host),
                            port=self.port, mdns=self.discovery is not None,
                            transfers=self.transfers.listed(), space=space,
                            following=self.follows.status(), live=self.live.status(),
                            announced=self.discovery.announced_addresses if self.discovery else [],
                            store_failure=self.lib.store.failure)

    async def _c_read(self, body: dict[str, Any]) -> dict[str, Any]:
        call, args = _field(body, "call", str), _field(body, "args", list) or []
        if call not in READ_CALLS:
            raise InvalidInput(f"control: {call!r} is not a read-only library call")
        if not all(isinstance(a, str | bool) for a in args):
            raise InvalidInput("control: read arguments must be strings or booleans")
        value = await asyncio.to_thread(getattr(self.lib, str(call)), *args)
        if isinstance(value, bytes):
            return {"b64": base64.b64encode(value).decode()}
        if isinstance(value, list):
            return {"value": [v.as_dict() for v in value]}
        return {"value": value.as_dict()}

    async def _c_cat(self, body: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        """Session `src` as NDJSON events of CAT_EVENT bytes, from Library.session_runs: `cat`
        through the node, never whole in memory on either side; the end is a result or an error."""
        src = _field(body, "src", str)
        if not isinstance(src, str) or not is_hash_hex(src):
            raise InvalidInput("control: 'src' must be a session hash (64 hex digits)")
        runs = self.lib.session_runs(src)

        async def events() -> AsyncGenerator[dict[str, Any], None]:
            size = 0
            try:
                while (run := await asyncio.to_thread(next, runs, None)) is not None:
                    size += len(run)
                    for at in range(0, len(run), CAT_EVENT):
                        yield {"event": "data", "b64": base64.b64encode(run[at:at + CAT_EVENT]).decode()}
            except (P2PNodeError, StoreError) as exc:  # a damaged record: as `cat` without a node says
                error = exc if isinstance(exc, P2PNodeError) else from_store(exc, "the node's store",
                                                                              "cat again")
                if error is None:
                    raise
                yield {"event": "error", "message": str(error), "exit_code": error.exit_code}
                return
            yield {"event": "result", "result": {"src": src, "size": size}}

        return events()

    async def _c_status(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self.status()

    async def _c_share(self, body: dict[str, Any]) -> dict[str, Any] | AsyncGenerator[dict[str, Any], None]:
        cwd, target = _field(body, "cwd", str) or None, _field(body, "target", str) or None
        if cwd and target and not os.path.isabs(target) and (Path(cwd) / target).exists():
            target = str(Path(cwd) / target)  # a path relative to the caller, not to the node
        share = functools.partial(self.lib.share, target, latest=bool(_field(body, "latest", bool)),
                                  no_lineage=bool(_field(body, "no_lineage", bool)), cwd=cwd,
                                  pi=_pi_dirs(body), allow_secrets=bool(_field(body, "allow_secrets", bool)),
                                  redact=bool(_field(body, "redact", bool)),
                                  expires=_field(body, "expires", str), to=_field(body, "to", list, str))
        if body.get("stream") is not True:
            return await self._shared(await asyncio.to_thread(share))
        meter = ProgressMeter()
        return streamed(functools.partial(share, progress=meter), self._shared,
                        lambda: meter.current.as_dict(), self._shared_meanwhile)

    async def _shared(self, result: ShareResult) -> dict[str, Any]:
        log.info("shared %s (%s)", result.branch, result.path)
        self.live.restate(result)
        self.announce_soon()
        handoff = await asyncio.to_thread(self._share_handoff, result.branch)
        self._warm([result.src])  # after: its manifest holds the library's lock the handoff takes
        return dict(result.as_dict(), **handoff)

    def _shared_meanwhile(self, result: ShareResult) -> None:
        log.info("shared %s (%s; its command went away)", result.branch, result.path)
        self.live.restate(result)
        self.announce_soon()
        self._warm([result.src])

    def _warm(self, srcs: list[str] | None) -> None:
        """The line manifests of `srcs` built on a thread, before peers ask (upkeep.warm_manifests)."""
        self._tasks = [t for t in self._tasks if not t.done()]  # one per share: those ended go
        self._tasks.append(asyncio.ensure_future(asyncio.to_thread(upkeep.warm_manifests, self.lib, srcs)))

    def _share_handoff(self, branch: str) -> dict[str, Any]:
        """The fetch command and ticket `share` prints (node/routing.share_handoff), answered
        with the share: the CLI then needs no second round trip, no identity and no library."""
        held = [b.branch for b in self.lib.branches(include_unshared=True)]
        addresses = ticket_addresses({"port": self.port, "addresses": listen_addresses(self.config.host)})
        return share_handoff(branch, held, self.identity.fingerprint, addresses)

    async def _c_unshare(self, body: dict[str, Any]) -> dict[str, Any]:
        loop = asyncio.get_running_loop()

        def unlive(branches: list[str]) -> list[str]:  # from unshare's thread: live shares run on the loop
            return asyncio.run_coroutine_threadsafe(self.live.stop_offering(branches), loop).result()

        done = await asyncio.to_thread(unshare_live, self.lib, _field(body, "branch", str) or "", unlive)
        log.info("unshared %s", done["branch"])
        self.announce_soon()
        return done  # the branch in full: a prefix names it

    def trusted_online(self) -> list[PeerAddress]:
        """Every address of every trusted peer whose last probe answered (whom `browse` asks)."""
        peers = self.discovery.peers.values() if self.discovery else []
        return [a for p in peers if p.online and self.is_trusted(p.node_id) for a in self._addresses(p)]

    async def _c_fetch(self, body: dict[str, Any], progress: ProgressMeter | None = None) -> dict[str, Any]:
        """The fetch itself (run as a transfer by node/transfers.py, which reports `progress`)."""
        branch = _field(body, "branch", str) or ""
        peers = [PeerAddress.parse(text) for text in _field(body, "peers", list, str) or []]
        pi = _pi_dirs(body) or self.lib.pi_dirs(os.getcwd())
        while not self.lib.leases.try_acquire():  # no GC while this fetch stores lines
            await asyncio.sleep(0.05)
        try:
            async with asyncio.timeout(FETCH_LIMITS.fetch_timeout):
                newest = await newest_to_fetch(branch, peers, self.identity, self.trust, self._candidates,
                                               exact=bool(_field(body, "exact", bool)))  # the latest version
                peers = newest.peers or await self.holders(newest.branch)
                if not peers:
                    raise PeerUnavailable(f"branch {newest.branch}: no trusted peer on the LAN offers it")
                if progress is not None:
                    progress(0, 0, ProgressInfo(peers=tuple(str(p) for p in peers)))
                result = await fetch_newest(self.lib, dataclasses.replace(newest, peers=peers), self.identity,
                                            self.trust, agent_dir=pi.agent, progress=progress,
                                            limits=FETCH_LIMITS, session_dir=pi.sessions)
        except TimeoutError:
            raise PeerUnavailable(f"fetch {branch}: not done after {FETCH_LIMITS.fetch_timeout:g} s; "
                                  "given up") from None
        except P2PNodeError as exc:
            log.info("fetch %s refused or failed: %s", branch, exc)
            raise
        finally:
            self.lib.leases.release()
        log.info("fetched %s", result.branch)
        self.announce_soon()
        return result.as_dict()

    async def _candidates(self, target: str) -> list[PeerAddress]:
        """Peers that may offer `target`: a branch's holders, or for a session id every
        trusted peer on the LAN (node/follow.py)."""
        return lan_peers(self) if is_session_id(target) else await self.holders(target)


# --- the control channel (JSON over HTTP on a Unix socket) ------------------------------------

CONTROL_CHECK_SECONDS = 5.0
"""How often the node looks that its control socket is still where commands look for it."""


async def _bind_control(runner: web.AppRunner, path: Path) -> tuple[web.UnixSite, int]:
    """The control socket listening at `path`, and its inode."""
    path.unlink(missing_ok=True)  # left by a node that was killed (a live one was refused)
    old = os.umask(0o177)  # the socket is born 0600: nobody else may drive this node
    try:
        site = web.UnixSite(runner, str(path))
        await site.start()
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    return site, os.stat(path).st_ino


async def _keep_control(runner: web.AppRunner, path: Path, site: web.UnixSite, bound: int) -> None:
    """A control socket removed or replaced while the node runs (a cleanup of the home, a
    mistaken `rm`) is made again: else every command would find no node and no store."""
    while True:
        await asyncio.sleep(CONTROL_CHECK_SECONDS)
        try:
            there = os.lstat(path)
            if there.st_ino == bound and stat.S_ISSOCK(there.st_mode):
                continue
        except FileNotFoundError:
            pass
        log.warning("the control socket %s was removed or replaced: listening there again", path)
        await site.stop()
        site, bound = await _bind_control(runner, path)


def _pi_dirs(body: dict[str, Any]) -> PiDirs | None:
    """The caller's Pi dirs from a control request (None: it sent none, the node's count)."""
    pi = body.get("pi")
    if pi is None:
        return None
    try:
        return PiDirs.from_dict(pi if isinstance(pi, dict) else {})
    except ValueError as exc:
        raise InvalidInput(f"control request: pi: {exc}") from None


@web.middleware
async def _errors_as_json(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every failure goes back as JSON with the CLI exit code, so the caller can report it."""
    try:
        try:
            return await handler(request)
        except Exception as exc:
            error = known_error(exc)
            if error is None or error is exc:
                raise
            raise error from None
    except P2PNodeError as exc:
        return web.json_response({"error": type(exc).__name__, "message": str(exc),
                                  "exit_code": exc.exit_code}, status=400)
    except web.HTTPRequestEntityTooLarge:
        return web.json_response({"error": "RequestTooLarge", "exit_code": InvalidInput.exit_code,
                                  "message": f"control request over {CONTROL_MAX_BODY} bytes"}, status=413)
    except ConnectionError:  # the command went away mid-answer (Ctrl-C, `cat | head`): no one to tell
        log.debug("control %s: the command went away", request.path)
        return web.Response(status=499)  # never sent: aiohttp drops it with the connection
    except Exception as exc:  # a bug or a store error: logged here, reported there
        log.exception("control %s failed", request.path)
        return web.json_response({"error": type(exc).__name__, "exit_code": 1, "message":
                                  f"the node failed: {exc or 'no details'} (its log has the traceback)"},
                                 status=500)


def _json_handler(fn: Callable[[dict[str, Any]], Awaitable[Any]]) -> Any:
    async def handle(request: web.Request) -> web.StreamResponse:
        """fn's answer as one JSON reply, or, when fn answers an async generator, as NDJSON events."""
        try:
            body = await request.json() if request.can_read_body else {}
        except (ValueError, RecursionError) as exc:
            raise InvalidInput(f"control request is not JSON: {type(exc).__name__}") from None
        if not isinstance(body, dict):
            raise InvalidInput("control request must be a JSON object")
        answer = await fn(body)
        if not isinstance(answer, AsyncGenerator):
            return web.json_response(answer)
        stream = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await stream.prepare(request)
        async with contextlib.aclosing(answer):  # closed early when the caller goes away
            async for event in answer:
                await stream.write(json.dumps(event).encode() + b"\n")
        await stream.write_eof()
        return stream

    return handle


def _field(body: dict[str, Any], key: str, kind: type, items: type | None = None) -> Any:
    """body[key] if it is a `kind` (a list: of `items`), or None if absent; any other type is
    InvalidInput, answered 400 (never a 500 from deeper down)."""
    value = body.get(key)
    if value is None:
        return None
    wrong = not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))
    if wrong or (items is not None and not all(isinstance(v, items) for v in value)):
        what = f"a list of {items.__name__}" if items else f"a {kind.__name__}"
        raise InvalidInput(f"control: {key!r} must be {what}, not {json.dumps(value)[:40]}")
    return value


# --- `p2pnode serve` ----------------------------------------------------------------------------


async def serve(paths: NodePaths, config: NodeConfig) -> None:
    """Run a node until SIGTERM or SIGINT, then say goodbye on mDNS and stop cleanly."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    node = Node(paths, config)
    await node.start()
    try:
        await stop.wait()
        log.info("stopping")
    finally:
        await node.close()
