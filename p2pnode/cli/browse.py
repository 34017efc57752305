"""`p2pnode browse` (also `ls --peers`): what every reachable trusted peer offers, and the
hand-off `share` ends with (what the teammate types).  Through the running node (it knows the
peers on the LAN) or, with no node, from the peers given with --from.  Every text a peer sent
goes through render.shown / one_line before it reaches the terminal."""
from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime
from typing import Any

from p2pnode.cli.render import one_line, print_json, shown, size
from p2pnode.errors import PeerUnavailable
from p2pnode.node.routing import via_node
from p2pnode.paths import NodePaths
from p2pnode.peer.offers import unanswered


def cmd_browse(args: argparse.Namespace) -> int:
    from p2pnode.cli.main import node_paths
    from p2pnode.node.names import from_addresses

    paths = node_paths(args)
    given = from_addresses(paths, getattr(args, "peer", None) or [])  # also NAME and NAME@HOST:PORT
    answer = via_node(paths, "browse", {"peers": [str(p) for p in given]})
    if answer is None:
        answer = _browse_here(paths, given)
    if not answer["peers"]:  # nobody to ask: as `fetch` says it, not an empty listing
        raise PeerUnavailable("no trusted peer is online to ask (`p2pnode peers` lists them; "
                              "`--from HOST:PORT` asks one directly)")
    failed = [p for p in answer["peers"] if p["error"]]
    why = "; ".join(f"{shown(_who(p))}: {shown(p['error'])}" for p in failed)
    if failed and len(failed) == len(answer["peers"]):  # asked, and none answered: why, by the exit code
        raise unanswered(p.get("exit_code") for p in failed)(f"no peer asked answered: {why}")
    for p in failed:
        print(f"p2pnode: warning: {shown(_who(p))} did not answer: {shown(p['error'])}", file=sys.stderr)
    if args.json:
        print_json(answer)
    else:
        print_offers(answer["branches"], time.time())
    return 0


def _browse_here(paths: NodePaths, given: list[Any]) -> dict[str, Any]:
    """No node runs: ask the --from peers ourselves."""
    import asyncio

    from p2pnode.peer.identity import load_or_create_identity
    from p2pnode.peer.offers import ask_catalogs, by_node, offered_rows
    from p2pnode.peer.trust import TrustStore

    if not given:
        raise PeerUnavailable("browse: no node is running to ask the LAN; start one (`p2pnode serve`) "
                              "or give --from HOST:PORT")
    trust = TrustStore(paths.trust)
    answers = asyncio.run(ask_catalogs(by_node(given), load_or_create_identity(paths.identity), trust))
    return offered_rows(answers, {p.node_id: p.name for p in trust.peers()})


def _who(row: dict[str, Any]) -> str:
    if row.get("node_id") is None:
        return ", ".join(row.get("addresses") or ["?"])
    return f"{row['name']} ({row['short_id']})" if row.get("name") else str(row["short_id"])


def print_offers(rows: list[dict[str, Any]], now: float) -> None:
    from p2pnode.peer.offers import unique_prefix

    hashes = [r["branch"] for r in rows]
    print(f"{'WHO':24}  {'BRANCH':16}  {'AGE':>4}  {'LINES':>6}  {'SIZE':>8}  {'VERS':>4}  "
          f"{'PROJECT':20}  TITLE")
    for r in rows:
        print(f"{one_line(_who(r), 24):24}  {unique_prefix(r['branch'], hashes):16}  "
              f"{age(r['timestamp'], now):>4}  {r['lines']:>6}  {size(r['size']):>8}  {r['versions']:>4}  "
              f"{one_line(r['project'], 20):20}  {one_line(r['title'], 60)}")


def age(timestamp: object, now: float) -> str:
    """How long ago a session began (its header's ISO timestamp), in one short unit."""
    try:
        then = datetime.fromisoformat(str(timestamp).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return "?"
    s = max(0.0, now - then)
    for unit, length in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= length:
            return f"{int(s // length)}{unit}"
    return f"{int(s)}s"


def print_handoff(command: str, ticket: str | None) -> None:
    """The end of `share` (stderr: stdout keeps the hash and the ticket for scripts)."""
    print(f"teammates on the LAN run:  {command}", file=sys.stderr)
    if ticket:
        print(f"off the LAN:               p2pnode fetch {ticket}", file=sys.stderr)
    else:
        print("off the LAN: start the node (`p2pnode serve`) and share again for a ticket", file=sys.stderr)


def add_browse_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("browse", help="list what every reachable trusted peer offers (also `ls --peers`)")
    add_browse_arguments(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_browse)


def add_browse_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from", dest="peer", action="append", metavar="[NODEID@]HOST:PORT|NAME",
                   help="a peer to ask (repeatable; needed when no node runs)")
