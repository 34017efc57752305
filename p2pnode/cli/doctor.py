"""`p2pnode doctor`: one line per health check, with what to do (the checks: node/doctor.py).
Exit 0 when no check failed, 1 otherwise (README's exit codes)."""
from __future__ import annotations

import argparse
import os

from p2pnode.cli import argtypes
from p2pnode.cli.render import print_json, shown

MARKS = {"ok": "ok  ", "fail": "FAIL", "skip": "skip"}


def cmd_doctor(args: argparse.Namespace) -> int:
    from p2pnode.cli.main import node_paths
    from p2pnode.node.doctor import diagnose, failed
    from p2pnode.paths import PiDirs

    cwd = os.getcwd()
    checks = diagnose(node_paths(args), PiDirs.resolve(cwd, args.session_dir), cwd, timeout=args.timeout)
    if args.json:
        print_json({"ok": not failed(checks), "checks": [c.as_dict() for c in checks]})
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            fix = f" -> {c.fix}" if c.fix and c.outcome != "ok" else ""
            print(f"{MARKS[c.outcome]}  {c.name:<{width}}  {shown(c.detail)}{shown(fix)}")
    return 1 if failed(checks) else 0


def add_doctor_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="check the store, the node, reachability, mDNS, mutual trust and "
                                      "Pi's session dir; one line each, with what to do")
    p.add_argument("--session-dir", help="Pi's --session-dir, if you pass one to pi")
    p.add_argument("--timeout", type=argtypes.seconds, default=3.0,
                   help="seconds for each network check (default 3)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_doctor)
