"""What a peer may be served (Library._visible and the line index, library/lineindex.py) is
kept up to date as branches come and go: the versions added walked in, those gone walked out,
a growth by its new lines only; either way it answers what a rebuild from nothing answers,
through shares, re-shares, grown versions, audiences, unshares and expiry.  The lines are
indexed once for all peers, so what peers may have costs memory per line, not per peer."""
from __future__ import annotations

import json
import random
import tracemalloc
from collections.abc import Iterable
from pathlib import Path

import pytest
from test_share import agent  # noqa: F401  (the corpus, as test_share copies it)

from p2pnode.library import access
from p2pnode.library.api import Library
from p2pnode.library.lineindex import LineIndex

ALICE = "a" * 56
BOB = "b" * 56
CAROL = "c" * 56
PEERS = (None, ALICE, BOB)
SESSION_ID = "0199a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b"


def _kinds(lib: Library, peer: str | None) -> dict[str, str]:
    """Every hash `peer` may be served, with its kind (the lines: of those the index holds)."""
    visible = lib._visible(peer)
    hashes = [*visible.objects, *(digest.hex() for digest in lib._lines._holders)]
    return {h: kind for h in hashes if (kind := lib.offered_object(h, peer)) is not None}


def _from_nothing(lib: Library, peer: str | None) -> dict[str, str]:
    kept, served, lines = dict(lib._access), lib._served, lib._lines
    lib._access.clear()
    lib._served, lib._lines = None, LineIndex()
    try:
        return _kinds(lib, peer)
    finally:
        lib._access.clear()
        lib._access.update(kept)
        lib._served, lib._lines = served, lines


def _indexed_lines(lib: Library) -> set[bytes]:
    return {h for src in lib._lines._versions for h in lib.sessions.line_hashes(src)}


def _walks(lib: Library, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """The (version, lines skipped) the line index walks from now on."""
    walked: list[tuple[str, int]] = []
    known = lib._line_hashes_after

    def recorded(src: str, skip: int) -> Iterable[bytes]:
        walked.append((src, skip))
        return known(src, skip)

    monkeypatch.setattr(lib, "_line_hashes_after", recorded)
    return walked


def test_the_kept_map_is_always_a_rebuilt_one(lib: Library, agent: Path,  # noqa: F811
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(7)
    files = sorted((agent / "sessions").rglob("*.jsonl"))
    clock = [access.now_ms()]
    monkeypatch.setattr(access, "now_ms", lambda: clock[0])
    shared: list[str] = []
    for step in range(60):
        op = rng.choice(["share", "share", "share", "grow", "unshare", "time"])
        if op in ("share", "grow") or not shared:
            path = rng.choice(files)
            if op == "grow":
                with open(path, "ab") as f:
                    f.write(b'{"type":"custom","id":"%08x","parentId":null,"data":{}}\n' % step)
            to = rng.choice([None, [ALICE], [BOB], [ALICE, BOB]])
            expires = rng.choice([None, "1h", "never"])
            shared.append(lib.share(str(path), to=to, expires=expires).branch)
        elif op == "unshare":
            lib.unshare(rng.choice(shared))
        else:
            clock[0] += 2 * 3600 * 1000  # past every "1h"
        for peer in rng.sample(PEERS, 2):
            assert _kinds(lib, peer) == _from_nothing(lib, peer), f"step {step} ({op}), peer {peer}"
        # the index holds the lines of the versions it follows, and no others (none left behind)
        assert set(lib._lines._holders) == _indexed_lines(lib), f"step {step} ({op})"


def test_a_new_share_walks_only_its_own_lines(lib: Library, agent: Path,  # noqa: F811
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Another session shared: the index gains its lines (and its new ancestors'), without
    the versions offered before being walked again, once for every peer."""
    files = sorted((agent / "sessions").rglob("*.jsonl"))
    for path in files[:3]:
        lib.share(str(path))
    lib._visible(ALICE)
    before = {b.branch for b in lib.branches()}
    lib.share(str(files[3]))
    added = {b.src for b in lib.branches() if b.branch not in before}
    walked = _walks(lib, monkeypatch)
    lib._visible(ALICE)
    lib._visible(BOB)
    assert added and sorted(walked) == sorted((src, 0) for src in added)
    monkeypatch.undo()
    assert _kinds(lib, ALICE) == _from_nothing(lib, ALICE)


def _session(agent_dir: Path, lines: int) -> Path:
    """A Pi session of `lines` tiny entries after its header (a long agent run)."""
    path = agent_dir / "sessions" / "--w--" / f"2026-01-01T00-00-00-000Z_{SESSION_ID}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    header = {"type": "session", "version": 3, "id": SESSION_ID, "timestamp": "2026-01-01T00:00:00.000Z",
              "cwd": "/w"}
    path.write_bytes(json.dumps(header).encode() + b"\n" + b"".join(
        b'{"type":"custom","id":"%08x","parentId":null,"data":{"n":%d}}\n' % (i, i) for i in range(lines)))
    return path


def test_a_grown_version_walks_its_new_lines_only(lib: Library, agent: Path,  # noqa: F811
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The lines a version shares with the one it grew from are not walked again; they are
    visible through it, and the old version's own lines stay visible after it is gone."""
    path = _session(agent, 200)
    first = lib.share(str(path))
    lib._visible(ALICE)
    with open(path, "ab") as f:
        f.write(b'{"type":"custom","id":"new","parentId":null,"data":{}}\n')
    walked = _walks(lib, monkeypatch)
    grown = lib.share(str(path))
    assert lib.offered_object(lib.line_manifest(grown.src)[-1].hash.hex(), ALICE) == "line"
    assert walked == [(grown.src, first.lines)]
    monkeypatch.undo()
    assert lib._lines.grown_from == {grown.src: first.src}
    refs = lib.line_manifest(grown.src)
    assert all(lib.offered_object(r.hash.hex(), ALICE) == "line" for r in refs)
    assert lib.offered_object(refs[1].hash.hex().upper(), ALICE) is None  # our text form only
    assert _kinds(lib, ALICE) == _from_nothing(lib, ALICE)
    lib.unshare(grown.branch)  # the session's versions go together
    assert all(lib.offered_object(r.hash.hex(), ALICE) is None for r in refs)
    assert not lib._lines._holders


def test_a_version_forgotten_under_its_growth_rebuilds_the_index(lib: Library, agent: Path) -> None:  # noqa: F811
    """`rm` of the older version's branch while the grown one stays offered: the lines the
    grown one did not claim were the older one's, so the index is made again from nothing."""
    path = _session(agent, 50)
    first = lib.share(str(path))
    with open(path, "ab") as f:
        f.write(b'{"type":"custom","id":"new","parentId":null,"data":{}}\n')
    grown = lib.share(str(path))
    lib._visible(ALICE)
    assert lib._lines.grown_from == {grown.src: first.src}
    lib.remove(first.branch)
    assert not lib.has_session(first.src)
    assert all(lib.offered_object(r.hash.hex(), ALICE) == "line" for r in lib.line_manifest(grown.src))
    assert lib._lines.grown_from == {} and set(lib._lines._holders) == _indexed_lines(lib)
    assert _kinds(lib, ALICE) == _from_nothing(lib, ALICE)


def test_what_peers_may_have_costs_memory_per_line_not_per_peer(lib: Library, agent: Path) -> None:  # noqa: F811
    """Memory for the answers of four peers is that of one: the per-peer part is the branches."""
    lines = 20_000
    lib.share(str(_session(agent, lines)))
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        lib._visible(ALICE)
        one = tracemalloc.get_traced_memory()[0] - start
        for peer in (None, BOB, CAROL):
            lib._visible(peer)
        four = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    # a dict entry and a 32-byte key per line; the hex-keyed map per peer was some 200 bytes a line
    assert one < 160 * lines, one
    assert four - one < 16 * 1024, (one, four)
