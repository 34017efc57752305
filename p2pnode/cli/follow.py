"""`p2pnode follow` and `p2pnode live`, and what `share --live` asks the node: the command line
side of following a teammate's session live and of sharing one's own live (node/follow.py,
node/live.py do the work in the running node, which keeps both across restarts)."""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from p2pnode.cli.render import one_line, print_json, short, shown
from p2pnode.errors import EXIT_INTERRUPTED, InvalidInput, P2PNodeError, PeerUnavailable
from p2pnode.node.control_client import NodeError, call_node, node_running
from p2pnode.paths import NodePaths, PiDirs

EVENTS_WAIT = 20.0
NODE_BACK_POLL = 1.0
"""While the node restarts, how often `follow` looks for it again."""


def _paths(args: argparse.Namespace) -> NodePaths:
    return (NodePaths(Path(args.home)) if args.home else NodePaths.default()).ensure()


def require_node(paths: NodePaths, what: str) -> None:
    if not node_running(paths):
        raise PeerUnavailable(f"{what} needs the running node (start it with `p2pnode serve`): it is "
                              "the node that keeps watching while you work")


def _call(paths: NodePaths, op: str, payload: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
    reply = call_node(paths, op, payload, timeout=timeout)
    if reply is None:
        raise PeerUnavailable(f"the node for {paths.home} is not running")
    return reply


def start_live(paths: NodePaths, shared: dict[str, Any], pi: PiDirs, cwd: str, allow_secrets: bool) -> None:
    """After `share --live`: the node shares the file again whenever it grows, each time to
    whom this share went and until the moment it ends (not pushed back by each growth)."""
    _call(paths, "live", {"path": shared["path"], "pi": pi.as_dict(), "cwd": cwd,
                          "allow_secrets": allow_secrets, "branch": shared["branch"],
                          "to": shared["to"], "expires_at": shared["expires_at"]})
    print(f"p2pnode: note: sharing {shown(shared['path'])} live: the node shares it again as it grows "
          "(`p2pnode live --stop <file>` ends that)", file=sys.stderr)


def print_event(event: dict[str, Any]) -> None:
    when = time.strftime("%H:%M:%S", time.localtime(event["time"]))
    kind = event["kind"]
    if kind == "version":
        v = f"v{event['version']}" if event.get("version") else "new version"
        print(f"{when}  {v} {short(event['branch'])}  +{event['new_lines']} lines, +{event['turns']} "
              f"message(s), {event['lines']} lines in all  {one_line(event.get('words'), 80)}", flush=True)
        if event.get("conflict"):
            print(f"{when}  not placed: {shown(event['conflict'])}", flush=True)
        elif event.get("written"):
            print(f"{when}  updated {shown(event['path'])}", flush=True)
    elif kind == "following":
        print(f"{when}  following {short(event['branch'])} from {shown(event['peer'])}  "
              f"{one_line(event.get('title'), 80)}".rstrip(), flush=True)
    else:
        print(f"{when}  {kind}: {one_line(event.get('message'), 200)}", flush=True)


class _Told(Exception):
    """The command was told to end by a signal other than Ctrl-C (SIGTERM; SIGHUP: its terminal
    closed): it stops following as Ctrl-C does, then ends by that signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _told(signum: int, _frame: object) -> None:
    raise _Told(signum)


def cmd_follow(args: argparse.Namespace) -> int:
    import os
    import signal

    from p2pnode.node.names import from_addresses

    paths = _paths(args)
    if args.stop:
        stopped = _call(paths, "unfollow", {"key": args.target})
        _said(args, {"kind": "stopped", "key": stopped["key"]}, f"stopped following {shown(stopped['key'])}")
        return 0
    require_node(paths, "follow")
    pi = PiDirs.resolve(os.getcwd(), args.session_dir)
    peers = [str(p) for p in from_addresses(paths, args.peer or [])]  # also NAME and NAME@HOST:PORT
    reply = _call(paths, "follow", {"target": args.target, "peers": peers, "pi": pi.as_dict(),
                                    "attached": not args.detach})
    key = reply["key"]
    if args.detach:
        _said(args, {"kind": "detached", "key": key}, f"following {shown(key)} in the node (`p2pnode status` "
              f"shows it; `p2pnode follow --stop {shown(key)}` ends it)")
        return 0
    for signum in (signal.SIGTERM, signal.SIGHUP):  # a command killed with SIGKILL: the node
        signal.signal(signum, _told)  # ends the follow after follow.ATTACHED_GRACE
    try:  # from the line that says Ctrl-C stops, a Ctrl-C is this command's to handle
        print(f"p2pnode: following {shown(key)}; Ctrl-C stops", file=sys.stderr)
        return _print_events(paths, key, reply["epoch"], args.json)
    except (KeyboardInterrupt, _Told) as stop:
        if reply.get("attached", True):
            with contextlib.suppress(P2PNodeError):  # not followed any more anyway
                call_node(paths, "unfollow", {"key": key}, timeout=10.0)
            said = f"stopped following {shown(key)}"
        else:  # followed with --detach before this command: the node's, not this command's
            said = f"the node goes on following {shown(key)} (`follow --detach` asked it to; " \
                   "`p2pnode follow --stop` ends it)"
        with contextlib.suppress(OSError):  # a closed terminal
            print(f"p2pnode: {said}", file=sys.stderr)
        if isinstance(stop, _Told):
            signal.signal(stop.signum, signal.SIG_DFL)
            os.kill(os.getpid(), stop.signum)
        return EXIT_INTERRUPTED  # Ctrl-C, as for any command it ends (README's exit codes)


def _said(args: argparse.Namespace, obj: dict[str, Any], text: str) -> None:
    """What `follow --detach`/`--stop` and `live --stop` did: with --json one JSON line, as the
    events of an attached `follow` are."""
    print(json.dumps(obj) if args.json else text)


def _print_events(paths: NodePaths, key: str, epoch: str, as_json: bool) -> int:
    """Print what the node reports for this follow until it is no longer followed; wait out a
    restart of the node (it follows on after one: follows.json)."""
    after, waiting = 0, False
    while True:
        try:
            reply = call_node(paths, "follow-events", {"key": key, "after": after, "wait": EVENTS_WAIT},
                              timeout=EVENTS_WAIT + 10)
        except PeerUnavailable:
            reply = None
        if reply is None:
            if not waiting:
                print("p2pnode: the node stopped; waiting for it to come back", file=sys.stderr)
                waiting = True
            time.sleep(NODE_BACK_POLL)
            continue
        waiting = False
        if reply["epoch"] != epoch:  # the node restarted: its events start over
            epoch, after = reply["epoch"], 0
        for event in reply["events"]:
            after = event["seq"]
            if event["kind"] == "failed":  # the node ended the follow: its error, its exit code
                raise NodeError(event["message"], event["exit_code"])
            if as_json:
                print(json.dumps(event), flush=True)
            else:
                print_event(event)
        if not reply["following"]:
            print(f"p2pnode: {shown(key)} is no longer followed", file=sys.stderr)
            return 0


def cmd_live(args: argparse.Namespace) -> int:
    import os

    paths = _paths(args)
    if args.stop:
        require_node(paths, "live --stop")
        stopped = _call(paths, "unlive", {"path": os.path.abspath(args.stop)})
        _said(args, {"stopped": stopped["path"]}, f"stopped sharing {shown(stopped['path'])} live")
        return 0
    status = call_node(paths, "status", {}) or {}
    live = status.get("live", [])
    if args.json:
        print_json(live)
        return 0
    for entry in live:
        print(f"{short(entry['branch'])}  {shown(entry['path'])}"
              f"{'  ERROR ' + one_line(entry['error'], 100) if entry['error'] else ''}")
    return 0


def print_live_stopped(paths: list[str], why: str) -> None:
    """`unshare` and `rm` ended these live shares first (else Pi's next line offers it again)."""
    for path in paths:
        print(f"stopped sharing {shown(path)} live ({why}; `p2pnode share --live` it again to "
              "offer it as it grows)")


def check_live(args: argparse.Namespace, paths: NodePaths) -> None:
    """`share --live` is refused before anything is shared when it cannot be done."""
    if args.redact:
        raise InvalidInput("share --live cannot be combined with --redact (each update would be a new copy)")
    require_node(paths, "share --live")


def add_follow_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("follow", help="keep a teammate's growing session current here, live (needs `serve`)")
    p.add_argument("target", metavar="SESSION|BRANCH|TICKET",
                   help="a Pi session id, a branch hash of any of its versions (or a unique start of "
                        "one), or a p2p1: ticket")
    p.add_argument("--from", dest="peer", action="append", metavar="[NODEID@]HOST:PORT|NAME",
                   help="a peer to follow it from (repeatable; default: found on the LAN)")
    p.add_argument("--session-dir", help="Pi's --session-dir: place the session flat in this dir")
    p.add_argument("--detach", action="store_true", help="leave the node following it and return")
    p.add_argument("--stop", action="store_true", help="stop following it")
    p.add_argument("--json", action="store_true",
                   help="one JSON event per line (--detach, --stop: one object, kind detached or stopped)")
    p.set_defaults(func=cmd_follow)
    p = sub.add_parser("live", help="list the sessions shared live (`share --live`), or stop one")
    p.add_argument("--stop", metavar="FILE", help="stop sharing this file live (what is shared stays)")
    p.add_argument("--json", action="store_true", help="the list; with --stop, {\"stopped\": FILE}")
    p.set_defaults(func=cmd_live)
