"""Placing a fetched session (pi/placement.py): the temp files of fetches whose process is gone
are removed when the next one starts; fetches of one version at once do not mix; a file system
without hard links, or across devices; an append cut short."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from p2pnode.library.manifest import PlacedFile, PlacedFiles
from p2pnode.pi import placement
from p2pnode.pi.placement import (
    Content,
    PiFolderFull,
    PlacementConflict,
    SessionFile,
    _remove_stale,
    appendable,
    hash_bytes,
    stamp_of,
)
from p2pnode.pi.session import SessionHeader, parse_header


def _session(n: int) -> tuple[SessionHeader, bytes, bytes]:
    """Session n's header, its first version (the header and one message) and a message more."""
    line = b'{"type":"session","version":3,"id":"0a1b2c3d-0000-7000-8000-%012d",' % n + \
        b'"timestamp":"2026-11-28T09:00:00.000Z","cwd":"/w"}\n'
    first = line + b'{"type":"message","id":"m1","parentId":null,"message":{"role":"user","content":"a"}}\n'
    more = b'{"type":"message","id":"m2","parentId":"m1","message":{"role":"user","content":"b"}}\n'
    return parse_header(line, "test"), first, more


def _content(data: bytes) -> Content:
    return Content(hash_bytes(data), len(data), hash_bytes(data), None)


def _staged(tmp_path: Path, header: SessionHeader, data: bytes, start: int = 0) -> SessionFile:
    """The bytes of `data` from `start` in a fetch's temp file in the node's staging dir."""
    f = SessionFile.create(tmp_path / "agent", header, hash_bytes(data), staging=tmp_path / "fetching")
    f.write(data[start:])
    return f


def _fails(monkeypatch: pytest.MonkeyPatch, call: str, code: int, when: Path, side: int) -> None:
    """os.<call>(src, dst) fails with `code` when its argument `side` (0: src, 1: dst) is under
    `when`: a file system the tests cannot mount here, simulated."""
    real = getattr(os, call)

    def failing(src: str | Path, dst: str | Path) -> None:
        if Path((src, dst)[side]).is_relative_to(when):
            raise OSError(code, os.strerror(code), str(src), None, str(dst))
        real(src, dst)

    monkeypatch.setattr(placement.os, call, failing)


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
    header, old, more = _session(1)
    new = old + more * 500
    placed = PlacedFiles(tmp_path / "placed.json")
    target = _staged(tmp_path, header, old).publish(_content(old), placed).path
    both = [_staged(tmp_path, header, new, len(old)), _staged(tmp_path, header, new, len(old))]
    assert both[0].tmp != both[1].tmp and both[0].tmp.exists() and both[1].tmp.exists()
    to = appendable(target, placed, hash_bytes(old), len(old), True)
    assert to is not None
    start = threading.Barrier(2)
    outcomes: list[str] = []

    def append(f: SessionFile) -> None:
        start.wait()
        try:
            written = f.append_to(to, len(old), _content(new), placed).written
            outcomes.append("appended" if written else "there")
        except PlacementConflict:
            outcomes.append("refused")

    threads = [threading.Thread(target=append, args=(f,)) for f in both]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["appended", "there"] and target.read_bytes() == new
    again = _staged(tmp_path, header, old).publish(_content(old), placed)
    assert not again.written and target.read_bytes() == new
    assert list((tmp_path / "fetching").iterdir()) == []


def test_a_session_is_placed_where_the_file_system_has_no_hard_links(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Pi's folder on an exFAT or FAT drive (or an SMB share): os.link fails there (ENOTSUP on
    macOS, EPERM on Linux).  Simulated: os.link fails for every target under the agent dir.
    The session is placed all the same, from a hidden copy renamed into place, and a second
    placement of another file there is still refused."""
    _fails(monkeypatch, "link", errno.ENOTSUP, tmp_path / "agent", side=1)
    header, data, more = _session(2)
    placed = PlacedFiles(tmp_path / "placed.json")
    target = _staged(tmp_path, header, data).publish(_content(data), placed).path
    assert target.read_bytes() == data and target.is_relative_to(tmp_path / "agent")
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no hidden copy left
    target.write_bytes(b"the user's own file\n")  # not what a fetch placed
    with pytest.raises(PlacementConflict):
        _staged(tmp_path, header, data + more).publish(_content(data + more), placed)
    assert target.read_bytes() == b"the user's own file\n"


def test_a_placed_version_is_replaced_from_a_staging_dir_on_another_file_system(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The node stages in its home; Pi's folder may be on another drive.  A placed file whose
    stat changed (a `touch`) is replaced, not appended to: that rename crossed file systems
    (EXDEV, exit 1).  Simulated: os.replace from the staging dir fails with EXDEV."""
    _fails(monkeypatch, "replace", errno.EXDEV, tmp_path / "fetching", side=0)
    header, old, more = _session(3)
    placed = PlacedFiles(tmp_path / "placed.json")
    for data in (old, old + more):
        target = _staged(tmp_path, header, data).publish(_content(data), placed).path
        assert target.read_bytes() == data
        os.utime(target, ns=(time.time_ns(), time.time_ns() + 10**9))  # touched: replaced next time
    assert [p.name for p in target.parent.iterdir()] == [target.name]
    assert list((tmp_path / "fetching").iterdir()) == []


def test_an_append_cut_short_is_undone_or_finished_by_the_next_fetch(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """An append of a newer version to a placed file that fails (a full disk) leaves the old
    version; one killed (kill -9) leaves the old version and part of the new one, which the
    next fetch of the session finishes (it was a conflict, 'the user's own file', for ever);
    a line Pi appended is not taken for that."""
    header, old, more = _session(4)
    new = old + more * 40
    placed = PlacedFiles(tmp_path / "placed.json")
    target = _staged(tmp_path, header, old).publish(_content(old), placed).path
    to = appendable(target, placed, hash_bytes(old), len(old), True)
    assert to is not None

    def full_disk(fd: int, data: bytes, offset: int) -> None:
        os.pwrite(fd, data[: len(data) // 2], offset)
        raise OSError(errno.ENOSPC, "No space left on device")

    # injected: an ordinary user cannot fill a real disk here (the root part fills a real loop device)
    monkeypatch.setattr(placement, "write_at", full_disk)
    with pytest.raises(PiFolderFull, match=f"Pi's session folder {target.parent} is full"):
        _staged(tmp_path, header, new, len(old)).append_to(to, len(old), _content(new), placed)
    assert target.read_bytes() == old  # as before the append
    monkeypatch.undo()
    with open(target, "ab") as f:  # Pi's own line: the user's file now, never replaced
        f.write(more)
    with pytest.raises(PlacementConflict, match="own file"):
        _staged(tmp_path, header, new).publish(_content(new), placed)
    os.truncate(target, len(old))
    placed.record(target, PlacedFile(len(old), hash_bytes(old)), stamp_of(target))
    placed.appending(target, PlacedFile(len(new), hash_bytes(new)))  # what a kill -9 part-way
    with open(target, "ab") as f:  # into the append leaves
        f.write(new[len(old): len(old) + 100])
    again = _staged(tmp_path, header, new).publish(_content(new), placed)
    assert again.written and target.read_bytes() == new
    assert [p.name for p in target.parent.iterdir()] == [target.name]


def test_a_full_pi_folder_is_named_and_leaves_nothing(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Pi's folder full while a session is placed (its temp file there, or the copy beside the
    target when the node stages on another file system): PiFolderFull naming that folder (exit
    1), not an OSError naming no file (the CLI blamed the node's home; the node answered "the
    node failed" with a traceback in its log), and nothing partial is left in Pi's folder.
    ENOSPC is injected: an ordinary user cannot mount a small file system here (a root run on
    a 5 MB tmpfs gives the same message)."""
    header, data, _ = _session(5)
    real = os.write

    def full(fd: int, chunk: bytes) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(placement.os, "write", full)
    with pytest.raises(PiFolderFull) as info:
        placement.place_session(tmp_path / "agent", data, hash_bytes(data))
    folder = placement.target_path(tmp_path / "agent", header).parent
    assert f"Pi's session folder {folder} is full" in str(info.value) and info.value.exit_code == 1
    assert not folder.exists() or list(folder.iterdir()) == []
    monkeypatch.setattr(placement.os, "write", real)
    staged = _staged(tmp_path, header, data)
    _fails(monkeypatch, "link", errno.EXDEV, tmp_path / "fetching", side=0)
    real_flush = placement.flush_data

    def flush(fd: int) -> None:  # the copy's flush, in Pi's folder (the staged file's goes through)
        if Path(os.readlink(f"/proc/self/fd/{fd}")).is_relative_to(tmp_path / "agent"):
            full(fd, b"")
        real_flush(fd)

    monkeypatch.setattr(placement, "flush_data", flush)
    with pytest.raises(PiFolderFull, match=f"Pi's session folder {folder} is full"):
        staged.publish(_content(data), None)
    assert list(folder.iterdir()) == []


def test_a_fetched_file_is_flushed_behind_its_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every FLUSH_EVERY bytes the temp file is flushed on a thread of its own: the writes go
    on while the disk syncs (the writer is a fetch's step, which the next verified lines wait
    for), one flush at a time, and publishing waits for it before its own."""
    header, data, more = _session(6)
    monkeypatch.setattr(placement, "FLUSH_EVERY", 64)
    release, started = threading.Event(), []
    real_flush = placement.flush_data

    def slow(fd: int) -> None:
        started.append(fd)
        assert release.wait(10)
        real_flush(fd)

    monkeypatch.setattr(placement, "flush_data", slow)
    f = SessionFile.create(tmp_path / "agent", header, hash_bytes(data), staging=tmp_path / "fetching")
    for _ in range(4):  # each over FLUSH_EVERY; the first flush still hangs
        f.write(data)
    assert len(started) == 1  # one in flight, none started beside it; the writes did not wait
    threading.Timer(0.2, release.set).start()
    placed = f.publish(_content(data * 4), None)
    assert placed.written and placed.path.read_bytes() == data * 4
    assert len(started) == 2  # the one behind, then publishing's own


def test_a_failed_flush_behind_the_writes_fails_the_placing(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """An I/O error of a flush behind the writes (EIO, injected) is raised by publishing, in
    the fetch's step, and nothing is placed: no error is lost on its thread."""
    header, data, _ = _session(7)
    monkeypatch.setattr(placement, "FLUSH_EVERY", 64)
    real_flush = placement.flush_data
    calls = []

    def failing(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_flush(fd)

    monkeypatch.setattr(placement, "flush_data", failing)
    f = _staged(tmp_path, header, data)
    with pytest.raises(OSError) as info:
        f.publish(_content(data), None)
    assert info.value.errno == errno.EIO
    assert not placement.target_path(tmp_path / "agent", header).exists()
    assert not f.tmp.exists()


def test_a_fetched_file_is_written_behind_and_a_failed_write_fails_the_placing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write returns while its bytes go to the temp file on the file's writer thread (the
    fetch's step hashes the next lines meanwhile), one write in flight: the next waits for it.
    The bytes are placed in order; a write's I/O error (EIO, injected) is raised by the next
    write, or by publishing, and nothing is placed."""
    header, data, more = _session(8)
    release, writing = threading.Event(), []
    real_write = os.write

    def slow(fd: int, chunk: memoryview) -> int:
        writing.append(bytes(chunk))
        assert release.wait(10)
        return real_write(fd, chunk)

    monkeypatch.setattr(placement.os, "write", slow)
    f = SessionFile.create(tmp_path / "agent", header, hash_bytes(data + more), staging=tmp_path / "fetching")
    f.write(data)  # returns with its write hanging
    assert f.written == len(data)
    threading.Timer(0.2, release.set).start()
    f.write(more)  # waits for the first
    assert writing[0] == data
    placed = f.publish(_content(data + more), None)
    assert placed.written and placed.path.read_bytes() == data + more

    def failing(fd: int, chunk: memoryview) -> int:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(placement.os, "write", failing)
    header, data, more = _session(9)
    for last in ("write", "publish"):
        f = SessionFile.create(tmp_path / "agent", header, hash_bytes(data + more),
                               staging=tmp_path / "fetching")
        f.write(data)
        with pytest.raises(OSError) as info:
            f.write(more) if last == "write" else f.publish(_content(data), None)
        assert info.value.errno == errno.EIO
        f.discard()
        assert not placement.target_path(tmp_path / "agent", header).exists() and not f.tmp.exists()


def test_a_fetched_files_last_bytes_are_synced_beside_the_commit(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`flush_soon` (a fetch's, after its last byte) syncs what the writes left unflushed on a
    thread of its own, beside the store's commit; publishing then waits for that sync and does
    not sync again.  A write after it is synced by publishing; an I/O error of that sync (EIO,
    injected) is raised by publishing, and nothing is placed."""
    header, data, more = _session(10)
    real, syncs = placement.flush_data, []

    def counted(fd: int) -> None:
        syncs.append(threading.current_thread().name)
        real(fd)

    monkeypatch.setattr(placement, "flush_data", counted)
    f = _staged(tmp_path, header, data)
    f.flush_soon()
    placed = f.publish(_content(data), None)
    assert placed.written and placed.path.read_bytes() == data
    assert syncs == ["p2pnode-flush"]

    header, data, more = _session(11)
    syncs.clear()
    f = _staged(tmp_path, header, data)
    f.flush_soon()
    f.write(more)
    placed = f.publish(_content(data + more), None)
    assert placed.path.read_bytes() == data + more
    assert syncs == ["p2pnode-flush", "MainThread"]

    def failing(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(placement, "flush_data", failing)
    header, data, more = _session(12)
    f = _staged(tmp_path, header, data)
    f.flush_soon()
    with pytest.raises(OSError) as info:
        f.publish(_content(data), None)
    assert info.value.errno == errno.EIO
    assert not placement.target_path(tmp_path / "agent", header).exists() and not f.tmp.exists()
