"""`share` and the secret scan: refused when a session or its lineage holds a key (nothing
offered), `--allow-secrets` marks what it shared, `--redact` shares a redacted copy; on real
Pi files from tests/data, through the library, the CLI as a real process, and a running node."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from pifork import find
from procnode import PEAK_RSS, PY, Node, peak_kb
from secretkeys import PLANTED, plant
from skips import KERNEL_LIMITATION

from p2pnode.library import api
from p2pnode.library.api import Library
from p2pnode.paths import NodePaths
from p2pnode.pi import secrets
from p2pnode.pi.hashing import hash_file
from p2pnode.pi.session import read_header, session_file_name

DATA = Path(__file__).resolve().parents[1] / "data"
B1 = "*4f3f-74a0-8c1a-0b533764bed8.jsonl"  # pi 0.73.1 beta root
B5 = "*69ef-76bb-aaf0-d291c98d9fe0.jsonl"  # new_session{parentSession: B3}; B3 -> B2 -> B1
TOOLRESULT_FILE = "*a271-70bf-bc80-66a3334c5c30.jsonl"  # pi 1.5.2 alpha: bash tool results


def copy_corpus(corpus: str, tmp_path: Path) -> Path:
    agent = tmp_path / "agent"
    shutil.copytree(DATA / corpus / "sessions", agent / "sessions")
    for f in agent.rglob("*.jsonl"):
        f.chmod(0o644)
    return agent


@pytest.fixture
def agent(tmp_path: Path) -> Path:
    return copy_corpus("pi-corpus-0.73.1", tmp_path)


def plant_all(path: Path) -> None:
    """Every kind of key, spread over the tool results, user messages and bash commands."""
    data = path.read_bytes()
    for i, (_, value) in enumerate(PLANTED):
        data = plant(data, ("toolResult", "user", "bash")[i % 3], value)[0]
    path.write_bytes(data)


@pytest.mark.parametrize("corpus", ["pi-corpus-0.73.1", "pi-corpus-1.5.2"])
def test_every_file_of_both_corpora_shares_with_no_finding(corpus: str, tmp_path: Path) -> None:
    agent = copy_corpus(corpus, tmp_path)
    files = sorted((agent / "sessions").rglob("*.jsonl"))
    with Library.open(NodePaths(tmp_path / "node"), agent_dir=agent) as lib:
        for path in files:
            result = lib.share(str(path), no_lineage=True)
            assert result.secrets == [] and result.redacted_from is None and not result.secrets_allowed
        assert all(not b.secrets_allowed for b in lib.branches())
        assert {b.path for b in lib.branches()} >= {str(p) for p in files}


def test_refused_when_the_session_holds_keys_and_nothing_is_offered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The import's scan of the bytes as it reads them is what refuses (the stored bytes are
    not read again for it)."""
    agent = copy_corpus("pi-corpus-1.5.2", tmp_path)
    path = find(agent, TOOLRESULT_FILE)
    plant_all(path)
    with Library.open(NodePaths(tmp_path / "node"), agent_dir=agent) as lib:
        generation = lib.catalog().generation
        monkeypatch.setattr(lib, "session_runs", lambda src: pytest.fail("read again to scan"))
        with pytest.raises(secrets.SecretsFound) as refused:
            lib.share(str(path))
        assert sorted(f.kind for _, f in refused.value.found) == sorted(k for k, _ in PLANTED)
        assert refused.value.exit_code == 4
        text = str(refused.value)
        for _, value in PLANTED:
            assert value not in text
        assert lib.branches(include_unshared=True) == [] and lib.catalog().generation == generation


def test_refused_when_an_ancestor_holds_a_key(lib: Library, agent: Path) -> None:
    """The scan covers the lineage share would offer: a key in B1 refuses sharing B5."""
    root = find(agent, B1)
    kind, value = PLANTED[0]
    data, line_no, _ = plant(root.read_bytes(), "user", value)
    root.write_bytes(data)
    with pytest.raises(secrets.SecretsFound) as refused:
        lib.share(str(find(agent, B5)))
    [(where, finding)] = refused.value.found
    assert (where, finding.kind, finding.line) == (str(root), kind, line_no)
    assert lib.branches(include_unshared=True) == []


def test_refused_when_a_known_ancestor_offered_again_holds_a_key(agent: Path, tmp_path: Path) -> None:
    """A held ancestor that share would offer again (unshared since) is scanned from the store."""
    root = find(agent, B1)
    data = plant(root.read_bytes(), "user", PLANTED[4][1])[0]
    root.write_bytes(data)
    with Library.open(NodePaths(tmp_path / "node"), agent_dir=agent) as lib:
        shared = lib.share(str(root), allow_secrets=True)
        lib.unshare(shared.branch)
        root.unlink()  # gone from disk: only the store's copy is left to offer
        with pytest.raises(secrets.SecretsFound):
            lib.share(str(find(agent, B5)))
        assert [b.branch for b in lib.branches()] == []


def test_a_refused_session_stays_refused_and_a_grown_one_is_scanned_from_where_it_grew(
        lib: Library, agent: Path) -> None:
    """The store keeps what a refused share imported, which must not make the next share skip
    the scan; a re-share scans only the new lines (scanned.json), with the right line numbers."""
    path = find(agent, B1)
    clean = path.read_bytes()
    first = lib.share(str(path))
    kind, value = PLANTED[5]
    grown_line = json.dumps({"type": "message", "id": "f00dcafe", "parentId": None, "message": {
        "role": "user", "content": [{"type": "text", "text": f"use {value} please"}]}}).encode() + b"\n"
    path.write_bytes(clean + grown_line)
    for _ in range(2):
        with pytest.raises(secrets.SecretsFound) as refused:
            lib.share(str(path))
        [(_, finding)] = refused.value.found
        assert (finding.kind, finding.line, finding.where) == (kind, clean.count(b"\n") + 1,
                                                               "message.content[0].text")
        assert finding.start == len(clean) + len(b'{"type": "message", "id": "f00dcafe", "parentId": null, '
                                                 b'"message": {"role": "user", "content": [{"type": "text", '
                                                 b'"text": "use ')
    assert [b.branch for b in lib.branches()] == [first.branch]


def test_allow_secrets_shares_and_marks(lib: Library, agent: Path) -> None:
    path = find(agent, B5)
    plant_all(find(agent, B1))
    result = lib.share(str(path), allow_secrets=True)
    assert len(result.secrets) == len(PLANTED)
    assert {s["file"] for s in result.secrets} == {str(find(agent, B1))}
    marked = {b.branch: b.secrets_allowed for b in lib.branches()}
    assert marked[result.ancestors[0].branch] is True and result.ancestors[0].secrets_allowed
    assert marked[result.branch] is False
    assert sum(marked.values()) == 1


def test_redact_shares_a_new_pi_session_identical_but_for_the_secrets(lib: Library, agent: Path) -> None:
    path = find(agent, B1)
    plant_all(path)
    original = path.read_bytes()
    result = lib.share(str(path), redact=True)
    assert path.read_bytes() == original and result.redacted_from == str(path)
    copy = Path(result.path or "")
    assert copy.parent == path.parent and copy != path
    header, old = read_header(copy), read_header(path)
    assert header.id != old.id and copy.name == session_file_name(old.timestamp or "", header.id)
    assert header.parent_session == old.parent_session is None and result.ancestors == []
    redacted = copy.read_bytes()
    assert secrets.scan(redacted) == [] and result.src == hash_file(copy)
    for _, value in PLANTED:
        assert json.dumps(value)[1:-1].encode() not in redacted
    before, after = original.split(b"\n"), redacted.split(b"\n")
    assert len(before) == len(after)
    assert after[0] == before[0].replace(old.id.encode(), header.id.encode())
    changed = 0
    for old_line, new_line in zip(before[1:], after[1:], strict=True):
        if old_line != new_line:
            changed += 1
            assert b"[REDACTED:" in new_line
            json.loads(new_line)
    assert changed == 3  # one tool result, one user message, one bash command
    assert [b.branch for b in lib.branches() if b.path == str(path)] == []


def test_redact_refused_for_the_lineage_names_the_copy_it_wrote(lib: Library, agent: Path) -> None:
    """Secrets in an ancestor, which --redact leaves as it is: refused, and the message says
    what to share with --no-lineage: the redacted copy it wrote (in Pi's folder, a session of
    its own), or the session itself when it had nothing to redact."""
    plant_all(find(agent, B1))
    child = find(agent, B5)
    with pytest.raises(secrets.SecretsFound) as refused:
        lib.share(str(child), redact=True)
    assert "share the session with --no-lineage" in str(refused.value)
    before = set(child.parent.iterdir())
    child.write_bytes(plant(child.read_bytes(), "user", PLANTED[0][1])[0])
    with pytest.raises(secrets.SecretsFound) as refused:
        lib.share(str(child), redact=True)
    [copy] = set(child.parent.iterdir()) - before
    assert f"share the redacted copy {copy} with --no-lineage" in str(refused.value)
    assert lib.share(str(copy), no_lineage=True).path == str(copy)


def test_redact_reads_in_runs_and_writes_what_redacting_the_whole_would(
        agent: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy is written in runs (here of 7 bytes: every secret read across runs) and is
    byte for byte the whole file redacted, its header's id replaced, a key in the header
    line (its cwd) included."""
    path = find(agent, B1)
    plant_all(path)
    key = next(value for kind, value in PLANTED if kind == "github-token")
    header, rest = path.read_bytes().split(b"\n", 1)
    path.write_bytes(header.replace(b'"cwd":"', b'"cwd":"/w ' + key.encode() + b" ", 1) + b"\n" + rest)
    original = path.read_bytes()
    monkeypatch.setattr(api, "SESSION_RUN", 7)
    with Library.open(NodePaths(tmp_path / "node"), agent_dir=agent) as lib:
        copy = Path(lib.share(str(path), redact=True).path or "")
    old_id, new_id = read_header(path).id, read_header(copy).id
    whole = secrets.redact(original, secrets.scan(original))
    assert copy.read_bytes() == whole.replace(old_id.encode(), new_id.encode(), 1)
    assert b"[REDACTED:github-token]" in copy.read_bytes().split(b"\n", 1)[0]


@pytest.mark.skipif(not Path("/proc/self/status").exists(),
                    reason=KERNEL_LIMITATION + "no /proc/<pid>/status (VmHWM) for a peak RSS: not Linux")
def test_redact_of_a_big_session_in_bounded_memory(agent: Path, tmp_path: Path) -> None:
    """`share --redact` of a 40 MB session peaks within 16 MB of `share --allow-secrets` of
    the same file (which reads it in runs as it imports it); it held the session and its
    redacted copy whole (180 MB against 50)."""
    path = find(agent, B1)
    plant_all(path)
    header, rest = path.read_bytes().split(b"\n", 1)
    filler = json.dumps({"type": "custom", "customType": "pad", "data": "x" * 100_000}).encode() + b"\n"
    with path.open("wb") as f:
        f.write(header + b"\n" + rest)
        for _ in range(400):
            f.write(filler)
    peaks = {}
    for how in ("--allow-secrets", "--redact"):
        node = Node(tmp_path, how.strip("-"))
        proc = subprocess.run([PY, "-c", PEAK_RSS, "share", str(path), how, "--json"], env=node.env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        peaks[how] = peak_kb(proc.stderr)
    assert peaks["--redact"] < peaks["--allow-secrets"] + 16_000, peaks


def test_redact_with_nothing_to_redact_shares_the_file_itself(lib: Library, agent: Path) -> None:
    path = find(agent, B5)
    files = sorted(path.parent.iterdir())
    result = lib.share(str(path), redact=True)
    assert result.path == str(path.absolute()) and result.redacted_from is None
    assert sorted(path.parent.iterdir()) == files


# --- the CLI as a real process, with and without a running node ---------------------------


def _run(node: Node, *args: str) -> subprocess.CompletedProcess[str]:
    return node.run(*args, check=False)


def _listed(node: Node) -> list[dict]:
    return json.loads(node.run("ls", "--json", "--all").stdout)


def _cli_checks(node: Node, path: Path) -> None:
    plant_all(path)
    refused = _run(node, "share", str(path))
    assert refused.returncode == 4 and refused.stdout == ""
    lines = refused.stderr.splitlines()
    assert all(line.startswith("p2pnode: ") for line in lines)
    assert sum(f":{path.name}" in line or str(path) in line for line in lines) == len(PLANTED)
    assert "--redact" in refused.stderr and "--allow-secrets" in refused.stderr
    for _, value in PLANTED:
        assert value.split("\n")[0][8:] not in refused.stderr
    assert "sk-ant-…" in refused.stderr
    assert _listed(node) == []

    redacted = _run(node, "share", str(path), "--redact", "--json")
    assert redacted.returncode == 0, redacted.stderr
    shared = json.loads(redacted.stdout)
    assert "redacted copy" in redacted.stderr and shared["path"] in redacted.stderr
    assert secrets.scan(Path(shared["path"]).read_bytes()) == []

    allowed = _run(node, "share", str(path), "--allow-secrets")
    assert allowed.returncode == 0, allowed.stderr
    assert allowed.stderr.count("shared with --allow-secrets") == len(PLANTED)
    branch = allowed.stdout.splitlines()[0]  # then a ticket, when a node runs
    marks = {b["branch"]: b["secrets_allowed"] for b in _listed(node)}
    assert marks == {branch: True, shared["branch"]: False}
    assert "(secrets allowed)" in node.run("ls").stdout
    assert "--allow-secrets" in node.run("show", branch).stdout


def test_cli_refuses_with_exit_4_then_redacts_and_allows(tmp_path: Path, corpus_new_dir: Path) -> None:
    node = Node(tmp_path, "a")
    shutil.copytree(corpus_new_dir / "sessions", node.agent / "sessions")
    _cli_checks(node, find(node.agent, TOOLRESULT_FILE))


def test_cli_through_a_running_node_passes_the_flags(tmp_path: Path, corpus_new_dir: Path) -> None:
    node = Node(tmp_path, "a")
    shutil.copytree(corpus_new_dir / "sessions", node.agent / "sessions")
    with node.node_running() as proc:
        _cli_checks(node, find(node.agent, TOOLRESULT_FILE))
        assert proc.poll() is None  # the node did the shares (the CLI could not open its store)


def test_a_fetched_session_shared_back_grown_is_scanned_in_its_file(
        agent: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A teammate's session fetched here (never scanned here), continued and shared back: the
    lines it was fetched with are scanned where they are, in the file (their hash checked
    first), not read back from the store line by line; findings in both parts keep their
    line numbers, and the fetched version's scan is remembered."""
    path = find(agent, B1)
    kind, value = PLANTED[2]
    data, line, _ = plant(path.read_bytes(), "user", value)
    path.write_bytes(data)
    with Library.open(NodePaths(tmp_path / "sender"), agent_dir=agent) as sender:
        shared = sender.share(str(path), allow_secrets=True)
        sidecar = sender.sidecar_bytes(shared.branch)
    mine = tmp_path / "mine" / "sessions" / "--w--" / path.name
    mine.parent.mkdir(parents=True)
    with Library.open(NodePaths(tmp_path / "receiver"), agent_dir=tmp_path / "mine") as lib:
        lib.add_fetched(sidecar, data.splitlines(keepends=True))
        grown_line = json.dumps({"type": "message", "id": "f00dcafe", "parentId": None, "message": {
            "role": "user", "content": [{"type": "text", "text": f"and {value} again"}]}}).encode() + b"\n"
        mine.write_bytes(data + grown_line)

        def no_read_back(self: Library, src: str) -> None:
            raise AssertionError("the fetched version read back from the store to scan it")

        monkeypatch.setattr(Library, "session_runs", no_read_back)
        with pytest.raises(secrets.SecretsFound) as refused:
            lib.share(str(mine))
        assert [(f.kind, f.line) for _, f in refused.value.found] == [
            (kind, line), (kind, data.count(b"\n") + 1)]
        assert shared.src in json.loads((tmp_path / "receiver" / "scanned.json").read_text())
