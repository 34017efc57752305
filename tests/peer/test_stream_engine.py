"""The streaming fetch in one process: two node homes (a sharer served by a real PeerServer over
mutual TLS on loopback, a fetcher), so that a test can look inside the fetcher's store and
files.  Sessions are generated Pi-shaped files (test_stream_fetch.pi_session) or corpus files.
"""
from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from test_stream_fetch import SESSION_ID, pi_session

from p2pnode.errors import VerificationFailed
from p2pnode.library.api import Library
from p2pnode.paths import NodePaths
from p2pnode.peer import get as get_module
from p2pnode.peer import wire
from p2pnode.peer.address import PeerAddress
from p2pnode.peer.get import FetchResult, OpenPerUse, fetch_branch
from p2pnode.peer.getter import LIVE
from p2pnode.peer.identity import Identity, load_or_create_identity
from p2pnode.peer.provider import PeerServer
from p2pnode.peer.trust import TrustStore
from p2pnode.pi.hashing import hash_file
from p2pnode.pi.lines import LineRef, split_lines

PROJECT = "sessions/--w--"
NAME = f"2026-11-21T20-00-00-000Z_{SESSION_ID}.jsonl"


@dataclass
class Duo:
    sharer: Library
    fetcher: Library
    me: Identity
    trust: TrustStore
    peer: PeerAddress
    share_agent: Path
    agent: Path

    def write(self, data: bytes) -> Path:
        """The sharer's session file (the same path every time: a session that grows)."""
        path = self.share_agent / PROJECT / NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return path

    async def fetch(self, branch: str, lib: Library | None = None,
                    limits: wire.Limits = wire.DEFAULT_LIMITS) -> FetchResult:
        """As `fetch` does: the session id from the sharer's catalog entry (`?after=` names held
        versions of that session only)."""
        return await fetch_branch(lib or self.fetcher, branch, [self.peer], self.me, self.trust,
                                  agent_dir=self.agent, limits=limits,
                                  session_id=self.sharer.branch(branch).header["id"])

    @property
    def placed(self) -> Path:
        return self.agent / PROJECT / NAME


@pytest.fixture
async def duo(tmp_path: Path) -> AsyncIterator[Duo]:
    server_id = load_or_create_identity(tmp_path / "server-id")
    me = load_or_create_identity(tmp_path / "me-id")
    server_trust = TrustStore(tmp_path / "server-trust.json")
    my_trust = TrustStore(tmp_path / "me-trust.json")
    server_trust.trust(me.node_id)
    my_trust.trust(server_id.node_id)
    sharer = Library.open(NodePaths(tmp_path / "sharer"), tmp_path / "sharer-agent")
    fetcher = Library.open(NodePaths(tmp_path / "fetcher"), tmp_path / "agent")
    server = PeerServer(sharer, server_id, server_trust)
    await server.start("127.0.0.1", 0)
    try:
        yield Duo(sharer, fetcher, me, my_trust, PeerAddress(server_id.node_id, "127.0.0.1", server.port),
                  tmp_path / "sharer-agent", tmp_path / "agent")
    finally:
        await server.close()
        sharer.close()
        fetcher.close()


async def test_a_256_mib_line_end_to_end(duo: Duo) -> None:
    """PROTOCOL.md's largest line (256 MiB, the store's max_payload and the wire's max_blob) is
    shared, served, fetched, stored and placed.  Memory: about 1.5 GB at the peak (the line
    raw and compressed on both sides of one process)."""
    head = json.dumps({"type": "session", "version": 3, "id": SESSION_ID,
                       "timestamp": "2026-11-21T20:00:00.000Z", "cwd": "/w"}).encode() + b"\n"
    frame = b'{"type":"custom","data":"'
    body = os.urandom(((256 << 20) - len(frame) - 3) * 3 // 4 + 3).hex().encode()
    big = frame + body[:(256 << 20) - len(frame) - 3] + b'"}\n'
    assert len(big) == 256 << 20
    path = duo.write(head + big + b'{"type":"custom","data":"after"}\n')
    del body, big
    branch = duo.sharer.share(str(path)).branch
    # the server shares this process's event loop, which it blocks while it encrypts the line:
    # no stall detection here (what is tested is the size)
    result = await duo.fetch(branch, limits=wire.Limits(progress_timeout=300.0))
    assert result.written and Path(result.path or "").read_bytes() == path.read_bytes()
    assert duo.fetcher.branch(branch).lines == 3
    refs = duo.fetcher.line_manifest(result.src)
    assert [r.length for r in refs] == [len(x) for x in split_lines(path.read_bytes())]


def _grow(path: Path, seed: int, lines: int = 5) -> bytes:
    """Pi appends whole lines to a session: `lines` more, as pi_session makes them."""
    more = b"".join(pi_session(60_000 * lines, seed=seed, image_bytes=40_000).splitlines(keepends=True)[1:])
    with open(path, "ab") as f:
        f.write(more)
    return more


async def test_a_grown_version_is_appended_not_rewritten(duo: Duo) -> None:
    """v2 of a session (v1 plus new lines) fetched after v1: only v1's lines after the last
    newline are asked for (`?after=`), the hash continues from v1's, and the placed file is
    appended to: the same inode, and v1's bytes are not read back.  That last is shown by
    changing them on disk behind the node's back (same size, mtime restored: the stat the
    node recorded is unchanged): had the fetch read them, it would have refused or rewritten
    the file; it appends after them instead."""
    path = duo.write(pi_session(3_000_000, seed=1))
    v1 = duo.sharer.share(str(path)).branch
    first = await duo.fetch(v1)
    placed = duo.placed
    assert first.written and placed.read_bytes() == path.read_bytes()
    before = placed.stat()
    tampered = placed.read_bytes().replace(b"look at image", b"LOOK AT IMAGE")
    with open(placed, "r+b") as f:
        f.write(tampered)
    os.utime(placed, ns=(before.st_atime_ns, before.st_mtime_ns))
    new = _grow(path, seed=2)
    v2 = duo.sharer.share(str(path)).branch
    second = await duo.fetch(v2)
    assert second.written and second.conflict is None
    assert 0 < second.lines_fetched <= len(split_lines(new))  # (some new lines repeat old ones)
    assert placed.stat().st_ino == before.st_ino
    assert placed.read_bytes() == tampered + new  # appended after the (unread) old bytes
    assert second.bytes_received < len(new) + 1000  # the manifest of the new lines only
    assert duo.fetcher.branch(v2).src == second.src


async def test_a_one_shot_fetch_rehashes_the_held_prefix(duo: Duo) -> None:
    """Without the node's live hash state (a one-shot process), the held prefix is hashed from
    the placed file (unchanged by its stat) and the file appended to; with no placed file,
    from the store's lines, and the whole file written.  Both verified to the new src."""
    path = duo.write(pi_session(2_000_000, seed=3))
    await duo.fetch(duo.sharer.share(str(path)).branch)
    inode = duo.placed.stat().st_ino
    LIVE.clear()
    _grow(path, seed=4)
    second = await duo.fetch(duo.sharer.share(str(path)).branch)
    assert second.written and duo.placed.stat().st_ino == inode
    assert duo.placed.read_bytes() == path.read_bytes()
    duo.placed.unlink()
    LIVE.clear()
    _grow(path, seed=5)
    third = await duo.fetch(duo.sharer.share(str(path)).branch)
    assert third.written and 0 < third.lines_fetched < third.lines_total
    assert duo.placed.read_bytes() == path.read_bytes()


async def test_a_one_shot_fetch_checks_the_placed_file_it_hashed_meanwhile(
        duo: Duo, monkeypatch: pytest.MonkeyPatch) -> None:
    """The held prefix's hash state comes from the placed file, hashed on a thread while the
    new lines come (the store's lines are not read for it); a file changed behind an unchanged
    stat does not hash to the held version, so the store's lines give the state instead: the
    new version is still verified and committed (the file is appended to, after bytes this
    node did not write, as its stat said)."""
    from_store: list[int] = []
    store_hasher = get_module._store_hasher
    monkeypatch.setattr(get_module, "_store_hasher", lambda lib, refs: from_store.append(len(refs))
                        or store_hasher(lib, refs))
    path = duo.write(pi_session(2_000_000, seed=6))
    await duo.fetch(duo.sharer.share(str(path)).branch)
    LIVE.clear()
    _grow(path, seed=8)
    assert (await duo.fetch(duo.sharer.share(str(path)).branch)).written
    assert from_store == [] and duo.placed.read_bytes() == path.read_bytes()
    before = duo.placed.stat()
    tampered = duo.placed.read_bytes().replace(b"look at image", b"LOOK AT IMAGE")
    assert tampered != path.read_bytes()
    duo.placed.write_bytes(tampered)
    os.utime(duo.placed, ns=(before.st_atime_ns, before.st_mtime_ns))
    LIVE.clear()
    new = _grow(path, seed=7)
    got = await duo.fetch(duo.sharer.share(str(path)).branch)
    assert got.written and got.conflict is None
    assert duo.fetcher.branch(got.branch).src == got.src == hash_file(path)
    assert duo.placed.read_bytes() == tampered + new
    assert len(from_store) == 1 and from_store[0] > 0  # the held lines, read back once


async def test_the_new_lines_do_not_wait_for_the_placed_file_to_be_hashed(
        duo: Duo, monkeypatch: pytest.MonkeyPatch) -> None:
    """The placed file an incremental fetch continues is hashed on a thread while the new lines
    come; the lines verified meanwhile are staged and the batches go on.  Here the hash may end
    only once every line was received (a delay injected into the hashing thread): batches that
    waited on it would wait for ever, so the hash gives up after 10 s and the fetch fails."""
    path = duo.write(pi_session(1_000_000, seed=21))
    await duo.fetch(duo.sharer.share(str(path)).branch)
    LIVE.clear()
    _grow(path, seed=22, lines=8)
    received = threading.Event()
    real_hasher, real_get_lines = get_module.prefix_hasher, get_module.batches.get_lines

    def hasher(target: Path, size: int) -> object:
        if not received.wait(10):
            raise AssertionError("the new lines waited for the placed file's hash")
        return real_hasher(target, size)

    async def get_lines(*args: Any, **kw: Any) -> None:
        await real_get_lines(*args, **kw)
        received.set()

    monkeypatch.setattr(get_module, "prefix_hasher", hasher)
    monkeypatch.setattr(get_module.batches, "get_lines", get_lines)
    monkeypatch.setattr(get_module, "STAGE_MIN", 1)  # each verified run is staged as it comes
    got = await duo.fetch(duo.sharer.share(str(path)).branch)
    assert received.is_set() and got.written and 0 < got.lines_fetched < got.lines_total
    assert duo.placed.read_bytes() == path.read_bytes()


async def test_a_one_shot_fetch_hashes_the_placed_file_before_asking_for_the_manifest(
        duo: Duo, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no live hash state, the placed file of the session's largest held version is
    hashed from the fetch's first opening of the store on, before the peer is asked which
    version the new one extends; that hash (one, not a second) is what the fetch continues."""
    path = duo.write(pi_session(1_000_000, seed=31))
    await duo.fetch(duo.sharer.share(str(path)).branch)
    LIVE.clear()
    _grow(path, seed=32)
    events: list[str] = []
    real_hasher, real_manifest = get_module.prefix_hasher, get_module._Fetch._manifest

    def hasher(target: Path, size: int) -> object:
        events.append("hash")
        return real_hasher(target, size)

    async def manifest(self: object, peer: object, src: str, after: list[str]) -> object:
        events.append("manifest")
        return await real_manifest(self, peer, src, after)

    monkeypatch.setattr(get_module, "prefix_hasher", hasher)
    monkeypatch.setattr(get_module._Fetch, "_manifest", manifest)
    got = await duo.fetch(duo.sharer.share(str(path)).branch)
    assert got.written and 0 < got.lines_fetched < got.lines_total
    assert duo.placed.read_bytes() == path.read_bytes()
    assert events == ["hash", "manifest"]


async def test_a_one_shot_fetch_of_a_grown_version_opens_the_store_once(
        duo: Duo, monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-shot fetch (OpenPerUse: `fetch` without a node) keeps the store open from one
    step to the next while they come: a grown version's (held versions looked up, the
    manifest's start, the staged runs, the commit and placing) opens it once, where an
    opening scans the store's unindexed tail.  It is closed when the fetch returns."""
    path = duo.write(pi_session(1_000_000, seed=41))
    await duo.fetch(duo.sharer.share(str(path)).branch)
    LIVE.clear()
    _grow(path, seed=42)
    branch = duo.sharer.share(str(path)).branch
    duo.fetcher.close()
    openings: list[OpenPerUse] = []
    real_open = OpenPerUse.__call__

    def counted(self: OpenPerUse) -> Library:
        openings.append(self)
        return real_open(self)

    monkeypatch.setattr(OpenPerUse, "__call__", counted)
    monkeypatch.setattr(get_module, "STAGE_MIN", 1)  # the new lines come in several staged runs
    session_id = duo.sharer.branch(branch).header["id"]
    got = await fetch_branch(OpenPerUse(duo.fetcher.paths, duo.agent), branch, [duo.peer], duo.me,
                             duo.trust, agent_dir=duo.agent, session_id=session_id)
    assert got.written and 0 < got.lines_fetched < got.lines_total
    assert duo.placed.read_bytes() == path.read_bytes()
    assert len(openings) == 1
    after = Library.open_unless(duo.fetcher.paths, duo.agent, wait=0, pointless=lambda: False)
    assert after is not None  # StoreLocked if the fetch left it open
    with after:
        assert after.has_branch(branch)


async def test_a_grown_version_is_committed_without_reading_the_held_lines(
        duo: Duo, monkeypatch: pytest.MonkeyPatch) -> None:
    """An incremental one-shot fetch (no live hash state) of v2 after v1: neither the held
    prefix's refs nor any turn chain is read (store.chain refused during the fetch); the commit
    continues v1's turns.  Afterwards v2 reads back from the store as the sharer's file, with
    v1's line hashes as its first lines and v1 as its `previous`."""
    path = duo.write(pi_session(1_000_000, seed=11))
    v1 = await duo.fetch(duo.sharer.share(str(path)).branch)
    assert v1.written
    LIVE.clear()
    _grow(path, seed=12)
    v2_branch = duo.sharer.share(str(path)).branch

    def refused(turn_id: int) -> list[object]:
        raise AssertionError(f"store.chain({turn_id}) read during an incremental fetch")

    with monkeypatch.context() as m:
        m.setattr(duo.fetcher.store, "chain", refused)
        v2 = await duo.fetch(v2_branch)
    assert v2.written and v2.conflict is None and 0 < v2.lines_fetched < v2.lines_total
    assert duo.placed.read_bytes() == path.read_bytes()
    assert duo.fetcher.session_bytes(v2.src) == path.read_bytes()
    old, new = duo.fetcher.sessions.line_hashes(v1.src), duo.fetcher.sessions.line_hashes(v2.src)
    assert new[:len(old)] == old and len(new) > len(old)
    lengths = [len(x) for x in split_lines(path.read_bytes())]
    assert [r.length for r in duo.fetcher.line_manifest(v2.src)] == lengths
    assert duo.fetcher.version(v2.src).previous == v1.src


async def test_a_held_branch_still_placed_is_not_read_again(duo: Duo,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Fetching a branch held and placed, its file unchanged by its stat: nothing is read from
    the store (session_bytes refused) and the file is left as it is; once the file is gone, it
    is placed again from the store."""
    path = duo.write(pi_session(1_000_000, seed=13))
    branch = duo.sharer.share(str(path)).branch
    assert (await duo.fetch(branch)).written
    inode = duo.placed.stat().st_ino
    with monkeypatch.context() as m:
        m.setattr(duo.fetcher, "session_bytes", lambda src: pytest.fail(f"session_bytes({src})"))
        again = await duo.fetch(branch)
    assert not again.written and again.path == str(duo.placed) and duo.placed.stat().st_ino == inode
    duo.placed.unlink()
    assert (await duo.fetch(branch)).written and duo.placed.read_bytes() == path.read_bytes()


async def test_an_older_version_fetched_where_a_newer_one_is_placed_says_so(duo: Duo) -> None:
    """`fetch --exact v1` where the placed file holds v2 (v1 grown, placed by a later fetch):
    the file is kept, nothing written, and the result says the path holds a newer version, and
    how to get the one fetched; a version whose own bytes are there says nothing."""
    path = duo.write(pi_session(1_000_000, seed=17))
    v1 = duo.sharer.share(str(path)).branch
    assert (await duo.fetch(v1)).note is None
    _grow(path, seed=18)
    v2 = duo.sharer.share(str(path))
    assert (await duo.fetch(v2.branch)).written
    older = await duo.fetch(v1)
    assert not older.written and older.path == str(duo.placed)
    assert duo.placed.read_bytes() == path.read_bytes()  # v2, kept
    assert older.note is not None and f"holds a newer version of this session (blake3 {v2.src})" in older.note
    assert f"`p2pnode cat {v1}`" in older.note
    assert (await duo.fetch(v2.branch)).note is None


async def test_pi_appended_locally_is_a_conflict(duo: Duo) -> None:
    """The placed copy was continued by Pi here: the grown version from the peer is not
    written over it (a conflict naming the file); the file keeps the local lines."""
    path = duo.write(pi_session(1_000_000, seed=7))
    await duo.fetch(duo.sharer.share(str(path)).branch)
    local = b'{"type":"message","id":"local","parentId":null,"timestamp":"x","message":{"role":"user"}}\n'
    with open(duo.placed, "ab") as f:
        f.write(local)
    mine = duo.placed.read_bytes()
    _grow(path, seed=8)
    second = await duo.fetch(duo.sharer.share(str(path)).branch)
    assert second.conflict and str(duo.placed) in second.conflict and not second.written
    assert duo.placed.read_bytes() == mine
    assert duo.fetcher.branch(second.branch).src == second.src  # stored all the same


def test_manifest_after_test_vector() -> None:
    """docs/PROTOCOL.md's test vector of a version-2 line manifest."""
    src, base = bytes(range(32)), bytes(range(32, 64))
    body = wire.encode_line_manifest_after(src, base, 2, [LineRef(b"\xaa" * 32, 10)])
    assert body.hex() == (
        "50324c4d0200" + src.hex() + base.hex() + "02000000" + "01000000" + "aa" * 32 + "0a000000")
    got = wire.decode_any_line_manifest(body, src, [base.hex()])
    assert got == wire.ManifestAfter(base, 2, [LineRef(b"\xaa" * 32, 10)])
    with pytest.raises(wire.WireError, match="after"):
        wire.decode_any_line_manifest(body, src, ["0" * 64])


async def test_a_refused_session_leaves_nothing_where_pi_looks(duo: Duo,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A line manifest with two genuine lines swapped (each line verifies, the whole does not
    hash to the session) is found out only at the end, after the temp file and its project
    directory were made: both go, no branch is recorded, and the lines staged on the way are
    unreferenced."""
    path = duo.write(pi_session(500_000, seed=9))
    shared = duo.sharer.share(str(path))
    refs = duo.sharer.line_manifest(shared.src)
    monkeypatch.setattr(duo.sharer, "line_manifest", lambda src: [refs[0], refs[2], refs[1], *refs[3:]])
    with pytest.raises(VerificationFailed):
        await duo.fetch(shared.branch)
    assert not (duo.agent / "sessions" / "--w--").exists()
    assert not duo.fetcher.has_branch(shared.branch)


async def test_a_cancelled_fetch_leaves_nothing_where_pi_looks(duo: Duo) -> None:
    """Cancelled half way (Ctrl-C, or the node's caller gone): the temp file and the project
    directory it made are removed, nothing is committed; fetched again, it completes."""
    path = duo.write(pi_session(20_000_000, seed=10))
    branch = duo.sharer.share(str(path)).branch
    half = asyncio.Event()

    def progress(done: int, total: int) -> None:
        if done * 2 >= total:
            half.set()

    fetching = asyncio.ensure_future(fetch_branch(duo.fetcher, branch, [duo.peer], duo.me, duo.trust,
                                                  agent_dir=duo.agent, progress=progress))
    await asyncio.wait_for(half.wait(), 60)
    fetching.cancel()
    with pytest.raises(asyncio.CancelledError):
        await fetching
    assert not (duo.agent / "sessions" / "--w--").exists()
    assert not duo.fetcher.has_branch(branch)
    result = await duo.fetch(branch)
    assert duo.placed.read_bytes() == path.read_bytes() and result.lines_fetched < result.lines_total


async def test_a_newer_version_fetched_for_an_older_one_is_checked_as_it_is_hashed(
        duo: Duo, monkeypatch: pytest.MonkeyPatch) -> None:
    """`fetch v2` where the peer holds v3 (v2 grown) fetches v3, which must start with v2's
    bytes (the catalog saying so is not trusted).  The fetcher holds v1: v3 comes as v1 plus
    the new lines, and v2's hash is compared as the getter hashes v3 past v2's size; no stored
    version is read back for it (it was: a whole decompression of the session from the store,
    2.2 s of a 256 MB one, after the transfer)."""
    from p2pnode.node.follow import fetch_newest, newest_to_fetch

    read_back: list[str] = []

    def session_runs(self: Library, src: str) -> Iterator[bytes]:
        read_back.append(src)
        return iter([b""])

    monkeypatch.setattr(Library, "session_runs", session_runs)
    path = duo.write(pi_session(2_000_000, seed=31))
    await duo.fetch(duo.sharer.share(str(path)).branch)
    _grow(path, seed=32)
    v2 = duo.sharer.share(str(path))
    _grow(path, seed=33)
    v3 = duo.sharer.share(str(path))

    async def nobody(target: str) -> list[PeerAddress]:
        return []

    newest = await newest_to_fetch(v2.branch, [duo.peer], duo.me, duo.trust, nobody)
    assert (newest.branch, newest.extends) == (v3.branch, (v2.src, v2.size))
    got = await fetch_newest(duo.fetcher, newest, duo.me, duo.trust, agent_dir=duo.agent)
    assert got.written and got.branch == v3.branch and duo.placed.read_bytes() == path.read_bytes()
    assert 0 < got.lines_fetched < got.lines_total  # v1's lines were held
    assert read_back == []


async def test_a_held_branch_whose_file_is_gone_is_placed_again_in_runs(
        duo: Duo, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fetch of a branch held already, whose placed file the user deleted, writes it again
    from the store in runs through the getter (verified to src, the header first), in the
    node's `fetching/` first as a fetch does: the session is never read whole into memory
    (`session_bytes`, refused here)."""
    path = duo.write(pi_session(3_000_000, seed=41, image_bytes=200_000))
    branch = duo.sharer.share(str(path)).branch
    first = await duo.fetch(branch)
    assert first.written
    duo.placed.unlink()

    def whole(self: Library, src: str) -> bytes:
        raise AssertionError("the whole session read into memory")

    monkeypatch.setattr(Library, "session_bytes", whole)
    again = await duo.fetch(branch)
    assert again.written and again.fetched == [] and again.bytes_received < 10_000
    assert duo.placed.read_bytes() == path.read_bytes()
    assert not [p for p in duo.placed.parent.iterdir() if p.name.startswith(".")]  # no temp file left
    assert not list(duo.fetcher.paths.fetching.glob(".p2pnode-*"))  # written there, then linked
    assert not (await duo.fetch(branch)).written  # in place now: nothing written


async def test_a_whole_session_is_served_as_the_store_reads_it(
        duo: Duo, monkeypatch: pytest.MonkeyPatch) -> None:
    """GET /v1/object/<src> (the fallback for a peer without line manifests) and its Range
    answers come from Library.session_runs as they are read: right bytes across runs, with
    no copy of the whole session in memory (`session_bytes`, refused here)."""
    import aiohttp

    from p2pnode.peer.tls import client_context

    data = pi_session(5_000_000, seed=51, image_bytes=300_000)  # three runs and more
    info = duo.sharer.share(str(duo.write(data)))

    def whole(self: Library, src: str) -> bytes:
        raise AssertionError("the whole session read into memory")

    monkeypatch.setattr(Library, "session_bytes", whole)
    tls = client_context(duo.me, duo.trust, None)
    url = f"https://127.0.0.1:{duo.peer.port}" + wire.PATH_OBJECT.format(hash=info.src)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls)) as s:
        async with s.get(url) as r:
            assert r.status == 200 and await r.read() == data
        for start, end in ((0, 10), (2_097_000, 4_300_000), (len(data) - 7, len(data) - 1)):
            async with s.get(url, headers={"Range": f"bytes={start}-{end}"}) as r:
                assert r.status == 206 and await r.read() == data[start:end + 1]
        async with s.get(url, headers={"Range": "bytes=-3"}) as r:
            assert r.status == 206 and await r.read() == data[-3:]


def _header_first(data: bytes) -> bytes:
    """The moved-header form FORMAT.md documents: the header line, then the lines before it."""
    lines = data.splitlines(keepends=True)
    return lines[2] + lines[0] + lines[1] + b"".join(lines[3:])


@pytest.mark.parametrize("one_shot", [False, True], ids=["node", "one-shot"])
async def test_later_versions_of_a_session_placed_header_first_update_its_file(
        duo: Duo, one_shot: bool) -> None:
    """A session whose header follows a blank and a malformed line is placed header first; each
    later version (fetched from the one held, with the node's hash state or, one-shot, without)
    replaces that file with its own header-first form, which extends the placed one: no
    conflict, even when the placed file was deleted meanwhile or a version is skipped."""
    path = duo.write(b"\n{broken\n" + pi_session(500_000, seed=21))
    v1 = await duo.fetch(duo.sharer.share(str(path)).branch)
    assert v1.written and duo.placed.read_bytes() == _header_first(path.read_bytes())
    for step in range(4):
        if one_shot:
            LIVE.clear()
        if step == 2:
            duo.placed.unlink()
        _grow(path, seed=22 + step)
        if step != 3:  # the last one fetches two versions grown at once
            got = await duo.fetch(duo.sharer.share(str(path)).branch)
            assert got.conflict is None and got.written, got.conflict
            assert 0 < got.lines_fetched < got.lines_total
            assert duo.placed.read_bytes() == _header_first(path.read_bytes())
    got = await duo.fetch(duo.sharer.share(str(path)).branch)
    assert got.conflict is None and got.written
    assert duo.placed.read_bytes() == _header_first(path.read_bytes())
    placed = json.loads(duo.fetcher.paths.placed.read_text())[str(duo.placed)]
    assert placed["size"] == len(path.read_bytes()) and placed["blake3"] == hash_file(duo.placed)
    assert not (await duo.fetch(got.branch)).written  # held and placed: nothing to do
