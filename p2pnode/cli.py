"""The `p2pnode` command line: argument parsing and output only, over the library API.

Each command is a function `cmd_<name>(args) -> int`; library errors (P2PNodeError) are
reported on stderr as `p2pnode: <message>` with their exit code (see p2pnode/errors.py).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from typing import Any

from p2pnode import __version__
from p2pnode.errors import P2PNodeError
from p2pnode.paths import NodePaths

Command = Callable[[argparse.Namespace], int]


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def node_paths(args: argparse.Namespace) -> NodePaths:
    return (NodePaths(args.home) if args.home else NodePaths.default()).ensure()


# --- store ------------------------------------------------------------------------------


def cmd_fsck(args: argparse.Namespace) -> int:
    from store.fsck import fsck

    report = fsck(node_paths(args).store, full=args.full, repair=args.repair)
    if args.json:
        print_json(report.as_dict())
    else:
        print(report.summary())
    return 0 if report.ok else 1


def add_store_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fsck", help="check the node's store (CRCs, index, heads, depths)")
    p.add_argument("--full", action="store_true", help="also re-hash every blob")
    p.add_argument("--repair", action="store_true", help="truncate torn tails and rebuild the index")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_fsck)


# --- parser -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="p2pnode", description=__doc__)
    parser.add_argument("--version", action="version", version=f"p2pnode {__version__}")
    parser.add_argument("--home", help="node state directory (default: $P2PNODE_HOME or the user state dir)")
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING or ERROR")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_store_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except P2PNodeError as exc:
        print(f"p2pnode: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
