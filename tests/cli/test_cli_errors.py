"""Every subcommand with bad input: the exit code is one of README.md's table, stderr is one
line and never a traceback, an exception class name or a Python tuple.

The subcommands are read from the argparse parser, so a new one is walked without a change
here.  All processes run as an ordinary user (tests/ordinary.py): unreadable files are
unreadable only to someone who is not root."""
from __future__ import annotations

import argparse
import builtins
import importlib
import json
import os
import pkgutil
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from ordinary import OrdinaryUser

import p2pnode
import store
import sysio
from p2pnode.cli import main as cli
from p2pnode.errors import KINDS
from p2pnode.library.api import Library
from p2pnode.paths import NodePaths
from p2pnode.pi.sidecar import Sidecar, blake3_hex
from store.config import StoreConfig

README = Path(__file__).resolve().parents[2] / "README.md"
B5 = "--tmp-pi-harness-work-beta--/2026-11-21T19-26-53-423Z_01a1ff93-69ef-76bb-aaf0-d291c98d9fe0.jsonl"
GARBAGE = "zz:not/valid"


def readme_exit_codes() -> dict[int, str]:
    table = README.read_text().split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    return {int(m[1]): m[2] for m in re.finditer(r"^\| (\d+) \| (.+?) \|$", table, re.M)}


CODES = readme_exit_codes()


def _exception_names() -> set[str]:
    """Every exception class a message could leak: builtins, the store, the node, aiohttp, ssl."""
    import aiohttp  # noqa: F401  (its classes are subclasses of builtins' by now)

    for package in (p2pnode, store, sysio):
        for mod in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if mod.name != "p2pnode.__main__" and mod.name != "store.__main__":
                importlib.import_module(mod.name)
    seen: set[type] = set()
    todo: list[type] = [BaseException]
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.add(cls)
            todo += cls.__subclasses__()
    names = {c.__name__ for c in seen} | {n for n in dir(builtins) if n.endswith(("Error", "Exception"))}
    return {n for n in names if sum(ch.isupper() for ch in n) >= 2 or n.endswith(("Error", "Exception"))}


EXCEPTION_NAMES = _exception_names()
PY_TUPLE = re.compile(r"\(\s*'[^']*',\s*\d+\s*\)")


def assert_clean(proc: subprocess.CompletedProcess[bytes], what: str,
                 expected: set[int] | None = None) -> str:
    """The exit code is in README's table (and in `expected`); stderr has one error line, and
    no traceback, exception class name or Python tuple."""
    err = proc.stderr.decode(errors="replace")
    assert proc.returncode in CODES, f"{what}: exit {proc.returncode} is not in README's table: {err}"
    if expected is not None:
        assert proc.returncode in expected, f"{what}: exit {proc.returncode}, expected {expected}: {err}"
    assert "Traceback" not in err, f"{what}: {err}"
    leaked = sorted(n for n in EXCEPTION_NAMES if re.search(rf"\b{n}\b", err))
    assert not leaked, f"{what}: stderr names {leaked}: {err}"
    assert not PY_TUPLE.search(err), f"{what}: a Python tuple in {err}"
    if proc.returncode not in (0, 2):  # 2: argparse's usage text and its one error line
        errors = [ln for ln in err.splitlines() if ln.startswith("p2pnode: ") and "warning:" not in ln]
        assert len(errors) == 1, f"{what}: not one error line: {err}"
    return err


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def positionals(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not a.option_strings]


def test_readme_has_the_exit_codes_the_cli_uses() -> None:
    assert set(CODES) == {0, 1, 2, 3, 4, 5, 6, 7, 8, cli.EXIT_INTERRUPTED, cli.EXIT_BROKEN_PIPE}
    assert {"share", "ls", "show", "cat", "fsck", "serve", "serve-peers", "fetch"} <= set(subcommands())


def test_every_subcommand_with_bad_input_and_no_node(ordinary: OrdinaryUser) -> None:
    env = ordinary.node("walk")
    for name, parser in subcommands().items():
        assert_clean(ordinary.run(env, name, "--no-such-option"), f"{name} --no-such-option", {2})
        args = positionals(parser)
        if any(a.nargs is None for a in args):  # required positionals missing
            assert_clean(ordinary.run(env, name), f"{name} (no arguments)", {2})
        if args:
            garbage = [GARBAGE] * len(args)
            assert_clean(ordinary.run(env, name, *garbage), f"{name} {GARBAGE}", set(CODES) - {0, 1})


def test_every_subcommand_beside_a_running_node(ordinary: OrdinaryUser, corpus_dir: Path) -> None:
    """With the node holding the store: read commands go through it, and what needs the store
    itself (fsck, a second node, serve-peers) says who holds it, exit 7."""
    env = ordinary.node("busy", corpus_dir / "sessions")
    node, _ = ordinary.start_node(env)
    try:
        node_id = json.loads(ordinary.run(env, "status", "--json").stdout)["node_id"]
        for name, parser in subcommands().items():
            args = [GARBAGE] * len(positionals(parser))
            proc = ordinary.run(env, name, *args)
            expected = {7} if name in ("serve", "serve-peers", "fsck") else set(CODES) - {1}
            err = assert_clean(proc, f"{name} {' '.join(args)} beside a node", expected)
            if proc.returncode == 7:
                assert env["P2PNODE_HOME"] in err and node_id in err, err
        assert "could not check" in ordinary.run(env, "fsck").stderr.decode()
    finally:
        ordinary.stop_node(node)


def assert_json_failure(proc: subprocess.CompletedProcess[bytes], what: str) -> None:
    """A failed command run with --json: its stdout ends with one object naming the failure
    as its stderr line and exit code do (a program reading the JSON gets an answer)."""
    last = proc.stdout.decode().strip().splitlines()[-1:] or ["(nothing)"]
    try:
        failure = json.loads(last[0])["error"]
    except (ValueError, KeyError, TypeError) as exc:
        raise AssertionError(f"{what}: exit {proc.returncode}, stdout ends with no error object: "
                             f"{last[0]}") from exc
    assert failure["exit_code"] == proc.returncode, f"{what}: {failure}"
    assert failure["kind"] == KINDS[proc.returncode], f"{what}: {failure}"
    assert f"p2pnode: {failure['message']}" in proc.stderr.decode(), f"{what}: {failure}"


def test_a_failure_with_json_is_also_an_object_on_stdout(ordinary: OrdinaryUser, corpus_dir: Path) -> None:
    """Every subcommand that takes --json, failing without a node and beside one (whose
    errors come back as a code and a message only)."""
    env = ordinary.node("json", corpus_dir / "sessions")
    with_json = {name: parser for name, parser in subcommands().items()
                 if any("--json" in a.option_strings for a in parser._actions)}
    assert {"share", "ls", "show", "fetch", "browse", "gc"} <= set(with_json)

    def walk(where: str) -> int:
        failed = 0
        for name, parser in with_json.items():
            args = [GARBAGE] * len(positionals(parser))
            proc = ordinary.run(env, name, *args, "--json")
            if name in ("doctor", "fsck") and proc.returncode == 1:
                continue  # problems found: the report is their JSON
            assert_clean(proc, f"{name} --json {where}")
            if proc.returncode not in (0, 2, 7):  # 7: a command that needs the node's store
                assert_json_failure(proc, f"{name} {' '.join(args)} --json {where}")
                failed += 1
        return failed

    assert walk("without a node") >= 5
    node, _ = ordinary.start_node(env)
    try:
        assert walk("beside a node") >= 5
        assert_json_failure(ordinary.run(env, "show", "ab" * 32, "--json"), "show of an unknown branch, node")
    finally:
        ordinary.stop_node(node)


def ambiguous_pair(tmp: Path) -> tuple[Path, Path, str]:
    """Two root sessions whose branch hashes share their first 4 hex digits (a birthday search
    over header ids; the branch hash of a root is BLAKE3 of its canonical sidecar)."""
    seen: dict[str, bytes] = {}
    for i in range(100_000):
        data = b'{"type":"session","version":3,"id":"amb-%d","timestamp":"t","cwd":"/w"}\n' % i
        prefix = Sidecar(blake3_hex(data), None).branch[:4]
        if prefix in seen:
            a, b = tmp / "a.jsonl", tmp / "b.jsonl"
            a.write_bytes(seen[prefix])
            b.write_bytes(data)
            return a, b, prefix
        seen[prefix] = data
    raise AssertionError("no two branch hashes share 4 hex digits")


def test_specific_bad_inputs_have_their_exit_codes(ordinary: OrdinaryUser, corpus_dir: Path) -> None:
    env = ordinary.node("specific", corpus_dir / "sessions")
    files = ordinary.root / "specific" / "files"
    files.mkdir()
    a, b, prefix = ambiguous_pair(files)
    unreadable = files / "unreadable.jsonl"
    unreadable.write_bytes(a.read_bytes())
    pipe = files / "pipe.jsonl"  # a share of it waited for a writer forever
    os.mkfifo(pipe)
    ordinary.own(files)
    unreadable.chmod(0)
    for f in (a, b):
        assert ordinary.run(env, "share", str(f)).returncode == 0
    cases: list[tuple[list[str], int, str]] = [
        (["share", str(files / "missing.jsonl")], 3, "does not exist"),
        (["share", str(unreadable)], 4, str(unreadable)),
        (["share", str(files)], 4, "is a directory"),
        (["show", prefix], 3, "matches 2"),
        (["cat", "ab" * 32], 3, "ab" * 32),
        (["unshare", "xyz!"], 4, "not a branch hash"),
        (["cat", "12"], 4, "not a branch hash"),
        (["fetch", "xyz"], 4, "not a branch hash"),
        (["fetch", "ab" * 32, "--from", "nowhere"], 4, "not HOST:PORT"),
        (["fetch", "ab" * 32, "--from", "127.0.0.1:1"], 6, "127.0.0.1:1"),
        (["fetch", "abab12", "--from", "127.0.0.1:1"], 6, "no peer could be asked"),  # a prefix: the same
        (["browse", "--from", "127.0.0.1:1"], 6, "127.0.0.1:1"),
        (["trust", "not-a-node-id"], 4, "not-a-node-id"),
        (["untrust", "AAAAAAA"], 4, "AAAAAAA"),
        (["share", str(pipe)], 4, "not a regular file"),
        (["cat", "ab" * 32 + "a"], 4, "not a branch hash"),
        (["rm", "01a1ff93-0000-7000-8000-000000000000"], 3, "no branch of Pi session"),
        (["serve", "--port", "many"], 2, "not a whole number"),
        (["serve", "--port", "70000"], 2, "not a TCP port"),
        (["serve-peers", "--port", "-1"], 2, "not a TCP port"),
        (["log", "-n", "0"], 2, "not a count"),
        (["--log-level", "LOUD", "ls"], 2, "not one of"),
        (["doctor", "--timeout", "-1"], 2, "not a duration"),
        (["--home", "", "ls"], 2, "names no directory"),
        (["--home", str(unreadable), "ls"], 4, str(unreadable)),
    ]
    for args, code, text in cases:
        err = assert_clean(ordinary.run(env, *args), " ".join(args), {code})
        assert text in err, f"{' '.join(args)}: {err}"
    assert "nothing to check" in assert_clean(
        ordinary.run(env, "--home", str(files / "fresh"), "fsck"), "fsck of a fresh home", {3})


def test_an_address_a_server_cannot_listen_on_is_named_with_its_exit_code(ordinary: OrdinaryUser) -> None:
    """A port another process holds is a conflict (7), an address this machine lacks is input
    (4), for each command that listens: the node, the peer server alone, a pairing code."""
    env = ordinary.node("ports")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for command in (["serve", "--no-mdns"], ["serve-peers"]):
            args = [*command, "--host", "127.0.0.1", "--port", str(port)]
            err = assert_clean(ordinary.run(env, *args), " ".join(args), {7})
            assert f"cannot listen on 127.0.0.1:{port}: port {port} is taken by another process" in err, err
    for command in (["serve", "--no-mdns"], ["serve-peers"], ["pair", "--no-mdns"]):
        args = [*command, "--host", "198.51.100.7"]  # TEST-NET-2: no machine's
        err = assert_clean(ordinary.run(env, *args), " ".join(args), {4})
        assert "cannot listen on 198.51.100.7:" in err and "not an address of this machine" in err, err


def test_a_closed_stdout_ends_quietly(ordinary: OrdinaryUser, corpus_dir: Path) -> None:
    """`p2pnode ls | head`: the reader goes away; exit 141 (128 + SIGPIPE, as a shell reports
    it) and nothing on stderr."""
    env = ordinary.node("pipe", corpus_dir / "sessions")
    session = Path(env["PI_CODING_AGENT_DIR"]) / "sessions" / B5
    big = session.parent / "big.jsonl"  # larger than a pipe's buffer, so that cat must block
    big.write_bytes(session.read_bytes() + b'{"type":"message","text":"%s"}\n' % (b"x" * (1 << 20)))
    ordinary.own(big)
    branch = ordinary.run(env, "share", str(big), "--no-lineage").stdout.decode().strip()
    p2p = f"'{ordinary.python.executable}' -m p2pnode"
    for command in (f"cat {branch}", "ls", "ls --json"):
        proc = ordinary.shell(env, f"{{ {p2p} {command} 2>err; echo $? >rc; }} | head -c 1 >/dev/null")
        err, rc = (ordinary.root / "err").read_text(), int((ordinary.root / "rc").read_text())
        assert (rc, err) in ((cli.EXIT_BROKEN_PIPE, ""), (0, "")), f"{command}: exit {rc}: {err}"
        assert proc.returncode == 0
    proc = ordinary.shell(env, f"{{ {p2p} cat {branch} 2>err; echo $? >rc; }} | head -c 1 >/dev/null")
    assert int((ordinary.root / "rc").read_text()) == cli.EXIT_BROKEN_PIPE  # 1 MB cannot fit the pipe
    node, _ = ordinary.start_node(env)
    try:  # through the node: the runs come as events, and the pipe closes while one is written
        for command in (f"cat {branch}", f"cat {branch} --json"):
            ordinary.shell(env, f"{{ {p2p} {command} 2>err; echo $? >rc; }} | head -c 1 >/dev/null")
            err, rc = (ordinary.root / "err").read_text(), int((ordinary.root / "rc").read_text())
            assert (rc, err) == (cli.EXIT_BROKEN_PIPE, ""), f"{command} through the node: exit {rc}: {err}"
    finally:
        ordinary.stop_node(node)


def test_ctrl_c_is_one_line_and_130(ordinary: OrdinaryUser) -> None:
    """SIGINT while a fetch waits on a peer that accepted the connection and says nothing."""
    env = ordinary.node("ctrlc")
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        silent.settimeout(60)
        fetch = ordinary.popen(env, "fetch", "ab" * 32, "--from", f"127.0.0.1:{silent.getsockname()[1]}")
        conn, _ = silent.accept()  # it is inside the TLS handshake now
        with conn:
            time.sleep(0.2)
            fetch.send_signal(signal.SIGINT)
            out, err = fetch.communicate(timeout=30)
    proc = subprocess.CompletedProcess(fetch.args, fetch.returncode, out, err)
    assert assert_clean(proc, "fetch interrupted", {cli.EXIT_INTERRUPTED}).strip() == "p2pnode: interrupted"


def test_one_sided_trust_is_refused_with_what_to_run(ordinary: OrdinaryUser, corpus_dir: Path) -> None:
    """Bob trusts Alice; Alice does not trust Bob: her node hangs up after the handshake.  Bob is
    told so (exit 8), with her id and the command she must run."""
    alice, bob = ordinary.node("alice", corpus_dir / "sessions"), ordinary.node("bob")
    branch = ordinary.run(alice, "share", str(Path(alice["PI_CODING_AGENT_DIR"]) / "sessions" / B5))
    alice_id = ordinary.run(alice, "id").stdout.decode().strip()
    bob_id = ordinary.run(bob, "id").stdout.decode().strip()
    assert ordinary.run(bob, "trust", alice_id).returncode == 0
    node, port = ordinary.start_node(alice)
    try:
        proc = ordinary.run(bob, "fetch", branch.stdout.decode().strip(), "--from", f"127.0.0.1:{port}")
    finally:
        ordinary.stop_node(node)
    err = assert_clean(proc, "fetch from a node that does not trust us", {8})
    assert alice_id in err and f"ask them to run: p2pnode trust {bob_id}" in err, err


def test_an_unexpected_error_is_one_line_and_the_traceback_only_on_request(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], node_home: Path) -> None:
    """The guard in cli.main, for a failure no test can provoke from outside: a command that
    raises what no handler expects (stood in for by replacing `cmd_id`)."""
    def broken(args: argparse.Namespace) -> int:
        raise ZeroDivisionError("the disk said 42")

    monkeypatch.setattr(cli, "cmd_id", broken)
    assert cli.main(["id"]) == 1
    err = capsys.readouterr().err
    assert err == "p2pnode: unexpected error: the disk said 42 (run with P2PNODE_DEBUG=1 for the traceback)\n"
    monkeypatch.setenv("P2PNODE_DEBUG", "1")
    assert cli.main(["id"]) == 1
    assert "Traceback" in capsys.readouterr().err


def test_a_line_over_the_store_limit_is_invalid_input_with_its_number(node_home: Path,
                                                                      tmp_path: Path) -> None:
    """The store's limit is 256 MiB (PROTOCOL.md); the same check with a 64 KiB store."""
    path = tmp_path / "long.jsonl"
    path.write_bytes(b'{"type":"session","version":3,"id":"l1","timestamp":"t","cwd":"/w"}\n{"a":1}\n'
                     + b'{"text":"' + b"y" * 70_000 + b'"}\n')
    from p2pnode.errors import InvalidInput

    with Library.open(NodePaths(node_home), config=StoreConfig(max_payload=64 << 10)) as lib:
        with pytest.raises(InvalidInput, match=r"long\.jsonl: line 3 is 70012 bytes, over the store's limit"):
            lib.share(str(path))
        assert lib.branches(include_unshared=True) == []
    assert StoreConfig().max_payload == 256 << 20


def test_through_the_node_a_file_it_cannot_read_is_the_callers_input(ordinary: OrdinaryUser,
                                                                     corpus_dir: Path) -> None:
    """`share` of a file its user may not read, or of a named pipe, through the running node:
    exit 4 naming the file, as without a node; the pipe is not waited on (it held the node's
    worker, and with it every other command and peer), so the node answers the next command."""
    env = ordinary.node("via", corpus_dir / "sessions")
    files = ordinary.root / "via" / "files"
    files.mkdir()
    unreadable = files / "unreadable.jsonl"
    unreadable.write_bytes((corpus_dir / "sessions" / B5).read_bytes())
    os.mkfifo(files / "pipe.jsonl")
    ordinary.own(files)
    unreadable.chmod(0)
    node, _ = ordinary.start_node(env)
    try:
        for target, text in ((unreadable, "permission denied"), (files / "pipe.jsonl", "not a regular file")):
            err = assert_clean(ordinary.run(env, "share", str(target)), f"share {target.name} via node", {4})
            assert text in err.lower() and str(target) in err, err
        assert ordinary.run(env, "status", "--json").returncode == 0
    finally:
        ordinary.stop_node(node)


def test_store_failures_damage_and_a_read_only_disk_have_their_exit_codes(tmp_path: Path) -> None:
    """What a command reports for the store's failed state (exit 1, what to do), a damaged
    record (5, as bytes that fail their hash) and a read-only file system (4, as a path this
    user may not write): one line each, no "unexpected error"."""
    import errno as errnos

    from store.errors import CorruptRecord, StoreFailed, StoreFull, UnknownBlob

    args = cli.build_parser().parse_args(["--home", str(tmp_path / "h"), "ls"])
    cases = [(StoreFull("/h/store", "No space left on device", errnos.ENOSPC), 1, "make room"),
             (StoreFailed("/h/store/heads.wal-next", "Permission denied", errnos.EACCES), 4,
              "/h/store/heads.wal-next is not writable by this user (Permission denied) and nothing of it "
              "was recorded"),
             (StoreFailed("/h/store", "Read-only file system", errnos.EROFS), 4, "mount it read-write"),
             (CorruptRecord("turns.log", 320, "turn record CRC mismatch"), 5, "turns.log at offset 320"),
             (UnknownBlob(b"\x01" * 32), 5, "fsck"),
             (OSError(errnos.EROFS, "Read-only file system", "/h/store/LOCK"), 4, "/h/store/LOCK"),
             (OSError(errnos.ENAMETOOLONG, "File name too long", "/deep/eee"), 4, "too long: /deep/eee"),
             (OSError(errnos.ELOOP, "Too many levels of symbolic links", "/h/a"), 4, "symbolic links: /h/a")]
    for exc, code, text in cases:
        error = cli._as_node_error(exc, args)
        assert error.exit_code == code and text in str(error) and "unexpected" not in str(error), (exc, error)


@pytest.mark.parametrize("name, what", [("node.key", "the node key"), ("node.crt", "the node certificate")])
def test_an_identity_file_this_user_may_not_read_is_exit_4_naming_it(ordinary: OrdinaryUser, name: str,
                                                                     what: str) -> None:
    """node.key or node.crt at mode 000 (the user's own file): exit 4, as for any file this
    user may not read (README), naming it and what to do; it was exit 1 with a Python errno
    tuple, and an unreadable certificate is not taken for a damaged one and replaced.  As an
    ordinary user: root reads it whatever its mode."""
    env = ordinary.node("keyless")
    assert ordinary.run(env, "id").returncode == 0
    path = Path(env["P2PNODE_HOME"]) / "identity" / name
    path.chmod(0)
    for command in ("status", "id"):
        err = assert_clean(ordinary.run(env, command), f"{command} with {name} unreadable", {4})
        assert f"cannot read {what} {path}: permission denied" in err and "owner or mode" in err, err
    assert path.stat().st_mode & 0o777 == 0  # left as it was
    path.chmod(0o600)
    assert ordinary.run(env, "status").returncode == 0
