"""The temp files beside a session being placed (pi/placement.py): those of fetches whose process
is gone are removed when the next one starts; a live one's, and names this node did not make, stay."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from p2pnode.pi.placement import _remove_stale


def test_only_the_temp_files_of_dead_fetches_are_removed(tmp_path: Path) -> None:
    src = "ab" * 32
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead = tmp_path / f".p2pnode-{src[:16]}.{int(gone.stdout)}.tmp"
    live = tmp_path / f".p2pnode-{src[:16]}.{os.getpid()}.tmp"
    odd = tmp_path / f".p2pnode-{src[:16]}.\u00b2.tmp"  # a digit to str.isdigit(), not to int()
    other = tmp_path / f".p2pnode-{'cd' * 8}.1.tmp"
    for p in (dead, live, odd, other):
        p.write_bytes(b"x")
    _remove_stale(tmp_path, src)
    assert not dead.exists() and live.exists() and odd.exists() and other.exists()


def test_fetches_of_one_version_at_once_in_one_process_do_not_mix(tmp_path: Path) -> None:
    """A node places for several fetches and follows at once (one pid): two of the same
    version each write their own temp file, and two appends of it to the placed file are
    one after the other: the second finds that version there and writes nothing (the file was
    one old version plus two copies of the new bytes: found by a soak of the running node);
    the older version placed again finds it inside the newer one: nothing written either."""
    import threading

    from p2pnode.library.manifest import PlacedFiles
    from p2pnode.pi.placement import Content, PlacementConflict, SessionFile, appendable, hash_bytes
    from p2pnode.pi.session import parse_header

    line = b'{"type":"session","version":3,"id":"0a1b2c3d-0000-7000-8000-000000000001",' \
           b'"timestamp":"2026-11-28T09:00:00.000Z","cwd":"/w"}\n'
    old = line + b'{"type":"message","id":"m1","parentId":null,"message":{"role":"user","content":"a"}}\n'
    more = b'{"type":"message","id":"m2","parentId":"m1","message":{"role":"user","content":"b"}}\n'
    new = old + more * 500
    header, agent, staging = parse_header(line, "test"), tmp_path / "agent", tmp_path / "fetching"
    placed = PlacedFiles(tmp_path / "placed.json")

    def written(data: bytes, start: int = 0) -> SessionFile:
        f = SessionFile.create(agent, header, hash_bytes(new), staging=staging)
        f.write(data[start:])
        return f

    first = written(old)
    target = first.publish(Content(hash_bytes(old), len(old), hash_bytes(old), None), placed).path
    both = [written(new, len(old)), written(new, len(old))]
    assert both[0].tmp != both[1].tmp and both[0].tmp.exists() and both[1].tmp.exists()
    to = appendable(target, placed, hash_bytes(old), len(old), True)
    assert to is not None
    content = Content(hash_bytes(new), len(new), hash_bytes(new), None)
    start = threading.Barrier(2)
    outcomes: list[str] = []

    def append(f: SessionFile) -> None:
        start.wait()
        try:
            outcomes.append("appended" if f.append_to(to, len(old), content, placed).written else "there")
        except PlacementConflict:
            outcomes.append("refused")

    threads = [threading.Thread(target=append, args=(f,)) for f in both]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["appended", "there"] and target.read_bytes() == new
    again = written(old).publish(Content(hash_bytes(old), len(old), hash_bytes(old), None), placed)
    assert not again.written and target.read_bytes() == new
    assert list(staging.iterdir()) == []


def test_a_session_is_placed_where_the_file_system_has_no_hard_links(tmp_path: Path, monkeypatch) -> None:
    """Pi's folder on an exFAT or FAT drive (or an SMB share): os.link fails there (ENOTSUP on
    macOS, EPERM on Linux).  Simulated (no such file system can be mounted here): os.link fails
    for every target under the agent dir.  The session is placed all the same, from a hidden
    copy renamed into place, and a second placement of another file there is still refused."""
    import errno

    from p2pnode.library.manifest import PlacedFiles
    from p2pnode.pi import placement
    from p2pnode.pi.placement import Content, PlacementConflict, SessionFile, hash_bytes
    from p2pnode.pi.session import parse_header

    agent, staging = tmp_path / "agent", tmp_path / "fetching"
    real_link = os.link

    def no_links(src: str | Path, dst: str | Path) -> None:
        if Path(dst).is_relative_to(agent):
            raise OSError(errno.ENOTSUP, "Operation not supported", str(src), None, str(dst))
        real_link(src, dst)

    monkeypatch.setattr(placement.os, "link", no_links)
    line = b'{"type":"session","version":3,"id":"0a1b2c3d-0000-7000-8000-000000000002",' \
           b'"timestamp":"2026-11-28T09:00:00.000Z","cwd":"/w"}\n'
    data = line + b'{"type":"message","id":"m1","parentId":null,"message":{"role":"user","content":"a"}}\n'
    header, placed = parse_header(line, "test"), PlacedFiles(tmp_path / "placed.json")
    content = Content(hash_bytes(data), len(data), hash_bytes(data), None)
    f = SessionFile.create(agent, header, content.src, staging=staging)
    f.write(data)
    target = f.publish(content, placed).path
    assert target.read_bytes() == data and target.is_relative_to(agent)
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no hidden copy left
    other = data + b'{"type":"message","id":"m2","parentId":"m1","message":{"role":"user","content":"b"}}\n'
    target.write_bytes(b"the user's own file\n")  # not what a fetch placed
    f = SessionFile.create(agent, header, hash_bytes(other), staging=staging)
    f.write(other)
    try:
        f.publish(Content(hash_bytes(other), len(other), hash_bytes(other), None), placed)
        raise AssertionError("placed over the user's file")
    except PlacementConflict:
        pass
    assert target.read_bytes() == b"the user's own file\n"


def test_a_placed_version_is_replaced_from_a_staging_dir_on_another_file_system(tmp_path: Path,
                                                                                 monkeypatch) -> None:
    """The node stages in its home; Pi's folder may be on another drive.  A placed file whose
    stat changed (a `touch`) is replaced, not appended to: that rename crossed file systems
    (EXDEV, exit 1).  Simulated: os.replace from the staging dir fails with EXDEV."""
    import errno
    import time

    from p2pnode.library.manifest import PlacedFiles
    from p2pnode.pi import placement
    from p2pnode.pi.placement import Content, SessionFile, hash_bytes
    from p2pnode.pi.session import parse_header

    agent, staging = tmp_path / "agent", tmp_path / "fetching"
    real_replace = os.replace

    def cross_device(src: str | Path, dst: str | Path) -> None:
        if Path(src).is_relative_to(staging):
            raise OSError(errno.EXDEV, "Invalid cross-device link", str(src), None, str(dst))
        real_replace(src, dst)

    monkeypatch.setattr(placement.os, "replace", cross_device)
    line = b'{"type":"session","version":3,"id":"0a1b2c3d-0000-7000-8000-000000000003",' \
           b'"timestamp":"2026-11-28T09:00:00.000Z","cwd":"/w"}\n'
    old = line + b'{"type":"message","id":"m1","parentId":null,"message":{"role":"user","content":"a"}}\n'
    new = old + b'{"type":"message","id":"m2","parentId":"m1","message":{"role":"user","content":"b"}}\n'
    header, placed = parse_header(line, "test"), PlacedFiles(tmp_path / "placed.json")
    for data in (old, new):
        f = SessionFile.create(agent, header, hash_bytes(data), staging=staging)
        f.write(data)
        target = f.publish(Content(hash_bytes(data), len(data), hash_bytes(data), None), placed).path
        assert target.read_bytes() == data
        os.utime(target, ns=(time.time_ns(), time.time_ns() + 10**9))  # touched: replaced next time
    assert [p.name for p in target.parent.iterdir()] == [target.name] and list(staging.iterdir()) == []


def test_an_append_cut_short_is_undone_or_finished_by_the_next_fetch(tmp_path: Path, monkeypatch) -> None:
    """An append of a newer version to a placed file that fails (a full disk) leaves the old
    version; one killed (kill -9) leaves the old version and part of the new one, which the
    next fetch of the session finishes (it was a conflict, 'the user's own file', for ever)."""
    import errno

    import pytest

    from p2pnode.library.manifest import PlacedFile, PlacedFiles
    from p2pnode.pi import placement
    from p2pnode.pi.placement import Content, PlacementConflict, SessionFile, appendable, hash_bytes, stamp_of
    from p2pnode.pi.session import parse_header

    line = b'{"type":"session","version":3,"id":"0a1b2c3d-0000-7000-8000-000000000004",' \
           b'"timestamp":"2026-11-28T09:00:00.000Z","cwd":"/w"}\n'
    old = line + b'{"type":"message","id":"m1","parentId":null,"message":{"role":"user","content":"a"}}\n'
    new = old + b'{"type":"message","id":"m2","parentId":"m1","message":{"role":"user","content":"b"}}\n' * 40
    header, agent, staging = parse_header(line, "test"), tmp_path / "agent", tmp_path / "fetching"
    placed = PlacedFiles(tmp_path / "placed.json")

    def staged(data: bytes, start: int = 0) -> SessionFile:
        f = SessionFile.create(agent, header, hash_bytes(data), staging=staging)
        f.write(data[start:])
        return f

    content = Content(hash_bytes(new), len(new), hash_bytes(new), None)
    target = staged(old).publish(Content(hash_bytes(old), len(old), hash_bytes(old), None), placed).path
    to = appendable(target, placed, hash_bytes(old), len(old), True)
    assert to is not None

    def full_disk(fd: int, data: bytes, offset: int) -> None:
        os.pwrite(fd, data[: len(data) // 2], offset)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(placement, "write_at", full_disk)
    with pytest.raises(OSError, match="No space"):
        staged(new, len(old)).append_to(to, len(old), content, placed)
    assert target.read_bytes() == old  # as before the append
    monkeypatch.undo()
    with open(target, "ab") as f:  # Pi's own line: the user's file now, never replaced
        f.write(new[len(old): len(old) + 94])
    with pytest.raises(PlacementConflict, match="own file"):
        staged(new).publish(content, placed)
    os.truncate(target, len(old))
    placed.record(target, PlacedFile(len(old), hash_bytes(old)), stamp_of(target))
    placed.appending(target, PlacedFile(content.size, content.blake3))  # what a kill -9 part-way
    with open(target, "ab") as f:  # into the append leaves
        f.write(new[len(old): len(old) + 100])
    again = staged(new).publish(content, placed)
    assert again.written and target.read_bytes() == new
    assert [p.name for p in target.parent.iterdir()] == [target.name]
