"""A fork fetched with its parent held (issue 12: faster than Syncthing): the parent's lines are
not asked for; they are read from the parent's placed file when it is still what this node
placed (a run's ends hashed, the whole by the session's hash; each line hashed where that
fails), else from the fetcher's store in runs (Library.lines: one call per run of about
READ_BACK bytes, each line checked against its hash), never one call per line; the placed fork
is byte-identical.  In one process over mutual TLS on loopback (test_stream_engine's
Duo)."""
from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import blake3
import pytest
from test_stream_engine import PROJECT, Duo, duo
from test_stream_fetch import pi_session

from p2pnode.errors import PeerUnavailable, VerificationFailed
from p2pnode.library.api import Library
from p2pnode.paths import NodePaths
from p2pnode.peer import batches, getter, heldlines
from p2pnode.peer.address import PeerAddress
from p2pnode.peer.get import OpenPerUse, fetch_branch
from p2pnode.peer.getter import SessionGetter
from p2pnode.pi.lines import LineRef, split_lines
from store.files import blobpack
from store.files.blobpack import scan_pack
from store.layout import BLOB_HEADER

__all__ = ["duo"]  # the fixture, shared with test_stream_engine

FORK_ID = "01a1ff93-0000-7000-8000-00000000f0c4"


def _fork(duo: Duo, parent: Path, keep: float = 0.9) -> Path:
    """What `pi --fork` writes: a new header naming the parent, the parent's first lines, new ones."""
    lines = split_lines(parent.read_bytes())[1:]
    header = json.dumps({"type": "session", "version": 3, "id": FORK_ID, "cwd": "/w",
                         "timestamp": "2026-11-21T21:00:00.000Z", "parentSession": str(parent)})
    header += "\n"
    more = b"".join(pi_session(400_000, seed=77, image_bytes=30_000).splitlines(keepends=True)[1:])
    path = duo.share_agent / PROJECT / f"2026-11-21T21-00-00-000Z_{FORK_ID}.jsonl"
    path.write_bytes(header.encode() + b"".join(lines[: int(len(lines) * keep)]) + more)
    return path


def _counted(duo: Duo, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of lines of each Library.lines call of the fetcher; Library.line refused."""
    calls: list[int] = []
    read = duo.fetcher.lines

    def counted(hashes: Sequence[bytes]) -> list[bytes]:
        calls.append(len(hashes))
        return read(hashes)

    monkeypatch.setattr(duo.fetcher, "lines", counted)
    monkeypatch.setattr(duo.fetcher, "line", lambda h: pytest.fail(f"line({h.hex()}): a store call per line"))
    return calls


async def test_a_fork_with_its_parent_placed_reads_the_held_lines_from_its_file(
        duo: Duo, monkeypatch: pytest.MonkeyPatch) -> None:
    """The parent's file, still what this node placed: every line the fork copied from it comes
    from it (no store read), in runs of which only the first and last lines are hashed alone
    (the session's hash covers every byte of them)."""
    parent = duo.write(pi_session(4_000_000, seed=20, image_bytes=60_000))
    assert (await duo.fetch(duo.sharer.share(str(parent)).branch)).written
    fork = _fork(duo, parent)
    branch = duo.sharer.share(str(fork)).branch
    calls = _counted(duo, monkeypatch)
    hashed: list[int] = []
    runs: list[int] = []
    line_hash, read = heldlines.blob_hash, heldlines._read
    monkeypatch.setattr(heldlines, "blob_hash", lambda line: hashed.append(len(line)) or line_hash(line))
    monkeypatch.setattr(heldlines, "_read",
                        lambda placed, refs, start: runs.append(len(refs)) or read(placed, refs, start))
    got = await duo.fetch(branch)
    assert got.written and Path(got.path or "").read_bytes() == fork.read_bytes()
    copied = int((len(split_lines(parent.read_bytes())) - 1) * 0.9)
    new = got.lines_total - 1 - copied  # pi_session's new lines repeat some of the parent's (held,
    assert copied > 20 and sum(calls) <= new  # elsewhere in its file: those come from the store)
    assert sum(runs) >= copied and len(hashed) <= 2 * len(runs) < copied // 2


async def test_a_fetched_versions_manifest_is_kept_for_its_forks_and_its_peers(
        duo: Duo, monkeypatch: pytest.MonkeyPatch) -> None:
    """The manifest a fetch verified is the one a fork fetched next compares with its own, and
    the one a peer fetching the version from here asks for: kept at the commit, not made again
    from the version's turns and the blob index."""
    parent = duo.write(pi_session(2_000_000, seed=27, image_bytes=60_000))
    src = (await duo.fetch(duo.sharer.share(str(parent)).branch)).src
    branch = duo.sharer.share(str(_fork(duo, parent))).branch
    monkeypatch.setattr(duo.fetcher.sessions, "line_hashes", lambda of: pytest.fail(f"line_hashes({of})"))
    monkeypatch.setattr(duo.fetcher.store, "raw_lengths", lambda hashes: pytest.fail("raw_lengths"))
    lengths = [len(x) for x in split_lines(parent.read_bytes())]
    assert [r.length for r in duo.fetcher.line_manifest(src)] == lengths
    assert (await duo.fetch(branch)).written


async def test_a_fork_with_its_parent_held_reads_the_held_lines_in_runs(
        duo: Duo, monkeypatch: pytest.MonkeyPatch) -> None:
    """The parent's file gone: the held lines come from the store in runs."""
    parent = duo.write(pi_session(4_000_000, seed=21, image_bytes=60_000))
    first = await duo.fetch(duo.sharer.share(str(parent)).branch)
    Path(first.path or "").unlink()
    fork = _fork(duo, parent)
    branch = duo.sharer.share(str(fork)).branch
    monkeypatch.setattr(getter, "READ_BACK", 1 << 20)  # several runs of a 4 MB parent
    calls = _counted(duo, monkeypatch)
    got = await duo.fetch(branch)
    assert got.written and Path(got.path or "").read_bytes() == fork.read_bytes()
    held = got.lines_total - got.lines_fetched
    assert held > 20 and sum(calls) == held and 3 <= len(calls) < held / 5


async def test_the_cpu_of_reading_held_lines_back_counts_the_stores_threads(
        duo: Duo, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading held lines back is CPU no received byte causes (pace.FetchPace.not_shared).
    The store decodes and hashes them on its own threads: the worker's clock alone missed
    half of it (a resumed 256 MB fetch then looked CPU-bound and withheld the stream), so
    the whole process's CPU over the reads is counted, at least all that the reads took."""
    parent = duo.write(pi_session(8_000_000, seed=24, image_bytes=60_000))
    first = await duo.fetch(duo.sharer.share(str(parent)).branch)
    Path(first.path or "").unlink()  # the held lines come from the store
    branch = duo.sharer.share(str(_fork(duo, parent))).branch
    reads: list[float] = []
    read = duo.fetcher.lines

    def timed(hashes: Sequence[bytes]) -> list[bytes]:
        cpu = time.process_time()
        try:
            return read(hashes)
        finally:
            reads.append(time.process_time() - cpu)

    not_shared: list[Callable[[], float]] = []
    get_lines = batches.get_lines

    async def noted(*args: object) -> None:
        not_shared.append(args[7])  # type: ignore[arg-type]  # get.py hands _Stream.held_cpu on
        await get_lines(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(duo.fetcher, "lines", timed)
    monkeypatch.setattr(batches, "get_lines", noted)
    assert (await duo.fetch(branch)).written
    assert reads and not_shared[0]() >= sum(reads) > 0


async def test_lines_changed_in_the_parents_file_behind_its_stat_come_from_the_store(
        duo: Duo, monkeypatch: pytest.MonkeyPatch) -> None:
    """The parent's placed file changed on disk (same size, mtime restored: its stat says
    unchanged): the lines that no longer hash right are read from the store, the others from
    the file, and the fork placed is the sharer's, byte for byte.  The peer is not blamed (not
    dropped) and no line crosses the wire twice."""
    parent = duo.write(pi_session(3_000_000, seed=23, image_bytes=60_000))
    placed = Path((await duo.fetch(duo.sharer.share(str(parent)).branch)).path or "")
    before = placed.stat()
    tampered = placed.read_bytes().replace(b"look at image", b"LOOK AT IMAGE")
    placed.write_bytes(tampered)
    os.utime(placed, ns=(before.st_atime_ns, before.st_mtime_ns))
    fork = _fork(duo, parent)
    changed = sum(1 for line in split_lines(fork.read_bytes()) if b"look at image" in line)
    branch = duo.sharer.share(str(fork)).branch
    calls = _counted(duo, monkeypatch)
    got = await duo.fetch(branch)
    assert got.written and Path(got.path or "").read_bytes() == fork.read_bytes()
    assert 0 < calls[-1] <= changed < got.lines_total - got.lines_fetched
    assert got.dropped_peers == {} and got.lines_fetched == len(set(split_lines(fork.read_bytes())) - set(
        split_lines(parent.read_bytes())))


async def test_a_line_changed_inside_a_run_of_the_parents_file_is_caught_by_the_session_hash(
        duo: Duo, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """One line changed in the middle of the parent's placed file, behind its stat: the run
    holding it is taken on its ends' hashes, so the session does not hash to src; the fetch
    takes its held lines again, each one checked (that line from the store), places the fork
    byte for byte and blames no peer; the new lines cross the wire once."""
    parent = duo.write(pi_session(3_000_000, seed=25, image_bytes=60_000))
    placed = Path((await duo.fetch(duo.sharer.share(str(parent)).branch)).path or "")
    lines = split_lines(placed.read_bytes())
    once = [i for i in range(len(lines) // 3, len(lines) * 2 // 3)
            if all(lines.count(lines[j]) == 1 for j in (i - 1, i, i + 1))]
    victim = once[len(once) // 2]
    before = placed.stat()
    lines[victim] = lines[victim].replace(b'"', b"'", 1)
    placed.write_bytes(b"".join(lines))
    os.utime(placed, ns=(before.st_atime_ns, before.st_mtime_ns))
    fork = _fork(duo, parent)
    branch = duo.sharer.share(str(fork)).branch
    from_store: list[bytes] = []
    read = duo.fetcher.lines
    monkeypatch.setattr(duo.fetcher, "lines", lambda hashes: from_store.extend(hashes) or read(hashes))
    with caplog.at_level(logging.INFO, logger="p2pnode.peer.get"):
        got = await duo.fetch(branch)
    assert "taken again, each one checked" in caplog.text
    assert got.written and Path(got.path or "").read_bytes() == fork.read_bytes()
    assert got.dropped_peers == {}
    assert blake3.blake3(split_lines(parent.read_bytes())[victim]).digest() in from_store
    new = set(split_lines(fork.read_bytes())) - set(split_lines(parent.read_bytes()))
    assert got.lines_fetched == len(new)


async def test_a_manifest_naming_another_held_line_inside_a_run_is_not_committed(
        duo: Duo, monkeypatch: pytest.MonkeyPatch) -> None:
    """A manifest that names, for a line the fork shares with its parent, another line this
    node holds of the same length: the bytes placed would be right (they come from the
    parent's file, and hash to src), the version committed would not (its turn would reference
    the other line).  The run is not taken whole where the manifest is not the parent's line
    for line; the line it names is read from the store, the session does not hash to src, the
    peer is dropped and nothing is committed or placed."""
    lines = split_lines(pi_session(2_000_000, seed=26, image_bytes=60_000))
    twins = [json.dumps({"type": "custom", "id": f"{n:08x}", "data": c * 500}).encode() + b"\n"
             for n, c in ((1, "a"), (2, "b"))]
    at = len(lines) // 3
    lines[at:at] = [twins[0], *lines[at:at + 10], twins[1]]
    parent = duo.write(b"".join(lines))
    assert (await duo.fetch(duo.sharer.share(str(parent)).branch)).written
    fork = _fork(duo, parent)
    branch = duo.sharer.share(str(fork)).branch
    src = duo.sharer.branch(branch).src
    truth = duo.sharer.line_manifest
    a, b = (blake3.blake3(t).digest() for t in twins)

    def lying(of: str) -> list[LineRef]:
        refs = truth(of)
        return [LineRef(b, r.length) if of == src and r.hash == a else r for r in refs]

    monkeypatch.setattr(duo.sharer, "line_manifest", lying)
    with pytest.raises((PeerUnavailable, VerificationFailed)):
        await duo.fetch(branch)
    assert not duo.fetcher.has_branch(branch) and not (duo.agent / PROJECT / fork.name).exists()


@pytest.mark.parametrize("folded", [True, False])
async def test_a_damaged_held_line_refuses_the_fork_or_is_fetched_again(
        duo: Duo, tmp_path: Path, folded: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A held line whose stored copy was damaged (a bit flipped in the fetcher's blobs.pack)
    behind blobs.idx is found when it is read back: the fetch fails naming the store, not the
    peer, and no fork file is placed.  Beyond the index (the close did not fold the parent's
    few MB into it), the open's scan finds the damaged record: the line is not held, so it is
    fetched from the peer like a new one, and the fork is placed whole."""
    if folded:
        monkeypatch.setattr(blobpack, "FOLD_BYTES", 0)
    parent = duo.write(pi_session(2_000_000, seed=22, image_bytes=60_000))
    assert (await duo.fetch(duo.sharer.share(str(parent)).branch)).written
    fork = _fork(duo, parent)
    branch = duo.sharer.share(str(fork)).branch
    victim = split_lines(parent.read_bytes())[5]
    (duo.agent / PROJECT / parent.name).unlink()  # the parent's file gone: the store gives the held lines
    duo.fetcher.close()
    pack = NodePaths(tmp_path / "fetcher").store / "blobs.pack"
    data = bytearray(pack.read_bytes())
    victim_hash = blake3.blake3(victim).digest()
    (at,) = [o for o, hdr in scan_pack(bytes(data)).records if hdr.hash == victim_hash]
    data[at + BLOB_HEADER.size + 5] ^= 0x08
    pack.write_bytes(bytes(data))
    with Library.open(NodePaths(tmp_path / "fetcher"), duo.agent) as lib:
        if not folded:
            assert any(victim_hash.hex() in note for note in lib.store.recovery_notes)
            assert (await duo.fetch(branch, lib)).written
            assert (duo.agent / PROJECT / fork.name).read_bytes() == fork.read_bytes()
            return
        with pytest.raises(VerificationFailed, match="cannot be read back from the store"):
            await duo.fetch(branch, lib)
    assert not (duo.agent / PROJECT / fork.name).exists()


def test_from_store_gives_the_run_at_the_cursor_once_each_up_to_the_limit() -> None:
    """Sans-IO: the held run stops before a line still to come from a peer, at a line repeated
    within the run (the buffer holds one copy), and after `limit` bytes; read back, it is
    handed out in joined parts and the next run follows."""
    lines = split_lines(pi_session(300_000, seed=5, image_bytes=20_000))
    lines = [*lines[:6], lines[2], *lines[6:]]  # a repeat of line 3 as line 7
    refs = [LineRef(blake3.blake3(x).digest(), len(x)) for x in lines]
    g = SessionGetter(blake3.blake3(b"".join(lines)).hexdigest(), refs, [refs[9].hash])
    first = g.from_store(limit=1 << 30)
    assert first == [r.hash for r in refs[:6]]  # not the repeat (line 7)
    g.read_back(first, lines[:6])
    assert b"".join(g.ready()) == b"".join(lines[:6])
    assert g.from_store(limit=1 << 30) == [r.hash for r in refs[6:9]]  # stops before the peer's line 10
    assert g.from_store(limit=1) == [refs[6].hash]  # at least one line, however small the limit
    g.read_back([r.hash for r in refs[6:9]], lines[6:9])
    list(g.ready())
    assert g.from_store() == []  # the cursor waits on a peer
    g.arrived(refs[9].hash, lines[9])
    list(g.ready())
    rest = g.from_store()
    g.read_back(rest, [lines[refs.index(next(r for r in refs if r.hash == h))] for h in rest])
    list(g.ready())
    assert g.done and g.finish().src == g.src


def _flip_lines(pack: Path, lines: Sequence[bytes]) -> None:
    """A bit flipped in the stored record of each of `lines` (blobs.pack)."""
    data = bytearray(pack.read_bytes())
    records = {hdr.hash: o for o, hdr in scan_pack(bytes(data)).records}
    for line in lines:
        data[records[blake3.blake3(line).digest()] + BLOB_HEADER.size + 5] ^= 0x08
    pack.write_bytes(bytes(data))


@pytest.mark.parametrize("one_shot", [False, True])
async def test_a_held_branch_whose_stored_lines_are_damaged_is_fetched_again(
        duo: Duo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_shot: bool) -> None:
    """A branch held already is placed from the store; where some of its stored lines were
    damaged (bits flipped in blobs.pack, behind the index), `fetch` asks the peers for those
    lines again, verifies them, stores them again (which heals the store: fsck finds no
    damaged line of it) and places the file whole.  Only the damaged lines cross the wire.
    The same for a one-shot fetch (OpenPerUse), which closes the store while it waits on a
    peer: what a read found damaged is known to one opening only."""
    monkeypatch.setattr(blobpack, "FOLD_BYTES", 0)
    session = duo.write(pi_session(2_000_000, seed=23, image_bytes=60_000))
    branch = duo.sharer.share(str(session)).branch
    assert (await duo.fetch(branch)).written
    duo.placed.unlink()
    duo.fetcher.close()
    lines = split_lines(session.read_bytes())
    victims = [lines[3], lines[len(lines) // 2], lines[-2]]
    paths = NodePaths(tmp_path / "fetcher")
    _flip_lines(paths.store / "blobs.pack", victims)
    with socket.socket() as unused:  # no peer answers there: the error says why it fetched at all
        unused.bind(("127.0.0.1", 0))
        gone = PeerAddress(duo.peer.node_id, "127.0.0.1", unused.getsockname()[1])
        with pytest.raises(PeerUnavailable, match=f"branch {branch} is held, but 3 of its lines cannot"):
            await fetch_branch(OpenPerUse(paths, duo.agent), branch, [gone], duo.me, duo.trust,
                               agent_dir=duo.agent)
    assert not duo.placed.exists()
    if one_shot:
        got = await fetch_branch(OpenPerUse(paths, duo.agent), branch, [duo.peer], duo.me, duo.trust,
                                 agent_dir=duo.agent)
    with Library.open(paths, duo.agent) as lib:
        if not one_shot:
            got = await duo.fetch(branch, lib)
        assert got.written and duo.placed.read_bytes() == session.read_bytes()
        assert got.healed == got.lines_fetched == len(set(victims))
        assert sum(len(v) for v in set(victims)) <= got.bytes_received < 2 * len(session.read_bytes()) // 10
        assert lib.damaged_lines() == []
    with Library.open(paths, duo.agent) as lib:  # healed for good: placed again from the store alone
        duo.placed.unlink()
        assert (await duo.fetch(branch, lib)).lines_fetched == 0
        assert duo.placed.read_bytes() == session.read_bytes()
