"""The store's command line (`python -m store fsck`, `serve`).

`run_fsck` is the fsck command's one body (check, print the report, exit code), which
`p2pnode fsck` calls too, so that both print the same report the same way.  `p2pnode` builds
its own parser without importing the store (a CLI start pays nothing for it) and so declares
the same three flags itself.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence


def run_fsck(path: str | os.PathLike[str], args: argparse.Namespace, repaired: Sequence[str] = (),
             errors: Sequence[str] = ()) -> int:
    """Check the store at path as args say (--full, --repair, --json) and print the report:
    exit 0 when clean, 1 when not; StoreLocked when another process holds it.  `repaired`,
    `errors`: what the store's user repaired first, and found it could not (listed first)."""
    from store.fsck import fsck

    report = fsck(path, full=args.full, repair=args.repair)
    report.repaired[:0] = repaired
    report.errors[:0] = errors
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.summary())
    return 0 if report.ok else 1


def _fsck_command(args: argparse.Namespace) -> int:
    """`python -m store fsck`: exit 1 also when another process holds the store (said on stderr,
    not as a finding)."""
    from store.errors import StoreLocked

    try:
        return run_fsck(args.path, args)
    except StoreLocked as exc:
        print(f"store: {exc}: stop the process that uses it, then check again", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m store", description="turn and blob store tools")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("fsck", help="check a store: CRCs, index, heads, depths")
    p.add_argument("path", help="the store directory")
    p.add_argument("--full", action="store_true", help="also re-hash every blob")
    p.add_argument("--repair", action="store_true", help="truncate torn tails and rebuild the index")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_fsck_command)
    p = sub.add_parser("serve", help="serve a store over the frame protocol (docs/PROTOCOL.md)")
    p.add_argument("path", help="the store directory")
    p.add_argument("--socket", help="Unix socket path (default: PATH.sock beside the store)")
    p.add_argument("--tcp", metavar="HOST:PORT", help="also listen on this loopback address")
    p.set_defaults(func=cmd_serve)
    return parser


def cmd_serve(args: argparse.Namespace) -> int:
    from store.service.server import loopback_address, run_service

    try:
        tcp = loopback_address(args.tcp) if args.tcp is not None else None
    except ValueError as exc:  # a usage error: one line, exit 2, before the store is opened
        print(f"python -m store serve: --tcp: {exc}", file=sys.stderr)
        return 2
    return run_service(args.path, args.socket, tcp)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from store.errors import StoreError

    try:
        return int(args.func(args))
    except StoreError as exc:
        print(f"store: {exc}", file=sys.stderr)
        return 2
