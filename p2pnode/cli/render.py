"""What the CLI prints: JSON, the text views of status, peers, ls, show and fetch, a transfer's
progress in words (the live bar is cli/progress.py's), and `shown`, the one escape for text
that may come from a peer before it reaches a terminal.
Nothing here decides anything; main.py parses and dispatches."""
from __future__ import annotations

import json
import math
import shlex
import sys
import time
from collections.abc import Mapping
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from p2pnode.library.api import BranchInfo


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


class JsonLines:
    """`cat --json`'s answer, `{**head, "lines": [...]}` as print_json prints it, written as
    the session's bytes come (in runs cut anywhere): one line in memory at a time, not the
    session (which a 2 GB session held four times over).  A line is what Pi reads as one: the
    bytes up to and including a newline, nothing else splits it (U+2028, a lone CR)."""

    def __init__(self, out: IO[bytes], head: dict[str, Any]) -> None:
        self.out = out
        self._begun: list[bytes] = []
        """The pieces of a line begun in earlier runs (joined once, when its newline comes)."""
        self._sep = b"\n    "
        fields = json.dumps({**head, "lines": []}, indent=2)
        out.write(fields[: fields.rindex("[") + 1].encode())

    def write(self, run: bytes) -> None:
        start = 0
        while (end := run.find(b"\n", start) + 1) > 0:
            self._line([*self._begun, run[start:end]])
            self._begun.clear()
            start = end
        if start < len(run):
            self._begun.append(run[start:])

    def _line(self, pieces: list[bytes]) -> None:
        text = b"".join(pieces).decode("utf-8", "replace")
        self.out.write(self._sep + json.dumps(text).encode())
        self._sep = b",\n    "

    def close(self) -> None:
        """The last line (if it has no newline) and the end of the answer."""
        if self._begun:
            self._line(self._begun)
        self.out.write(b"]\n}\n" if self._sep == b"\n    " else b"\n  ]\n}\n")


def size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def short(h: str | None) -> str:
    return h[:16] if h else "-"


def shown(text: object) -> str:
    """Text that may come from a peer (titles, header fields, paths, reasons), safe to print
    on a terminal: every non-printable character (C0, DEL, C1 such as U+009B, a terminal's
    CSI, bidi controls) is written as a visible escape instead of reaching the terminal."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def one_line(text: str | None, width: int) -> str:
    flat = shown(" ".join((text or "").split()))
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def transfer_detail(t: dict[str, Any]) -> str:
    """Rate, ETA, lines verified and peers of a transfer (TransferProgress's fields), in one text."""
    rate, eta, lines, peers = t.get("rate"), t.get("eta"), t.get("lines_verified"), t.get("peers") or []
    of = f"/{t['lines_total']}" if t.get("lines_total") else ""
    parts = [f"{rate / 1e6:.1f} MB/s" if rate else "-- MB/s",
             f"ETA {clock(eta)}" if eta is not None else "ETA --"]
    if lines is not None:
        parts.append(f"{lines}{of} lines verified")
    if peers:
        parts.append(f"{len(peers)} peer{'s' if len(peers) > 1 else ''}"
                     + (f" ({shown(peers[0])})" if len(peers) == 1 else ""))
    return "  ".join(parts)


def clock(seconds: float) -> str:
    """m:ss or h:mm:ss (an ETA)."""
    s = int(seconds + 0.5)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def print_status(status: dict[str, Any]) -> None:
    print(f"node       {status['node_id'] or '(no identity yet)'}")
    if status["running"]:
        print(f"running    port {status['port']} on {', '.join(status['addresses'])}"
              f"{'' if status['mdns'] else ' (mDNS off)'}")
    else:
        print("running    no (start it with `p2pnode serve`)")
    print(f"shared     {len(status['shared'])} branch(es), catalog generation {status['catalog_generation']}")
    for b in status["shared"]:
        print(f"  {b['branch'][:16]}  {b['size']:>10}  {one_line(b['title'], 90)}")
        if b.get("withheld"):
            print(f"    {shown(b['withheld'])}")
    trusted = [p for p in status["peers"] if p["trusted"]]
    print(f"peers      {len(trusted)} trusted ({sum(1 for p in trusted if p['online'])} online), "
          f"{len(status['peers']) - len(trusted)} untrusted seen")
    listed, more = _bounded(status["peers"])
    for p in listed:
        state = {True: "online", False: "offline", None: "unconfirmed"}[p["online"]]
        where = _where(p)
        print(f"  {p['node_id']}  {'trusted' if p['trusted'] else 'UNTRUSTED'}  {state}  {where}"
              f"  {p['name'] or ''}")
    if more:
        print(f"  ... and {more} more untrusted (`--json` lists them all)")
    if status.get("store_damage"):
        print(f"store      {status['store_bytes']} bytes, DAMAGED: {shown(status['store_damage'])} "
              "(`p2pnode fsck`, then, with no node running, `p2pnode fsck --repair`)")
    elif status.get("store_bytes") is not None:
        print(f"store      {status['store_bytes']} bytes, about {status['reclaimable_bytes']} reclaimable "
              "(`p2pnode gc`)")
    if status.get("store_failure"):
        print(f"store      REFUSES WRITES since a write failed ({shown(status['store_failure'])}): make room "
              "(or mend the disk), then restart the node")
    for f in status.get("following", []):
        print(f"following  {shown(f['key'])}  {short(f['branch'])}  {shown(f['state'])}  "
              f"{shown(f['path'] or '-')}")
    for live in status.get("live", []):
        error = f"  ERROR {one_line(live['error'], 80)}" if live["error"] else ""
        print(f"live       {shown(live['path'])}  {short(live['branch'])}{error}")
    print(f"transfers  {len(status['transfers']) or 'none'}")
    for t in status["transfers"]:
        total = t["bytes_total"]
        done = f"{size(t['bytes_done'])}/{size(total)}" if total else size(t["bytes_done"])
        running = t.get("state", "running") == "running"
        state = t.get("state", "running") + (" (background)" if t.get("background") else "")
        ended = t.get("error") or t.get("conflict") or t.get("path") or ""  # how it ended, or where it went
        how = transfer_detail(t) if running else shown(ended)
        print(f"  {t.get('id', '-')}  {t['branch'][:16]}  {state}  {done}  {how}".rstrip())


def print_branches(infos: list[BranchInfo], names: Mapping[str, str] | None = None) -> None:
    print(f"{'BRANCH':16}  {'TIME':16}  {'VERS':>4}  {'LINES':>5}  {'SIZE':>9}  {'PARENT':16}  "
          f"{'CWD':24}  TITLE")
    for i in infos:
        when = (i.header.get("timestamp") or "")[:16].replace("T", " ")
        mark = access_note(i, names) + (" (secrets allowed)" if i.secrets_allowed else "")
        mark += f" (withheld: {'secrets found' if 'secret' in i.withheld else 'lineage not offered'})" \
            if i.withheld else ""
        print(f"{short(i.branch):16}  {when:16}  {i.versions:>4}  {i.lines:>5}  {i.size:>9}  "
              f"{short(i.parent):16}  {one_line(i.header.get('cwd'), 24):24}  {one_line(i.title, 50)}{mark}")


def print_unshared(answer: Mapping[str, Any]) -> None:
    """`unshare`: the branch, the other versions of its session withdrawn with it, and (stderr)
    the offered branches that descend from it, no longer served; or that it was not offered."""
    if not answer.get("was_offered", True):
        why = {"unshared": "unshared already", "expired": "its offer expired"}.get(
            answer.get("withdrawn") or "", "fetched here, never shared")
        print(f"not offered: {answer['branch']} ({why}); nothing to unshare")
        return
    print(f"unshared {answer['branch']}")
    if answer["versions"]:
        print(f"  and {len(answer['versions'])} other version(s) of its session")
    for w in answer["withheld"]:
        titled = f" ({one_line(w['title'], 50)})" if w["title"] else ""
        print(f"p2pnode: warning: {short(w['branch'])}{titled} descends from it and is no longer served "
              "(its lineage is not): share this again to serve it", file=sys.stderr)


def print_versions(info: BranchInfo, versions: list[BranchInfo],
                   names: Mapping[str, str] | None = None) -> None:
    """`show --versions`: the versions of the branch's Pi session, oldest first."""
    print(f"versions    {len(versions)} of session {shown(info.header.get('id'))}, oldest first")
    for v in versions:
        here = "   <- this branch" if v.branch == info.branch else ""
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(v.shared_at / 1000))
        print(f"  v{v.version:<4} {short(v.branch)}  {v.lines:>6} lines  {v.size:>10} bytes  {when}"
              f"{access_note(v, names)}{here}")


def access_note(info: BranchInfo, names: Mapping[str, str] | None = None, now: float | None = None) -> str:
    """ " (unshared)", " (expired)", " (expires in 6d)", " (to bob, 7TQ2XKA)": who may fetch it,
    until when (`names`: node id -> the name it is trusted by here)."""
    if not info.offered:
        return f" ({info.withdrawn})" if info.withdrawn else " (fetched, not offered)"
    note = ""
    if info.expires_at is not None:
        left = info.expires_at / 1000 - (time.time() if now is None else now)
        note += f" (expires in {duration(left)})" if left > 0 else " (expired)"
    if info.to is not None:
        note += f" (to {', '.join(one_line((names or {}).get(p), 20) or p[:7] for p in info.to)})"
    return note


def duration(seconds: float) -> str:
    """4d, 3h, 12m, 40s: time left in the largest unit it fills, rounded up (`--expires 7d`
    shows 7d at once, not 6d)."""
    for unit, size in (("w", 604800), ("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{math.ceil(seconds / size)}{unit}"
    return f"{max(math.ceil(seconds), 0)}s"


def print_show(info: BranchInfo, sidecar: str, lineage: list[BranchInfo], children: list[BranchInfo],
               names: Mapping[str, str] | None = None) -> None:
    h = info.header
    print(f"branch      {info.branch}")
    print(f"sidecar     {sidecar}")
    print(f"session     {info.src}  ({info.size} bytes, {info.lines} lines)")
    print(f"title       {one_line(info.title, 90)}")
    print(f"header      id {shown(h.get('id'))}  timestamp {shown(h.get('timestamp'))}")
    print(f"            cwd {shown(h.get('cwd'))}")
    if h.get("parent_session"):
        print(f"            parentSession {shown(h.get('parent_session'))}")
    if info.lineage_cut:
        print(f"lineage cut shared with --no-lineage: parentSession {shown(info.lineage_cut)} "
              "was not followed")
    print(f"path        {shown(info.path or '-')}")
    print(f"offered     {'yes' if info.offered else 'no'}{access_note(info, names)}")
    if info.secrets_allowed:
        print("secrets     shared with --allow-secrets: the secret scan found some in it")
    if info.withheld:
        print(f"withheld    {shown(info.withheld)}")
    print("lineage")
    ancestors = list(reversed(lineage))
    if ancestors[0].parent is not None:
        print(f"  {short(ancestors[0].parent)}  (parent not held here)")
    for depth, a in enumerate(ancestors):
        here = "   <- this branch" if a.branch == info.branch else ""
        print(f"  {'   ' * depth}{'└─ ' if depth else ''}{short(a.branch)}  {one_line(a.title, 50)}{here}")
    for c in children:
        print(f"  {'   ' * len(ancestors)}└─ {short(c.branch)}  {one_line(c.title, 50)}")


SHOWN_UNTRUSTED = 20
"""Untrusted nodes listed by `status` and `peers` (every host on the LAN can announce any
number of them); trusted ones are all listed."""


def _where(peer: dict[str, Any]) -> str:
    """Where a peer answered over mutual TLS with its key, else where it is announced first
    (an announcement may be another host's)."""
    if peer.get("reached"):
        return str(peer["reached"])
    return f"{peer['addresses'][0]}:{peer['port']}" if peer["addresses"] else "-"


def _bounded(peers: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """Every trusted peer and the first SHOWN_UNTRUSTED others; how many others were left out."""
    others = [p for p in peers if not p["trusted"]]
    trusted = [p for p in peers if p["trusted"]]
    return trusted + others[:SHOWN_UNTRUSTED], max(0, len(others) - SHOWN_UNTRUSTED)


def print_peers(peers: list[dict[str, Any]]) -> None:
    listed, more = _bounded(peers)
    for p in listed:
        where = _where(p)
        state = "untrusted (`p2pnode trust <id>` to allow)" if not p["trusted"] else \
            {True: "online", False: "offline", None: ""}[p["online"]]
        if p.get("trusts_us") is False:  # it refused this node's last probe
            state = "does not trust this node: its owner must run `p2pnode trust <this node's id>`"
        print(f"{p['id']}  {p['name'] or ''}  {where}  {state}".rstrip())
    if more:
        print(f"... and {more} more untrusted nodes seen on the LAN (`--json` lists them all)")


def print_fetch(result: dict[str, Any]) -> None:
    fetched = len(result["fetched"])
    print(f"branch   {result['branch']}")
    print(f"fetched  {fetched} branch(es), {result['lines_fetched']} of {result['lines_total']} lines, "
          f"{result['bytes_received']} bytes received" if fetched else "fetched  nothing: already held")
    if result.get("healed"):
        print(f"healed   {result['healed']} line(s) of the stored copy that could not be read back "
              "(damaged): fetched again from peers and stored again")
    for where, why in result["dropped_peers"].items():
        print(f"dropped  {shown(where)}: {shown(why)}")
    if result["path"] and not result["conflict"]:
        print(f"path     {shown(result['path'])}")
        print(f"continue with:  pi --fork {shown(shlex.quote(result['path']))}")


def print_share_notes(result: dict[str, Any]) -> None:
    """What `share --redact` or `--allow-secrets` did, on stderr (stdout keeps the hash)."""
    if result.get("redacted_from"):
        print(f"p2pnode: note: shared a redacted copy {shown(result['path'])} of "
              f"{shown(result['redacted_from'])} (secrets replaced by [REDACTED:<kind>]; the original "
              "is unchanged and not shared)", file=sys.stderr)
    for f in result.get("secrets", []):
        where = f" at {f['where']}" if f.get("where") else ""
        print(f"p2pnode: warning: shared with --allow-secrets: {shown(f['file'])}:{f['line']}: {f['kind']} "
              f"{shown(f['masked'])} in {shown(f['entry'])}{shown(where)}", file=sys.stderr)
