"""`cat` streams a session from the store in runs (Library.session_runs), alone and through the
running node (/v1/cat's NDJSON events): each line checked as it is read, the whole against
src at the end.  Real processes and files; the damaged store is a library-level test."""
from __future__ import annotations

import io
import json
import os
import random
import select
import subprocess
import time
from pathlib import Path

import pytest
from procnode import PEAK_RSS, PY, Node, hwm_kb, peak_kb
from skips import KERNEL_LIMITATION

from p2pnode.cli.render import JsonLines
from p2pnode.errors import VerificationFailed
from p2pnode.library.api import Library
from p2pnode.library.sessions import SessionStore
from p2pnode.paths import NodePaths
from store import StoreConfig, StoreLocked

SESSION_ID = "0c0ffee0-0000-4000-8000-00000000ca70"


def session(path: Path, size: int) -> Path:
    """A Pi-shaped session of about `size` bytes, lines of many lengths (some over a run)."""
    rng = random.Random(5)
    lines = [json.dumps({"type": "session", "version": 3, "id": SESSION_ID,
                         "timestamp": "2026-11-28T03:00:00.000Z", "cwd": "/w"})]
    total = 0
    while total < size:
        text = os.urandom(rng.choice([50, 2_000, 40_000, 600_000]) // 2).hex()
        lines.append(json.dumps({"type": "message", "message": {"role": "user", "content": text}}))
        total += len(lines[-1])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def cat(node: Node, branch: str) -> bytes:
    proc = subprocess.run([PY, "-m", "p2pnode", "cat", branch], env=node.env, capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_cat_streams_the_session_alone_and_through_the_node(tmp_path: Path) -> None:
    a = Node(tmp_path, "a")
    path = session(a.agent / "sessions" / "--w--" / f"2026-11-28T03-00-00-000Z_{SESSION_ID}.jsonl", 3_000_000)
    branch = json.loads(a.run("share", str(path), "--json").stdout)["branch"]
    assert cat(a, branch) == path.read_bytes()
    with a.node_running():
        assert cat(a, branch) == path.read_bytes()
        missing = a.run("cat", "ab" * 32, check=False)
        assert missing.returncode == 3 and "Traceback" not in missing.stderr


@pytest.mark.parametrize("data", [b'{"a":"\xe2\x82\xac \xe2\x80\xa8 \r"}\n{"b":1}\n', b"x", b"", b"one\n\n",
                                  b"\xff\n"])
def test_json_lines_cut_anywhere_print_what_print_json_prints(data: bytes) -> None:
    """Runs cut at every pair of places (inside a UTF-8 character too) give the same bytes as
    print_json of the whole answer, the lines cut at newlines only."""
    parts = data.split(b"\n")
    lines = [p + b"\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])
    head = {"branch": "b" * 64, "size": len(data)}
    expected = json.dumps({**head, "lines": [ln.decode("utf-8", "replace") for ln in lines]}, indent=2) + "\n"
    for i in range(len(data) + 1):
        for j in range(i, len(data) + 1):
            out = io.BytesIO()
            answer = JsonLines(out, head)
            for run in (data[:i], data[i:j], data[j:]):
                answer.write(run)
            answer.close()
            assert out.getvalue().decode() == expected


JSON_RSS_MARGIN_KB = 16_000
"""What `cat --json` may hold beyond plain `cat` of the same session (the CLI, and the node it
reads through): a line or a run at a time.  Whole, it held ~3.3x the session in the CLI and
~5.7x in the node (bytes, base64, JSON): ~100 and ~170 MB for the 30 MB session below."""


@pytest.mark.skipif(not Path("/proc/self/status").exists(),
                    reason=KERNEL_LIMITATION + "no /proc/<pid>/status (VmHWM) for a peak RSS: not Linux")
def test_cat_json_lists_pi_lines_in_bounded_memory_alone_and_through_the_node(tmp_path: Path) -> None:
    """`cat --json` lists the lines as Pi cuts them (at newlines only: not at a raw U+2028 or
    U+0085 inside a line, which JSON allows and Python's splitlines cut at), and its peak RSS,
    alone and in the node it reads through, stays near plain `cat`'s."""
    a = Node(tmp_path, "a")
    path = session(a.agent / "sessions" / "--w--" / f"2026-11-28T03-00-00-000Z_{SESSION_ID}.jsonl", 30 << 20)
    odd = json.dumps({"type": "message", "message": {"role": "user", "content": "a\u2028b\u0085c"}},
                     ensure_ascii=False).encode()
    with path.open("ab") as f:
        f.write(odd + b"\n")
    data = path.read_bytes()
    branch = json.loads(a.run("share", str(path), "--json").stdout)["branch"]

    def peak(*args: str) -> tuple[bytes, int]:
        proc = subprocess.run([PY, "-c", PEAK_RSS, "cat", branch, *args], env=a.env, capture_output=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout, peak_kb(proc.stderr.decode())

    def check(answer: bytes) -> None:
        lines = json.loads(answer)["lines"]
        assert [line.encode() for line in lines] == [line + b"\n" for line in data.split(b"\n")[:-1]]
        assert lines[-1].encode() == odd + b"\n"
        assert "".join(lines).encode() == data

    plain, plain_kb = peak()
    assert plain == data
    answer, json_kb = peak("--json")
    check(answer)
    assert json_kb < plain_kb + JSON_RSS_MARGIN_KB, (json_kb, plain_kb)
    with a.node_running() as node:
        assert peak()[0] == data
        node_plain_kb = hwm_kb(node.pid)
        answer, cli_kb = peak("--json")
        check(answer)
        assert hwm_kb(node.pid) < node_plain_kb + JSON_RSS_MARGIN_KB
        assert cli_kb < plain_kb
    assert not [p for p in a.home.iterdir() if p.name.startswith("tmp")]


def test_session_runs_check_each_run_and_the_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs of about the bytes asked for (a longer line is a run of its own) that join to the
    file; lines in another order (each one fine: damaged turn records) end in VerificationFailed
    after the runs before it."""
    agent = tmp_path / "agent"
    path = session(agent / "sessions" / "--w--" / f"2026-11-28T03-00-00-000Z_{SESSION_ID}.jsonl", 2_000_000)
    with Library.open(NodePaths(tmp_path / "home"), agent) as lib:
        src = lib.share(str(path)).src
        runs = list(lib.session_runs(src, 256 << 10))
        assert b"".join(runs) == path.read_bytes() and len(runs) > 2
        longest = max(len(line) for line in path.read_bytes().splitlines(keepends=True))
        assert max(map(len, runs)) < (256 << 10) + longest
        turns = lib.sessions.line_turns(src)
        swapped = [turns[0], turns[2], turns[1], *turns[3:]]
        monkeypatch.setattr(SessionStore, "line_turns", lambda self, s: swapped)
        out: list[bytes] = []
        with pytest.raises(VerificationFailed, match="hashes to"):
            lib.write_session(src, out.append)
        assert b"".join(out) != path.read_bytes() and out


def test_cat_to_a_reader_that_does_not_read_leaves_the_store_to_other_commands(tmp_path: Path) -> None:
    """`p2pnode cat B | less` with no node: the session is spooled beside the store first, so
    the store is not held while the reader takes its time (every other command waited 10 s
    for it, then failed with "store in use")."""
    a = Node(tmp_path, "a")
    path = session(a.agent / "sessions" / "--w--" / f"2026-11-28T03-00-00-000Z_{SESSION_ID}.jsonl", 3_000_000)
    branch = json.loads(a.run("share", str(path), "--json").stdout)["branch"]
    proc = subprocess.Popen([PY, "-m", "p2pnode", "cat", branch], env=a.env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert select.select([proc.stdout], [], [], 30)[0]  # cat is writing (nothing is read)
        deadline = time.monotonic() + 30
        while True:  # cat waits on the full pipe
            try:
                with Library.open(NodePaths(a.home), config=StoreConfig(lock_timeout=0.5)) as lib:
                    assert lib.branch(branch).src
                break
            except StoreLocked:
                assert time.monotonic() < deadline, "cat kept the store while its reader did not read"
        assert proc.poll() is None  # still writing: the store was free before the reader read
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, err
    assert out == path.read_bytes()
    assert not [p for p in a.home.iterdir() if p.name.startswith("tmp")]
