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
