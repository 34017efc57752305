"""Pi headers, Pi's directory layout, hostile header fields and parentSession lineage."""
from __future__ import annotations

import json
import os
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from p2pnode.errors import InvalidInput, NotFound
from p2pnode.pi import session as pisession
from p2pnode.pi.session import HostileHeader, InvalidHeader, SessionHeader


def header_line(**fields: object) -> bytes:
    obj = {"type": "session", "version": 3, "id": "01a1ff93-0000-7000-8000-000000000001",
           "timestamp": "2026-11-21T19:26:27.092Z", "cwd": "/tmp/work/x"}
    obj.update(fields)
    return json.dumps({k: v for k, v in obj.items() if v is not None}, separators=(",", ":")).encode() + b"\n"


def write_session(path: Path, **fields: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header_line(**fields) + b'{"type":"model_change","id":"aa","parentId":null}\n')
    return path


def test_every_corpus_header_parses_and_its_dir_is_pis_encoding(corpus_dir: Path,
                                                                 corpus_manifest: dict) -> None:
    for entry in corpus_manifest["files"]:
        path = corpus_dir / entry["path"]
        header = pisession.read_header(path)
        assert header.id == entry["header"]["id"]
        assert header.cwd == entry["header"]["cwd"]
        assert header.parent_session == entry["header"].get("parentSession")
        assert path.parent.name == pisession.session_dir_name(header.cwd)
        rel = pisession.session_relpath(header)
        assert rel.parts[:2] == ("sessions", path.parent.name)
        if entry["checks"]["name_uuid_equals_header_id"] and entry["checks"]["name_pattern"]:
            assert rel.name == path.name  # Pi's own file name, rebuilt from the header alone


def test_dir_encoding_edge_cases() -> None:
    assert pisession.session_dir_name("/tmp/pi-harness/work/alpha") == "--tmp-pi-harness-work-alpha--"
    assert pisession.session_dir_name("/a-b/c") == pisession.session_dir_name("/a/b-c")  # lossy, as in Pi
    assert pisession.session_dir_name("C:\\Users\\me") == "--C--Users-me--"
    assert pisession.session_dir_name("/with space/ünï") == "--with space-ünï--"
    assert pisession.session_dir_name("//double") == "---double--"  # only one leading / is dropped
    name = pisession.session_file_name("2026-11-21T19:26:27.092Z", "abc")
    assert name == "2026-11-21T19-26-27-092Z_abc.jsonl"


@pytest.mark.parametrize(
    ("fields", "complaint"),
    [
        ({"id": "../../etc/passwd"}, "the id"),
        ({"id": "a/b"}, "the id"),
        ({"id": ".."}, "the id"),
        ({"id": "a\x00b"}, "the id"),
        ({"id": "a."}, "the id"),
        ({"id": "-a"}, "the id"),
        ({"id": "a b"}, "the id"),
        ({"id": "a" * 225}, "over 255 bytes"),  # 24 + 1 + 225 + 6 bytes of file name
        ({"timestamp": "2026/11/21"}, "timestamp"),
        ({"timestamp": None}, "timestamp"),
        ({"cwd": "/tmp/../../etc"}, "'..'"),
        ({"cwd": "/tmp/a\x00b"}, "control"),
        ({"cwd": "/" + "x" * 5000}, "over 4096"),
        ({"cwd": "/" + "y" * 300}, "over 255 bytes"),
        ({"cwd": None}, "no cwd"),
    ],
)
def test_hostile_header_fields_are_refused(fields: dict, complaint: str) -> None:
    header = pisession.parse_header(header_line(**fields).rstrip(b"\n"), "test")
    with pytest.raises(HostileHeader, match=complaint):
        pisession.session_relpath(header)


def test_a_safe_header_gives_a_relative_path_inside_sessions() -> None:
    rel = pisession.session_relpath(pisession.parse_header(header_line().rstrip(), "t"))
    assert rel == PurePosixPath(
        "sessions/--tmp-work-x--/2026-11-21T19-26-27-092Z_01a1ff93-0000-7000-8000-000000000001.jsonl")
    assert not rel.is_absolute() and ".." not in rel.parts


def test_bad_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="does not exist"):
        pisession.read_header(tmp_path / "missing.jsonl")
    with pytest.raises(InvalidInput, match="is a directory"):
        pisession.read_header(tmp_path)
    (tmp_path / "empty.jsonl").write_bytes(b"")
    with pytest.raises(InvalidHeader, match="empty"):
        pisession.read_header(tmp_path / "empty.jsonl")
    (tmp_path / "text.jsonl").write_bytes(b"hello world\n")
    with pytest.raises(InvalidHeader, match="not a JSON"):
        pisession.read_header(tmp_path / "text.jsonl")
    (tmp_path / "entry.jsonl").write_bytes(b'{"type":"message","id":"x"}\n')
    with pytest.raises(InvalidHeader, match="type is not"):
        pisession.read_header(tmp_path / "entry.jsonl")
    (tmp_path / "noid.jsonl").write_bytes(b'{"type":"session","version":3}\n')
    with pytest.raises(InvalidHeader, match="no id"):
        pisession.read_header(tmp_path / "noid.jsonl")
    (tmp_path / "badcwd.jsonl").write_bytes(b'{"type":"session","id":"x","cwd":5}\n')
    with pytest.raises(InvalidHeader, match="cwd is int"):
        pisession.read_header(tmp_path / "badcwd.jsonl")
    (tmp_path / "long.jsonl").write_bytes(b"{" + b" " * (pisession.MAX_HEADER_BYTES + 10))
    with pytest.raises(InvalidHeader, match="longer than"):
        pisession.read_header(tmp_path / "long.jsonl")


def test_old_branched_from_field_counts_as_parent() -> None:
    header = pisession.parse_header(b'{"type":"session","id":"x","cwd":"/w","branchedFrom":"/p.jsonl"}', "t")
    assert header.parent_session == "/p.jsonl"


def test_parent_candidates_as_stored_moved_agent_dir_session_dir_and_beside_the_child(tmp_path: Path) -> None:
    agent = tmp_path / "agent"
    work = tmp_path / "work" / "proj"
    child = tmp_path / "flat" / "child.jsonl"
    flat = tmp_path / "sessdir"

    absolute = SessionHeader("c", None, str(work), "/old/home/.pi/agent/sessions/--w--/p.jsonl", 3)
    assert pisession.parent_candidates(absolute, agent, child, flat) == [
        Path("/old/home/.pi/agent/sessions/--w--/p.jsonl"), agent / "sessions/--w--/p.jsonl",
        flat / "p.jsonl", child.parent / "p.jsonl"]
    relative = SessionHeader("c", None, str(work), "../../agent/sessions/--w--/p.jsonl", 3)
    assert pisession.parent_candidates(relative, agent)[0] == tmp_path / "agent/sessions/--w--/p.jsonl"
    no_tail = SessionHeader("c", None, str(work), "/elsewhere/p.jsonl", 3)
    assert pisession.parent_candidates(no_tail, agent, child) == [Path("/elsewhere/p.jsonl"),
                                                                  child.parent / "p.jsonl"]
    assert pisession.parent_candidates(SessionHeader("c", None, str(work), None, 3), agent) == []


def test_session_ids_as_pi_1_5_2_allows_them() -> None:
    for good in ("my.session_1", "fork-of-my.session_1", "a", "0", "L" + "0123456789abcdef" * 12 + "-end"):
        header = SessionHeader(good, "2026-11-23T11:40:10.981Z", "/w", None, 3)
        assert pisession.session_relpath(header).name == f"2026-11-23T11-40-10-981Z_{good}.jsonl"
    for bad in ("", ".a", "a.", "a_", "_a", "a/b", "a\\b", "ä", "a\nb"):
        with pytest.raises(HostileHeader, match="the id"):
            pisession.placed_names(SessionHeader(bad, "2026-11-23T11:40:10.981Z", "/w", None, 3))
    longest = "x" * (255 - len("2026-11-23T11-40-10-981Z_.jsonl"))
    header = SessionHeader(longest, "2026-11-23T11:40:10.981Z", "/w", None, 3)
    assert len(pisession.placed_names(header)[1]) == 255
    with pytest.raises(HostileHeader, match="over 255 bytes"):
        pisession.placed_names(SessionHeader(longest + "x", "2026-11-23T11:40:10.981Z", "/w", None, 3))


def test_header_after_blank_and_malformed_lines(tmp_path: Path) -> None:
    """pi 1.5.2 finds the header within the first 1 MiB, past blank and malformed lines; the
    first JSON line must be it."""
    path = tmp_path / "s.jsonl"
    path.write_bytes(b"\n   \n{broken\n" + b"x" * 70_000 + b"\n" + header_line(id="late") + b'{"type":"x"}\n')
    assert pisession.read_header(path).id == "late"
    lines = path.read_bytes().splitlines(keepends=True)
    assert pisession.header_index(lines, "t") == 4 and pisession.find_header(lines, "t").id == "late"
    path.write_bytes(b"\n" * (pisession.HEADER_SCAN_BYTES + 1) + header_line())
    scanned = f"only blank lines in its first {pisession.HEADER_SCAN_BYTES} bytes "
    with pytest.raises(InvalidHeader, match=scanned + r"\(pi 1.5.2 looks for the header no further\)"):
        pisession.read_header(path)  # (it was "is empty")
    path.write_bytes(b"\n\r\n  \n")
    with pytest.raises(InvalidHeader, match="has only blank lines: no Pi session header"):
        pisession.read_header(path)
    path.write_bytes(b"junk\n" * 300_000 + header_line())
    with pytest.raises(InvalidHeader, match="not a JSON"):
        pisession.read_header(path)
    path.write_bytes(b"\n" + b'{"type":"message","id":"1"}\n' + header_line())
    with pytest.raises(InvalidHeader, match="type is not"):
        pisession.read_header(path)


def test_system_prompt_is_recognised(corpus_dir: Path, corpus_new_dir: Path) -> None:
    assert all(pisession.has_system_prompt(p) for p in (corpus_new_dir / "sessions").glob("*/*.jsonl")
               if p.stat().st_size)
    assert not any(pisession.has_system_prompt(p) for p in (corpus_dir / "sessions").glob("*/*.jsonl"))


def test_session_dir_as_pi_resolves_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--session-dir, then $PI_CODING_AGENT_SESSION_DIR (~ expanded), then settings.json
    sessionDir (the project's over the global one), relative to the cwd."""
    from p2pnode.paths import PiDirs, session_dir

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    agent, cwd = tmp_path / "agent", tmp_path / "proj"
    (cwd / ".pi").mkdir(parents=True)
    agent.mkdir()
    assert session_dir(str(cwd), agent, env={}) is None
    (agent / "settings.json").write_text('{"sessionDir": "~/global-sessions"}')
    assert session_dir(str(cwd), agent, env={}) == tmp_path / "home" / "global-sessions"
    (cwd / ".pi" / "settings.json").write_text('{"theme": "dark", "sessionDir": "rel/sessions"}')
    assert session_dir(str(cwd), agent, env={}) == cwd / "rel" / "sessions"
    env = {"PI_CODING_AGENT_SESSION_DIR": "~/env-sessions"}
    assert session_dir(str(cwd), agent, env=env) == tmp_path / "home" / "env-sessions"
    assert session_dir(str(cwd), agent, "opt", env) == cwd / "opt"
    (cwd / ".pi" / "settings.json").write_text("{not json")  # Pi goes on without a broken file
    assert session_dir(str(cwd), agent, env={}) == tmp_path / "home" / "global-sessions"
    pi = PiDirs.resolve(str(cwd), env={"PI_CODING_AGENT_DIR": str(agent)})
    assert PiDirs.from_dict(pi.as_dict()) == pi == PiDirs(agent, tmp_path / "home" / "global-sessions")
    with pytest.raises(ValueError):
        PiDirs.from_dict({"agent_dir": "relative", "session_dir": None})


def test_a_session_dir_is_flat_and_the_only_place_looked(tmp_path: Path) -> None:
    agent, flat = tmp_path / "agent", tmp_path / "flat"
    default = agent / "sessions" / pisession.session_dir_name("/tmp/work/x") / "default.jsonl"
    write_session(default, id="in-default")
    mine = write_session(flat / "a.jsonl", id="flat-a", cwd="/tmp/work/x")
    other = write_session(flat / "b.jsonl", id="flat-b", cwd="/tmp/work/other")
    os.utime(other, ns=(3 * 10**18, 3 * 10**18))  # newer, but another project's
    assert pisession.session_files(agent, flat) == [mine, other]
    assert pisession.latest_session(agent, "/tmp/work/x", flat) == mine
    assert pisession.find_by_id(agent, "flat-b", flat) == other
    with pytest.raises(NotFound, match=str(flat)):
        pisession.find_by_id(agent, "in-default", flat)


def test_find_by_id_prefix_and_latest(tmp_path: Path) -> None:
    agent = tmp_path / "agent"
    d = agent / "sessions" / pisession.session_dir_name("/tmp/work/x")
    first = write_session(d / "one.jsonl", id="0199-aaaa-1")
    second = write_session(d / "two.jsonl", id="0199-aaaa-2")
    (d / "junk.jsonl").write_bytes(b"not a session\n")
    assert pisession.find_by_id(agent, "0199-aaaa-1") == first
    assert pisession.find_by_id(agent, "0199-aaaa-2") == second
    with pytest.raises(InvalidInput, match="matches 2 sessions"):
        pisession.find_by_id(agent, "0199-aaaa")
    with pytest.raises(NotFound):
        pisession.find_by_id(agent, "zzz")
    os.utime(first, ns=(10**18, 10**18))
    os.utime(second, ns=(2 * 10**18, 2 * 10**18))
    os.utime(d / "junk.jsonl", ns=(3 * 10**18, 3 * 10**18))  # newest, but not a session
    assert pisession.latest_session(agent, "/tmp/work/x") == second
    with pytest.raises(NotFound, match="no Pi session"):
        pisession.latest_session(agent, "/tmp/work/other")


def test_files_that_cannot_be_read_are_passed_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A named pipe (opened, it would wait for a writer forever) and a file this user may not
    read (stood in for by an open that fails: root reads anything) beside the sessions: `share`
    with no argument, or by id, takes the session, as pi does."""
    agent = tmp_path / "agent"
    d = agent / "sessions" / pisession.session_dir_name("/tmp/work/x")
    mine = write_session(d / "mine.jsonl", id="0199-bbbb-1")
    os.mkfifo(d / "pipe.jsonl")
    locked = write_session(d / "locked.jsonl", id="0199-bbbb-2")
    real_open = os.open

    def refuse(path: Any, flags: int, *args: Any) -> int:
        if str(path) == str(locked):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refuse)
    for f in (mine, d / "pipe.jsonl", locked):
        os.utime(f, ns=(10**18, 10**18) if f == mine else (2 * 10**18, 2 * 10**18), follow_symlinks=False)
    assert pisession.latest_session(agent, "/tmp/work/x") == mine
    assert pisession.find_by_id(agent, "0199-bbbb") == mine


def test_line_title() -> None:
    assert pisession.line_title(b'{"type":"session_info","id":"1","name":"My work"}\n') == ("name", "My work")
    user = b'{"type":"message","id":"2","message":{"role":"user","content":[{"type":"text","text":"Hi"}]}}\n'
    assert pisession.line_title(user) == ("user", "Hi")
    plain = b'{"type":"message","message":{"role":"user","content":"plain"}}'
    assert pisession.line_title(plain) == ("user", "plain")
    assert pisession.line_title(b'{"type":"message","message":{"role":"assistant"}}\n') is None
    assert pisession.line_title(b'{"role":"user" broken') is None


def test_titles_come_from_the_marks_pi_writes_at_a_lines_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """The name of the last session_info, else the first user message, looked for where Pi
    writes them (TITLE_SCAN): a long tool output that holds the marks further in, as objects
    (not strings, whose quotes are escaped), is not taken for either, nor even parsed."""
    parsed: list[bytes] = []
    line_title = pisession.line_title
    monkeypatch.setattr(pisession, "line_title", lambda line: parsed.append(line) or line_title(line))
    start = b'"id":"45bafc27","parentId":"a144fe42","timestamp":"2026-11-21T19:26:27.132Z"'
    user = b'{"type":"message",' + start + \
        b',"message":{"role":"user","content":[{"type":"text","text":"Add a helper."}],"timestamp":1}}\n'
    named = b'{"type":"session_info",' + start + b',"name":"beta main line"}\n'
    nested = json.dumps({"type": "message", "message": {"role": "toolResult", "content": [
        {"type": "text", "text": "x" * 4000}], "details": {"log": [{"type": "session_info", "name": "no"},
                                                                   {"role": "user", "content": "no"}]}}},
                        separators=(",", ":")).encode()
    assert nested.find(b'"role":"user"') > pisession.TITLE_SCAN
    titles: tuple[str | None, str | None] = (None, None)
    for line in (nested, user, nested, named, nested):
        titles = pisession.titles_after(line, *titles)
    assert titles == ("beta main line", "Add a helper.")
    assert pisession.titles_after(nested, None, None) == (None, None)
    assert parsed == [user, named]


def _big(blocks: list[dict[str, Any]], **top: Any) -> bytes:
    entry = {"type": "message", "id": "3", "message": {"role": "user", "content": blocks}, **top}
    return json.dumps(entry, separators=(",", ":")).encode() + b"\n"


IMAGE = {"type": "image", "data": "QUJD" * 400_000, "mimeType": "image/png"}


@pytest.mark.parametrize("line", [
    _big([IMAGE, {"type": "text", "text": "what is in this picture?"}]),
    _big([{"type": "text", "text": 'a "data":"quoted" word'}, IMAGE, IMAGE]),
    _big([{"type": "image", "data": "Q\\/" * 600_000}, {"type": "text", "text": "escaped data"}]),
    _big([{"type": "text", "text": "x" * 2_000_000}]),
    _big([IMAGE], note={"data": "not an image, " * 1000}),
    json.dumps({"type": "session_info", "name": "named", "data": "QUJD" * 400_000},
               separators=(",", ":")).encode(),
], ids=["image then text", "text quoting the key", "escaped data", "long text", "no text", "session name"])
def test_a_big_lines_title_is_the_one_its_whole_parse_gives(line: bytes,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Lines over TITLE_PARSE_MAX lose their images' data before the title search parses them:
    the same title as parsing them whole, the stripped line still JSON."""
    assert len(line) > pisession.TITLE_PARSE_MAX
    stripped = pisession._without_image_data(line)
    json.loads(stripped)
    assert len(stripped) < len(line) or b"\\" in line or b"QUJD" not in line
    title = pisession.line_title(line)
    monkeypatch.setattr(pisession, "TITLE_PARSE_MAX", 1 << 40)
    assert title == pisession.line_title(line)
