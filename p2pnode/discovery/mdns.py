"""mDNS / DNS-SD announce and browse for p2pnode nodes on the LAN (python-zeroconf, IPv4);
the names and TXT records themselves are records.py's.

mDNS is a hint, not liveness: records a peer announced stay in caches long after it vanished
(zeroconf clamps PTR TTLs to >= 1125 s).  The node confirms a peer over HTTPS before it counts
it as online (`Peer.online`, set by `p2pnode.node.daemon`); this module only says who claims what.

Scheme (docs/PROTOCOL.md, "LAN discovery"):
  * one instance `<label>._p2pnode._tcp.local.` per node; `<label>` is derived from the node id,
    so names are unique by construction and probing is skipped (`cooperating_responders`);
  * its TXT: `v` protocol version, `id` node id, `port`, `gen` catalog generation, and
    `b0`, `b1`, ... the most recently shared branch hashes that fit in TXT_LIMIT bytes;
  * per offered branch (up to MAX_SUBTYPES) a DNS-SD subtype (RFC 6763 section 7.1)
    `_<first 16 hex>._sub._p2pnode._tcp.local.` pointing at a per-branch instance
    `<label>-<first 16 hex>` with the node's SRV/A and a short TXT (`v`, `id`, `port`), so
    "who holds branch X?" is one multicast query that only holders answer.

Usage:
    d = Discovery(my_node_id)              # my_node_id None: browse only (one-shot fetch)
    await d.start()
    await d.announce(port, generation, branches)   # again on every catalog change
    holders = await d.find_holders(branch_hex, timeout=3.0)
    d.peers                                  # node id -> Peer
    await d.close()                          # sends the goodbye
"""
from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ifaddr
from zeroconf import IPVersion, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from p2pnode.discovery.records import (
    MAIN_INSTANCE,
    MAX_SUBTYPES,
    PAIR_SERVICE_TYPE,
    SERVICE_TYPE,
    SUBTYPE_HEX,
    Announcement,
    BadAnnouncement,
    branch_instance_name,
    instance_label,
    instance_name,
    pair_instance_name,
    pair_subtype,
    pair_txt,
    parse_pair_txt,
    parse_txt,
    subtype_name,
)
from p2pnode.errors import InvalidInput
from p2pnode.logquota import LogQuota

if TYPE_CHECKING:
    from p2pnode.peer.address import PeerAddress

log = logging.getLogger("p2pnode.discovery")

REANNOUNCE_SECONDS = 45.0
INTERFACE_POLL_SECONDS = 5.0
RESOLVE_TIMEOUT_MS = 3000
MAX_ADDRESSES = 8
"""IPv4 addresses taken from one announcement (a machine has a few; a forged one could list
hundreds, each a connect timeout for a fetch)."""
FALLBACK_BROWSE_SECONDS = 1.2


@dataclass
class Peer:
    """A node seen on the LAN.  `online` is None until the node has asked it over HTTPS."""

    node_id: str
    instance: str
    addresses: tuple[str, ...]
    port: int
    generation: int
    branches: tuple[str, ...]
    online: bool | None = None
    name: str | None = None
    """The name it announces: a claim anyone on the LAN could make (trust.json's name wins)."""
    trusts_us: bool | None = None
    """False when it hung up on the node's last probe right after accepting its TLS handshake:
    one-sided trust (set by the node, like `online`)."""
    proven: tuple[str, int] | None = None
    """(host, port) where it last answered over mutual TLS with its own key (set by the node).
    Anyone on the LAN can announce under its name: an announcement never takes this away, and
    it is tried first."""

    def endpoints(self) -> list[tuple[str, int]]:
        """Where to reach it: where it last proved its key, then where it is announced."""
        announced = [(host, self.port) for host in self.addresses]
        return ([self.proven] if self.proven else []) + [e for e in announced if e != self.proven]

    def as_dict(self) -> dict[str, object]:
        return {"node_id": self.node_id, "instance": self.instance, "addresses": list(self.addresses),
                "port": self.port, "generation": self.generation, "branches": list(self.branches),
                "online": self.online, "announced_name": self.name, "trusts_us": self.trusts_us,
                "reached": f"{self.proven[0]}:{self.proven[1]}" if self.proven else None}


def local_ipv4_addresses() -> list[str]:
    """This machine's non-loopback IPv4 addresses (loopback only when there is nothing else)."""
    found = sorted({str(ip.ip) for adapter in ifaddr.get_adapters() for ip in adapter.ips
                    if ip.is_IPv4 and not ipaddress.ip_address(str(ip.ip)).is_loopback})
    return found or ["127.0.0.1"]


WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def listen_addresses(host: str) -> list[str]:
    """The IPv4 addresses a server bound to `host` really answers on: this machine's (as
    local_ipv4_addresses) for a wildcard bind, else `host` itself (a name resolved), so that
    tickets and status never name an address the node does not listen on."""
    if host in WILDCARD_HOSTS:
        return local_ipv4_addresses()
    try:
        return [str(ipaddress.IPv4Address(host))]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return []
    return sorted({str(info[4][0]) for info in infos})


# --- asyncio layer ------------------------------------------------------------------------


class Discovery:
    """Announces this node (when it has an id) and keeps a table of the peers it sees."""

    def __init__(self, node_id: str | None = None, *,
                 on_change: Callable[[str, Peer], None] | None = None, name: str | None = None):
        self.node_id = node_id
        self.name = name
        """Announced in the TXT record (set it, then announce again, to rename)."""
        self._pairing: AsyncServiceInfo | None = None
        self.peers: dict[str, Peer] = {}
        self._on_change = on_change
        self._azc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._main: AsyncServiceInfo | None = None
        self._branch_infos: dict[str, AsyncServiceInfo] = {}
        self._announced: Announcement | None = None
        self._addresses: list[str] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._changed = asyncio.Event()
        self._malformed = LogQuota(log, logging.WARNING, "malformed announcements ignored")

    async def start(self) -> None:
        self._azc = AsyncZeroconf(ip_version=IPVersion.V4Only)
        self._addresses = local_ipv4_addresses()
        self._browser = AsyncServiceBrowser(self._azc.zeroconf, [SERVICE_TYPE], handlers=[self._on_service])
        self._spawn(self._housekeeping())

    async def close(self) -> None:
        """Stop browsing and send the goodbye for everything announced."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._browser is not None:
            await self._browser.async_cancel()
        if self._azc is not None:
            await self._azc.async_close()   # unregisters all services: the goodbye
        self._azc = None

    @property
    def announced_addresses(self) -> list[str]:
        """The addresses this node's records give peers (`doctor` checks the port answers there)."""
        return list(self._addresses)

    # -- announcing ----------------------------------------------------------------------

    async def announce(self, port: int, generation: int, branches: Iterable[str]) -> None:
        """Register or update this node's records; call again whenever the catalog changes.

        Returns once every record has been sent; the sends run concurrently, since each
        registration is three broadcasts 225 ms apart.
        """
        azc = self._azc
        assert azc is not None and self.node_id is not None, "start() with a node id first"
        ann = Announcement(self.node_id, port, generation, tuple(branches), name=self.name)
        self._announced = ann
        sent = []
        info = self._info(SERVICE_TYPE, instance_name(self.node_id), ann.txt())
        if self._main is None:
            sent.append(await azc.async_register_service(info, cooperating_responders=True))
        else:
            sent.append(await azc.async_update_service(info))
        self._main = info
        wanted = {b[:SUBTYPE_HEX]: b for b in ann.branches[:MAX_SUBTYPES]}
        for prefix in set(self._branch_infos) - set(wanted):
            sent.append(await azc.async_unregister_service(self._branch_infos.pop(prefix)))
        short = Announcement(self.node_id, port, generation).txt()
        for prefix, branch in wanted.items():
            info = self._info(subtype_name(branch), branch_instance_name(self.node_id, branch), short)
            if prefix in self._branch_infos:
                sent.append(await azc.async_update_service(info))
            else:
                sent.append(await azc.async_register_service(info, cooperating_responders=True))
            self._branch_infos[prefix] = info
        await asyncio.gather(*sent)
        log.debug("announced gen=%d branches=%d subtypes=%d", generation, len(ann.branches), len(wanted))

    def _info(self, type_: str, name: str, props: dict[str, str]) -> AsyncServiceInfo:
        assert self.node_id is not None
        return AsyncServiceInfo(type_, name, port=int(props["port"]), properties=props,
                                server=f"{instance_label(self.node_id)}.local.",
                                parsed_addresses=self._addresses)

    async def _housekeeping(self) -> None:
        """Re-announce periodically and at once when this machine's addresses change."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(INTERFACE_POLL_SECONDS)
            self._malformed.roll()
            try:
                addresses = await asyncio.to_thread(local_ipv4_addresses)
                moved = addresses != self._addresses
                if moved:
                    log.info("interfaces changed: %s -> %s", ",".join(self._addresses), ",".join(addresses))
                    self._addresses = addresses
                    assert self._azc is not None
                    await self._azc.zeroconf.async_update_interfaces()  # rebinds zeroconf's sockets
                if self._announced and (moved or time.monotonic() - last >= REANNOUNCE_SECONDS):
                    a = self._announced
                    await self.announce(a.port, a.generation, a.branches)
                    last = time.monotonic()
            except OSError as exc:  # e.g. no network at all for a moment: try again next round
                log.warning("re-announce failed: %s", exc)

    # -- browsing ------------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_service(self, zeroconf: Zeroconf, service_type: str, name: str,
                    state_change: ServiceStateChange) -> None:
        if not MAIN_INSTANCE.match(name):  # per-branch instances are for find_holders only
            return
        if state_change is ServiceStateChange.Removed:
            for peer in [p for p in self.peers.values() if p.instance == name]:
                del self.peers[peer.node_id]
                log.info("peer lost (goodbye) id=%s", peer.node_id)
                self._notify("lost", peer)
            return
        self._spawn(self._resolve(name))

    async def _resolve(self, name: str) -> None:
        peer = await self.resolve(name)
        if peer is None or peer.node_id == self.node_id:
            return
        old = self.peers.get(peer.node_id)
        if old is not None:  # keep what the node learned over HTTPS
            if (old.instance, old.addresses, old.port, old.generation, old.branches, old.name) == (
                    peer.instance, peer.addresses, peer.port, peer.generation, peer.branches, peer.name):
                return  # nothing new (looked up again): the entry, and what the node set on it, stay
            same_place = (old.addresses, old.port) == (peer.addresses, peer.port)
            # online is decided over TLS where it proved its key, not by what is announced
            peer.online = old.online if same_place or old.proven is not None else None
            peer.proven = old.proven
        self.peers[peer.node_id] = peer
        if old is None or (old.addresses, old.port, old.generation) != (peer.addresses, peer.port,
                                                                        peer.generation):
            log.info("peer seen id=%s addr=%s port=%d gen=%d", peer.node_id, ",".join(peer.addresses),
                     peer.port, peer.generation)
            self._notify("seen", peer)

    async def resolve(self, name: str) -> Peer | None:
        """SRV/TXT/A of one instance, validated; None (logged) when it is missing or malformed."""
        assert self._azc is not None
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        if not await info.async_request(self._azc.zeroconf, RESOLVE_TIMEOUT_MS):
            log.debug("could not resolve %s", name)
            return None
        props = {k: v for k, v in info.decoded_properties.items() if k is not None}
        try:
            ann = parse_txt(props, name)
        except BadAnnouncement as exc:
            self._malformed.log("ignoring announcement: %s", exc)
            return None
        addresses = tuple(info.parsed_addresses(IPVersion.V4Only))[:MAX_ADDRESSES]
        if not addresses or info.port is None:
            return None
        return Peer(ann.node_id, name, addresses, info.port, ann.generation, ann.branches, name=ann.name)

    async def resolve_again(self, node_id: str) -> None:
        """Look a peer up again (a trusted peer that stopped answering: its table entry may
        come from a forged announcement that its own later ones, unchanged, did not replace)."""
        peer = self.peers.get(node_id)
        if peer is not None:
            await self._resolve(peer.instance)

    def _notify(self, what: str, peer: Peer) -> None:
        self._changed.set()
        if self._on_change is not None:
            self._on_change(what, peer)

    async def wait_change(self, timeout: float) -> None:
        """Wait (bounded) until a peer is seen or lost."""
        self._changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)

    async def find_holders(self, branch_hex: str, timeout: float = 3.0, grace: float = 0.15, *,
                           from_table: bool = True) -> list[Peer]:
        """Peers that announce branch_hex: from the table, else by one subtype query.

        Returns as soon as one holder is found plus `grace` seconds for others to answer; an
        empty list after `timeout`.  Subtype answers carry a 64-bit prefix only, so callers
        must still check the full hash in the peer's catalog (fetch does, by verifying bytes).
        """
        assert self._azc is not None
        known = [p for p in self.peers.values() if branch_hex in p.branches] if from_table else []
        if known:
            return known

        async def holder(name: str) -> tuple[str, Peer] | None:
            peer = await self.resolve(name)
            return (peer.node_id, peer) if peer is not None and peer.node_id != self.node_id else None

        return await self._browse(subtype_name(branch_hex), holder, timeout, grace)

    async def _browse(self, subtype: str, resolve: Callable[[str], Awaitable[tuple[str, Peer] | None]],
                      timeout: float, grace: float) -> list[Peer]:
        """Peers answering one subtype query, each name resolved by `resolve` to (key, peer) or
        None: all found within `grace` s of the first one, none after `timeout`."""
        assert self._azc is not None
        names: asyncio.Queue[str] = asyncio.Queue()

        def on_sub(zeroconf: Zeroconf, service_type: str, name: str,
                   state_change: ServiceStateChange) -> None:
            if state_change is not ServiceStateChange.Removed:
                names.put_nowait(name)

        browser = AsyncServiceBrowser(self._azc.zeroconf, [subtype], handlers=[on_sub])
        found: dict[str, Peer] = {}
        seen: set[str] = set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            while (left := deadline - loop.time()) > 0:
                try:
                    name = await asyncio.wait_for(names.get(), left)
                except TimeoutError:
                    break
                got = None if name in seen else await resolve(name)
                if got is not None:
                    seen.add(name)
                    found[got[0]] = got[1]
                    deadline = min(deadline, loop.time() + grace)
        finally:
            await browser.async_cancel()
        return list(found.values())

    # -- pairing ---------------------------------------------------------------------------

    async def announce_pairing(self, channel: int, port: int) -> None:
        """Announce a waiting pairing code by its channel number (the words stay secret)."""
        assert self._azc is not None
        await self.withdraw_pairing()
        token = secrets.token_hex(4)
        info = AsyncServiceInfo(pair_subtype(channel), pair_instance_name(channel, token), port=port,
                                properties=pair_txt(channel), server=f"pair{channel}-{token}.local.",
                                parsed_addresses=self._addresses)
        await (await self._azc.async_register_service(info, cooperating_responders=True))
        self._pairing = info

    async def withdraw_pairing(self) -> None:
        if self._pairing is not None and self._azc is not None:
            info, self._pairing = self._pairing, None
            await (await self._azc.async_unregister_service(info))

    async def find_pairing(self, channel: int, timeout: float) -> list[Peer]:
        """Waiters announcing `channel`: all that answer within `timeout` s.  The whole time,
        not a grace after the first: a waiter forged by another host, cached before the real
        one answers, would win the race, where two waiters must stop the joiner (exit 7)."""
        assert self._azc is not None
        zc = self._azc.zeroconf

        async def waiter(name: str) -> tuple[str, Peer] | None:
            info = AsyncServiceInfo(PAIR_SERVICE_TYPE, name)
            if not await info.async_request(zc, RESOLVE_TIMEOUT_MS):
                return None
            try:
                parse_pair_txt({k: v for k, v in info.decoded_properties.items() if k is not None},
                               name, channel)
            except BadAnnouncement as exc:
                self._malformed.log("ignoring pairing announcement: %s", exc)
                return None
            addresses = tuple(info.parsed_addresses(IPVersion.V4Only))
            return (name, Peer("", name, addresses, info.port, 0, ())) if addresses and info.port else None

        return await self._browse(pair_subtype(channel), waiter, timeout, grace=timeout)


async def lan_peers(branch_hex: str, is_trusted: Callable[[str], bool],
                    timeout: float = 2.0) -> list[PeerAddress]:
    """Browse mDNS once for trusted peers announcing branch_hex (a fetch with no node running).

    When no trusted holder answers (the branch may be older than the announced ones), every
    trusted peer seen meanwhile is returned: the fetch asks them in turn.
    """
    from p2pnode.peer.address import PeerAddress  # here, so that discovery imports without aiohttp

    def trusted(node_id: str) -> bool:
        try:
            return is_trusted(node_id)
        except InvalidInput:  # an announced id that is not a node id at all
            return False

    loop = asyncio.get_running_loop()
    started = loop.time()
    d = Discovery(None)
    await d.start()
    try:
        found = await d.find_holders(branch_hex, timeout, from_table=False)
        refused = [p.node_id for p in found if not trusted(p.node_id)]
        if refused:
            log.info("fetch %s: not asking untrusted holders %s", branch_hex[:16], ", ".join(refused))
        chosen = [p for p in found if trusted(p.node_id)]
        if not chosen:  # let the browse see the LAN a moment (its first queries go out at 0 and 1 s)
            await asyncio.sleep(max(0.0, FALLBACK_BROWSE_SECONDS - (loop.time() - started)))
            chosen = [p for p in d.peers.values() if trusted(p.node_id)]
        return [PeerAddress(p.node_id, host, p.port) for p in chosen for host in p.addresses]
    finally:
        await d.close()
