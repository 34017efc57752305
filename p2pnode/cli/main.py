"""The `p2pnode` command line: argument parsing, dispatch and exit codes, over the library API
(what is printed is render.py's; whether the running node does the work is node/routing.py's).

Over 400 lines on purpose: one parser block and one small cmd_ function per command (sixteen).

Each command is a function `cmd_<name>(args) -> int`; library errors (P2PNodeError) are
reported on stderr as `p2pnode: <message>` with their exit code (see p2pnode/errors.py).
Nothing else reaches the user as a traceback: `main` turns every other failure into one line
and an exit code from README.md's table (the traceback only with P2PNODE_DEBUG=1).
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import gc
import io
import json
import logging
import os
import shutil
import stat
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from p2pnode import __version__
from p2pnode.cli import argtypes, browse
from p2pnode.cli.access import peer_names, share_to
from p2pnode.cli.doctor import add_doctor_commands
from p2pnode.cli.follow import add_follow_commands
from p2pnode.cli.log import add_log_commands
from p2pnode.cli.pairing import add_pairing_commands, cmd_pending, cmd_trust, cmd_untrust
from p2pnode.cli.render import (
    JsonLines,
    one_line,
    print_branches,
    print_fetch,
    print_json,
    print_peers,
    print_share_notes,
    print_show,
    print_status,
    print_unshared,
    print_versions,
    shown,
)
from p2pnode.cli.space import add_space_commands
from p2pnode.errors import (
    CALLERS_PATH_ERRNOS,
    EXIT_INTERRUPTED,
    KINDS,
    PERMISSION_ERRNOS,
    Conflict,
    InvalidInput,
    NotFound,
    P2PNodeError,
    from_store,
    listen_failed,
    unwritable,
)
from p2pnode.node.control_client import NodeLibrary
from p2pnode.node.routing import open_library, routed, share_handoff, via_node, via_node_streamed
from p2pnode.paths import NodePaths

Command = Callable[[argparse.Namespace], int]


def node_paths(args: argparse.Namespace) -> NodePaths:
    return (NodePaths(Path(args.home)) if args.home else NodePaths.default()).ensure()


# --- store ------------------------------------------------------------------------------


def cmd_fsck(args: argparse.Namespace) -> int:
    """Exit 1 only when the check ran and found problems; a store it could not check (held by the
    running node, or none yet) is another exit code and says so."""
    from p2pnode.library.api import Library
    from p2pnode.node.control_client import node_running, store_in_use
    from store.cli import run_fsck
    from store.errors import StoreLocked

    paths = node_paths(args)
    if node_running(paths):  # it holds the store's lock for as long as it runs
        raise store_in_use(paths, "check the store")
    if not any(paths.store.iterdir()):  # made empty by node_paths
        raise NotFound(f"no store in {paths.home} yet (nothing shared or fetched there): nothing to check")
    try:
        repaired, errors = _repair_sessions(paths) if args.repair else ([], Library.unreadable_files(paths))
        return run_fsck(paths.store, args, repaired, errors)
    except StoreLocked:  # a node starting or stopping, a share or fetch: not damage (exit 1)
        raise store_in_use(paths, "check the store") from None


def _repair_sessions(paths: NodePaths) -> tuple[list[str], list[str]]:
    """`fsck --repair`'s steps above the store (Library.repair) as the report's lines: what
    was done, each with how to get back what was lost; and what could not be done."""
    from p2pnode.library.api import Library

    done = Library.repair(paths)
    said = [f"{path} was unreadable: moved to {kept}; it starts empty" for path, kept in done.moved]
    if done.rebuilt is not None:
        reason, found, kept = done.rebuilt
        said += [f"{paths.home / 'sessions.json'} rebuilt from the store (it {reason}): "
                 f"{len(found.branches)} branch(es), none offered (share them again to offer them)"
                 + (f"; the old file kept as {kept}" if kept else "")]
        said += [f"not rebuilt: branch {b[:16]}, removed earlier (audit log)" for b in found.left_out]
        said += [f"not rebuilt: branch {b[:16]} ({why}): share its file again, or fetch {b[:16]} again"
                 if b else f"not rebuilt: {why}" for b, why in found.lost]
    said += [f"dropped branch {d.branch[:16]} ({one_line(d.title, 50)}): {d.why}; "
             + (f"share {d.path} again to store it anew" if d.shared_here and d.path
                else f"fetch {d.branch[:16]} again")
             if d.branch else f"dropped session version {d.src[:16]} (no branch held): {d.why}"
             for d in done.dropped]
    said += [f"branch {d.branch[:16]} ({one_line(d.title, 50)}): {d.lines} line(s) in damaged store records "
             "(kept; `cat` of it exits 5); "
             + (f"share {d.path} again to store them anew" if d.shared_here and d.path
                else f"`p2pnode rm {d.branch[:16]}`, then fetch {d.branch[:16]} again")
             for d in done.damaged]
    return said, [f"sessions not checked: {done.unchecked}"] if done.unchecked else []


def add_store_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fsck", help="check the node's store (CRCs, index, heads, depths)")
    p.add_argument("--full", action="store_true", help="also re-hash every blob")
    p.add_argument("--repair", action="store_true",
                   help="rebuild a lost sessions.json, forget what cannot be read, cut torn tails, "
                        "rebuild the index")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_fsck)


# --- node (p2pnode serve / status; routing to a running node) ------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    from p2pnode.node.daemon import DEFAULT_PORT, NodeConfig, serve
    from sysio import eventloop

    port = DEFAULT_PORT if args.port is None else args.port
    config = NodeConfig(host=args.host, port=port, mdns=not args.no_mdns)
    eventloop.run(serve(node_paths(args), config))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from p2pnode.node.status import offline_status

    status = routed(node_paths(args), "status", {}, lambda lib: offline_status(node_paths(args), lib),
                    read_only=True)
    for problem in node_paths(args).privacy_problems():
        print(f"p2pnode: warning: {shown(problem)}", file=sys.stderr)
    if args.json:
        print_json(status)
        return 0
    print_status(status)
    return 0


def add_node_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the node in the foreground: store service, peer server, mDNS")
    p.add_argument("--port", type=argtypes.port,
                   help="HTTPS peer port (default 47470, or a free one if that is taken; 0 = any free port)")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all)")
    p.add_argument("--no-mdns", action="store_true", help="neither announce nor browse on the LAN")
    p.set_defaults(func=cmd_serve, default_log_level="INFO")
    p = sub.add_parser("status", help="node id, addresses, port, peers online/offline, shares, transfers")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)


# --- sessions (share / ls / show / cat / unshare) -------------------------------------------


def pi_dirs(args: argparse.Namespace) -> Any:
    """Pi's agent dir and session-dir override as this command sees them (its environment,
    cwd and --session-dir): what counts, also when a running node does the work."""
    import os

    from p2pnode.paths import PiDirs

    return PiDirs.resolve(os.getcwd(), args.session_dir)


def cmd_share(args: argparse.Namespace) -> int:
    import os

    from p2pnode.cli.follow import check_live, start_live
    from p2pnode.cli.progress import TransferBar

    if args.live:
        check_live(args, node_paths(args))
    pi = pi_dirs(args)
    payload = {"target": args.session, "latest": args.latest, "no_lineage": args.no_lineage,
               "cwd": os.getcwd(), "pi": pi.as_dict(), "allow_secrets": args.allow_secrets,
               "redact": args.redact, "expires": args.expires, "to": share_to(node_paths(args), args.to)}
    with TransferBar(label="share") as bar:
        def here(lib: Any) -> dict[str, Any]:
            from p2pnode.node.live import restate_saved  # no node runs: its live.json, if any

            result = lib.share(args.session, latest=args.latest, no_lineage=args.no_lineage, pi=pi,
                               allow_secrets=args.allow_secrets, redact=args.redact,
                               expires=payload["expires"], to=payload["to"], progress=bar).as_dict()
            held = [b.branch for b in lib.branches(include_unshared=True)]
            restate_saved(node_paths(args).home, result)
            return dict(result, **share_handoff(result["branch"], held, None, []))  # no node: no ticket

        def ask(paths: NodePaths, op: str, body: dict[str, Any]) -> dict[str, Any] | None:
            try:
                return via_node_streamed(paths, op, body, bar.event)  # + "fetch", "ticket"
            except KeyboardInterrupt:
                print("p2pnode: the running node finishes the share on its own (`p2pnode ls` then lists it; "
                      "`p2pnode unshare` withdraws it)", file=sys.stderr)
                raise

        result = routed(node_paths(args), "share", payload, here, ask)
    ticket, command = result.pop("ticket"), result.pop("fetch")
    print_share_notes(result)
    for warning in result.get("warnings", []):
        print(f"p2pnode: warning: {shown(warning)}", file=sys.stderr)
    for notice in result.get("notices", []):
        print(f"p2pnode: note: {shown(notice)}", file=sys.stderr)
    if args.live:
        start_live(node_paths(args), result, pi, os.getcwd(), args.allow_secrets)
    if args.json:
        print_json(dict(result, ticket=ticket, fetch=command) if ticket else dict(result, fetch=command))
    else:
        print(result["branch"])
        if ticket:
            print(ticket)
        browse.print_handoff(command, ticket)
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    if args.peers or args.peer:  # a peer to ask (--from) is a listing of peers' offers
        return browse.cmd_browse(args)
    with open_library(node_paths(args), read_only=True) as lib:
        infos = lib.sessions_latest(include_unshared=args.all)  # one row per session: its latest version
    if args.json:
        print_json([i.as_dict() for i in infos])
        return 0
    print_branches(infos, peer_names(node_paths(args)))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    with open_library(node_paths(args), read_only=True) as lib:
        info = lib.branch(args.branch)
        sidecar = lib.sidecar_bytes(info.branch).decode("utf-8", "replace")
        lineage = lib.lineage(info.branch)
        children = lib.children(info.branch)
        versions = lib.versions(info.branch) if args.versions else None
    if args.json:
        extra = {"versions": [v.as_dict() for v in versions]} if versions is not None else {}
        print_json({"branch": info.as_dict(), "sidecar": sidecar,
                    "lineage": [i.as_dict() for i in lineage], "children": [c.as_dict() for c in children],
                    **extra})
        return 0
    names = peer_names(node_paths(args))
    print_show(info, sidecar, lineage, children, names)
    if versions is not None:
        print_versions(info, versions, names)
    return 0


CAT_COPY = 1 << 20


def cmd_cat(args: argparse.Namespace) -> int:
    out = sys.stdout.buffer
    spool: BinaryIO | None
    # in runs, each line checked as read, the whole at the end
    with open_library(node_paths(args), read_only=True) as lib:
        info = lib.branch(args.branch)
        if args.json:  # printed once the whole hashed to src: a JSON answer is all or nothing
            spool = _spool(lib)
            answer = JsonLines(spool, {"branch": info.branch, "src": info.src, "size": info.size})
            lib.write_session(info.src, answer.write)
            answer.close()
        else:
            spool = _reader_paced(out, lib)
            try:
                lib.write_session(info.src, (spool or out).write)
            except OSError as exc:  # no room beside the store for the spool: straight out, as to a file
                if spool is None or exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                spool.close()
                spool = None
                lib.write_session(info.src, out.write)
    if spool is not None:  # the store is free again; the reader takes its time
        with spool:
            spool.seek(0)
            shutil.copyfileobj(spool, out, CAT_COPY)
    out.flush()
    return 0


def _reader_paced(out: BinaryIO, lib: Any) -> BinaryIO | None:
    """A temp file beside the store for `cat` to write first, when the session comes from the
    store itself (no node) and goes to a pipe or a terminal: its reader (`| less`) sets the
    pace, and the store stays locked against every other command while it is open.  None: to
    a file, or through the running node, the runs go out as they are read."""
    if isinstance(lib, NodeLibrary):
        return None
    try:
        if stat.S_ISREG(os.fstat(out.fileno()).st_mode):
            return None
    except (OSError, ValueError):  # no file descriptor (io.UnsupportedOperation is a ValueError)
        pass
    return _spool(lib)


def _spool(lib: Any) -> BinaryIO:
    """A temp file beside the store (gone when closed, or with the process); in the system's
    temp dir when this user may not write in the node's home (a read needs no write there)."""
    try:
        return tempfile.TemporaryFile(dir=lib.paths.home)
    except OSError as exc:
        if exc.errno not in PERMISSION_ERRNOS:
            raise
        return tempfile.TemporaryFile()


def cmd_unshare(args: argparse.Namespace) -> int:
    from p2pnode.cli.follow import print_live_stopped
    from p2pnode.node.live import unlive_saved, unshare_live

    paths = node_paths(args)
    answer = routed(paths, "unshare", {"branch": args.branch},
                    lambda lib: unshare_live(lib, args.branch, lambda gone: unlive_saved(paths.home, gone)))
    if args.json:
        print_json(answer)
    else:
        print_live_stopped(answer["live_stopped"], "it would offer again what unshare withdraws")
        print_unshared(answer)
    return 0


def add_session_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("share", help="share a Pi session (and its fork lineage); prints the branch hash")
    p.add_argument("session", nargs="?",
                   help="session file, header id or id prefix (default: newest session of cwd)")
    p.add_argument("--latest", action="store_true", help="the newest session of the current directory")
    p.add_argument("--no-lineage", action="store_true",
                   help="share without its parentSession (parent null; `show` says the lineage was cut)")
    p.add_argument("--session-dir", help="Pi's --session-dir: sessions are flat in this dir (as for pi)")
    p.add_argument("--allow-secrets", action="store_true",
                   help="share even if the secret scan finds some (the branch is marked so in ls/show)")
    p.add_argument("--redact", action="store_true",
                   help="share a redacted copy (a new Pi session beside the original)")
    p.add_argument("--expires", metavar="DURATION",
                   help="stop serving it after 30m, 12h, 7d, 2w or 'never' "
                        "(default: share_expires in the node's config.json, else never)")
    p.add_argument("--to", nargs="+", metavar="PEER",
                   help="offer it only to these trusted peers (names or ids; default: all trusted peers); "
                        "give it after the session: it takes every word that follows")
    p.add_argument("--json", action="store_true", help="hash, src, parent, header fields, sizes, ancestors")
    p.add_argument("--live", action="store_true",
                   help="the running node shares it again whenever it grows (`p2pnode live` lists them)")
    p.set_defaults(func=cmd_share)
    p = sub.add_parser("ls", help="list shared sessions, one row each: its latest version")
    p.add_argument("--all", action="store_true", help="also branches that were unshared")
    p.add_argument("--peers", action="store_true", help="what trusted peers offer instead (= browse)")
    browse.add_browse_arguments(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ls)
    for name, func, text in (
        ("show", cmd_show, "a branch's sidecar, header and lineage tree"),
        ("cat", cmd_cat, "print a branch's session file, verbatim and verified"),
        ("unshare", cmd_unshare, "stop offering a branch to peers (its bytes stay)"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("branch", help="branch hash, or a unique prefix of one (at least 4 hex digits)")
        p.add_argument("--json", action="store_true")
        p.set_defaults(func=func)
    sub.choices["show"].add_argument("--versions", action="store_true",
                                     help="also list the versions of its Pi session held here")


# --- peers (identity, trust, fetch, standalone peer server) ---------------------------------


def _identity(args: argparse.Namespace) -> Any:
    from p2pnode.peer.identity import load_or_create_identity

    return load_or_create_identity(node_paths(args).identity)


def _trust(args: argparse.Namespace) -> Any:
    from p2pnode.peer.trust import TrustStore

    return TrustStore(node_paths(args).trust)


def cmd_id(args: argparse.Namespace) -> int:
    ident = _identity(args)
    if args.json:
        print_json({"node_id": ident.node_id, "cert": str(ident.cert_path), "ca": str(ident.ca_path)})
    else:
        print(ident.node_id)
    return 0


def cmd_peers(args: argparse.Namespace) -> int:
    from p2pnode.node.status import peers_view

    if args.pending:
        return cmd_pending(args)

    # node's addition: a running node adds whom it sees on the LAN
    peers = peers_view(_trust(args).peers(), via_node(node_paths(args), "status", {}))
    if args.json:
        print_json(peers)
    else:
        print_peers(peers)
    return 0


def _fetch_target(args: argparse.Namespace) -> tuple[str, list[Any]]:
    """(branch hash, prefix or session id; peers) from the target or a ticket, plus every --from.
    A target that is not a ticket loads no more than a fetch handed to the node needs (the wire
    formats only for a ticket: tests/cli/test_startup.py)."""
    from p2pnode.node.names import from_addresses
    from p2pnode.peer.address import PeerAddress
    from p2pnode.peer.nodeid import format_node_id
    from p2pnode.peer.offers import check_target

    peers = from_addresses(node_paths(args), args.peer or [])  # also NAME and NAME@HOST:PORT
    try:
        return check_target(args.target), peers
    except InvalidInput:
        from p2pnode.peer import wire

        if not wire.is_ticket(args.target):
            raise
        ticket = wire.decode_ticket(args.target)
    node_id = format_node_id(ticket.node)
    peers += [PeerAddress(node_id, host, port) for host, port in ticket.addresses]
    return ticket.branch.hex(), peers


def _fetch_here(args: argparse.Namespace, branch: str, peers: list[Any]) -> dict[str, Any]:
    from p2pnode.cli.progress import TransferBar
    from p2pnode.node.routing import fetch_here
    from sysio.memory import one_arena

    one_arena()  # before the first thread: this process will move a whole session (sysio/memory.py)
    with TransferBar([str(p) for p in peers]) as view:
        return fetch_here(node_paths(args), branch, peers, pi_dirs(args), _identity(args), _trust(args), view,
                          exact=args.exact)


def _fetch_here_or_via_node(args: argparse.Namespace, branch: str, peers: list[Any],
                            payload: dict[str, Any]) -> dict[str, Any]:
    """The fetch in this process; a node that starts meanwhile takes over (the lines this
    process stored already are the node's too: its fetch asks only for the others)."""
    from p2pnode.cli.fetching import fetch_via_node
    from p2pnode.peer.get import StoreTaken

    try:
        return _fetch_here(args, branch, peers)
    except StoreTaken as exc:
        print(f"p2pnode: note: {exc}: the fetch goes on through it", file=sys.stderr)
        result = fetch_via_node(node_paths(args), payload)
        if result is None:  # the node stopped again
            raise
        return result


def cmd_fetch(args: argparse.Namespace) -> int:
    from p2pnode.cli.fetching import fetch_in_background, fetch_via_node

    branch, peers = _fetch_target(args)
    payload = {"branch": branch, "peers": [str(p) for p in peers], "pi": pi_dirs(args).as_dict(),
               "exact": args.exact}
    if args.background:
        started = fetch_in_background(node_paths(args), payload)
        if args.json:
            print_json(started)
        else:
            print(started["id"])
            print(f"p2pnode: fetching {started['branch']} in the background as transfer {started['id']}; "
                  "`p2pnode status` shows it", file=sys.stderr)
        return 0
    result = fetch_via_node(node_paths(args), payload)
    if result is None:
        result = _fetch_here_or_via_node(args, branch, peers, payload)
    if result.get("note"):
        print(f"p2pnode: note: {shown(result['note'])}", file=sys.stderr)
    if args.json:
        print_json(result)
    else:
        print_fetch(result)
    if result["conflict"]:  # stored, not placed: a failure as any other (with --json, its object last)
        raise Conflict(result["conflict"])
    return 0


def cmd_serve_peers(args: argparse.Namespace) -> int:
    """The peer server alone (no store service, no mDNS): for tests and scripted setups."""
    import asyncio
    import signal

    from p2pnode.library.api import Library
    from p2pnode.node.control_client import node_running, store_in_use
    from p2pnode.peer.provider import PeerServer

    paths = node_paths(args)
    if node_running(paths):
        raise store_in_use(paths, "serve peers")

    async def run() -> None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        with Library.open(paths) as lib:
            server = PeerServer(lib, _identity(args), _trust(args))
            try:
                await server.start(args.host, args.port)
            except OSError as exc:
                await server.close()
                raise listen_failed(args.host, args.port, exc) from exc
            print(f"listening on {args.host}:{server.port}", flush=True)
            try:
                await stop.wait()
            finally:
                await server.close()

    asyncio.run(run())
    return 0


def add_peer_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("id", help="print this node's id (made on first use)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_id)
    p = sub.add_parser("trust", help="allow a peer (by node id or name) to fetch from and serve this node")
    p.add_argument("node_id", metavar="NAME|NODEID")
    p.add_argument("--name", help="a name to show for the peer")
    p.set_defaults(func=cmd_trust)
    p = sub.add_parser("untrust", help="remove a peer from the allowlist; its connections are closed")
    p.add_argument("node_id", metavar="NAME|NODEID")
    p.set_defaults(func=cmd_untrust)
    p = sub.add_parser("peers", help="list trusted peers, and untrusted ones a running node sees")
    p.add_argument("--pending", action="store_true", help="untrusted nodes that tried to connect")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_peers)
    p = sub.add_parser("fetch", help="fetch a branch and its lineage from peers, verified")
    p.add_argument("target", metavar="BRANCH|TICKET|SESSION",
                   help="a branch hash, a unique prefix of one (as `browse` lists), a Pi session id or "
                        "a unique start of one up to a dash at least (its latest version), or a p2p1: ticket")
    p.add_argument("--exact", action="store_true",
                   help="fetch this very version, not the latest version of its session that peers offer")
    p.add_argument("--from", dest="peer", action="append", metavar="[NODEID@]HOST:PORT|NAME",
                   help="a peer to fetch from (repeatable; without NODEID any trusted node is accepted)")
    p.add_argument("--session-dir", help="Pi's --session-dir: place the session flat in this dir")
    p.add_argument("--background", action="store_true",
                   help="let the running node fetch it; print the transfer id and return (see `status`)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_fetch)
    p = sub.add_parser("serve-peers", help="run only the HTTPS peer server (no mDNS, no store service)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=argtypes.port, default=0, help="0 = any free port (printed)")
    p.set_defaults(func=cmd_serve_peers)


# --- parser -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="p2pnode", description="Share Pi coding-agent sessions, with their "
                                     "fork lineage, with teammates on the LAN; every byte verified by hash.")
    parser.add_argument("--version", action="version", version=f"p2pnode {__version__}")
    parser.add_argument("--home", type=argtypes.directory,
                        help="node state directory (default: $P2PNODE_HOME or the user state dir)")
    parser.add_argument("--log-level", type=argtypes.log_level,
                        help="DEBUG, INFO, WARNING or ERROR (default WARNING; INFO for serve)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_store_commands(sub)
    add_node_commands(sub)
    add_session_commands(sub)
    add_peer_commands(sub)
    browse.add_browse_commands(sub)
    add_log_commands(sub)
    add_space_commands(sub)
    add_follow_commands(sub)
    add_pairing_commands(sub)
    add_doctor_commands(sub)
    return parser


DEBUG_ENV = "P2PNODE_DEBUG"
"""Set to 1 to see the traceback of an unexpected error (the user sees one line otherwise)."""
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports `yes | head`: the reader went away


GC_YOUNG_OBJECTS = 10_000
"""Allocations between two collections of the youngest generation (Python's default: 700).  A
transfer makes and drops a few objects per line, none in cycles that matter; at the default,
collections took ~0.18 s of a 256 MB fetch, ~0.06 s at this."""


def main(argv: list[str] | None = None) -> int:
    """Run one command; every failure is one line on stderr and an exit code (README.md)."""
    args: argparse.Namespace | None = None
    gc.set_threshold(GC_YOUNG_OBJECTS, *gc.get_threshold()[1:])
    try:
        args = build_parser().parse_args(argv)
        level = args.log_level or getattr(args, "default_log_level", "WARNING")
        logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        code = int(args.func(args))
        sys.stdout.flush()  # here, not at exit, so that a closed pipe is caught below
        return code
    except BrokenPipeError:
        return _stdout_gone()
    except KeyboardInterrupt:
        return _fail("interrupted", EXIT_INTERRUPTED, args)
    except Exception as exc:
        error = _as_node_error(exc, args)
        if os.environ.get(DEBUG_ENV) == "1":
            traceback.print_exc()
        return _fail(str(error), error.exit_code, args)


def run() -> None:
    """The `p2pnode` command: main, then exit at once with its code.  Python's teardown would
    free a big fetch's objects one by one (~0.1 s after a 256 MB fetch); by now every file and
    the store are closed, stdout was flushed (main) and nothing registers atexit work."""
    _name_stdout_failures()
    code = main()
    with contextlib.suppress(OSError):  # stdout gone: main has reported it already
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


class StdoutFailed(OSError):
    """A write to stdout failed (`p2pnode cat X > file` on a full disk): the user's redirect
    target, not the node's home, which an OSError naming no file is otherwise blamed on."""


class _Stdout(io.FileIO):
    """fd 1 whose failed writes are StdoutFailed (a closed pipe stays BrokenPipeError: exit 141).
    `was_closed`: fd 1 was closed when the command began (`p2pnode ls >&-`); it holds /dev/null
    now, so that no file the command opens takes its place, and every write fails (EBADF)."""

    def __init__(self, closed: bool) -> None:
        super().__init__(1, "w", closefd=False)
        self.was_closed = closed

    def write(self, data: Any, /) -> int:
        try:
            if self.was_closed:
                raise OSError(errno.EBADF, os.strerror(errno.EBADF))
            return super().write(data)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise StdoutFailed(exc.errno, exc.strerror) from exc


def _name_stdout_failures() -> None:
    """sys.stdout over _Stdout, buffered as before (line by line to a terminal)."""
    old = sys.stdout
    closed = old is None
    if closed:
        devnull = os.open(os.devnull, os.O_WRONLY)
        if devnull != 1:
            os.dup2(devnull, 1)
            os.close(devnull)
    encoding, errors, by_line = ("utf-8", "strict", False) if old is None else \
        (old.encoding, old.errors, old.line_buffering)
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(_Stdout(closed)), encoding=encoding, errors=errors,
                                  line_buffering=bool(by_line))


def _as_node_error(exc: Exception, args: argparse.Namespace | None) -> P2PNodeError:
    """The P2PNodeError (message and exit code) to report for any exception a command raised."""
    from p2pnode.node.control_client import store_in_use
    from store.errors import PayloadTooLarge, StoreLocked

    if isinstance(exc, P2PNodeError):
        return exc
    if isinstance(exc, StoreLocked) and args is not None:
        return store_in_use(node_paths(args), "open the store")
    if isinstance(exc, PayloadTooLarge):
        return InvalidInput(f"a line of {exc.size} bytes is over the store's limit of {exc.limit} bytes")
    if (known := from_store(exc, "the store", "run it again")) is not None:
        return known
    if isinstance(exc, StdoutFailed):
        return P2PNodeError(f"cannot write to standard output: {(exc.strerror or str(exc)).lower()}")
    if isinstance(exc, OSError):
        text = f"{(exc.strerror or str(exc) or 'system error').lower()}: {_os_error_subject(exc, args)}"
        if isinstance(exc, FileNotFoundError):
            return NotFound(text)
        if exc.errno in CALLERS_PATH_ERRNOS or exc.errno in (errno.EEXIST, errno.EROFS):
            return InvalidInput(text)  # a path given that cannot be used: another file, or not ours
        return P2PNodeError(text)
    hint = f" (run with {DEBUG_ENV}=1 for the traceback)" if os.environ.get(DEBUG_ENV) != "1" else ""
    return P2PNodeError(f"unexpected error: {str(exc) or 'no details'}{hint}")


def _os_error_subject(exc: OSError, args: argparse.Namespace | None) -> str:
    """The files an OSError names, else where the command was writing (a full disk: which one)."""
    names = [str(n) for n in (exc.filename, exc.filename2) if n is not None]
    if len(names) == 1 and exc.errno in PERMISSION_ERRNOS and not os.path.lexists(names[0]):
        return f"{unwritable(names[0])} is not writable by this user"  # a file being made there
    if not names and args is not None:
        return f"in the node's home {node_paths(args).home}"
    return " -> ".join(names) or "(no file named)"


def _fail(message: str, code: int, args: argparse.Namespace | None) -> int:
    """The failure on stderr, one line each (a list, such as the secret scan's findings, all
    prefixed); with --json also as one object on stdout, so that a program reading the
    command's JSON gets an answer it can parse, whatever went wrong."""
    for line in message.split("\n"):
        print(f"p2pnode: {shown(line)}", file=sys.stderr)
    if getattr(args, "json", False):
        with contextlib.suppress(OSError):  # stdout gone: stderr and the code said it
            failure = {"kind": KINDS.get(code, "error"), "exit_code": code, "message": message}
            print(json.dumps({"error": failure}), flush=True)
    return code


def _stdout_gone() -> int:
    """The reader of stdout went away (`p2pnode ls | head`): stop quietly.  stdout is pointed at
    /dev/null so that the interpreter's final flush cannot fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_BROKEN_PIPE
