"""`p2pnode log [--json]`: the audit trail (library/audit.py), read straight from the node's
home, so it works whether or not the node runs (and while it writes)."""
from __future__ import annotations

import argparse
import time
from collections.abc import Mapping
from typing import Any

from p2pnode.cli import argtypes
from p2pnode.cli.access import peer_names
from p2pnode.cli.render import one_line, print_json, short, shown
from p2pnode.library.audit import AuditLog


def cmd_log(args: argparse.Namespace) -> int:
    from p2pnode.cli.main import node_paths

    paths = node_paths(args)
    entries = AuditLog(paths.home / "audit.log").read()
    if args.limit:
        entries = entries[-args.limit:]
    if args.json:
        print_json(entries)
        return 0
    names = peer_names(paths)
    for entry in entries:
        print(log_line(entry, names))
    return 0


def log_line(e: dict[str, Any], names: Mapping[str, str] | None = None) -> str:
    """One event as a line: time, event, then what it concerns (`names`: node id -> the name
    it is trusted by here, for a share's peers; an id not trusted now is shown whole)."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(e.get("time", 0))))
    event = str(e.get("event"))
    if event == "served":
        who = f"{shown(e.get('peer_name'))} " if e.get("peer_name") else ""
        branches = ", ".join(short(b) for b in e.get("branches") or []) or "-"
        what = f"{e.get('kind')} of {branches} to {who}{shown(e.get('peer'))}, {e.get('bytes')} bytes"
        what += "" if e.get("complete", True) else " (cut off)"
    elif event == "gc":
        what = f"{len(e.get('branches') or [])} branch(es), {e.get('versions')} version(s) forgotten"
    elif event == "reclaimed":
        what = f"{e.get('bytes')} bytes freed in the store"
    else:
        what = f"{short(e.get('branch'))}  {one_line(e.get('title'), 50)}"
        if event == "shared":
            to = e.get("to")
            peers = ", ".join(shown((names or {}).get(p) or p) for p in to or [])
            what += f"  to {peers}" if to else "  to all trusted peers"
            if e.get("expires_at"):
                until = time.localtime(e["expires_at"] / 1000)
                what += f", until {time.strftime('%Y-%m-%d %H:%M', until)}"
            if e.get("secrets_allowed"):
                what += " (secrets allowed)"
            if changed := e.get("audience_changed"):
                what += f"; the audience of {', '.join(short(c.get('branch')) for c in changed)} too"
        elif event == "fetched":
            what += f"  {e.get('bytes')} bytes"
        elif event == "dropped":
            what += f"  (fsck --repair: {e.get('why')})"
        elif event == "expired" and isinstance(e.get("expires_at"), int):  # logged when next looked at
            what += f"  (expiry {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(e['expires_at'] / 1000))})"
    return f"{when}  {event:8}  {what}"


def add_log_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("log", help="the audit trail: shared, unshared, expired, fetched, served to whom")
    p.add_argument("-n", "--limit", type=argtypes.count, help="only the last N events (N >= 1)")
    p.add_argument("--json", action="store_true", help="a JSON list of the events, oldest first")
    p.set_defaults(func=cmd_log)
