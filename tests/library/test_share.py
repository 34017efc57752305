"""Sharing through the session library, on copies of the real Pi corpus in a real store."""
from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import blake3
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pifork import find
from procnode import PEAK_RSS, PY, Node, peak_kb
from skips import KERNEL_LIMITATION

from p2pnode.errors import InvalidInput, NotFound, VerificationFailed
from p2pnode.library import sessions as sessions_module
from p2pnode.library.api import Library
from p2pnode.library.manifest import ManifestCorrupt
from p2pnode.library.sessions import StateCorrupt
from p2pnode.paths import NodePaths
from p2pnode.pi.hashing import hash_file
from p2pnode.pi.session import InvalidHeader, LineageCycle
from p2pnode.pi.sidecar import InvalidSidecar, Sidecar
from store import StoredBlob

A1 = "*0313-7475-8d45-88a780e9fa37.jsonl"  # root
A3 = "*173a-7744-89ad-bbc16c12cc22.jsonl"  # 1.4 MB, images
A6 = "*2810-72f3-bf21-ab15b19d413f.jsonl"  # pi --fork of A1
B1 = "*4f3f-74a0-8c1a-0b533764bed8.jsonl"
B5 = "*69ef-76bb-aaf0-d291c98d9fe0.jsonl"  # new_session{parentSession: B3}; B3 -> B2 -> B1


@pytest.fixture
def agent(corpus_dir: Path, tmp_path: Path) -> Path:
    """A moved agent dir: the corpus headers name /tmp/pi-harness/agent, the files live here."""
    agent = tmp_path / "agent"
    shutil.copytree(corpus_dir / "sessions", agent / "sessions")
    for f in agent.rglob("*.jsonl"):
        f.chmod(0o644)
    return agent


def stored_bytes(lib: Library) -> int:
    """What the blob pack holds for us, as stored (compressed)."""
    return sum(len(lib.store.get_stored_blob(h).stored) for h in lib.store.blob_hashes())


def make_child(parent: Path, child: Path, parent_session: str | None, cwd: str, extra: bytes = b"") -> Path:
    """A fork as Pi writes it: a new header, then the parent's entries verbatim, then new ones."""
    header = json.loads(parent.read_bytes().split(b"\n", 1)[0])
    header.update(id="01a1ff93-ffff-7000-8000-" + child.stem[-12:].rjust(12, "0"), cwd=cwd,
                  parentSession=parent_session)
    if parent_session is None:
        del header["parentSession"]
    body = parent.read_bytes().split(b"\n", 1)[1]
    child.parent.mkdir(parents=True, exist_ok=True)
    child.write_bytes(json.dumps(header, separators=(",", ":")).encode() + b"\n" + body + extra)
    return child


def test_every_corpus_file_shares_verbatim_with_its_lineage(lib: Library, agent: Path,
                                                            corpus_manifest: dict) -> None:
    branch_of: dict[str, str] = {}
    for entry in corpus_manifest["files"]:
        path = agent / entry["path"]
        result = lib.share(str(path))
        assert result.src == hash_file(path) == entry["blake3"]
        assert lib.session_bytes(result.src) == path.read_bytes()
        assert result.size == entry["bytes"] and result.lines == entry["lines"]
        assert result.header["id"] == entry["header"]["id"]
        assert Sidecar(result.src, result.parent).branch == result.branch
        assert lib.sidecar_bytes(result.branch) == Sidecar(result.src, result.parent).encode()
        branch_of[entry["header"]["id"]] = result.branch
    for entry in corpus_manifest["files"]:
        info = lib.branch(branch_of[entry["header"]["id"]])
        parent_path = entry["header"].get("parentSession")
        if parent_path is None:
            assert info.parent is None
        else:  # found through the moved agent dir: the parent's own branch hash
            parent_id = next(e["header"]["id"] for e in corpus_manifest["files"]
                             if parent_path.endswith(e["path"]))
            assert info.parent == branch_of[parent_id]
    manifest = json.loads(lib.paths.manifest.read_text())
    assert set(manifest) == set(branch_of.values())
    assert all(Path(p).is_file() for p in manifest.values())


def test_fork_of_fork_of_fork(lib: Library, agent: Path) -> None:
    result = lib.share(str(find(agent, B5)))
    assert len(result.ancestors) == 3
    chain = [*result.ancestors, result]
    assert chain[0].parent is None and chain[0].header["id"].endswith("0b533764bed8")
    for parent, child in zip(chain, chain[1:], strict=False):
        assert child.parent == parent.branch
    assert [i.branch for i in lib.lineage(result.branch)] == [c.branch for c in reversed(chain)]
    assert [c.branch for c in lib.children(chain[0].branch)] == [chain[1].branch]


def test_relative_parent_session(lib: Library, agent: Path, tmp_path: Path) -> None:
    a1 = find(agent, A1)
    cwd = tmp_path / "work" / "alpha"
    cwd.mkdir(parents=True)
    rel = "../../agent/sessions/" + a1.parent.name + "/" + a1.name  # as `pi --fork <relative path>` stores it
    child = make_child(a1, agent / "sessions" / "--x--" / "rel-000000000001.jsonl", rel, str(cwd))
    result = lib.share(str(child))
    assert result.parent == lib.share(str(a1)).branch
    # A relative path with no sessions/ tail resolves only against the header's cwd.
    grand = make_child(a1, cwd / "grand.jsonl", "/nowhere/grand-parent.jsonl", str(cwd))
    child2 = make_child(grand, agent / "sessions" / "--x--" / "rel-000000000002.jsonl", "grand.jsonl",
                        str(cwd))
    with pytest.raises(NotFound, match="/nowhere/grand-parent.jsonl"):
        lib.share(str(child2))  # grand.jsonl was found next to cwd; its own parent is missing
    make_child(a1, grand, None, str(cwd))  # now a root
    assert lib.share(str(child2)).parent == lib.share(str(grand)).branch


def test_missing_parent_is_a_clear_error_and_no_lineage_shares_without(lib: Library, agent: Path) -> None:
    a1 = find(agent, A1)
    child = make_child(a1, agent / "sessions" / "--x--" / "orphan-00000001.jsonl",
                       "/gone/.pi/agent/sessions/--gone--/parent.jsonl", "/w")
    with pytest.raises(NotFound, match="/gone/.pi/agent/sessions/--gone--/parent.jsonl"):
        lib.share(str(child))
    assert lib.branches() == [] and not lib.paths.manifest.exists()
    result = lib.share(str(child), no_lineage=True)
    assert result.parent is None and result.ancestors == []


def test_cycle_is_detected_and_nothing_is_shared(lib: Library, agent: Path) -> None:
    a1 = find(agent, A1)
    d = agent / "sessions" / "--cycle--"
    x, y = d / "x-000000000001.jsonl", d / "y-000000000002.jsonl"
    make_child(a1, x, str(y), "/w")
    make_child(a1, y, str(x), "/w")
    with pytest.raises(LineageCycle, match="cycle"):
        lib.share(str(x))
    assert lib.branches(include_unshared=True) == []


def test_fork_and_parent_share_line_blobs(lib: Library, agent: Path) -> None:
    a3 = find(agent, A3)
    lib.share(str(a3))
    before, turns = stored_bytes(lib), lib.store.turn_count
    new_line = b'{"type":"message","id":"feedbeef","parentId":null,"message":{"role":"user","content":"x"}}\n'
    fork = make_child(a3, agent / "sessions" / "--x--" / "fork-00000000a3.jsonl", str(a3), "/w", new_line)
    result = lib.share(str(fork))
    growth = stored_bytes(lib) - before
    assert lib.store.turn_count - turns == 3  # the new line, the header, the sidecar: the rest is shared
    assert fork.stat().st_size > 1_400_000
    assert growth < 3000  # the new header, one new line and a sidecar; the 1.4 MB of images are shared
    assert lib.session_bytes(result.src) == fork.read_bytes()
    parent_lines = {r.hash for r in lib.line_manifest(lib.branch(result.parent).src)}
    fork_lines = [r.hash for r in lib.line_manifest(result.src)]
    assert sum(h in parent_lines for h in fork_lines) == len(fork_lines) - 2


def test_a_shared_versions_manifest_is_the_one_its_import_met(lib: Library, agent: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The manifest a node serves right after a share (a fetch asks for it next) is made from
    the lines the import met, in small batches and with a fork's lines taken from its parent's
    turns: the file's lines, in order, with no walk of the version's turns and no blob index
    lookup per line."""
    monkeypatch.setattr("p2pnode.library.sessions.BATCH_LINES", 7)
    a3 = find(agent, A3)
    new_line = b'{"type":"message","id":"feedbeef","parentId":null,"message":{"role":"user","content":"x"}}\n'
    fork = make_child(a3, agent / "sessions" / "--x--" / "fork-00000000a3.jsonl", str(a3), "/w", new_line)
    shared = lib.share(str(fork))
    with monkeypatch.context() as m:
        m.setattr(lib.store, "chain", lambda turn_id: pytest.fail(f"store.chain({turn_id})"))
        m.setattr(lib.store, "raw_lengths", lambda hashes: pytest.fail("raw_lengths"))
        for src, path in ((shared.src, fork), (lib.branch(shared.parent or "").src, a3)):
            assert [(r.hash, r.length) for r in lib.line_manifest(src)] == [
                (blake3.blake3(x).digest(), len(x)) for x in path.read_bytes().splitlines(keepends=True)]


def test_a_grown_versions_manifests_come_from_its_new_turns(lib: Library, agent: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """What a serving node answers for `?after=` of a grown version: its manifest extends the
    older version's cached one and `line_manifest_after` matches them by their shared turns,
    both without walking a whole chain (store.chain refused); the same answers as from the
    file.  A held version that merely has the same lines (imported apart) is matched by hashes."""
    b1 = find(agent, B1)
    first = lib.share(str(b1))
    v1 = lib.line_manifest(first.src)  # cached, as a node that served it has it
    with open(b1, "ab") as f:
        f.write(b"".join(b'{"type":"message","id":"%08x","n":%d}\n' % (i, i) for i in range(5)))
    second = lib.share(str(b1))
    with monkeypatch.context() as m:
        m.setattr(lib.store, "chain", lambda turn_id: pytest.fail(f"store.chain({turn_id})"))
        v2 = lib.line_manifest(second.src)
        assert lib.line_manifest_after(second.src, [first.src]) == (first.src, len(v1))
    assert v2[:len(v1)] == v1
    assert [(r.hash, r.length) for r in v2] == [(blake3.blake3(x).digest(), len(x))
                                                for x in b1.read_bytes().splitlines(keepends=True)]
    assert lib.line_manifest_after(second.src, [second.src]) is None


def test_reshare_after_growth_appends_only_new_lines(lib: Library, agent: Path) -> None:
    b1 = find(agent, B1)
    first = lib.share(str(b1))
    turns, blobs = lib.store.turn_count, len(lib.store.blob_hashes())
    new = b"".join(b'{"type":"message","id":"%08x","parentId":null,"n":%d}\n' % (i, i) for i in range(5))
    partial = b'{"type":"message","id":"partial"'
    with open(b1, "ab") as f:
        f.write(new + partial)  # Pi is mid-append: the last line is incomplete
    second = lib.share(str(b1))
    complete = b1.read_bytes()[: -len(partial)]  # only complete lines are shared, and the user is told
    assert second.src == blake3.blake3(complete).hexdigest() != first.src
    assert second.size == len(complete) and lib.session_bytes(second.src) == complete
    assert any(f"the {len(partial)} bytes after the last newline" in w for w in second.warnings)
    assert lib.store.turn_count - turns == 5 + 1 + 1  # 5 line turns, the header turn, the sidecar turn
    assert len(lib.store.blob_hashes()) - blobs == 5 + 1  # 5 lines and the sidecar
    old_body = lib.sessions.body_turns(first.src)
    new_body = lib.sessions.body_turns(second.src)
    assert new_body[: len(old_body)] == old_body  # the old version's turns, shared, not copied
    with open(b1, "ab") as f:
        f.write(b',"parentId":null}\n')  # the partial line is completed
    third = lib.share(str(b1))
    assert lib.session_bytes(third.src) == b1.read_bytes() and third.warnings == []
    assert lib.sessions.body_turns(third.src)[:-1] == new_body
    assert third.lines == second.lines + 1 and third.size == b1.stat().st_size


def test_rewritten_file_is_detected_and_stored_in_full(lib: Library, agent: Path) -> None:
    b1 = find(agent, B1)
    original = b1.read_bytes()
    first = lib.share(str(b1))
    migrated = original.replace(b'"version":3', b'"version":4', 1) + b'{"type":"custom","id":"x1"}\n'
    with open(b1, "r+b") as f:  # in place, as Pi's writeFileSync rewrites on migration
        f.write(migrated)
    second = lib.share(str(b1))
    assert second.src == hash_file(b1)
    assert lib.session_bytes(second.src) == migrated
    assert lib.session_bytes(first.src) == original  # nothing already stored is lost
    assert set(lib.sessions.body_turns(second.src)).isdisjoint(lib.sessions.body_turns(first.src))


@pytest.mark.parametrize("kind", ["missing", "empty", "not-a-header", "directory"])
def test_bad_input_changes_nothing(lib: Library, agent: Path, kind: str) -> None:
    target = agent / "sessions" / "--bad--" / "bad.jsonl"
    target.parent.mkdir(parents=True)
    expected: type[Exception] = InvalidHeader
    if kind == "missing":
        expected = NotFound
    elif kind == "empty":
        target.write_bytes(b"")
    elif kind == "not-a-header":
        target.write_bytes(b'{"type":"message","id":"1"}\n{"type":"message","id":"2"}\n')
    else:
        target.mkdir()
        expected = InvalidInput
    with pytest.raises(expected, match=str(target)):
        lib.share(str(target))
    assert lib.branches(include_unshared=True) == [] and lib.store.turn_count == 0
    state = json.loads((lib.paths.home / "sessions.json").read_bytes())  # written empty at open
    assert not lib.paths.manifest.exists() and state["sessions"] == state["branches"] == {}


def test_a_line_that_is_not_json_is_shared_verbatim_with_a_warning(lib: Library, agent: Path) -> None:
    a1 = find(agent, A1)
    glued = b'{"type":"message","id":"baf6cdfa","pare{"type":"message","id":"41ca3103","parentId":"x"}\n'
    crlf = b'{"type":"custom","id":"0d0a0d0a","parentId":null,"data":{}}\r\n'  # JSON to JSON.parse too
    deep = b'{"type":"custom","data":' + b"[" * 1500 + b"]" * 1500 + b"}\n"  # past simdjson's 1024 levels
    with open(a1, "ab") as f:
        f.write(glued + b"plain text\n" + crlf + deep)
    result = lib.share(str(a1))
    assert lib.session_bytes(result.src) == a1.read_bytes()
    assert len(result.warnings) == 2 and "line 18 is not JSON" in result.warnings[0]
    assert "line 19 is not JSON" in result.warnings[1]


def test_share_by_id_prefix_and_latest(lib: Library, agent: Path) -> None:
    a1 = find(agent, A1)
    assert lib.share("01a1ff93-0313-7475-8d45-88a780e9fa37").path == str(a1)
    assert lib.share("01a1ff93-0313").path == str(a1)
    with pytest.raises(InvalidInput, match="matches"):
        lib.share("01a1ff93")
    custom = agent / "sessions" / "--tmp-pi-harness-work-alpha--" / "my-custom-name.jsonl"
    assert lib.share("01a1ff93-49eb").path == str(custom)  # keyed by header id, not by file name
    newest = find(agent, A6)
    for f in newest.parent.glob("*.jsonl"):
        f.touch()
    newest_ns = newest.stat().st_mtime_ns + 10**9
    os.utime(newest, ns=(newest_ns, newest_ns))
    assert lib.share(latest=True, cwd="/tmp/pi-harness/work/alpha").path == str(newest)


def test_unshare_catalog_and_offered_objects(lib: Library, agent: Path) -> None:
    child = lib.share(str(find(agent, A6)))
    parent = child.ancestors[0]
    catalog = lib.catalog()
    assert {b.branch for b in catalog.branches} == {child.branch, parent.branch}
    refs = lib.line_manifest(child.src)
    assert sum(r.length for r in refs) == child.size and len(refs) == child.lines
    assert lib.offered_object(child.branch) == "sidecar"
    assert lib.offered_object(child.src) == "session"
    assert lib.offered_object(refs[3].hash.hex()) == "line"
    assert lib.line(refs[0].hash) == find(agent, A6).read_bytes().split(b"\n", 1)[0] + b"\n"

    lib.unshare(child.branch[:10])
    assert lib.catalog().generation > catalog.generation
    assert [b.branch for b in lib.branches()] == [parent.branch]
    assert not lib.branch(child.branch).offered and lib.has_branch(child.branch)
    assert lib.offered_object(child.branch) is None and lib.offered_object(child.src) is None
    assert lib.offered_object(refs[0].hash.hex()) is None  # the fork's own header line
    assert lib.offered_object(refs[3].hash.hex()) == "line"  # still reachable from the parent
    assert lib.session_bytes(child.src) == find(agent, A6).read_bytes()  # the bytes stay
    generation = lib.catalog().generation
    lib.share(str(find(agent, A6)))
    assert lib.branch(child.branch).offered and lib.catalog().generation > generation


def test_add_fetched_verifies_then_offers(lib: Library, agent: Path, tmp_path: Path) -> None:
    shared = lib.share(str(find(agent, A6)))
    sidecar = lib.sidecar_bytes(shared.branch)
    lines = [lib.line(r.hash) for r in lib.line_manifest(shared.src)]
    with Library.open(NodePaths(tmp_path / "other"), agent_dir=tmp_path / "other-agent") as other:
        with pytest.raises(VerificationFailed):
            other.add_fetched(sidecar, [*lines[:-1], lines[-1] + b"x"])
        with pytest.raises(InvalidSidecar):
            other.add_fetched(sidecar.replace(b'"version":1', b'"version":9'), lines)
        assert other.branches(include_unshared=True) == [] and other.store.turn_count == 0
        info = other.add_fetched(sidecar, lines)  # its parent is not held here: allowed
        assert info.branch == shared.branch and info.parent == shared.parent and not info.offered
        assert other.session_bytes(shared.src) == find(agent, A6).read_bytes()
        assert other.lineage(shared.branch) == [info]
        writes = []
        with pytest.MonkeyPatch.context() as m:  # fetched again: recorded, still not offered, in one write
            m.setattr(sessions_module, "_write_state", lambda path, state: writes.append(state))
            assert not other.add_fetched(sidecar, lines).offered
        assert len(writes) == 1
        turns = other.store.turn_count
        grown = [*lines, b'{"type":"message","id":"new1"}\n']
        grown_sidecar = Sidecar(blake3.blake3(b"".join(grown)).hexdigest(), shared.parent)
        other.add_fetched(grown_sidecar.encode(), grown)
        assert other.store.turn_count - turns == 3  # the new line, the header and the sidecar


def test_add_fetched_keeps_the_peers_compressed_bytes(lib: Library, agent: Path, tmp_path: Path) -> None:
    """Lines that come with their blob as the peer stored it are kept in exactly those bytes
    (not compressed again); a blob that does not decode to its line is refused, and lines
    not cut at the newlines are refused, each before anything becomes visible."""
    shared = lib.share(str(find(agent, A3)))
    sidecar = lib.sidecar_bytes(shared.branch)
    lines = [lib.line(r.hash) for r in lib.line_manifest(shared.src)]
    cctx = zstandard.ZstdCompressor(level=19)  # not the level the store would pick: recognisable
    stored = [StoredBlob(blake3.blake3(x).digest(), 1, len(x), cctx.compress(x)) for x in lines]
    with Library.open(NodePaths(tmp_path / "other"), agent_dir=tmp_path / "other-agent") as other:
        bad = stored[5]
        lie = StoredBlob(bad.hash, 1, bad.raw_len, cctx.compress(lines[5][:-2] + b"X\n"))
        with pytest.raises(VerificationFailed, match=bad.hash.hex()):
            other.add_fetched(sidecar, lines, [*stored[:5], lie, *stored[6:]])
        with pytest.raises(InvalidInput, match="not the file cut at its newlines"):
            other.add_fetched(sidecar, [lines[0] + lines[1], *lines[2:]])
        assert other.branches(include_unshared=True) == []
        other.add_fetched(sidecar, lines, stored)
        assert other.session_bytes(shared.src) == find(agent, A3).read_bytes()
        for blob in stored:
            kept = other.store.get_stored_blob(blob.hash)
            assert (kept.codec, kept.stored) == (1, blob.stored)


@pytest.mark.parametrize("chunk", [1, 4099])
def test_lines_cut_by_read_chunks_are_stored_whole(agent: Path, tmp_path: Path, chunk: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The file is read in chunks that cut lines anywhere; every turn is still one whole line."""
    monkeypatch.setattr("p2pnode.pi.hashing.CHUNK", chunk)
    path = find(agent, A6)
    with Library.open(NodePaths(tmp_path / "node"), agent_dir=agent) as lib:
        result = lib.share(str(path))
        lines = path.read_bytes().splitlines(keepends=True)
        assert [lib.line(r.hash) for r in lib.line_manifest(result.src)] == lines
        assert lib.session_bytes(result.src) == path.read_bytes()


def _image_session(path: Path, image_bytes: int) -> Path:
    """A header and one user message holding a random image of `image_bytes`, base64 (zstd
    keeps it at 0.75: stored compressed)."""
    sid = "01a1ff93-0000-7000-8000-" + str(image_bytes).rjust(12, "0")
    image = base64.b64encode(os.urandom(image_bytes)).decode()
    content = [{"type": "image", "mimeType": "image/png", "data": image}]
    header = {"type": "session", "version": 3, "id": sid, "timestamp": "2026-11-21T19:00:00Z", "cwd": "/w"}
    lines = [header,
             {"type": "message", "id": "a1", "parentId": None, "timestamp": "2026-11-21T19:00:01.000Z",
              "message": {"role": "user", "content": content}}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.skipif(not Path("/proc/self/status").exists(),
                    reason=KERNEL_LIMITATION + "no /proc/<pid>/status (VmHWM) for a peak RSS: not Linux")
def test_a_huge_line_is_shared_holding_it_about_twice(tmp_path: Path) -> None:
    """`share` of a 64 MB line (the one-shot CLI) peaks at under 2.4 times the line above a
    share of a small session: the splitter's pieces and their join, or the line and its
    compressed record, never three copies (the secret scan kept a copy of its own, the pack
    write joined the record into one bytes: 2.9 times, 827 MB for a 200 MB line)."""
    peaks, sizes = {}, {}
    for name, image in (("small", 1_000), ("huge", 48_000_000)):
        path = _image_session(tmp_path / f"2026-11-21T19-00-00-000Z_{name}.jsonl", image)
        node = Node(tmp_path, name)
        proc = subprocess.run([PY, "-c", PEAK_RSS, "share", str(path), "--json"], env=node.env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        peaks[name], sizes[name] = peak_kb(proc.stderr) * 1000, path.stat().st_size
        assert node.run("fsck").returncode == 0
    assert peaks["huge"] - peaks["small"] < 2.4 * sizes["huge"], (peaks, sizes)


def test_state_survives_reopen_and_a_corrupt_state_is_refused(agent: Path, tmp_path: Path) -> None:
    paths = NodePaths(tmp_path / "node")
    with Library.open(paths, agent_dir=agent) as lib:
        result = lib.share(str(find(agent, B5)))
        generation = lib.catalog().generation
    with Library.open(paths, agent_dir=agent) as lib:
        assert lib.catalog().generation == generation
        assert lib.session_bytes(result.src) == find(agent, B5).read_bytes()
        assert lib.share(str(find(agent, B5))).branch == result.branch
    state = paths.home / "sessions.json"
    state.write_bytes(state.read_bytes()[:50])
    from p2pnode.library.sessions import StateCorrupt

    with pytest.raises(StateCorrupt, match="sessions.json"):
        Library.open(paths, agent_dir=agent)
    assert len(state.read_bytes()) == 50  # left as it was, for inspection


def test_a_damaged_store_never_serves_wrong_bytes(agent: Path, tmp_path: Path) -> None:
    paths = NodePaths(tmp_path / "node")
    with Library.open(paths, agent_dir=agent) as lib:
        result = lib.share(str(find(agent, A1)))
    pack = paths.store / "blobs.pack"
    data = bytearray(pack.read_bytes())
    data[len(data) // 2] ^= 0x40  # inside one of A1's compressed lines
    pack.write_bytes(bytes(data))
    with Library.open(paths, agent_dir=agent) as lib, pytest.raises(VerificationFailed, match=result.src):
        lib.session_bytes(result.src)


@pytest.mark.parametrize("touched", [False, True], ids=["as it was", "touched"])
@pytest.mark.parametrize("damage", ["bit flipped, then fsck --repair", "pack cut short", "pack emptied"])
def test_sharing_the_file_again_restores_lines_the_store_lost(agent: Path, tmp_path: Path,
                                                              damage: str, touched: bool) -> None:
    """A line fsck reports damaged (and `--repair` drops), or lost with a pack cut short or
    emptied, is put back by sharing the file again (each line checked against its hash), where
    that share had reported success and left the branch unreadable; also when the file's stat
    changed (touched, copied, restored from a backup: it is hashed again, its bytes the same)."""
    from store.fsck import fsck

    paths = NodePaths(tmp_path / "node")
    source = find(agent, A1)
    with Library.open(paths, agent_dir=agent) as lib:
        result = lib.share(str(source))
    pack = paths.store / "blobs.pack"
    data = bytearray(pack.read_bytes())
    if damage.startswith("bit"):
        data[len(data) // 2] ^= 0x40
        pack.write_bytes(bytes(data))
        assert fsck(paths.store, repair=True).repaired
    else:
        pack.write_bytes(bytes(data[: len(data) // 2 if damage == "pack cut short" else 0]))
    if touched:
        os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 10**9))
    with Library.open(paths, agent_dir=agent) as lib:
        with pytest.raises(VerificationFailed):
            lib.session_bytes(result.src)
        assert lib.share(str(source)).branch == result.branch
        assert lib.session_bytes(result.src) == source.read_bytes()
    assert fsck(paths.store).ok


def test_manifest_survives_concurrent_writers(tmp_path: Path) -> None:
    """Four processes each record 40 branches at once; the flock keeps every one of them."""
    script = (
        "import sys; from pathlib import Path; from p2pnode.library.manifest import Manifest\n"
        "m = Manifest(Path(sys.argv[1]))\n"
        "for i in range(40): m.record(f'{int(sys.argv[2]):02x}{i:062x}', f'/s/{sys.argv[2]}/{i}.jsonl')\n"
    )
    path = tmp_path / "manifest.json"
    procs = [subprocess.Popen([sys.executable, "-c", script, str(path), str(n)]) for n in range(4)]
    assert all(p.wait(timeout=60) == 0 for p in procs)
    data = json.loads(path.read_text())
    assert len(data) == 160 and data[f"03{39:062x}"] == "/s/3/39.jsonl"


def test_corrupt_manifest_is_never_overwritten(lib: Library, agent: Path) -> None:
    lib.paths.manifest.write_text("{not json")
    with pytest.raises(ManifestCorrupt, match="manifest.json"):
        lib.share(str(find(agent, A1)))
    assert lib.paths.manifest.read_text() == "{not json"


def test_leftovers_of_a_crashed_import_are_dropped_on_open(agent: Path, tmp_path: Path) -> None:
    from p2pnode.library.sessions import TAG_LINE
    from store.types import TurnInput

    paths = NodePaths(tmp_path / "node")
    with Library.open(paths, agent_dir=agent) as lib:
        shared = lib.share(str(find(agent, A6)))
        cut_short = lib.store.create_context().context_id  # what a SIGKILL mid-import leaves
        lib.store.append_turns(cut_short, [TurnInput(b'{"a":1}\n', TAG_LINE)])
        foreign = lib.store.create_context().context_id  # another user of the store: untouched
        lib.store.append_turn(foreign, b"not ours", type_tag=7)
        before = {h.context_id for h in lib.store.list_contexts()}
    with Library.open(paths, agent_dir=agent) as lib:
        after = {h.context_id for h in lib.store.list_contexts()}
        assert after == before - {cut_short} and foreign in after
        assert lib.session_bytes(shared.src) == find(agent, A6).read_bytes()


line_bytes = st.binary(max_size=60).map(lambda b: b.replace(b"\n", b"")).map(lambda b: b"{" + b + b"}\n")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first=st.lists(line_bytes, max_size=12), more=st.lists(st.lists(line_bytes, max_size=5), max_size=3),
       cut=st.integers(min_value=0, max_value=40), fork_at=st.integers(min_value=0, max_value=12))
def test_any_growth_and_fork_reconstructs_exactly(tmp_path: Path, first: list[bytes], more: list[list[bytes]],
                                                   cut: int, fork_at: int) -> None:
    """Whatever the lines, partial tails and growth steps: every version reads back byte-exact
    (its complete lines: a partial tail waits for the next share), and a fork (new header + a
    prefix of the body) reads back exact too."""
    with tempfile.TemporaryDirectory(dir=tmp_path) as d:
        root = Path(d)
        header = b'{"type":"session","version":3,"id":"h1","timestamp":"t","cwd":"/w"}\n'
        f = root / "s.jsonl"
        data = header + b"".join(first)
        if 0 < cut < len(data) - len(header):
            data = data[:-cut]  # Pi mid-append: the last line may be cut short
        f.write_bytes(data)
        with Library.open(NodePaths(root / "node"), agent_dir=root / "agent") as lib:
            versions = [lib.share(str(f))]
            for step in more:
                with open(f, "ab") as out:
                    out.write(b"".join(step))
                versions.append(lib.share(str(f)))
            final = f.read_bytes()
            for v in versions:  # every earlier version reads back as the prefix it was
                assert final[: v.size] == lib.session_bytes(v.src)
            assert lib.session_bytes(versions[-1].src) == _complete(final)
            body = f.read_bytes()[len(header):].split(b"\n")
            fork = root / "fork.jsonl"
            fork.write_bytes(b'{"type":"session","version":3,"id":"h2","timestamp":"t","cwd":"/w",'
                             b'"parentSession":"' + str(f).encode() + b'"}\n' + b"\n".join(body[:fork_at]))
            forked = lib.share(str(fork))
            assert forked.parent == versions[-1].branch
            assert lib.session_bytes(forked.src) == _complete(fork.read_bytes())
            lengths = [len(x) for x in _split(_complete(fork.read_bytes()))]
            assert [r.length for r in lib.line_manifest(forked.src)] == lengths


def _split(data: bytes) -> list[bytes]:
    parts = data.split(b"\n")
    return [p + b"\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def _complete(data: bytes) -> bytes:
    return data[: data.rfind(b"\n") + 1]


@pytest.mark.parametrize(("line", "is_json"), [
    (b'{"type":"message","id":"1"}\n', True),
    (b'{"type":"message","id":"1"}', True),  # a last line without its newline
    (b'{"n":18446744073709552000}\n', True),  # over 64 bits (JS writes 2**64 so): json.loads takes it
    (b'{"x":NaN}\n', True),  # json.loads takes it (Python's own JSON)
    (b'{"type":"message","id":"baf6","pare{"type":"m"}\n', False),  # glued lines of a half-copied file
    (b'{"a":1}{"b":2}\n', False),
    (b'{"a":"\xff"}\n', False),  # not UTF-8
    (b'{"a":1\n', False),
    (b"plain text\n", False),
])
def test_the_json_check_of_a_line_is_json_loads(line: bytes, is_json: bool) -> None:
    import json

    import simdjson

    from p2pnode.library.sessions import _is_json

    parser = simdjson.Parser()
    assert _is_json(line, parser) is is_json
    assert _is_json(line, parser) is is_json  # the parser is used again
    try:
        json.loads(line)
        expected = True
    except ValueError:
        expected = False
    assert expected is is_json


def test_a_missing_state_file_beside_a_store_that_holds_sessions_deletes_nothing(lib: Library,
                                                                                 agent: Path) -> None:
    """sessions.json gone (a home restored without it, a sync tool): every context looked like a
    crash's leftover and was deleted at the next open, and the next `gc` freed all the data.
    Now the library refuses to open, changes nothing, and works again once the file is back."""
    info = lib.share(str(find(agent, A1)))
    paths, contexts = lib.paths, len(lib.store.list_contexts())
    lib.close()
    state = paths.home / "sessions.json"
    kept = state.read_bytes()
    state.unlink()
    with pytest.raises(StateCorrupt, match="is missing, but the store beside it holds"):
        Library.open(paths, agent_dir=agent)
    state.write_bytes(kept)
    with Library.open(paths, agent_dir=agent) as again:
        assert len(again.store.list_contexts()) == contexts
        assert again.session_bytes(info.src) == find(agent, A1).read_bytes()
