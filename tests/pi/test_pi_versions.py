"""The Pi people run today: pi 0.73.1 (@mariozechner) and pi 1.5.2 (@earendil-works) at once.

On the committed samples of both corpora: every file shares verbatim with its lineage
(1.5.2's non-UUID ids and their forks included), and a fetched session lands where both
versions' `pi -c` finds it.  The finders below follow the two versions' rules as the corpus
notes give them (pi 0.73.1 parses the first line within the first 512 bytes; pi 1.5.2 looks
for the header within the first 1 MiB); tests/pi/test_real_pi.py runs the real `pi` of both versions.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from procnode import Node

from p2pnode.library.api import SYSTEM_PROMPT_NOTICE, Library
from p2pnode.paths import NodePaths, PiDirs
from p2pnode.peer.trust import TrustStore
from p2pnode.pi import session as pisession
from p2pnode.pi.hashing import hash_file
from p2pnode.pi.placement import header_moved, pi_readable, place_session


def pi_0731_finds(session_dir: Path) -> Path | None:
    """pi 0.73.1 `-c` (`findMostRecentSession`): the newest file whose first line, within the
    first 512 bytes, is a header."""
    found = []
    for p in session_dir.glob("*.jsonl"):
        try:
            obj = json.loads(p.read_bytes()[:512].split(b"\n", 1)[0])
        except ValueError:
            continue
        if isinstance(obj, dict) and obj.get("type") == "session" and isinstance(obj.get("id"), str):
            found.append(p)
    return max(found, key=lambda p: p.stat().st_mtime_ns, default=None)


def pi_152_finds(session_dir: Path, cwd: str) -> Path | None:
    """pi 1.5.2 `-c`: the newest file with a header within the first 1 MiB (blank and malformed
    lines before it skipped) whose cwd is this one."""
    found = []
    for p in session_dir.glob("*.jsonl"):
        try:
            header = pisession.read_header(p)
        except pisession.InvalidInput:
            continue
        if header.cwd == cwd:
            found.append(p)
    return max(found, key=lambda p: p.stat().st_mtime_ns, default=None)


@pytest.fixture(params=["0.73.1", "1.5.2"])
def corpus(request: pytest.FixtureRequest, corpus_dir: Path, corpus_new_dir: Path) -> tuple[Path, dict]:
    d = corpus_dir if request.param == "0.73.1" else corpus_new_dir
    return d, json.loads((d / "manifest.json").read_text())


def test_every_file_shares_with_its_lineage_and_lands_where_both_pis_find_it(corpus, tmp_path: Path) -> None:
    source, manifest = corpus
    agent = tmp_path / "agent"
    shutil.copytree(source / "sessions", agent / "sessions")
    branch_of: dict[str, str] = {}
    with Library.open(NodePaths(tmp_path / "sharer"), agent_dir=agent) as lib, \
            Library.open(NodePaths(tmp_path / "fetcher"), agent_dir=tmp_path / "b-agent") as other:
        for entry in manifest["files"]:
            path = agent / entry["path"]
            result = lib.share(str(path))
            assert result.src == hash_file(path) == entry["blake3"] and result.size == entry["bytes"]
            assert result.header["id"] == entry["header"]["id"] and result.warnings == []
            branch_of[entry["path"]] = result.branch
        for entry in manifest["files"]:
            info = lib.branch(branch_of[entry["path"]])
            parent = entry["header"].get("parentSession")
            expected = None if parent is None else next(
                branch_of[e["path"]] for e in manifest["files"] if parent.endswith(e["path"]))
            assert info.parent == expected, entry["scenario"]

        for entry in manifest["files"]:  # fetched (stored, then placed) by another node
            info = lib.branch(branch_of[entry["path"]])
            for ancestor in reversed(lib.lineage(info.branch)):
                lines = [lib.line(r.hash) for r in lib.line_manifest(ancestor.src)]
                other.add_fetched(lib.sidecar_bytes(ancestor.branch), lines)
            placed = place_session(tmp_path / "b-agent", lib.session_bytes(info.src), info.src).path
            assert placed.read_bytes() == (source / entry["path"]).read_bytes()
            cwd = entry["header"]["cwd"]
            assert placed.parent.name == pisession.session_dir_name(cwd)
            newest = placed.stat().st_mtime_ns + 10**9
            os.utime(placed, ns=(newest, newest))  # the newest of its project, as after a fetch
            assert pi_0731_finds(placed.parent) == placed == pi_152_finds(placed.parent, cwd)
            assert other.lineage(info.branch)[0].branch == info.branch


def test_epsilon_ids_and_their_fork(corpus_new_dir: Path, corpus_new_manifest: dict, tmp_path: Path) -> None:
    """Non-UUID session ids (`--session-id my.session_1`) share, by id too, and their fork's
    parent is found."""
    agent = tmp_path / "agent"
    shutil.copytree(corpus_new_dir / "sessions", agent / "sessions")
    with Library.open(NodePaths(tmp_path / "n"), agent_dir=agent) as lib:
        fork = lib.share("fork-of-my.session_1")
        assert fork.header["id"] == "fork-of-my.session_1" and len(fork.ancestors) == 1
        assert fork.ancestors[0].header["id"] == "my.session_1"
        assert fork.notices == [SYSTEM_PROMPT_NOTICE]  # pi 1.5.2's system prompt: said once per node
        assert lib.share("my.session_1").notices == []
    with Library.open(NodePaths(tmp_path / "n"), agent_dir=agent) as lib:
        assert lib.share("my.session_1").notices == []  # remembered across runs


def test_a_long_id_shares_and_is_fetched(tmp_path: Path) -> None:
    """An id as long as the 255-byte file name allows goes through share and fetch; one byte
    longer is refused by share (peers could not place it) as by fetch."""
    a, b = Node(tmp_path, "a"), Node(tmp_path, "b")
    for x, y in ((a, b), (b, a)):
        TrustStore(NodePaths(x.home).trust).trust(y.id)
    timestamp = "2026-11-23T11:40:10.981Z"
    longest = "L" + "0123456789abcdef" * 13 + "-end"[: 255 - 31 - 1 - 16 * 13]
    longest = longest + "x" * (255 - len(pisession.session_file_name(timestamp, longest)))
    assert len(pisession.session_file_name(timestamp, longest)) == 255
    for session_id, ok in ((longest, True), (longest + "x", False)):
        header = {"type": "session", "version": 3, "id": session_id, "timestamp": timestamp, "cwd": "/w/p"}
        path = a.agent / "sessions" / "--w-p--" / f"{session_id[:100]}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        body = b'{"type":"model_change","id":"1","parentId":null}\n'
        path.write_bytes(json.dumps(header).encode() + b"\n" + body)
        proc = a.run("share", str(path), check=False)
        if not ok:
            assert proc.returncode == 4 and "peers could not place it" in proc.stderr
            continue
        branch = proc.stdout.split()[0]
        with a.serving() as port:
            got = b.fetch_json(branch, "--from", f"127.0.0.1:{port}")
        placed = Path(got["path"])
        assert placed.name == pisession.session_file_name(timestamp, session_id)
        assert placed.read_bytes() == path.read_bytes()


def test_a_header_after_skipped_lines_is_placed_first(tmp_path: Path, corpus_new_dir: Path) -> None:
    """A session whose header follows blank or malformed lines (pi 1.5.2 reads it) shares, and
    is placed with its header first (pi 0.73.1 reads only that)."""
    src_file = next((corpus_new_dir / "sessions").glob("*epsilon*/*_my.session_1.jsonl"))
    data = b"\n{broken\n" + src_file.read_bytes()
    path = tmp_path / "agent" / "sessions" / "--x--" / "s.jsonl"
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    with Library.open(NodePaths(tmp_path / "n"), agent_dir=tmp_path / "agent") as lib:
        result = lib.share(str(path))
        assert result.header["id"] == "my.session_1" and lib.session_bytes(result.src) == data
        placed = place_session(tmp_path / "b", data, result.src).path
    assert placed.read_bytes() == src_file.read_bytes().split(b"\n", 1)[0] + b"\n\n{broken\n" + \
        src_file.read_bytes().split(b"\n", 1)[1]
    cwd = result.header["cwd"]
    assert pi_0731_finds(placed.parent) == placed == pi_152_finds(placed.parent, cwd)
    assert not place_session(tmp_path / "b", data, result.src).written  # the same, placed again


def test_a_placed_path_too_long_for_the_system_is_bad_input(tmp_path: Path) -> None:
    """A fetch into a PI_CODING_AGENT_DIR so deep that the placed path is over PATH_MAX: exit 4
    with the path, one line, one-shot and through the node (exit 1, "the node failed" and a
    traceback in the node's log; one-shot, exit 1); the session is stored all the same."""
    a, b = Node(tmp_path, "a"), Node(tmp_path, "b")
    for x, y in ((a, b), (b, a)):
        TrustStore(NodePaths(x.home).trust).trust(y.id)
    header = {"type": "session", "version": 3, "id": "long-1", "timestamp": "2026-11-28T10:00:22.000Z",
              "cwd": "/" + "a" * 249}
    path = tmp_path / "s.jsonl"
    path.write_bytes(json.dumps(header).encode() + b'\n{"type":"message","id":"1","parentId":null}\n')
    branch = a.run("share", str(path)).stdout.split()[0]
    deep = tmp_path.joinpath(*["e" * 200] * (4000 // 201))
    deep.mkdir(parents=True)
    deep_env = dict(b.env, PI_CODING_AGENT_DIR=str(deep))
    log = tmp_path / "b-node.log"
    with a.serving() as port:
        for through_node in (False, True):
            with contextlib.ExitStack() as stack:
                if through_node:
                    stack.enter_context(b.node_running(log))
                proc = subprocess.run([sys.executable, "-m", "p2pnode", "fetch", branch, "--from",
                                       f"127.0.0.1:{port}"], env=deep_env, capture_output=True, text=True,
                                      timeout=60)
            assert proc.returncode == 4, (through_node, proc.stderr)
            assert proc.stderr.startswith(f"p2pnode: file name too long: {tmp_path}/eeee"), proc.stderr
            assert len(proc.stderr.splitlines()) == 1
    assert "Traceback" not in log.read_text()
    assert [r["branch"] for r in json.loads(b.run("ls", "--all", "--json").stdout)] == [branch]


def test_the_header_first_form_of_a_grown_version_extends_the_older_ones() -> None:
    """What lets a later version of a session placed header first replace the placed file: a
    version whose bytes extend an older one's has its header at the same line, so its header-first
    form extends the older one's, wherever the older one ends (after the header, inside a line,
    or inside the header line itself, whose newline the header-first form adds)."""
    header = b'{"type":"session","version":3,"id":"s-1","timestamp":"t","cwd":"/w"}\n'
    body = b'{"type":"message","id":"1"}\nnot json\n\n{"type":"message","id":"2"}\n'
    for before in (b"\n", b"{broken\n", b"\r\n\n{x\n"):
        grown = before + header + body
        assert header_moved(before.splitlines(keepends=True)[0])
        for cut in range(len(before) + len(header) - 1, len(grown) + 1):
            assert pi_readable(grown).startswith(pi_readable(grown[:cut])), (before, cut)
    assert not header_moved(header) and pi_readable(header + body) == header + body


def test_the_clis_pi_dirs_count_with_a_running_node(tmp_path: Path, corpus_new_dir: Path) -> None:
    """With `p2pnode serve` running (its own PI_CODING_AGENT_DIR), `share` by id finds the
    session in the CLI's agent dir, and `fetch --session-dir` places it in the CLI's dir."""
    a, b = Node(tmp_path, "a"), Node(tmp_path, "b")
    for x, y in ((a, b), (b, a)):
        TrustStore(NodePaths(x.home).trust).trust(y.id)
    cli_agent = tmp_path / "cli-agent"
    shutil.copytree(corpus_new_dir / "sessions", cli_agent / "sessions")
    cli_env = dict(a.env, PI_CODING_AGENT_DIR=str(cli_agent))
    with a.node_running(), b.node_running():
        proc = subprocess.run([sys.executable, "-m", "p2pnode", "share", "my.session_1", "--json"],
                              env=cli_env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        shared = json.loads(proc.stdout)
        assert shared["path"].startswith(str(cli_agent))
        assert "system prompt" in proc.stderr  # the one-time note
        status = json.loads(a.run("status", "--json").stdout)
        flat = tmp_path / "b-flat"
        got = b.fetch_json(shared["branch"], "--from", f"127.0.0.1:{status['port']}",
                           "--session-dir", str(flat))
        assert Path(got["path"]).parent == flat
        assert Path(got["path"]).read_bytes() == Path(shared["path"]).read_bytes()
        assert not (b.agent / "sessions").exists()  # Pi looks only in the session dir when one is set


def test_fetch_places_in_the_session_dir_from_the_environment(tmp_path: Path, corpus_new_dir: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """PI_CODING_AGENT_SESSION_DIR (~ expanded) is where a one-shot fetch places, flat."""
    a, b = Node(tmp_path, "a"), Node(tmp_path, "b")
    for x, y in ((a, b), (b, a)):
        TrustStore(NodePaths(x.home).trust).trust(y.id)
    src_file = next((corpus_new_dir / "sessions").glob("*epsilon*/*_my.session_1.jsonl"))
    branch = a.run("share", str(src_file)).stdout.split()[0]
    b.env.update(HOME=str(tmp_path / "home"), PI_CODING_AGENT_SESSION_DIR="~/flat")
    with a.serving() as port:
        got = b.fetch_json(branch, "--from", f"127.0.0.1:{port}")
    assert Path(got["path"]) == tmp_path / "home" / "flat" / src_file.name
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PI_CODING_AGENT_SESSION_DIR", "~/flat")
    assert PiDirs.resolve(str(tmp_path)).sessions == tmp_path / "home" / "flat"
