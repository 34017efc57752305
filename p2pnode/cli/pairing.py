"""`p2pnode pair [CODE]`, `trust`/`untrust` by name or id, `peers --pending`: parsing and
printing only (the work is node/pairing.py's and node/names.py's)."""
from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from p2pnode.cli.render import print_json, shown
from p2pnode.errors import InvalidInput
from p2pnode.node.routing import via_node
from p2pnode.paths import NodePaths

if TYPE_CHECKING:
    from p2pnode.peer.pairing import Party


def _paths(args: argparse.Namespace) -> NodePaths:
    from p2pnode.cli.main import node_paths

    return node_paths(args)


def _paired(args: argparse.Namespace, peer: Party | dict[str, Any]) -> int:
    info = peer if isinstance(peer, dict) else peer.as_dict()
    if args.json:
        print_json({"paired": info})
    else:
        who = f"{info['name']} ({info['id']})" if info.get("name") else info["id"]
        print(f"paired with {shown(who)}: both nodes trust each other now")
    return 0


def _show_code(args: argparse.Namespace, info: dict[str, Any]) -> None:
    """The code and what the other side runs: found over mDNS by the code alone, else (mDNS off
    here or on the running node) only with --from and an address of this machine."""
    if args.json:
        print_json({k: info[k] for k in ("code", "addresses", "port", "expires_in", "mdns")})
    else:
        code, port = info["code"], info["port"]
        froms = ([f"--from {a}:{port}" for a in info["addresses"]]
                 or [f"--from <this machine's address>:{port}"])
        if info["mdns"]:
            print(f"pairing code: {code}\n"
                  f"on the other machine run:  p2pnode pair {code}\n"
                  f"(where mDNS cannot reach, add {' or '.join(froms)})")
        else:
            print(f"pairing code: {code}\n"
                  f"on the other machine run:  p2pnode pair {code} {froms[0]}\n"
                  "(mDNS is off: the code is not announced on the LAN, the other side needs --from"
                  + (f"; other addresses of this machine: {' or '.join(froms[1:])})" if froms[1:] else ")"))
        print(f"waiting up to {info['expires_in'] / 60:g} minutes; the code works once")
    sys.stdout.flush()


def cmd_pair(args: argparse.Namespace) -> int:
    import asyncio

    from p2pnode.node import pairing
    from p2pnode.peer.address import PeerAddress

    paths = _paths(args)
    if args.code:
        addresses = [(a.host, a.port) for a in (PeerAddress.parse(t) for t in args.peer or [])]
        return _paired(args, asyncio.run(pairing.join_code(paths, args.code, addresses, args.name)))
    if args.peer:
        raise InvalidInput("--from is for the joining side: `p2pnode pair <code> --from HOST:PORT`")
    if args.name is not None:
        pairing.my_party(paths, args.name)  # checked and remembered (also announced by the node)
    started = via_node(paths, "pair/start", {"mdns": not args.no_mdns})
    if started is None:  # no node running: this process waits itself
        peer = asyncio.run(pairing.wait_here(paths, args.name, args.host, not args.no_mdns,
                                             lambda info: _show_code(args, info)))
        return _paired(args, peer)
    _show_code(args, started)
    from p2pnode.node.control_client import call_node
    from p2pnode.peer.pairing import CODE_TTL

    result = call_node(paths, "pair/wait", {"code": started["code"]}, timeout=CODE_TTL + 30)
    return _paired(args, result or {})


def cmd_trust(args: argparse.Namespace) -> int:
    """`trust <name|id>`: a pending caller or a LAN node by the name it announced, or an id."""
    from p2pnode.node.names import known_peers, resolve
    from p2pnode.peer.identity import load_or_create_identity
    from p2pnode.peer.trust import TrustStore

    paths = _paths(args)
    peer = resolve(args.node_id, known_peers(paths))
    if peer.node_id == load_or_create_identity(paths.identity).node_id:
        raise InvalidInput(f"{peer.node_id} is this node's own id: a node cannot trust itself")
    store = TrustStore(paths.trust)
    # a name given here is the user's: taken by another peer, refused (exit 4); the name the peer
    # announces is made unique, as pairing does
    name = args.name if args.name is not None else store.free_name(peer.name, peer.node_id)
    trusted = store.trust(peer.node_id, name=name)
    claim = f" (the name {peer.name!r} is what it announces: check the id with its owner)" \
        if peer.how not in ("", "trusted") and args.node_id != peer.node_id and not args.name else ""
    via_node(paths, "trust/reload", {})  # served from now on, not from the node's next poll
    print(f"trusted {trusted.node_id}{f' ({shown(trusted.name)})' if trusted.name else ''}{shown(claim)}")
    return 0


def cmd_untrust(args: argparse.Namespace) -> int:
    from p2pnode.node.names import TRUSTED, known_peers, resolve
    from p2pnode.peer.trust import TrustStore

    paths = _paths(args)
    peer = resolve(args.node_id, known_peers(paths), (TRUSTED,))
    removed = TrustStore(paths.trust).untrust(peer.node_id)
    via_node(paths, "trust/reload", {})  # its connections reset before this returns
    print(f"untrusted {removed.node_id}{f' ({shown(removed.name)})' if removed.name else ''}")
    return 0


def cmd_pending(args: argparse.Namespace) -> int:
    """`peers --pending`: untrusted nodes that tried to connect to the running node."""
    reply = via_node(_paths(args), "pending", {})
    pending = (reply or {}).get("pending", [])
    if args.json:
        print_json(pending)
        return 0
    if reply is None:
        print("no node running: untrusted callers are remembered by the running node (`p2pnode serve`)",
              file=sys.stderr)
    for p in pending:
        name = p.get("name")
        who = f"{name} ({p['id']})" if name else p["id"]
        print(f"{shown(who)}: tried to connect {p['attempts']} time(s), not trusted here (any key can try; "
              f"a name is what it announces): if its user confirms this id, run p2pnode trust {p['id']}")
    return 0


def add_pairing_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pair", help="pair with a teammate's node by a short one-time code (both trust each "
                                    "other after)")
    p.add_argument("code", nargs="?", help="the code the other node shows (omit it to show a code here)")
    p.add_argument("--name", help="the name the other node will know this one by (remembered; default: "
                                  "the last one given, else your login name)")
    p.add_argument("--from", dest="peer", action="append", metavar="HOST:PORT",
                   help="where the waiting node listens, when mDNS cannot reach it (joining side)")
    p.add_argument("--host", default="0.0.0.0", help="address the waiting side listens on without a "
                                                     "running node (default: all)")
    p.add_argument("--no-mdns", action="store_true",
                   help="do not announce the code on the LAN (the other side then gives --from "
                        "HOST:PORT, as printed)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_pair)
