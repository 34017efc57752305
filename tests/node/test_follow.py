"""Issue 14, following a teammate live, on loopback with two real `p2pnode serve` processes
(no mDNS: the follower is given the sharer's address): `share --live` re-shares as the file
grows, the serving node answers the follower's waiting catalog request (change notification),
the follower fetches each new version and its placed file follows, byte-identical; both
sides restart and it goes on.  Also: fetch of an older version or of a session id fetches
the latest (`--exact` keeps the one asked for), and the provider's long poll and its bounds."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from nodepair import trusting_nodes
from pifork import ROOT_FORK
from procnode import PY, Node

from p2pnode.errors import NotFound, VerificationFailed
from p2pnode.library.api import Library
from p2pnode.node import follow
from p2pnode.node.daemon import Node as InProcessNode
from p2pnode.node.daemon import NodeConfig
from p2pnode.node.follow import Newest, _check_newest, _session_id, newest_entry
from p2pnode.paths import NodePaths
from p2pnode.peer import wire
from p2pnode.peer.address import PeerAddress
from p2pnode.peer.get import check_starts_with
from p2pnode.peer.link import PeerLink
from p2pnode.peer.nodeid import parse_node_id
from p2pnode.peer.trust import TrustStore

T = TypeVar("T")
WAIT = 60.0
"""Bound on each wait for something to arrive (a correctness bound, not a speed assertion)."""


def wait_for(what: str, probe: Callable[[], T | None], bound: float = WAIT) -> T:
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"gave up waiting for {what} after {bound:g} s")


def grow(path: Path, tag: str, n: int = 2) -> None:
    with open(path, "ab") as f:
        for i in range(n):
            f.write(b'{"type":"message","id":"%s%d","parentId":null,"message":{"role":"user","content":'
                    b'"%s line %d of the growing session"}}\n' % (tag.encode(), i, tag.encode(), i))


def status(node: Node) -> dict[str, Any]:
    return json.loads(node.run("status", "--json").stdout)


@contextlib.contextmanager
def pair(tmp_path: Path, corpus: Path) -> Iterator[tuple[Node, Node, Path]]:
    a, b = Node(tmp_path, "a"), Node(tmp_path, "b")
    TrustStore(NodePaths(a.home).trust).trust(b.id)
    TrustStore(NodePaths(b.home).trust).trust(a.id)
    source = corpus / ROOT_FORK["1.5.2"][0]
    session = a.agent / ROOT_FORK["1.5.2"][0]
    session.parent.mkdir(parents=True)
    shutil.copyfile(source, session)
    yield a, b, session


def placed(b: Node, data: bytes) -> Callable[[], bool]:
    def probe() -> bool:
        files = list(b.agent.rglob("*.jsonl"))
        return len(files) == 1 and files[0].read_bytes() == data
    return probe


def follow_then(node: Node, args: list[str], ready: Callable[[subprocess.Popen[str]], object],
                signum: int = signal.SIGINT) -> tuple[int, str, str]:
    """`p2pnode follow ARGS` on `node`: once `ready(process)` returned (it waits, and asserts
    what it must), `signum` is sent; (exit status, stdout, stderr)."""
    follower = subprocess.Popen([PY, "-m", "p2pnode", "follow", *args], env=node.env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        ready(follower)
        follower.send_signal(signum)
        out, err = follower.communicate(timeout=30)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.communicate()
    return follower.returncode, out, err


def test_follow_a_live_share_across_restarts(tmp_path: Path, corpus_new_dir: Path) -> None:
    with pair(tmp_path, corpus_new_dir) as (a, b, session):
        with a.node_running() as a_proc:
            shared = json.loads(a.run("share", str(session), "--live", "--json").stdout)
            a_addr = f"{a.id}@127.0.0.1:{status(a)['port']}"
            assert [x["path"] for x in status(a)["live"]] == [str(session)]
            with b.node_running():
                ticket = wire.encode_ticket(wire.Ticket(bytes.fromhex(shared["branch"]), parse_node_id(a.id),
                                                        (("127.0.0.1", status(a)["port"]),)))

                def two_versions_arrive(_: subprocess.Popen[str]) -> None:
                    wait_for("the first version on B", placed(b, session.read_bytes()))
                    following = status(b)["following"]
                    assert [(f["key"], f["state"]) for f in following] == [(shared["branch"], "following")]
                    for tag in ("one", "two"):
                        grow(session, tag)
                        started = time.monotonic()
                        wait_for(f"version {tag} on B", placed(b, session.read_bytes()))
                        print(f"grown file on the follower after {time.monotonic() - started:.2f} s")
                    rows = json.loads(b.run("ls", "--all", "--json").stdout)
                    assert [(r["header"]["id"], r["versions"]) for r in rows] == [(shared["header"]["id"], 3)]
                    rows = json.loads(a.run("ls", "--json").stdout)
                    assert [(r["header"]["id"], r["versions"]) for r in rows] == [(shared["header"]["id"], 3)]

                code, out, err = follow_then(b, [ticket, "--json"], two_versions_arrive)
                assert code == 130, err  # Ctrl-C: README's "interrupted"
                assert "stopped following" in err and "Traceback" not in err
                events = [json.loads(line) for line in out.splitlines()]
                versions = [e for e in events if e["kind"] == "version"]
                assert [e["version"] for e in versions] == [1, 2, 3]
                assert [e["new_lines"] for e in versions[1:]] == [2, 2] and versions[-1]["turns"] == 2
                assert "two line 1 of the growing session" in versions[-1]["words"]
                assert status(b)["following"] == []

                # --detach: the node follows on its own, also after either side restarts
                detached = b.run("follow", shared["branch"][:12], "--from", a_addr, "--detach")  # a prefix
                assert shared["branch"] in detached.stdout
                a_proc.send_signal(signal.SIGTERM)
                a_proc.wait(timeout=30)
        grow(session, "three")  # while both nodes are down
        with a.node_running(), b.node_running():
            b.run("status")  # B's follow resumes from follows.json; A's live share from live.json
            a_port = status(a)["port"]
            if f"127.0.0.1:{a_port}" not in a_addr:  # A came back on another port: tell B where
                b.run("follow", "--stop", shared["branch"])
                b.run("follow", shared["branch"], "--from", f"{a.id}@127.0.0.1:{a_port}", "--detach")
            wait_for("the version grown while both were down", placed(b, session.read_bytes()))
            grow(session, "four")
            wait_for("a version after both restarted", placed(b, session.read_bytes()))
            assert f"following  {shared['branch']}" in b.run("status").stdout
            assert f"live       {session}" in a.run("status").stdout
            assert [x["path"] for x in status(a)["live"]] == [str(session)]
            a.run("live", "--stop", str(session))
            assert status(a)["live"] == []


def test_fetch_an_older_version_or_a_session_id_gets_the_latest(tmp_path: Path, corpus_new_dir: Path) -> None:
    with pair(tmp_path, corpus_new_dir) as (a, b, session):
        v1 = json.loads(a.run("share", str(session), "--json").stdout)
        grow(session, "x")
        v2 = json.loads(a.run("share", str(session), "--json").stdout)
        assert v2["previous"] == v1["branch"] and v2["version"] == 2
        with a.serving() as port:
            peer = f"{a.id}@127.0.0.1:{port}"
            exact = b.run("fetch", v1["branch"], "--from", peer, "--exact", "--json")
            assert json.loads(exact.stdout)["branch"] == v1["branch"] and "note" not in exact.stderr
            inode = next(b.agent.rglob("*.jsonl")).stat().st_ino
            latest = b.run("fetch", v1["branch"], "--from", peer, "--json")
            assert json.loads(latest.stdout)["branch"] == v2["branch"]
            assert json.loads(latest.stdout)["written"]
            assert next(b.agent.rglob("*.jsonl")).stat().st_ino == inode  # appended to
            assert "older version" in latest.stderr and "--exact" in latest.stderr
            files = list(b.agent.rglob("*.jsonl"))
            assert len(files) == 1 and files[0].read_bytes() == session.read_bytes()  # updated in place
            by_id = b.run("fetch", v1["header"]["id"], "--from", peer, "--json")
            assert json.loads(by_id.stdout)["branch"] == v2["branch"]
            missing = b.run("fetch", "0000-no-such-session", "--from", peer, check=False)
            assert missing.returncode == 3 and "no trusted peer offers a session with id" in missing.stderr
        rows = json.loads(b.run("ls", "--all", "--json").stdout)
        assert [(r["branch"], r["versions"]) for r in rows] == [(v2["branch"], 2)]


def test_a_newer_version_is_checked_before_it_is_placed(tmp_path: Path, corpus_new_dir: Path) -> None:
    """A peer's catalog is not trusted to say what is a newer version of what: the fetched
    branch must be a version of the session id asked for, or start with the bytes of the
    version asked for (else VerificationFailed, nothing placed)."""
    session = tmp_path / "s.jsonl"
    shutil.copyfile(corpus_new_dir / ROOT_FORK["1.5.2"][0], session)
    other = tmp_path / "o.jsonl"
    shutil.copyfile(corpus_new_dir / ROOT_FORK["1.5.2"][1], other)
    with Library.open(NodePaths(tmp_path / "node"), agent_dir=tmp_path / "agent") as lib:
        v1 = lib.share(str(session))
        grow(session, "g")
        v2 = lib.share(str(session))
        unrelated = lib.share(str(other), no_lineage=True)
        check_starts_with(lib, v2.branch, (v1.src, v1.size))
        _check_newest(lib, v2.branch, Newest(v2.branch, [], None, v1.header["id"]))
        for branch, starts in ((unrelated.branch, (v1.src, v1.size)), (v1.branch, (v2.src, v2.size))):
            with pytest.raises(VerificationFailed, match="does not start with its bytes"):
                check_starts_with(lib, branch, starts)
        with pytest.raises(VerificationFailed, match="is a version of session"):
            _check_newest(lib, unrelated.branch, Newest(unrelated.branch, [], None, v1.header["id"]))


def test_a_versions_summary_reads_its_new_lines_in_bounded_runs(tmp_path: Path, corpus_new_dir: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A follow's event counts the new version's messages from its new lines, read from the store
    in runs of about SUMMARY_RUN bytes: a first version is the whole session, which was read
    into memory at once (a 2 GB one)."""
    session = tmp_path / "s.jsonl"
    shutil.copyfile(corpus_new_dir / ROOT_FORK["1.5.2"][0], session)
    monkeypatch.setattr(follow, "SUMMARY_RUN", 4096)
    with Library.open(NodePaths(tmp_path / "node"), agent_dir=tmp_path / "agent") as lib:
        v1 = lib.share(str(session))
        read: list[int] = []
        lines = lib.lines
        monkeypatch.setattr(lib, "lines", lambda hashes: read.append(len(hashes)) or lines(hashes))
        whole = session.read_bytes().splitlines(keepends=True)
        assert list(follow.new_lines(lib, v1.src, 0)) == whole
        assert len(read) > 1 and sum(read) == len(whole)  # in runs, each line once
        assert list(follow.new_lines(lib, v1.src, 5)) == whole[5:]
        assert follow.summary(follow.new_lines(lib, v1.src, 0)) == follow.summary(whole)


def test_newest_entry_follows_previous_links_and_old_peers() -> None:
    header = {"id": "s-1", "timestamp": "t", "cwd": "/w", "parent_session": None}
    other = dict(header, id="s-2")

    def entry(n: int, previous: int | None, size: int, version: int | None = 1, head: dict = header
              ) -> wire.CatalogEntry:
        return wire.CatalogEntry(f"{n:064x}", f"{n:064x}", None, size, size, head, None,
                                 None if previous is None else f"{previous:064x}", version)

    chain = [entry(1, None, 10), entry(2, 1, 20, 2), entry(3, 2, 30, 3), entry(4, None, 99, 1, other)]
    rewritten = entry(5, None, 50, 1)  # same id, not grown from the others
    assert newest_entry(chain + [rewritten], f"{1:064x}") == chain[2]
    assert newest_entry(chain + [rewritten], f"{5:064x}") == rewritten
    assert newest_entry(chain, "s-1") == chain[2] and newest_entry(chain, "s-9") is None
    old = [entry(1, None, 10, None), entry(2, None, 20, None)]  # a peer that sends no version fields
    assert newest_entry(old, f"{1:064x}") == old[1]


def test_a_session_id_is_named_by_a_unique_start_of_it() -> None:
    """`fetch 01a1ff93-0313` (README): the one offered id that starts so; several: NotFound
    naming them; an id given whole is itself, even where longer ids start with it."""
    def catalog(*ids: str) -> wire.CatalogMessage:
        return wire.CatalogMessage(1, "n", [wire.CatalogEntry(f"{i:064x}", f"{i:064x}", None, 1, 1,
                                                              {"id": sid}, None)
                                            for i, sid in enumerate(ids, 1)])

    one, two = catalog("01a1ff93-0313-7475", "01a1ff93-1258-73ae"), catalog("01a1ff93-1258-73ae", "s-1")
    assert _session_id("01a1ff93-0313", [one, two]) == "01a1ff93-0313-7475"
    assert _session_id("01a1ff93-1258-73ae", [one, two]) == "01a1ff93-1258-73ae"
    assert _session_id("s-9", [one]) == "s-9"  # nobody offers it: NotFound comes later, with the peers asked
    with pytest.raises(NotFound, match="starts the ids of 2 offered sessions: 01a1ff93-0313-7475, 01a1"):
        _session_id("01a1ff93-", [one, two])
    assert _session_id("s-1", [catalog("s-1", "s-10")]) == "s-1"


async def test_catalog_long_poll_answers_on_change_and_is_bounded(tmp_path: Path,
                                                                  corpus_new_dir: Path) -> None:
    """GET /v1/catalog?wait=<generation>: at once when the generation differs, on a change
    otherwise, after catalog_wait at the latest; a third waiting request of one peer is 429;
    a wait that is not a generation is 400."""
    async with trusting_nodes(tmp_path) as (a, b):
        session = tmp_path / "a" / "agent" / ROOT_FORK["1.5.2"][0]
        session.parent.mkdir(parents=True)
        shutil.copyfile(corpus_new_dir / ROOT_FORK["1.5.2"][0], session)
        link = PeerLink(PeerAddress(a.identity.node_id, "127.0.0.1", a.port), b.identity, b.trust,
                        wire.DEFAULT_LIMITS)
        try:
            first = await link.get_small(wire.PATH_CATALOG, 1 << 20, "catalog")
            generation = wire.decode_catalog(first).generation
            stale = await link.get_small(f"{wire.PATH_CATALOG}?wait={generation + 7}", 1 << 20, "catalog")
            assert wire.decode_catalog(stale).generation == generation  # differs: answered at once
            waiting = [asyncio.ensure_future(link.get_small(f"{wire.PATH_CATALOG}?wait={generation}", 1 << 20,
                                                            "catalog")) for _ in range(2)]
            await asyncio.sleep(0.3)
            assert not any(w.done() for w in waiting)
            async with link.request("GET", f"{wire.PATH_CATALOG}?wait={generation}") as resp:
                assert resp.status == 429  # max_waiting_per_peer
            for bad in ("x", "-1", "1" * 30):
                async with link.request("GET", f"{wire.PATH_CATALOG}?wait={bad}") as resp:
                    assert resp.status == 400
            await asyncio.to_thread(a.lib.share, str(session))
            await a.announce()
            changed = [wire.decode_catalog(b) for b in await asyncio.wait_for(asyncio.gather(*waiting), 10)]
            assert all(c.generation > generation and len(c.branches) == 1 for c in changed)
            a.peer_server.limits = dataclasses.replace(a.peer_server.limits, catalog_wait=0.5)
            now = changed[0].generation
            unchanged = await link.get_small(f"{wire.PATH_CATALOG}?wait={now}", 1 << 20, "catalog")
            assert wire.decode_catalog(unchanged).generation == now  # no change: answered at catalog_wait
        finally:
            await link.close()


def test_share_live_needs_the_node(tmp_path: Path, corpus_new_dir: Path) -> None:
    with pair(tmp_path, corpus_new_dir) as (a, _b, session):
        r = a.run("share", str(session), "--live", check=False)
        assert r.returncode == 6 and "needs the running node" in r.stderr
        assert not (a.home / "sessions.json").exists() or json.loads(a.run("ls", "--json").stdout) == []
        r = a.run("follow", "0a1b2c3d-0000-7000-8000-000000000001", check=False)
        assert r.returncode == 6 and "needs the running node" in r.stderr
        assert os.environ.get("P2PNODE_HOME") != str(a.home)



async def test_an_attached_follow_ends_when_its_command_stops_asking(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A `follow` without --detach that dies without a word (SIGKILL, a lost ssh session): the
    node stops following for it once it has not asked for events for ATTACHED_GRACE; one
    still asking, and a detached one, go on; a --detach of an attached one makes it the node's."""
    from p2pnode.node import follow as node_follow

    monkeypatch.setattr(node_follow, "ATTACHED_GRACE", 1.0)
    monkeypatch.setattr(node_follow, "ATTACHED_CHECK", 0.1)
    agent = tmp_path / "agent"
    agent.mkdir()
    node = InProcessNode(NodePaths(tmp_path / "home"), NodeConfig(host="127.0.0.1", port=0, mdns=False,
                                                                  agent_dir=agent))
    await node.start()
    try:
        follows = node.follows
        ids = [f"0a1b2c3d-0000-7000-8000-00000000000{i}" for i in range(4)]
        for i, key in enumerate(ids):
            await follows._c_follow({"target": key, "attached": i != 1})
        await follows._c_follow({"target": ids[3], "attached": False})  # `follow --detach` of it now
        asking = asyncio.ensure_future(follows._c_events({"key": ids[2], "after": 10**9, "wait": 2.0}))
        await asyncio.sleep(1.5)
        assert sorted(f.key for f in follows.follows) == ids[1:]
        assert [f["attached"] for f in json.loads((tmp_path / "home" / "follows.json").read_text())] == \
            [False, True, False]
        await asyncio.sleep(1.0)  # its request ended 0.5 s ago: within the grace
        assert sorted(f.key for f in follows.follows) == ids[1:]
        await asking
        await asyncio.sleep(1.0)
        assert sorted(f.key for f in follows.follows) == [ids[1], ids[3]]
    finally:
        await node.close()


def test_without_mdns_a_peer_is_online_while_it_is_connected(tmp_path: Path, corpus_new_dir: Path) -> None:
    """With mDNS off a node cannot see its peers: a trusted peer is listed as not known (it was
    "offline" while it fetched from this node), and as online while it holds a connection here
    (a follow's long poll)."""
    with pair(tmp_path, corpus_new_dir) as (a, b, session), a.node_running(), b.node_running():
        def b_at_a() -> dict[str, Any]:
            return next(p for p in json.loads(a.run("peers", "--json").stdout) if p["id"] == b.id)

        assert b_at_a()["online"] is None and "offline" not in a.run("peers").stdout
        branch = json.loads(a.run("share", str(session), "--json").stdout)["branch"]
        b.run("follow", branch, "--from", f"{a.id}@127.0.0.1:{status(a)['port']}", "--detach")
        wait_for("b's follow connected to a", lambda: b_at_a()["online"])
        assert "online" in a.run("peers").stdout
        b.run("follow", "--stop", branch)


def test_a_follow_told_to_end_stops_following(tmp_path: Path) -> None:
    """SIGTERM or SIGHUP (a closed terminal) of a `follow` stops the node's follow at once, as
    Ctrl-C does, and the command ends by that signal."""
    b = Node(tmp_path, "b")
    with b.node_running():
        for signum in (signal.SIGTERM, signal.SIGHUP):
            code, _, err = follow_then(b, ["0a1b2c3d-0000-7000-8000-000000000001"], lambda _: wait_for(
                "the follow in the node", lambda: status(b)["following"]), signum)
            assert code == -signum and "stopped following" in err and "Traceback" not in err
            assert status(b)["following"] == []
        key = "0a1b2c3d-0000-7000-8000-000000000002"  # followed with --detach before: the node's
        b.run("follow", key, "--detach")

        def watching(follower: subprocess.Popen[str]) -> None:
            assert follower.stderr is not None and "Ctrl-C stops" in follower.stderr.readline()

        _, _, err = follow_then(b, [key], watching)
        assert "the node goes on following" in err and [f["key"] for f in status(b)["following"]] == [key]


def test_a_follow_of_a_version_held_here_reports_nothing_new(tmp_path: Path, corpus_new_dir: Path) -> None:
    """Following a session whose latest version was fetched before: its first event says
    +0 lines (it reported every line of the session as new)."""
    with pair(tmp_path, corpus_new_dir) as (a, b, session):
        shared = json.loads(a.run("share", str(session), "--json").stdout)
        with a.node_running(), b.node_running():
            a_addr = f"{a.id}@127.0.0.1:{status(a)['port']}"
            b.run("fetch", shared["branch"], "--from", a_addr)
            _, out, err = follow_then(b, [shared["branch"], "--from", a_addr, "--json"], lambda _: wait_for(
                "the follow's first version", lambda: any(f["branch"] for f in status(b)["following"])))
        [version] = [e for e in map(json.loads, out.splitlines()) if e["kind"] == "version"]
        assert (version["new_lines"], version["turns"], version["lines"]) == (0, 0, shared["lines"]), err


def test_rm_of_a_followed_session_stops_its_follow(tmp_path: Path, corpus_new_dir: Path) -> None:
    """`rm` of what a follow fetched ends that follow (said on stdout), else its next version
    would be fetched again, whole: in the running node, and in follows.json with no node."""
    with pair(tmp_path, corpus_new_dir) as (a, b, session):
        shared = json.loads(a.run("share", str(session), "--json").stdout)
        with a.serving() as port, b.node_running():
            b.run("follow", shared["branch"], "--from", f"{a.id}@127.0.0.1:{port}", "--detach")
            wait_for("the first version on B", placed(b, session.read_bytes()))
            removed = b.run("rm", shared["header"]["id"])
            assert f"stopped following {shared['branch']}" in removed.stdout
            assert status(b)["following"] == [] and b.run("ls", "--all", "--json").stdout.strip() == "[]"
            b.run("fetch", shared["branch"], "--from", f"127.0.0.1:{port}")
            b.run("follow", shared["branch"], "--from", f"{a.id}@127.0.0.1:{port}", "--detach")
        assert [f["key"] for f in json.loads((b.home / "follows.json").read_text())] == [shared["branch"]]
        removed = json.loads(b.run("rm", shared["branch"], "--json").stdout)  # no node runs now
        assert removed["unfollowed"] == [shared["branch"]]
        assert json.loads((b.home / "follows.json").read_text()) == []


def test_a_follow_whose_peer_stopped_trusting_this_node_says_so(tmp_path: Path, corpus_new_dir: Path) -> None:
    """After `untrust` on the sharing side, the follower's state says what `fetch` says: that
    peer does not trust this node, and the command its user must run."""
    with pair(tmp_path, corpus_new_dir) as (a, b, session):
        shared = json.loads(a.run("share", str(session), "--json").stdout)
        with a.serving() as port, b.node_running():
            b.run("follow", shared["branch"], "--from", f"{a.id}@127.0.0.1:{port}", "--detach")
            wait_for("the first version on B", placed(b, session.read_bytes()))
            a.run("untrust", b.id)  # the serving process re-reads trust.json and closes B's connection
            state = wait_for("the follow to say why it waits", lambda: next(
                (f["state"] for f in status(b)["following"] if "does not trust" in f["state"]), None))
            assert f"ask them to run: p2pnode trust {b.id}" in state
            assert "closed the connection before answering" not in state


def test_a_session_placed_header_first_is_kept_current(tmp_path: Path, corpus_new_dir: Path) -> None:
    """A session whose header follows a blank line is placed header first (FORMAT.md); each later
    version updates that file, to its own header-first form: fetched one-shot, fetched through
    the node, and followed (each was a conflict, exit 7, the placed file being the older form)."""
    def header_first() -> bytes:
        blank, header, rest = session.read_bytes().split(b"\n", 2)
        return header + b"\n" + blank + b"\n" + rest

    with pair(tmp_path, corpus_new_dir) as (a, b, session):
        session.write_bytes(b"\n" + session.read_bytes())
        with a.node_running():
            a.run("share", str(session), "--live")
            a_addr = f"{a.id}@127.0.0.1:{status(a)['port']}"
            session_id = json.loads(a.run("ls", "--json").stdout)[0]["header"]["id"]
            b.run("fetch", session_id, "--from", a_addr)  # one-shot
            [file] = b.agent.rglob("*.jsonl")
            assert file.read_bytes() == header_first() != session.read_bytes()

            def grown_and_fetched(tag: str) -> None:
                grow(session, tag)
                wait_for("the live share of the grown file", lambda: json.loads(
                    a.run("ls", "--json").stdout)[0]["size"] == session.stat().st_size)
                got = b.run("fetch", session_id, "--from", a_addr, "--json", check=False)
                assert got.returncode == 0 and json.loads(got.stdout)["written"], got.stderr
                assert file.read_bytes() == header_first()

            grown_and_fetched("one-shot")
            with b.node_running():
                grown_and_fetched("node")
                b.run("follow", session_id, "--from", a_addr, "--detach")
                for tag in ("follow-1", "follow-2"):
                    grow(session, tag)
                    wait_for(f"version {tag} on B", lambda: file.read_bytes() == header_first())
                assert [f["state"] for f in status(b)["following"]] == ["following"]
                assert list(b.agent.rglob("*.jsonl")) == [file]


def test_a_session_id_prefix_is_followed_and_json_is_one_object_a_line(tmp_path: Path,
                                                                      corpus_new_dir: Path) -> None:
    """`follow <start of a session id>` follows that session, as `fetch` takes it (it waited for
    ever: "does not offer 01a22373-3b77"); with --json, `--detach`, `--stop` and `live --stop`
    print one JSON object (they printed text)."""
    def lines(out: str) -> list[dict[str, Any]]:
        return [json.loads(line) for line in out.splitlines()]

    with pair(tmp_path, corpus_new_dir) as (a, b, session), a.node_running(), b.node_running():
        a_addr = f"{a.id}@127.0.0.1:{status(a)['port']}"
        session_id = json.loads(session.read_bytes().split(b"\n", 1)[0])["id"]
        prefix = session_id[:session_id.index("-") + 3]
        early = lines(b.run("follow", prefix, "--from", a_addr, "--detach", "--json").stdout)
        assert early == [{"kind": "detached", "key": prefix}]  # not offered yet: resolved when it is
        a.run("share", str(session), "--live")
        wait_for("the session followed by a prefix of its id", placed(b, session.read_bytes()))
        early_stop = b.run("follow", "--stop", prefix, "--json").stdout
        assert lines(early_stop) == [{"kind": "stopped", "key": prefix}]
        detached = b.run("follow", prefix, "--from", a_addr, "--detach", "--json").stdout
        assert lines(detached) == [{"kind": "detached", "key": session_id}]  # offered: resolved at once
        grow(session, "more")
        wait_for("its next version", placed(b, session.read_bytes()))
        stopped = b.run("follow", "--stop", session_id, "--json").stdout
        assert lines(stopped) == [{"kind": "stopped", "key": session_id}]
        assert status(b)["following"] == []
        ended = a.run("live", "--stop", str(session), "--json").stdout
        assert lines(ended) == [{"stopped": str(session)}]
        missing = b.run("follow", "--stop", session_id, "--json", check=False)
        assert missing.returncode == 3 and lines(missing.stdout)[-1]["error"]["exit_code"] == 3


def test_a_live_share_keeps_its_audience_and_end(tmp_path: Path, corpus_new_dir: Path) -> None:
    """`share --live --to C --expires 1h`: every share of the grown file, also after the node
    restarts, goes to C only and ends when the first one does (not an hour after each line);
    B, trusted but not named, cannot fetch it; so too from a live.json an older p2pnode saved
    without them (the branch's own).  `share --live` again replaces the options."""
    with pair(tmp_path, corpus_new_dir) as (a, b, session):
        c = Node(tmp_path, "c")
        TrustStore(NodePaths(a.home).trust).trust(c.id)
        with a.node_running():
            first = json.loads(a.run("share", str(session), "--live", "--to", c.id, "--expires", "1h",
                                     "--json").stdout)
            assert first["to"] == [c.id] and first["expires_at"] is not None
            a_addr = f"{a.id}@127.0.0.1:{status(a)['port']}"

            def offered_grown() -> dict[str, Any] | None:
                rows = json.loads(a.run("ls", "--json").stdout)
                return rows[0] if rows and rows[0]["size"] == session.stat().st_size else None

            time.sleep(1.5)  # the watcher's first look (a share at once) and a growth after it
            grow(session, "one")
            row = wait_for("the live share of the grown file", offered_grown)
            assert (row["to"], row["expires_at"]) == ([c.id], first["expires_at"])
            assert b.run("fetch", first["header"]["id"], "--from", a_addr, check=False).returncode == 3
        saved = json.loads((a.home / "live.json").read_bytes())
        assert [(e["to"], e["expires_at"]) for e in saved] == [([c.id], first["expires_at"])]
        older = [{k: v for k, v in e.items() if k not in ("to", "expires_at")} for e in saved]
        (a.home / "live.json").write_text(json.dumps(older))  # as a p2pnode before 2026-11-28 saved it
        grow(session, "two")  # while the node is down: shared as it comes back, to the same
        with a.node_running():
            row = wait_for("the share after a restart", offered_grown)
            assert (row["to"], row["expires_at"]) == ([c.id], first["expires_at"])
            a.run("share", str(session), "--live", "--expires", "never")  # to every trusted peer now
            grow(session, "three")
            row = wait_for("the share with the new options", offered_grown)
            assert (row["to"], row["expires_at"]) == (None, None)
            assert [(x["to"], x["expires_at"]) for x in status(a)["live"]] == [(None, None)]


def test_a_plain_share_of_a_live_file_sets_its_audience_anew(tmp_path: Path, corpus_new_dir: Path) -> None:
    """`share --live` to every peer, then `share F --to C` (no --live) narrows it: the next
    growth is shared to C only, not to everyone again; the same with the node down, as the
    node starts again (live.json)."""
    with pair(tmp_path, corpus_new_dir) as (a, b, session):
        c = Node(tmp_path, "c")
        TrustStore(NodePaths(a.home).trust).trust(c.id)

        def offered_grown() -> dict[str, Any] | None:
            rows = json.loads(a.run("ls", "--json").stdout)
            return rows[0] if rows and rows[0]["size"] == session.stat().st_size else None

        with a.node_running():
            a.run("share", str(session), "--live")
            time.sleep(1.0)  # the watcher's first look
            a.run("share", str(session), "--to", c.id)
            grow(session, "narrowed")
            row = wait_for("the grown file shared", offered_grown)
            assert row["to"] == [c.id]
            assert [x["to"] for x in status(a)["live"]] == [[c.id]]
        a.run("share", str(session), "--to", b.id)  # no node: live.json is set anew
        assert [e["to"] for e in json.loads((a.home / "live.json").read_bytes())] == [[b.id]]
        grow(session, "while down")
        with a.node_running():
            row = wait_for("the grown file shared as the node starts", offered_grown)
            assert row["to"] == [b.id]


def test_a_live_share_past_its_end_is_not_shared_again(tmp_path: Path, corpus_new_dir: Path) -> None:
    """A live share whose offer has expired (the node was down meanwhile) ends as the node
    starts: the grown file is not offered again."""
    with pair(tmp_path, corpus_new_dir) as (a, _b, session):
        past = int(time.time() * 1000) - 1000
        (a.home / "live.json").write_text(json.dumps([{"path": str(session), "pi": None, "cwd": None,
                                                        "allow_secrets": False, "branch": None, "to": None,
                                                        "expires_at": past}]))
        with a.node_running():
            wait_for("the expired live share to end", lambda: status(a)["live"] == [])
            time.sleep(1.0)
            assert json.loads(a.run("ls", "--all", "--json").stdout) == []
        assert json.loads((a.home / "live.json").read_bytes()) == []


@pytest.mark.parametrize("command", ["unshare", "rm"])
def test_unshare_or_rm_ends_the_live_share(tmp_path: Path, corpus_new_dir: Path, command: str) -> None:
    """`unshare` and `rm` of a session shared live end the live share first and say so, through
    the running node and without it: Pi's next line does not offer it again."""
    with pair(tmp_path, corpus_new_dir) as (a, _b, session):
        with a.node_running():
            shared = json.loads(a.run("share", str(session), "--live", "--json").stdout)
            target = shared["branch"][:12] if command == "unshare" else shared["header"]["id"]
            out = a.run(command, target).stdout
            assert f"stopped sharing {session} live" in out
            assert status(a)["live"] == []
            grow(session, "after")
            time.sleep(1.5)  # three of the watcher's looks, had it gone on
            assert json.loads(a.run("ls", "--json").stdout) == []
            grown = session.stat().st_size
            assert all(r["size"] != grown for r in json.loads(a.run("ls", "--all", "--json").stdout))
            a.run("share", str(session), "--live")  # again; then the node stops, still sharing it live
        assert len(json.loads((a.home / "live.json").read_bytes())) == 1
        out = a.run(command, json.loads(a.run("ls", "--json").stdout)[0]["branch"] if command == "unshare"
                    else shared["header"]["id"]).stdout
        assert f"stopped sharing {session} live" in out
        assert json.loads((a.home / "live.json").read_bytes()) == []
        grow(session, "later")
        with a.node_running():
            time.sleep(1.5)
            assert status(a)["live"] == []
            assert json.loads(a.run("ls", "--json").stdout) == []


def test_a_follow_that_cannot_place_ends_with_exit_4(tmp_path: Path, corpus_new_dir: Path) -> None:
    """A --session-dir the system refuses (a name too long for it, a file where the directory
    must be): each fetched version failed to be placed and the follow retried for ever.  Now
    `follow` says why and exits 4 (README), and the node no longer follows it."""
    with pair(tmp_path, corpus_new_dir) as (a, b, session):
        shared = json.loads(a.run("share", str(session), "--json").stdout)
        (tmp_path / "a-file").write_text("not a directory\n")
        with a.serving() as port, b.node_running():
            for session_dir, why in [(tmp_path / ("x" * 300), "file name too long"),
                                     (tmp_path / "a-file" / "sessions", "not a directory")]:
                follower = subprocess.run(
                    [PY, "-m", "p2pnode", "follow", shared["branch"], "--from", f"{a.id}@127.0.0.1:{port}",
                     "--session-dir", str(session_dir), "--json"],
                    env=b.env, capture_output=True, text=True, timeout=WAIT)
                assert follower.returncode == 4, follower.stderr
                assert why in follower.stderr and "the follow ended" in follower.stderr
                assert "Traceback" not in follower.stderr
                *events, last = map(json.loads, follower.stdout.splitlines())
                assert last["error"]["kind"] == "invalid_input" and why in last["error"]["message"]
                assert [e["kind"] for e in events] == ["following"]
                assert status(b)["following"] == []
                assert json.loads((b.home / "follows.json").read_text()) == []


def test_which_failures_end_a_follow() -> None:
    """Sans-IO: a path of this node's the system refuses ends it (exit 4); what may pass does not."""
    import errno

    from p2pnode.node.follow import _final

    for code in (errno.ENAMETOOLONG, errno.EACCES, errno.ENOTDIR, errno.EINVAL):
        final = _final(OSError(code, os.strerror(code), "/some/path"))
        assert final is not None and final.exit_code == 4 and "/some/path" in str(final)
    for exc in (OSError(errno.ENOENT, "No such file or directory", "/some/path"), ConnectionRefusedError(),
                OSError(errno.EACCES, "Permission denied"), OSError(errno.ENOSPC, "No space left", "/p"),
                NotFound("gone"), VerificationFailed("lied")):
        assert _final(exc) is None
