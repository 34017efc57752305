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
