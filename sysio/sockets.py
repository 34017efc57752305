"""Whether a process listens on a Unix socket file: the test before a stale socket is replaced.

A process that was killed leaves its socket file behind; binding there fails until the file
is removed, but removing a live one would steal its name.  Connecting tells them apart: a
stale file refuses (or is gone), a live one accepts.  Any other failure (no permission, a
full backlog that times out) says nothing either way and is raised, so that no caller takes
it for a stale file.
"""
from __future__ import annotations

import socket
from pathlib import Path


def listener_at(path: Path, timeout: float = 2.0) -> bool:
    """True if something accepts on the Unix socket at `path`; False if nothing does (the
    connection is refused or the file is gone).  Other OSErrors propagate."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(timeout)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return False
    return True
