"""Issue 14, a session has versions: successive shares of a growing Pi session are versions of
one session (locally, in `ls`/`show --versions`, and in the catalog offered to peers), on
copies of the real corpus in a real store."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from pifork import find

from p2pnode.cli.main import main
from p2pnode.library.api import Library
from p2pnode.paths import NodePaths
from p2pnode.peer import wire
from p2pnode.peer.provider import _catalog_entry

B1 = "*4f3f-74a0-8c1a-0b533764bed8.jsonl"
A1 = "*0313-7475-8d45-88a780e9fa37.jsonl"  # root
A6 = "*2810-72f3-bf21-ab15b19d413f.jsonl"  # pi --fork of A1


@pytest.fixture
def agent(corpus_dir: Path, tmp_path: Path) -> Path:
    agent = tmp_path / "agent"
    shutil.copytree(corpus_dir / "sessions", agent / "sessions")
    return agent


def grow(path: Path, n: int, tag: str) -> None:
    with open(path, "ab") as f:
        for i in range(n):
            f.write(b'{"type":"message","id":"%s%04d","parentId":null,'
                    b'"message":{"role":"user","content":"more %s"}}\n' % (tag.encode(), i, tag.encode()))


def three_versions(lib: Library, path: Path) -> list[str]:
    branches = [lib.share(str(path)).branch]
    grow(path, 2, "a")
    branches.append(lib.share(str(path)).branch)
    grow(path, 3, "b")
    branches.append(lib.share(str(path)).branch)
    return branches


def test_reshares_are_versions_of_one_session(lib: Library, agent: Path) -> None:
    b1 = find(agent, B1)
    v1, v2, v3 = three_versions(lib, b1)
    infos = [lib.branch(b) for b in (v1, v2, v3)]
    assert [i.version for i in infos] == [1, 2, 3]
    assert [i.previous for i in infos] == [None, v1, v2]
    assert all(i.versions == 3 and i.parent is None for i in infos)  # the sidecar format is unchanged
    rows = lib.sessions_latest()
    assert [(r.branch, r.versions) for r in rows] == [(v3, 3)]
    assert [v.branch for v in lib.versions(v1)] == [v1, v2, v3] == [v.branch for v in lib.versions(v3)]
    assert len(lib.branches()) == 3  # every version stays offered


def test_a_fork_and_a_rewrite_are_other_sessions(lib: Library, agent: Path) -> None:
    a1, a6 = find(agent, A1), find(agent, A6)
    root = lib.share(str(a1)).branch
    fork = lib.share(str(a6))
    assert fork.parent == root and fork.previous is None and fork.version == 1
    grow(a6, 1, "f")
    fork2 = lib.share(str(a6))
    assert fork2.parent == root and fork2.previous == fork.branch and fork2.version == 2
    data = a1.read_bytes()
    a1.write_bytes(data.replace(b'"version":3', b'"version":4', 1))  # rewritten in place: not a growth
    rewritten = lib.share(str(a1))
    assert rewritten.previous is None and rewritten.version == 1
    assert sorted((r.branch, r.versions) for r in lib.sessions_latest()) == sorted(
        [(fork2.branch, 2), (root, 1), (rewritten.branch, 1)])


def test_fetched_versions_link_to_the_held_older_one(lib: Library, agent: Path, tmp_path: Path) -> None:
    b1 = find(agent, B1)
    v1, v2, v3 = three_versions(lib, b1)
    with Library.open(NodePaths(tmp_path / "other"), agent_dir=tmp_path / "other-agent") as other:
        for branch in (v1, v3):  # v2 was never fetched here
            info = lib.branch(branch)
            lines = [lib.line(r.hash) for r in lib.line_manifest(info.src)]
            other.add_fetched(lib.sidecar_bytes(branch), lines)
        got = other.branch(v3)
        assert got.previous == v1 and got.version == 2 and got.versions == 2
        assert [r.branch for r in other.sessions_latest(include_unshared=True)] == [v3]


@pytest.mark.parametrize("order", [(0, 2, 1), (2, 0, 1), (2, 1, 0), (1, 2, 0)])
def test_versions_fetched_in_any_order_make_one_chain(lib: Library, agent: Path, tmp_path: Path,
                                                      order: tuple[int, int, int]) -> None:
    """v1, v3, then v2 (or the newest first): each version, as it arrives, becomes the
    `previous` of the ones held already that grew from it; numbers v1..v3, one row in `ls`."""
    v = three_versions(lib, find(agent, B1))
    with Library.open(NodePaths(tmp_path / "other"), agent_dir=tmp_path / "other-agent") as other:
        generation = other.sessions.generation
        for i in order:
            lines = [lib.line(r.hash) for r in lib.line_manifest(lib.branch(v[i]).src)]
            other.add_fetched(lib.sidecar_bytes(v[i]), lines)
        got = [(g.previous, g.version, g.versions) for g in map(other.branch, v)]
        assert got == [(None, 1, 3), (v[0], 2, 3), (v[1], 3, 3)]
        assert [r.branch for r in other.sessions_latest(include_unshared=True)] == [v[2]]
        assert other.sessions.generation > generation  # peers see the new links in the catalog
    with Library.open(NodePaths(tmp_path / "other"), agent_dir=tmp_path / "other-agent") as reopened:
        assert [reopened.branch(b).version for b in v] == [1, 2, 3]


def test_catalog_says_previous_and_version_and_old_peers_still_decode(lib: Library, agent: Path) -> None:
    v1, v2, v3 = three_versions(lib, find(agent, B1))
    catalog = lib.catalog()
    listed = {b.branch for b in catalog.branches}
    message = wire.CatalogMessage(catalog.generation, "node",
                                  [_catalog_entry(b, listed) for b in catalog.branches])
    decoded = {e.branch: e for e in wire.decode_catalog(wire.encode_catalog(message)).branches}
    assert (decoded[v1].previous, decoded[v1].version) == (None, 1)
    assert (decoded[v3].previous, decoded[v3].version) == (v2, 3)
    doc = json.loads(wire.encode_catalog(message))
    for entry in doc["branches"]:  # a peer from before versions: neither field
        del entry["previous"], entry["version"]
    old = wire.decode_catalog(json.dumps(doc).encode())
    assert {(e.previous, e.version) for e in old.branches} == {(None, None)}
    for bad in ({"previous": "xyz"}, {"version": 0}, {"version": "2"}, {"previous": 7}):
        doc["branches"][0].update(bad)
        with pytest.raises(wire.WireError):
            wire.decode_catalog(json.dumps(doc).encode())
        doc["branches"][0].update(previous=None, version=None)


def test_ls_shows_one_row_per_session_and_show_lists_versions(agent: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    home = tmp_path / "node"
    with Library.open(NodePaths(home), agent_dir=agent) as lib:
        v1, v2, v3 = three_versions(lib, find(agent, B1))
    assert main(["--home", str(home), "ls"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert len(rows) == 2 and rows[1].startswith(v3[:16]) and rows[1].split()[3] == "3"
    assert main(["--home", str(home), "ls", "--json"]) == 0
    assert [(r["branch"], r["versions"]) for r in json.loads(capsys.readouterr().out)] == [(v3, 3)]
    assert main(["--home", str(home), "show", v1[:12], "--versions"]) == 0
    out = capsys.readouterr().out
    assert "versions    3 of session" in out
    listed = [line.split()[1] for line in out.splitlines() if line.startswith("  v")]
    assert listed == [v1[:16], v2[:16], v3[:16]]
    assert main(["--home", str(home), "show", v2, "--versions", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [v["branch"] for v in shown["versions"]] == [v1, v2, v3] and shown["branch"]["version"] == 2


def test_a_torn_last_line_is_never_part_of_a_version(lib: Library, agent: Path) -> None:
    b1 = find(agent, B1)
    first = lib.share(str(b1))
    complete = b1.read_bytes()
    with open(b1, "ab") as f:
        f.write(b'{"type":"message","id":"torn","mess')  # Pi is mid-write
    torn = lib.share(str(b1))
    assert torn.branch == first.branch and lib.session_bytes(torn.src) == complete
    assert any("left for the next share" in w for w in torn.warnings)
    with open(b1, "ab") as f:
        f.write(b'age":{"role":"user","content":"done"}}\n')
    whole = lib.share(str(b1))
    assert whole.previous == first.branch and whole.version == 2
    assert lib.session_bytes(whole.src) == b1.read_bytes()


def diverged(agent: Path) -> tuple[Path, Path, Path]:
    """v1 (a corpus session), and two continuations of it in files of their own: vx, then vy
    (larger than vx, the same header id, vx not a prefix of it)."""
    v1 = find(agent, B1)
    vx, vy = agent / "vx.jsonl", agent / "vy.jsonl"
    shutil.copyfile(v1, vx)
    shutil.copyfile(v1, vy)
    grow(vx, 2, "x")
    grow(vy, 5, "y")
    return v1, vx, vy


def test_a_continuation_of_an_older_version_than_the_largest_is_its_growth(lib: Library, agent: Path) -> None:
    """vy grew from v1, not from vx (held, larger, not its prefix): version 2 with previous v1
    at once (not at the next open), and v1's lines are not stored again (its turns go on)."""
    v1, vx, vy = diverged(agent)
    first, x = lib.share(str(v1)), lib.share(str(vx))
    y = lib.share(str(vy))
    assert (x.previous, x.version) == (first.branch, 2)
    assert (y.previous, y.version) == (first.branch, 2)
    lines = lib.sessions.version(first.src).lines
    assert lib.sessions.line_turn(y.src, lines) == lib.sessions.line_turn(first.src, lines)  # the delta only
    assert len(lib.sessions_latest()) == 1  # one Pi session, one row in `ls`


def test_a_fetched_continuation_of_an_older_version_than_the_largest_is_its_growth(
        lib: Library, agent: Path, tmp_path: Path) -> None:
    v1, vx, vy = diverged(agent)
    shared = [lib.share(str(p)) for p in (v1, vx, vy)]
    with Library.open(NodePaths(tmp_path / "other"), agent_dir=tmp_path / "other-agent") as other:
        for info in shared:
            lines = [lib.line(r.hash) for r in lib.line_manifest(info.src)]
            other.add_fetched(lib.sidecar_bytes(info.branch), lines)
        got = [(g.previous, g.version) for g in map(other.branch, (s.branch for s in shared))]
        assert got == [(None, 1), (shared[0].branch, 2), (shared[0].branch, 2)]
        n = other.sessions.version(shared[0].src).lines
        assert other.sessions.line_turn(shared[2].src, n) == other.sessions.line_turn(shared[0].src, n)
