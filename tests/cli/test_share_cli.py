"""`p2pnode share/ls/show/cat/unshare` as real processes, with their own node home and agent dir."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procnode import Node
from skips import KERNEL_LIMITATION

from p2pnode.library.api import Library
from p2pnode.paths import NodePaths
from p2pnode.pi.hashing import hash_file
from p2pnode.pi.session import session_dir_name

B5 = "2026-11-21T19-26-53-423Z_01a1ff93-69ef-76bb-aaf0-d291c98d9fe0.jsonl"
BETA = "--tmp-pi-harness-work-beta--"


@pytest.fixture
def env(node_home: Path, tmp_path: Path, corpus_dir: Path) -> dict[str, str]:
    """The node_home fixture's environment, with the corpus copied into its (moved) agent dir."""
    agent = Path(os.environ["PI_CODING_AGENT_DIR"])
    shutil.copytree(corpus_dir / "sessions", agent / "sessions")
    for f in agent.rglob("*.jsonl"):
        f.chmod(0o644)
    return {**os.environ, "P2PNODE_HOME": str(node_home), "PI_CODING_AGENT_DIR": str(agent)}


def run(env: dict[str, str], *args: str, cwd: Path | None = None,
        check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "p2pnode", *args], env=env, cwd=cwd, capture_output=True,
                          timeout=60)
    if check and proc.returncode != 0:
        raise AssertionError(f"p2pnode {' '.join(args)} exited {proc.returncode}: {proc.stderr.decode()}")
    return proc


def agent_of(env: dict[str, str]) -> Path:
    return Path(env["PI_CODING_AGENT_DIR"])


def test_share_prints_the_branch_and_the_read_commands_agree(env: dict[str, str]) -> None:
    path = agent_of(env) / "sessions" / BETA / B5
    branch = run(env, "share", str(path)).stdout.decode().strip()
    assert len(branch) == 64 and all(c in "0123456789abcdef" for c in branch)

    shared = json.loads(run(env, "share", str(path), "--json").stdout)
    assert shared["branch"] == branch and shared["src"] == hash_file(path)
    assert shared["header"]["id"] == "01a1ff93-69ef-76bb-aaf0-d291c98d9fe0" and shared["size"] == 1317
    assert len(shared["ancestors"]) == 3 and shared["parent"] == shared["ancestors"][-1]["branch"]

    listed = json.loads(run(env, "ls", "--json").stdout)
    assert {b["branch"] for b in listed} == {branch, *(a["branch"] for a in shared["ancestors"])}
    assert "beta main line" in run(env, "ls").stdout.decode()

    shown = json.loads(run(env, "show", branch[:12], "--json").stdout)
    assert json.loads(shown["sidecar"]) == {"type": "branch", "version": 1, "src": shared["src"],
                                            "parent": shared["parent"]}
    ancestors = [a["branch"] for a in reversed(shared["ancestors"])]
    assert [b["branch"] for b in shown["lineage"]] == [branch, *ancestors]
    assert "<- this branch" in run(env, "show", branch).stdout.decode()

    assert run(env, "cat", branch[:10]).stdout == path.read_bytes()
    cat_json = json.loads(run(env, "cat", branch, "--json").stdout)
    assert "".join(cat_json["lines"]).encode() == path.read_bytes()

    assert json.loads(run(env, "unshare", branch, "--json").stdout) == {
        "branch": branch, "offered": False, "was_offered": True, "withdrawn": "unshared", "versions": [],
        "withheld": [], "live_stopped": []}
    everything = {b["branch"]: b for b in json.loads(run(env, "ls", "--all", "--json").stdout)}
    assert everything[branch]["offered"] is False and len(everything) == 4  # unshared, not deleted


def test_share_by_id_prefix_and_latest_of_cwd(env: dict[str, str], tmp_path: Path) -> None:
    agent = agent_of(env)
    by_prefix = json.loads(run(env, "share", "01a1ff93-69ef", "--json").stdout)
    assert by_prefix["path"] == str(agent / "sessions" / BETA / B5)
    project = tmp_path / "project"
    project.mkdir()
    d = agent / "sessions" / session_dir_name(str(project))
    d.mkdir()
    source = agent / "sessions" / BETA / B5
    older, newer = d / "a.jsonl", d / "b.jsonl"
    shutil.copy(source, older)
    header = json.loads(source.read_bytes().split(b"\n", 1)[0])
    header.update(id="01a1ff93-aaaa-7000-8000-000000000001", cwd=str(project))
    newer.write_bytes(json.dumps(header).encode() + b"\n" + source.read_bytes().split(b"\n", 1)[1])
    os.utime(older, ns=(10**18, 10**18))
    os.utime(newer, ns=(2 * 10**18, 2 * 10**18))
    for args in (("share", "--json"), ("share", "--latest", "--json")):
        assert json.loads(run(env, *args, cwd=project).stdout)["path"] == str(newer)


def test_bad_input_exit_codes_and_nothing_changes(env: dict[str, str], tmp_path: Path) -> None:
    header = b'{"type":"session","version":3,"id":"h1","timestamp":"t","cwd":"/w"}'
    cases = {"missing": (3, "does not exist"), "empty": (4, "is empty"),
             "not-a-header": (4, "Pi session header"), "directory": (4, "is a directory"),
             "blank-lines": (4, "has only blank lines in its first 1048576 bytes"),
             "unended-header": (4, f"no Pi session header among its complete lines: its last {len(header)} "
                                   "bytes end without a newline"),
             "unended-after-blank": (4, f"its last {len(header)} bytes end without a newline")}
    # "is empty" for the first two, "no Pi session header in its first 1048576 bytes" for the last
    for kind, (code, message) in cases.items():
        target = tmp_path / f"{kind}.jsonl"
        if kind == "empty":
            target.write_bytes(b"")
        elif kind == "blank-lines":
            target.write_bytes(b"\n" * (1 << 20) + header + b"\n")
        elif kind == "unended-header":
            target.write_bytes(header)
        elif kind == "unended-after-blank":
            target.write_bytes(b"\n" + header)
        elif kind == "not-a-header":
            target.write_bytes(b"hello\n")
        elif kind == "directory":
            target.mkdir()
        proc = run(env, "share", str(target), check=False)
        assert proc.returncode == code and proc.stdout == b"", kind
        assert message in proc.stderr.decode() and str(target) in proc.stderr.decode(), kind
    orphan = tmp_path / "orphan.jsonl"
    orphan.write_bytes(b'{"type":"session","version":3,"id":"x1","timestamp":"t","cwd":"/w",'
                       b'"parentSession":"/gone/sessions/--w--/p.jsonl"}\n')
    proc = run(env, "share", str(orphan), check=False)
    assert proc.returncode == 3 and "/gone/sessions/--w--/p.jsonl" in proc.stderr.decode()
    assert "--no-lineage" in proc.stderr.decode()
    assert json.loads((Path(env["P2PNODE_HOME"]) / "sessions.json").read_bytes())["branches"] == {}  # none
    assert run(env, "share", str(orphan), "--no-lineage").returncode == 0


def test_a_bad_config_value_fails_the_share_naming_file_key_and_value(env: dict[str, str]) -> None:
    """One line, exit 4, nothing offered (a typo in the settings is not silently no expiry)."""
    config = Path(env["P2PNODE_HOME"]) / "config.json"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text('{"share_expires": "fortnight"}')
    path = agent_of(env) / "sessions" / BETA / B5
    proc = run(env, "share", str(path), check=False)
    err = proc.stderr.decode()
    assert proc.returncode == 4 and err.count("p2pnode: ") == 1, err
    assert f"{config}: share_expires 'fortnight': a number and a unit" in err, err
    assert json.loads(run(env, "ls", "--json").stdout) == []


def test_unknown_branches_and_bad_hashes(env: dict[str, str]) -> None:
    proc = run(env, "show", "ab" * 32, check=False)
    assert proc.returncode == 3 and "ab" * 32 in proc.stderr.decode()
    proc = run(env, "unshare", "not-hex", check=False)
    assert proc.returncode == 4 and "not a branch hash" in proc.stderr.decode()


def test_a_line_that_is_not_json_warns_on_stderr(env: dict[str, str], tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    path.write_bytes(b'{"type":"session","version":3,"id":"w1","timestamp":"t","cwd":"/w"}\nnot json\n')
    proc = run(env, "share", str(path), "--json")
    assert "line 2 is not JSON" in proc.stderr.decode()
    assert json.loads(proc.stdout)["src"] == hash_file(path)  # shared verbatim all the same


def test_concurrent_shares_leave_a_valid_manifest(env: dict[str, str]) -> None:
    files = sorted((agent_of(env) / "sessions").glob("*/*.jsonl"))[:4]
    procs = [subprocess.Popen([sys.executable, "-m", "p2pnode", "share", str(f)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for f in files]
    branches = set()
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err.decode()
        branches.add(out.decode().strip())
    manifest = json.loads((Path(env["P2PNODE_HOME"]) / "manifest.json").read_text())
    assert branches <= set(manifest)
    assert {str(f) for f in files} <= set(manifest.values())


@pytest.mark.root
def test_original_agent_dir_layout_gives_the_same_branches(env: dict[str, str], tmp_path: Path,
                                                           corpus_dir: Path) -> None:
    """The corpus at /tmp/pi-harness/agent as on the machine that wrote it, in a private mount
    namespace (a tmp dir bound over /tmp/pi-harness), so the real /tmp/pi-harness is never
    touched; the mount point is made, and removed again, only if it does not exist.  Root
    (marker `root`): only root may make a mount namespace; unshare(1) is in util-linux, which
    every Linux CI machine has."""
    harness = tmp_path / "harness"
    shutil.copytree(corpus_dir / "sessions", harness / "agent" / "sessions")
    node = tmp_path / "inner-node"
    inner_env = {**env, "P2PNODE_HOME": str(node), "PI_CODING_AGENT_DIR": "/tmp/pi-harness/agent"}
    target = f"/tmp/pi-harness/agent/sessions/{BETA}/{B5}"
    mount_point = Path("/tmp/pi-harness")
    made = not mount_point.exists()
    mount_point.mkdir(exist_ok=True)
    cmd = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
           'mount --bind "$0" /tmp/pi-harness && exec "$@"', str(harness), sys.executable, "-m", "p2pnode",
           "share", target, "--json"]
    try:
        proc = subprocess.run(cmd, env=inner_env, capture_output=True, timeout=60)
    finally:
        if made:
            mount_point.rmdir()
    if proc.returncode != 0 and b"mount" in proc.stderr and b"p2pnode" not in proc.stderr:
        pytest.skip(f"{KERNEL_LIMITATION}private mount namespaces are unavailable here: "
                    f"{proc.stderr.decode().strip()}")
    assert proc.returncode == 0, proc.stderr.decode()
    original = json.loads(proc.stdout)
    assert original["path"] == target and (node / "manifest.json").is_file()
    moved = json.loads(run(env, "share", str(agent_of(env) / "sessions" / BETA / B5), "--json").stdout)
    assert original["branch"] == moved["branch"]  # lineage found directly, or through the moved agent dir
    assert [a["branch"] for a in original["ancestors"]] == [a["branch"] for a in moved["ancestors"]]


def test_share_killed_mid_import_recovers(env: dict[str, str], tmp_path: Path) -> None:
    """SIGKILL twice in the middle of a first share of 20 MB (while turns.log grows); the next
    share finishes, byte-exact, and the store checks clean."""
    path = tmp_path / "big.jsonl"
    body = b"".join(b'{"type":"message","id":"%08x","parentId":null,"text":"%s"}\n' % (i, b"%d-" % i * 300)
                    for i in range(12_000))
    path.write_bytes(b'{"type":"session","version":3,"id":"big1","timestamp":"t","cwd":"/w"}\n' + body)
    turns_log = Path(env["P2PNODE_HOME"]) / "store" / "turns.log"
    for grow_by in (50_000, 300_000):
        start = turns_log.stat().st_size if turns_log.exists() else 0
        proc = subprocess.Popen([sys.executable, "-m", "p2pnode", "share", str(path)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:
            if turns_log.exists() and turns_log.stat().st_size >= start + grow_by:
                break
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGKILL, "the share finished before it could be killed"
        state = Path(env["P2PNODE_HOME"]) / "sessions.json"
        if state.exists():
            json.loads(state.read_bytes())  # never torn
    branch = run(env, "share", str(path)).stdout.decode().strip()
    assert run(env, "cat", branch).stdout == path.read_bytes()
    state = json.loads((Path(env["P2PNODE_HOME"]) / "sessions.json").read_bytes())
    assert list(state["branches"]) == [branch] and list(state["sessions"]) == [hash_file(path)]
    fsck = run(env, "fsck", "--json", check=False)
    assert fsck.returncode == 0, fsck.stdout.decode()
    with Library.open(NodePaths(Path(env["P2PNODE_HOME"]))) as lib:  # the killed imports' contexts are gone
        named = {v["context"] for v in state["sessions"].values()}
        named |= {b["context"] for b in state["branches"].values()}
        assert {h.context_id for h in lib.store.list_contexts() if h.head_turn_id} <= named


@pytest.mark.parametrize("where", ["a body line", "a sidecar"])
def test_a_damaged_turn_record_is_dropped_by_fsck_repair_and_sharing_again_restores_it(
        env: dict[str, str], where: str) -> None:
    """README, "A damaged store": one turns.log record flipped where no WAL copy can repair it.
    `cat` of what goes through it and `gc` fail closed (exit 5); `fsck --repair` forgets exactly
    the branches whose turns go through it (forks that reuse the parent's turns too) and says
    how to get each back; then the store is clean (a warning names the dead record), `gc` works,
    and sharing the files again stores them byte for byte.  A branch's own sidecar turn heads
    its version's context: the version goes too (else that context stayed, headed by it)."""
    beta = agent_of(env) / "sessions" / BETA
    alpha = next((agent_of(env) / "sessions" / "--tmp-pi-harness-work-alpha--").glob("*173a-7744*.jsonl"))
    shared = json.loads(run(env, "share", str(beta / B5), "--json").stdout)
    other = run(env, "share", str(alpha)).stdout.decode().strip()
    root = shared["ancestors"][0]
    paths = NodePaths(Path(env["P2PNODE_HOME"]))
    with Library.open(paths) as lib:
        damaged = (lib.sessions.line_turns(root["src"])[1].turn_id if where == "a body line"  # the root's
                   else lib.sessions.branch(shared["branch"]).head)  # the newest fork's branch turn
        hit = {b.branch for b in lib.branches(include_unshared=True)
               if damaged in {t.turn_id for t in lib.store.chain(lib.sessions.branch(b.branch).head)}}
        while more := {b.branch for b in lib.branches(include_unshared=True) if b.parent in hit} - hit:
            hit |= more  # and the forks of those (new sessions whose parentSession they are)
        files = {b.branch: Path(b.path) for b in lib.branches(include_unshared=True) if b.path}
        lib.store.checkpoint()
        lib.store.checkpoint()  # neither WAL generation kept holds the record now
    assert root["branch"] in hit if where == "a body line" else hit == {shared["branch"]}
    assert other not in hit
    with open(paths.store / "turns.log", "r+b") as f:
        f.seek((damaged - 1) * 80 + 40)
        f.write(b"\x00\xff")

    before = run(env, "fsck", check=False)
    assert before.returncode == 1 and "cannot be read" in before.stdout.decode()
    if where == "a body line":
        assert run(env, "cat", root["branch"], check=False).returncode == 5
        assert "DAMAGED: turns.log at offset" in run(env, "status").stdout.decode()  # says so, exit 0
    assert run(env, "gc", check=False).returncode == 5

    repair = run(env, "fsck", "--repair", check=False)
    out = repair.stdout.decode()
    assert repair.returncode == 0, out
    assert {b for b in hit if f"dropped branch {b[:16]}" in out} == hit and other[:16] not in out
    assert f"share {files[shared['branch']]} again" in out
    after = run(env, "fsck")
    assert "no head reaches it" in after.stdout.decode()
    listed = {b["branch"] for b in json.loads(run(env, "ls", "--all", "--json").stdout)}
    assert other in listed and not hit & listed
    assert run(env, "cat", other).stdout == alpha.read_bytes()
    run(env, "gc")
    events = [json.loads(line) for line in (paths.home / "audit.log").read_text().splitlines()]
    assert {e["branch"] for e in events if e["event"] == "dropped"} == hit

    assert json.loads(run(env, "share", str(beta / B5), "--json").stdout)["branch"] == shared["branch"]
    for branch in hit:
        assert run(env, "cat", branch).stdout == files[branch].read_bytes()
    assert run(env, "fsck", "--full").returncode == 0


@pytest.mark.parametrize("damage", ["cut short", "deleted", "a list", "a field mistyped", "a key flipped",
                                    "a version dropped", "a header null", "sessions a list"])
def test_a_lost_or_unreadable_sessions_json_is_rebuilt_from_the_store_by_fsck_repair(
        env: dict[str, str], tmp_path: Path, damage: str) -> None:
    """Every command refuses the home (exit 1, naming the file and `fsck --repair`, nothing
    changed); `fsck --repair` rebuilds the records from the store: the same versions (sizes,
    lines, headers, titles, the link between a grown version and its older one), the same
    branches and lineage, none offered; the unreadable file is kept beside it; sharing again
    offers each with its old branch hash."""
    beta = agent_of(env) / "sessions" / BETA
    grown = tmp_path / "grown.jsonl"
    grown.write_bytes((beta / B5).read_bytes())
    first = json.loads(run(env, "share", str(grown), "--json").stdout)
    with open(grown, "ab") as f:
        f.write(b'{"type":"custom","id":"ffff0001","parentId":null,"timestamp":"t","data":1}\n')
    second = json.loads(run(env, "share", str(grown), "--json").stdout)
    home = Path(env["P2PNODE_HOME"])
    state = home / "sessions.json"
    before = json.loads(state.read_bytes())
    listed = json.loads(run(env, "ls", "--all", "--json").stdout)
    if damage == "cut short":
        state.write_bytes(state.read_bytes()[:100])
    elif damage == "deleted":
        state.unlink()
    elif damage == "a list":
        state.write_text("[]")
    else:  # valid JSON, wrong inside: a bit flipped in a key, a record lost, a field of another type
        doc = json.loads(state.read_bytes())
        if damage == "a field mistyped":
            doc["branches"][second["branch"]]["head"] = "x"
        elif damage == "a key flipped":
            doc["sessions"]["0" + first["src"][1:]] = doc["sessions"].pop(first["src"])
        elif damage == "a version dropped":
            del doc["sessions"][second["src"]]
        elif damage == "a header null":
            doc["sessions"][first["src"]]["header"] = None
        else:
            doc["sessions"] = list(doc["sessions"].values())
        state.write_text(json.dumps(doc))
    damaged = state.read_bytes() if state.exists() else None

    refused = run(env, "ls", check=False)
    assert refused.returncode == 1 and "fsck --repair" in refused.stderr.decode()
    if damaged is not None:  # plain fsck reports it too (a missing file needs the store: --repair says)
        checked = run(env, "fsck", check=False)
        assert checked.returncode == 1, checked.stdout
        assert f"error: {state}" in checked.stdout.decode() and "fsck --repair" in checked.stdout.decode()
    assert (state.read_bytes() if state.exists() else None) == damaged  # nothing changed

    repair = run(env, "fsck", "--repair")
    out = repair.stdout.decode()
    assert "rebuilt from the store" in out and f"{len(before['branches'])} branch(es)" in out
    if damaged is not None:
        assert (home / "sessions.json.damaged").read_bytes() == damaged
    run(env, "ls")  # opens the library: links the grown version to its older one again
    after = json.loads(state.read_bytes())
    assert after["sessions"] == before["sessions"]
    assert {b: (r["src"], r["parent"], r["head"], r["offered"]) for b, r in after["branches"].items()} == {
        b: (r["src"], r["parent"], r["head"], False) for b, r in before["branches"].items()}
    relisted = json.loads(run(env, "ls", "--all", "--json").stdout)
    keys = ("branch", "src", "parent", "size", "lines", "title", "version", "versions")
    assert sorted([b[k] for k in keys] for b in relisted) == sorted([b[k] for k in keys] for b in listed)

    assert json.loads(run(env, "share", str(grown), "--json").stdout)["branch"] == second["branch"]
    assert run(env, "cat", first["branch"]).stdout == (beta / B5).read_bytes()
    assert run(env, "fsck", "--full").returncode == 0


@pytest.mark.parametrize("name", ["manifest.json", "placed.json"])
def test_an_unreadable_index_of_local_files_is_moved_aside_by_fsck_repair(env: dict[str, str],
                                                                          name: str) -> None:
    """manifest.json (where branches came from) and placed.json (what fetches placed) hold
    nothing the store cannot do without: unreadable, they stop the commands that read them
    (exit 4, naming `fsck --repair`), which moves them aside to start empty."""
    path = agent_of(env) / "sessions" / BETA / B5
    branch = run(env, "share", str(path)).stdout.decode().strip()
    index = Path(env["P2PNODE_HOME"]) / name
    index.write_text("[1, 2")
    if name == "manifest.json":
        refused = run(env, "ls", check=False)
        assert refused.returncode == 4 and "fsck --repair" in refused.stderr.decode()
    repair = run(env, "fsck", "--repair")
    assert f"{index} was unreadable: moved to {index}.damaged" in repair.stdout.decode()
    assert (index.parent / f"{name}.damaged").read_text() == "[1, 2"
    assert run(env, "cat", branch).stdout == path.read_bytes() and run(env, "ls").returncode == 0


def test_a_rebuild_does_not_bring_back_a_removed_branch_whose_version_is_kept(env: dict[str, str]) -> None:
    """Two branches of one version (shared with its lineage, then --no-lineage); the first is
    removed, so its sidecar still heads the version's context, which the second keeps.  A
    rebuild of a lost sessions.json reads the audit log and leaves the removed one out (it
    says so)."""
    path = agent_of(env) / "sessions" / BETA / B5
    first = json.loads(run(env, "share", str(path), "--json").stdout)
    second = json.loads(run(env, "share", str(path), "--no-lineage", "--json").stdout)
    assert second["src"] == first["src"] and second["branch"] != first["branch"]
    run(env, "rm", first["branch"])
    (Path(env["P2PNODE_HOME"]) / "sessions.json").write_text("{")
    out = run(env, "fsck", "--repair").stdout.decode()
    assert f"not rebuilt: branch {first['branch'][:16]}, removed earlier" in out
    listed = {b["branch"] for b in json.loads(run(env, "ls", "--all", "--json").stdout)}
    assert second["branch"] in listed and first["branch"] not in listed
    assert run(env, "cat", second["branch"]).stdout == path.read_bytes()
    assert run(env, "fsck", "--full").returncode == 0


def test_a_rebuild_names_each_branch_the_store_cannot_give_back(env: dict[str, str]) -> None:
    """sessions.json unreadable and a line of one session lost from the pack: the rebuild
    gives back the rest and names that branch (its hash, what to do), logged as dropped."""
    alpha = next((agent_of(env) / "sessions" / "--tmp-pi-harness-work-alpha--").glob("*173a-7744*.jsonl"))
    lost = run(env, "share", str(alpha)).stdout.decode().strip()
    kept = run(env, "share", str(agent_of(env) / "sessions" / BETA / B5)).stdout.decode().strip()
    home = Path(env["P2PNODE_HOME"])
    with Library.open(NodePaths(home)) as lib:
        image = max(lib.line_manifest(lib.branch(lost).src), key=lambda r: r.length).hash
    pack = home / "store" / "blobs.pack"
    data = bytearray(pack.read_bytes())
    data[data.index(image) + 200] ^= 0x40  # inside the image line's record, past its header
    pack.write_bytes(bytes(data))
    (home / "sessions.json").write_text("{")
    out = run(env, "fsck", "--repair", check=False).stdout.decode()
    assert f"not rebuilt: branch {lost[:16]}" in out and f"fetch {lost[:16]} again" in out
    listed = {b["branch"] for b in json.loads(run(env, "ls", "--all", "--json").stdout)}
    assert kept in listed and lost not in listed
    events = [json.loads(line) for line in (home / "audit.log").read_text().splitlines()]
    assert [e["branch"] for e in events if e["event"] == "dropped"] == [lost]


def test_a_continuation_of_an_older_version_is_its_growth_through_a_running_node(tmp_path: Path,
                                                                                 corpus_dir: Path) -> None:
    """v1, then vx = v1 + X, then vy = v1 + Y (larger than vx) shared through one running node:
    vy is version 2 with previous v1 at once, and `ls` shows the session as one row."""
    node = Node(tmp_path, "a")
    shutil.copytree(corpus_dir / "sessions", node.agent / "sessions")
    v1 = node.agent / "sessions" / BETA / B5
    vx, vy = v1.with_name("vx.jsonl"), v1.with_name("vy.jsonl")
    for path, text in ((vx, "x"), (vy, "y, a little longer")):
        path.write_bytes(v1.read_bytes() + b'{"type":"message","id":"m9","parentId":null,'
                         b'"message":{"role":"user","content":"branch %s"}}\n' % text.encode())
    with node.node_running():
        first, x, y = (json.loads(node.run("share", str(p), "--json").stdout) for p in (v1, vx, vy))
        assert (x["version"], x["previous"]) == (y["version"], y["previous"]) == (2, first["branch"])
        ours = {first["branch"], x["branch"], y["branch"]}
        rows = [r for r in json.loads(node.run("ls", "--all", "--json").stdout) if r["branch"] in ours]
        assert [(r["branch"], r["versions"]) for r in rows] == [(y["branch"], 3)]  # its ancestors' rows aside


def test_fsck_repair_names_the_branches_whose_lines_are_in_a_damaged_record_and_what_heals_them(
        env: dict[str, str]) -> None:
    """README, "A damaged store": one byte flipped inside a line's record in blobs.pack.  The
    record stays an error (docs/FORMAT.md, "Checking"), and `fsck --repair` names each branch
    holding the line with what to run; sharing the file again heals it (fsck exit 0)."""
    from store.files.blobpack import scan_pack
    from store.layout import BLOB_HEADER

    b5 = agent_of(env) / "sessions" / BETA / B5
    shared = json.loads(run(env, "share", str(b5), "--json").stdout)
    paths = NodePaths(Path(env["P2PNODE_HOME"]))
    with Library.open(paths) as lib:
        line = lib.sessions.line_hashes(shared["src"])[-1]  # the newest line: B5's own, not its parents'
    pack = paths.store / "blobs.pack"
    offset = next(off for off, hdr in scan_pack(pack.read_bytes()).records if hdr.hash == line)
    with open(pack, "r+b") as f:
        f.seek(offset + BLOB_HEADER.size)
        byte = f.read(1)
        f.seek(offset + BLOB_HEADER.size)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert run(env, "cat", shared["branch"], check=False).returncode == 5

    repair = run(env, "fsck", "--repair", check=False)
    out = repair.stdout.decode()
    assert repair.returncode == 1 and "failed its CRC" in out  # an error until the bytes are stored again
    assert f"branch {shared['branch'][:16]}" in out and "1 line(s) in damaged store records" in out, out
    assert f"share {b5} again to store them anew" in out
    assert shared["ancestors"][0]["branch"][:16] not in out  # its parents do not hold that line

    run(env, "share", str(b5))
    assert run(env, "cat", shared["branch"]).stdout == b5.read_bytes()
    assert run(env, "fsck").returncode == 0


@pytest.mark.parametrize("name", ["manifest.json", "placed.json"])
def test_plain_fsck_names_an_unreadable_index_and_peers_still_get_the_catalog(
        env: dict[str, str], name: str) -> None:
    """Plain `fsck` exits 1 naming the file and `fsck --repair` (it said "ok"); the catalog
    peers get is built without manifest.json (local paths, which peers never see), so a
    damaged one is no error to them (it was a 500 with a traceback)."""
    shared = json.loads(run(env, "share", str(agent_of(env) / "sessions" / BETA / B5), "--json").stdout)
    home = Path(env["P2PNODE_HOME"])
    (home / name).write_text("{cut")
    checked = run(env, "fsck", check=False)
    assert checked.returncode == 1
    assert f"error: {home / name} is not JSON" in checked.stdout.decode()
    assert "`p2pnode fsck --repair`" in checked.stdout.decode()
    with Library.open(NodePaths(home)) as lib:
        assert shared["branch"] in [b.branch for b in lib.catalog().branches]
    run(env, "fsck", "--repair")
    assert run(env, "fsck").returncode == 0
