"""Portable durability and private file modes.

macOS cannot run here (CI and this suite run on Linux), so its path is simulated: the store
runs with `os.fdatasync` removed, as CPython on macOS has none, which sends every flush
through `flush_all`; and with a `fcntl.F_FULLFSYNC` attribute planted, the flush must be that
fcntl (recorded, then done as fsync, since Linux does not know the command).
"""
from __future__ import annotations

import fcntl
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from store import Store, StoreConfig, StoreLocked, TurnInput
from store.fsck import fsck
from sysio import flush

FAKE_F_FULLFSYNC = 51  # macOS's value; never passed to the real fcntl here
REAL_FSYNC = os.fsync


def _exercise(path: Path) -> None:
    """Append, batch, patch, checkpoint, GC, close, reopen: every flush the store makes."""
    with Store.open(path) as s:
        ctx = s.create_context().context_id
        s.append_turn(ctx, b"first " * 50)
        s.append_turns(ctx, [TurnInput(b"batch %d" % i * 30) for i in range(4)])
        s.append_turn(ctx, os.urandom(100_000))  # a big blob: the pack is flushed too
        s.patch(1, b"patched")
        gone = s.create_context().context_id
        s.append_turn(gone, b"dropped by gc " * 40)
        s.delete_context(gone)
        s.checkpoint()
        s.gc()
    with Store.open(path) as s:
        assert [t.turn_id for t in s.get_last(ctx, 10)] == [1, 2, 3, 4, 5, 6]
        assert s.payloads(s.get_last(ctx, 1))[0] != b""
    assert fsck(path).ok


@pytest.fixture
def no_fdatasync(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """os.fdatasync gone (as on macOS); the fsyncs that replace it are counted."""
    monkeypatch.delattr(os, "fdatasync")
    calls: list[str] = []

    def fsync(fd: int) -> None:
        calls.append("fsync")
        REAL_FSYNC(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    yield calls


def test_store_runs_without_fdatasync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      no_fdatasync: list[str]) -> None:
    """Neither fdatasync nor F_FULLFSYNC (the BSDs): fsync for everything."""
    monkeypatch.delattr(fcntl, "F_FULLFSYNC", raising=False)
    _exercise(tmp_path / "s")
    assert len(no_fdatasync) > 10  # every flush went through fsync


def test_full_fsync_chosen_where_it_exists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           no_fdatasync: list[str]) -> None:
    """macOS cannot run here: F_FULLFSYNC is planted and the fcntl call recorded."""
    monkeypatch.setattr(fcntl, "F_FULLFSYNC", FAKE_F_FULLFSYNC, raising=False)
    real_fcntl = fcntl.fcntl
    full: list[int] = []

    def fake_fcntl(fd: int, cmd: int, *args: object) -> object:
        if cmd == FAKE_F_FULLFSYNC:
            full.append(fd)
            REAL_FSYNC(fd)  # what F_FULLFSYNC does on macOS, and more
            return 0
        return real_fcntl(fd, cmd, *args)

    monkeypatch.setattr(fcntl, "fcntl", fake_fcntl)
    _exercise(tmp_path / "s")
    assert len(full) > 10
    assert no_fdatasync == [], "fsync used although F_FULLFSYNC worked"


def test_full_fsync_refused_falls_back_to_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               no_fdatasync: list[str]) -> None:
    """Some file systems (network, FUSE) refuse F_FULLFSYNC: fsync is then used."""
    monkeypatch.setattr(fcntl, "F_FULLFSYNC", FAKE_F_FULLFSYNC, raising=False)
    refused: list[int] = []

    def fake_fcntl(fd: int, cmd: int, *args: object) -> object:
        refused.append(fd)
        raise OSError(45, "Operation not supported")

    monkeypatch.setattr(fcntl, "fcntl", fake_fcntl)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        flush.flush_data(fd)
    finally:
        os.close(fd)
    flush.flush_dir(tmp_path)
    assert len(refused) == 2 and no_fdatasync == ["fsync", "fsync"]


def test_fdatasync_used_where_it_exists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (calls.append(fd), real(fd))[1])
    _exercise(tmp_path / "s")
    assert len(calls) > 10


# --- file modes ----------------------------------------------------------------------------


def _modes(root: Path) -> dict[str, int]:
    out = {".": stat.S_IMODE(os.stat(root).st_mode)}
    for p in root.rglob("*"):
        out[str(p.relative_to(root))] = stat.S_IMODE(os.lstat(p).st_mode)
    return out


def _assert_private(root: Path) -> None:
    modes = _modes(root)
    assert modes["."] == 0o700, modes
    files = {k: v for k, v in modes.items() if k != "."}
    assert {"blobs.pack", "blobs.idx", "turns.log", "turns.skip", "patches.log", "heads.tbl",
            "LOCK"} <= set(files), files
    wrong = {k: oct(v) for k, v in files.items() if v != 0o600}
    assert not wrong, f"not 0600: {wrong}"


def _store_with_everything(path: Path) -> None:
    with Store.open(path) as s:
        ctx = s.create_context().context_id
        for i in range(3):
            s.append_turn(ctx, b"turn %d " % i * 100)
        s.patch(1, b"patched")
        s.checkpoint()
        s.checkpoint()  # heads.tbl.prev too
        s.gc()


@pytest.mark.parametrize("umask", [0, 0o077, 0o022])
def test_store_files_private_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        _store_with_everything(tmp_path / "s")
        with Store.open(tmp_path / "s") as s:  # open while another may peek: still private
            _assert_private(tmp_path / "s")
            s.append_turn(1, b"more")
    finally:
        os.umask(old)
    _assert_private(tmp_path / "s")
    assert "heads.tbl.prev" in _modes(tmp_path / "s")


def test_existing_wide_store_is_tightened(tmp_path: Path) -> None:
    """A store made before this rule (0755 directory, 0644 files) is tightened on open."""
    root = tmp_path / "s"
    _store_with_everything(root)
    os.chmod(root, 0o755)
    for p in root.iterdir():
        os.chmod(p, 0o644)
    old = os.umask(0)
    try:
        with Store.open(root) as s:
            s.append_turn(1, b"after")
            s.checkpoint()
    finally:
        os.umask(old)
    _assert_private(root)


def test_tightening_takes_only_group_and_other_bits(tmp_path: Path) -> None:
    """A file the user made read-only (0444, 0400) loses group's and others' bits but is not made
    writable again; a 0750 directory becomes 0700, not more."""
    root = tmp_path / "s"
    _store_with_everything(root)
    os.chmod(root / "heads.tbl.prev", 0o444)
    os.chmod(root / "blobs.idx", 0o400)
    os.chmod(root, 0o750)
    with Store.open(root):
        pass
    modes = _modes(root)
    assert modes["heads.tbl.prev"] == 0o400 and modes["blobs.idx"] == 0o400
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700


def test_opening_a_store_another_holder_is_checkpointing(tmp_path: Path) -> None:
    """A second opener tightens the store's files before it asks for the lock, while the holder
    renames heads.tbl.tmp into place: a file gone between listing and stat is skipped, and the
    second opener is told the store is locked, never that a file is missing."""
    root = tmp_path / "s"
    done = threading.Event()
    with Store.open(root, StoreConfig(durable=False)) as held:
        held.append_turn(held.create_context().context_id, b"x")

        def checkpoint_often() -> None:
            for _ in range(400):
                held.checkpoint()
            done.set()

        worker = threading.Thread(target=checkpoint_often)
        worker.start()
        try:
            while not done.is_set():
                with pytest.raises(StoreLocked):
                    Store.open(root, StoreConfig(lock_timeout=0))
        finally:
            worker.join()
