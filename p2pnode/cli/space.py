"""`p2pnode gc` and `p2pnode rm <branch|session>` (library/space.py): through the running
node when there is one (it holds the store), else on the store directly."""
from __future__ import annotations

import argparse
from typing import Any

from p2pnode.cli.render import one_line, print_json, short, shown


def cmd_gc(args: argparse.Namespace) -> int:
    from p2pnode.cli.main import node_paths
    from p2pnode.node.routing import routed, via_node_streamed

    report = routed(node_paths(args), "gc", {}, lambda lib: lib.gc().as_dict(), via_node_streamed)
    if args.json:
        print_json(report)
    else:
        print_gc(report)
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from p2pnode.cli.follow import print_live_stopped
    from p2pnode.cli.main import node_paths
    from p2pnode.node.follow import unfollow_saved
    from p2pnode.node.live import unlive_saved
    from p2pnode.node.routing import routed, via_node_streamed
    from p2pnode.node.upkeep import remove_and_collect

    paths = node_paths(args)
    def here(lib: Any) -> dict[str, Any]:
        return remove_and_collect(lib, args.target, lambda gone: unfollow_saved(paths.home, gone),
                                  lambda gone: unlive_saved(paths.home, gone))

    result = routed(paths, "rm", {"target": args.target}, here, via_node_streamed)
    if args.json:
        print_json(result)
        return 0
    for key in result.get("unfollowed", []):
        print(f"stopped following {shown(key)} (it fetched what rm removes; `p2pnode follow` it again to "
              "keep it here)")
    print_live_stopped(result.get("live_stopped", []), "it would offer again what rm removes")
    for info in result["removed"]:
        print(f"removed {info['branch']}  {one_line(info['title'], 60)}")
    print_gc(result["gc"])
    return 0


def print_gc(report: dict[str, Any]) -> None:
    if report["skipped"]:
        print(f"gc skipped: {report['skipped']} (the node collects later)")
        return
    for branch in report["branches"]:
        print(f"forgot  {short(branch)}")
    dropped = len(report["versions"])
    versions = f" ({dropped} older version(s) dropped)" if dropped else ""
    freed, before, after = report["bytes_freed"], report["store_bytes_before"], report["store_bytes_after"]
    # README, "Space": the store shrinks by what was freed and the index entries of those lines
    store = f"{before} -> {after} bytes" if freed else f"{after} bytes"
    print(f"gc freed {freed} bytes of stored lines{versions}; the store: {store}")
    if report.get("staging_bytes_freed"):
        print(f"gc removed {report['staging_bytes_freed']} bytes that interrupted fetches left behind")


def add_space_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gc", help="reclaim store space held only by unshared, expired or removed sessions")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_gc)
    p = sub.add_parser("rm", help="forget a branch (or every branch of a Pi session id), then gc")
    p.add_argument("target", help="branch hash or unique prefix, or a Pi session id")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_rm)
