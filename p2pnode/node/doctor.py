"""`p2pnode doctor`: the health checks behind it (cli/doctor.py only prints them).

Each check says what it found and, when it fails, what to do.  A check that cannot apply now
(mDNS switched off, a trusted peer that is not on the LAN at the moment) is SKIP, not a
failure: `doctor` fails (exit 1) only on what is wrong here.  Every network step is bounded
(`timeout` seconds) and goes only to this machine's own addresses, or to trusted peers over
the peer protocol's mutual TLS.
"""
from __future__ import annotations

import asyncio
import errno
import os
import socket
import stat
from dataclasses import asdict, dataclass
from typing import Any, Literal

from p2pnode.errors import P2PNodeError, PeerUnavailable, Refused
from p2pnode.node.control_client import call_node
from p2pnode.paths import NodePaths, PiDirs

Outcome = Literal["ok", "fail", "skip"]
OK: Outcome = "ok"
FAIL: Outcome = "fail"
SKIP: Outcome = "skip"
DEFAULT_TIMEOUT = 3.0
STORE_LOCK_WAIT = 1.0
"""Seconds to wait for the store's lock: another process holding it longer is what to report."""


@dataclass(frozen=True)
class Check:
    """One line of `doctor`: what was checked, how it went, what was found, what to do."""

    name: str
    outcome: Outcome
    detail: str
    fix: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def diagnose(paths: NodePaths, pi: PiDirs, cwd: str, timeout: float = DEFAULT_TIMEOUT) -> list[Check]:
    """Every check, in the order a user would fix them: store, node, reachability, peers, Pi."""
    try:
        status = call_node(paths, "status", {}, timeout=timeout + 2.0)
    except P2PNodeError:
        status = None
    checks = [check_store(paths, running=status is not None), check_identity(paths),
              check_node(paths, status)]
    if status is None:
        checks += [Check(name, SKIP, "no node running") for name in ("peer port", "tickets", "mdns")]
    else:
        checks += [check_peer_port(status, timeout), check_tickets(status, timeout),
                   asyncio.run(check_mdns(status, timeout))]
    checks += asyncio.run(check_trust(paths, status, timeout))
    checks.append(check_pi(pi, cwd))
    return checks


def failed(checks: list[Check]) -> bool:
    return any(c.outcome == FAIL for c in checks)


# --- store and node -----------------------------------------------------------------------


def check_store(paths: NodePaths, *, running: bool) -> Check:
    """The node's files are this user's alone and usable, and the store opens."""
    problems = paths.privacy_problems()
    unusable = [str(p) for p in _store_files(paths) if not os.access(p, os.R_OK | os.W_OK)]
    if problems:
        return Check("store", FAIL, problems[0], f"chmod -R go-rwx {paths.home}")
    if unusable:
        return Check("store", FAIL, f"{unusable[0]} is not readable and writable by this user "
                     f"({len(unusable)} such files)", f"chown -R {_user()} {paths.home}")
    if running:
        return Check("store", OK, f"{paths.store}: held open by the running node; modes private")
    from p2pnode.library.api import ZSTD_LEVEL, Library
    from store.config import StoreConfig
    from store.errors import StoreLocked

    try:
        with Library.open(paths, config=StoreConfig(zstd_level=ZSTD_LEVEL, lock_timeout=STORE_LOCK_WAIT)):
            pass
    except StoreLocked:
        return Check("store", FAIL, f"{paths.store} is held by another p2pnode process",
                     "wait for that share or fetch to end, or stop the process holding it")
    except Exception as exc:
        return Check("store", FAIL, f"{paths.store} does not open: {exc}", "p2pnode fsck --repair")
    return Check("store", OK, f"{paths.store} opens; modes private")


def _store_files(paths: NodePaths) -> list[str]:
    """The node's own files and dirs (not symlinks, not the sockets a running node made)."""
    found = []
    for root, dirs, files in os.walk(paths.home):
        for name in dirs + files:
            path = os.path.join(root, name)
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:  # a temporary file gone meanwhile
                continue
            if not (stat.S_ISLNK(mode) or stat.S_ISSOCK(mode)):
                found.append(path)
    return found


def _user() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


def check_identity(paths: NodePaths) -> Check:
    """The node key and certificate load and match, and the certificate is one peers accept
    (a damaged one is refused by every peer, which then looks like a trust problem)."""
    from p2pnode.peer.identity import IdentityError, identity_files, load_identity

    if not identity_files(paths.identity):
        return Check("identity", SKIP, "this node has no identity yet", "start the node once: p2pnode serve")
    try:
        identity = load_identity(paths.identity)
    except IdentityError as exc:
        return Check("identity", FAIL, str(exc), "p2pnode id (re-issues a damaged certificate, "
                     "or says what to do about the key)")
    return Check("identity", OK, f"node {identity.node_id}: key and certificate match; peers accept it")


def check_node(paths: NodePaths, status: dict[str, Any] | None) -> Check:
    if status is None:
        return Check("node", FAIL, f"no node is running for {paths.home}",
                     "start it: p2pnode serve (keep it running, e.g. as a user service)")
    where = ", ".join(status["addresses"]) or "no address"
    return Check("node", OK, f"node {status['node_id']} is running: peer port {status['port']} on {where}")


# --- reachability ----------------------------------------------------------------------------


def _answers(host: str, port: int, timeout: float) -> bool:
    """A TCP connection to host:port is accepted (the peer port listens there)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def check_peer_port(status: dict[str, Any], timeout: float) -> Check:
    """The peer port answers at the addresses mDNS gives peers (when mDNS is on)."""
    port, listening = status["port"], status["addresses"]
    if not status["mdns"]:
        return Check("peer port", SKIP, "mDNS is off (serve --no-mdns): peers reach this node only by "
                     "ticket or --from")
    announced = status.get("announced") or []
    lan = [a for a in announced if not a.startswith("127.")]
    if not lan:
        return Check("peer port", FAIL, "mDNS announces no LAN address (only loopback): this machine has "
                     "no network interface up", "connect to the LAN, then restart the node")
    dead = [a for a in lan if not _answers(a, port, timeout)]
    if dead:
        return Check("peer port", FAIL, f"mDNS announces {', '.join(dead)} but peer port {port} does not "
                     f"answer there (the node listens on {', '.join(listening) or 'nothing'})",
                     "restart it listening on the LAN: p2pnode serve --host 0.0.0.0")
    return Check("peer port", OK, f"peer port {port} answers at {', '.join(lan)}, the addresses mDNS "
                 "announces (from this machine: a firewall may still stop other hosts)")


def check_tickets(status: dict[str, Any], timeout: float) -> Check:
    """The addresses tickets carry are ones the peer port answers at."""
    from p2pnode.node.routing import ticket_addresses

    addresses = ticket_addresses(status)
    if not addresses:
        return Check("tickets", FAIL, "the node reports no address to put in tickets",
                     "restart the node with --host set to this machine's LAN address")
    shown = ", ".join(f"{h}:{p}" for h, p in addresses)
    dead = [f"{h}:{p}" for h, p in addresses if not _answers(h, p, timeout)]
    if dead:
        return Check("tickets", FAIL, f"tickets carry {shown} but the peer port does not answer at "
                     f"{', '.join(dead)}", "restart the node: p2pnode serve")
    loopback = all(h.startswith("127.") for h, _ in addresses)
    return Check("tickets", OK, f"tickets carry {shown}" + (
        " (loopback only: for this machine's users alone; --host 0.0.0.0 for the LAN)" if loopback else ""))


async def check_mdns(status: dict[str, Any], timeout: float) -> Check:
    """This node hears its own announcement on the interfaces in use (multicast works)."""
    if not status["mdns"]:
        return Check("mdns", SKIP, "mDNS is off (serve --no-mdns)")
    from p2pnode.discovery.mdns import Discovery

    node_id, announced = status["node_id"], status.get("announced") or []
    browser = Discovery(None)
    try:
        await browser.start()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(timeout, 2.0)
        while node_id not in browser.peers and loop.time() < deadline:
            await browser.wait_change(deadline - loop.time())
        heard = browser.peers.get(node_id)
    except OSError as exc:
        return Check("mdns", FAIL, f"cannot use multicast DNS here: {exc}",
                     "allow UDP port 5353 (multicast 224.0.0.251) on this machine")
    finally:
        await browser.close()
    if heard is None:
        return Check("mdns", FAIL, f"this node's own announcement on {', '.join(announced)} was not heard "
                     f"within {max(timeout, 2.0):g} s", "allow UDP port 5353 (multicast 224.0.0.251) in the "
                     "firewall for the LAN interface; Wi-Fi with client isolation needs tickets instead")
    return Check("mdns", OK, f"announced and heard on {', '.join(heard.addresses)}, port {heard.port}")


# --- peers ----------------------------------------------------------------------------------


async def check_trust(paths: NodePaths, status: dict[str, Any] | None, timeout: float) -> list[Check]:
    """Each trusted peer trusts this node too: asked for its catalog, it answers (a refusal
    after the TLS handshake is the peer not trusting us)."""
    from p2pnode.peer.address import PeerAddress
    from p2pnode.peer.get import get_catalog
    from p2pnode.peer.identity import IdentityError, has_identity, load_identity
    from p2pnode.peer.trust import TrustStore

    trust = TrustStore(paths.trust)
    peers = trust.peers()
    if not peers:
        return [Check("trust", SKIP, "no trusted peers yet", "p2pnode trust <their node id>")]
    if not has_identity(paths.identity):
        return [Check("trust", FAIL, "this node has no identity yet", "start the node once: p2pnode serve")]
    try:
        identity = load_identity(paths.identity)
    except IdentityError:
        return [Check("trust", SKIP, "this node's identity does not load (the identity line says why)")]
    seen = {p["node_id"]: p for p in (status or {}).get("peers", []) if p.get("addresses") and p.get("port")}

    async def ask(peer_id: str, label: str) -> Check:
        where = seen.get(peer_id)
        if where is None:
            why = "no node running to find it" if status is None else "not seen on the LAN now"
            return Check(f"trust {label}", SKIP, f"{why}: cannot ask whether it trusts this node")
        for host in where["addresses"]:
            address = PeerAddress(peer_id, host, where["port"])
            try:
                await asyncio.wait_for(get_catalog(address, identity, trust), timeout)
            except Refused:
                return Check(f"trust {label}", FAIL, "you trust it but it does not trust you",
                             f"on that machine run: p2pnode trust {identity.node_id}")
            except (PeerUnavailable, TimeoutError, OSError, P2PNodeError):
                continue
            return Check(f"trust {label}", OK, f"mutual (answered at {host}:{where['port']})")
        return Check(f"trust {label}", SKIP, f"did not answer at {', '.join(where['addresses'])}: cannot ask")

    return list(await asyncio.gather(*(ask(p.node_id, p.name or p.node_id[:16]) for p in peers)))


# --- Pi -------------------------------------------------------------------------------------


def check_pi(pi: PiDirs, cwd: str) -> Check:
    """Where Pi started here keeps its sessions is where `share` looks and `fetch` places; a
    path the system refuses (a cwd so deep that its session dir's name is too long) is a
    failed check, not the end of the report."""
    try:
        return _check_pi(pi, cwd)
    except OSError as exc:
        why = (exc.strerror or str(exc)).lower()
        if exc.errno == errno.ENAMETOOLONG:
            return Check("pi", FAIL, f"Pi cannot keep sessions for {cwd}: the name of its session dir is too "
                         f"long ({why}: {exc.filename})",
                         "run pi and p2pnode from a shorter path, or give both --session-dir DIR")
        return Check("pi", FAIL, f"Pi's session dir for {cwd} cannot be read: {why}: {exc.filename}",
                     "make it readable by this user, or give pi and p2pnode --session-dir DIR")


def _check_pi(pi: PiDirs, cwd: str) -> Check:
    from p2pnode.pi.session import session_dir_name

    if not pi.agent.is_dir():
        return Check("pi", FAIL, f"Pi's agent dir {pi.agent} does not exist",
                     "run pi once, or set PI_CODING_AGENT_DIR to the agent dir pi uses")
    if pi.sessions is not None:
        if not pi.sessions.is_dir():
            return Check("pi", FAIL, f"Pi's session dir {pi.sessions} (set by --session-dir, "
                         "PI_CODING_AGENT_SESSION_DIR or settings.json sessionDir) does not exist",
                         "run pi here once, or fix the setting so that it names the dir pi writes to")
        n = sum(1 for _ in pi.sessions.glob("*.jsonl"))
        return Check("pi", OK, f"Pi keeps sessions flat in {pi.sessions} ({n} there): share and fetch "
                     "use it too")
    here = pi.agent / "sessions" / session_dir_name(cwd)
    n = sum(1 for _ in here.glob("*.jsonl")) if here.is_dir() else 0
    return Check("pi", OK, f"Pi keeps sessions in {pi.agent / 'sessions'} ({n} for {cwd}): share and fetch "
                 "use it too")
