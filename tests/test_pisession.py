"""Pi headers, Pi's directory layout, hostile header fields and parentSession lineage."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path, PurePosixPath

import pytest

from p2pnode import pisession
from p2pnode.errors import InvalidInput, NotFound
from p2pnode.pisession import HostileHeader, InvalidHeader, LineageCycle, SessionHeader


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
        ({"id": "a" * 129}, "the id"),
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


def test_parent_resolution_absolute_relative_and_moved_agent_dir(tmp_path: Path) -> None:
    agent = tmp_path / "agent"
    parent = write_session(agent / "sessions" / "--w--" / "p.jsonl")
    work = tmp_path / "work" / "proj"
    work.mkdir(parents=True)
    child = tmp_path / "child.jsonl"

    absolute = SessionHeader("c", None, str(work), str(parent), 3)
    assert pisession.resolve_parent(absolute, child, agent) == parent

    relative = SessionHeader("c", None, str(work), "../../agent/sessions/--w--/p.jsonl", 3)
    assert pisession.resolve_parent(relative, child, agent).resolve() == parent.resolve()

    moved = SessionHeader("c", None, str(work), "/old/home/.pi/agent/sessions/--w--/p.jsonl", 3)
    assert pisession.resolve_parent(moved, child, agent) == parent

    missing = SessionHeader("c", None, str(work), "/old/home/.pi/agent/sessions/--w--/gone.jsonl", 3)
    with pytest.raises(NotFound, match="/old/home/.pi/agent/sessions/--w--/gone.jsonl") as info:
        pisession.resolve_parent(missing, child, agent)
    assert "--no-lineage" in str(info.value)

    no_tail = SessionHeader("c", None, str(work), "/elsewhere/p.jsonl", 3)
    with pytest.raises(NotFound):
        pisession.resolve_parent(no_tail, child, agent)


def test_lineage_walks_to_the_root_and_detects_cycles(tmp_path: Path) -> None:
    agent = tmp_path / "agent"
    d = agent / "sessions" / "--w--"
    a = write_session(d / "a.jsonl", id="a")
    b = write_session(d / "b.jsonl", id="b", parentSession=str(a))
    c = write_session(d / "c.jsonl", id="c", parentSession=str(b))
    assert [h.id for _, h in pisession.lineage(c, agent)] == ["c", "b", "a"]
    assert [h.id for _, h in pisession.lineage(c, agent, follow=False)] == ["c"]

    write_session(d / "a.jsonl", id="a", parentSession=str(c))  # a -> c -> b -> a
    with pytest.raises(LineageCycle, match="cycle"):
        pisession.lineage(c, agent)
    selfish = write_session(d / "s.jsonl", id="s", parentSession=str(d / "s.jsonl"))
    with pytest.raises(LineageCycle):
        pisession.lineage(selfish, agent)
    os.link(b, d / "b-hardlink.jsonl")  # the same file under another name is still the same file
    write_session(d / "a.jsonl", id="a", parentSession=str(d / "b-hardlink.jsonl"))
    with pytest.raises(LineageCycle):
        pisession.lineage(c, agent)


def test_corpus_lineage_through_the_moved_agent_dir(corpus_dir: Path, tmp_path: Path) -> None:
    agent = tmp_path / "agent"
    shutil.copytree(corpus_dir / "sessions", agent / "sessions")
    b5 = next((agent / "sessions").glob("*/*69ef-76bb-aaf0-d291c98d9fe0.jsonl"))
    chain = pisession.lineage(b5, agent)
    assert [h.id[-12:] for _, h in chain] == ["d291c98d9fe0", "758d028dc479", "ca966db56817", "0b533764bed8"]


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


def test_line_title() -> None:
    assert pisession.line_title(b'{"type":"session_info","id":"1","name":"My work"}\n') == ("name", "My work")
    user = b'{"type":"message","id":"2","message":{"role":"user","content":[{"type":"text","text":"Hi"}]}}\n'
    assert pisession.line_title(user) == ("user", "Hi")
    plain = b'{"type":"message","message":{"role":"user","content":"plain"}}'
    assert pisession.line_title(plain) == ("user", "plain")
    assert pisession.line_title(b'{"type":"message","message":{"role":"assistant"}}\n') is None
    assert pisession.line_title(b'{"role":"user" broken') is None
