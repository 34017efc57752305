"""The secret scan of a big file on another core, while the import reads the same bytes.

`re` holds the GIL, so a scan in the importing process adds its whole time to a share's
(bench_share measured 134 MB/s without it, 68 with it).  A child process (`python -m
p2pnode.pi.scanproc PATH START`) reads the bytes from the file itself (the page cache has
them: nothing is copied through a pipe) and scans them with `secrets.Scanner`.  The parent
only tells it how far the import has read ("fed N" lines on its stdin, "done N" at the end),
so it never scans past what was imported, even when Pi appends meanwhile.

The child answers with the BLAKE3 of the bytes it scanned; the parent hashed what it fed the
import and accepts the findings only when the two agree.  A file rewritten under the share,
a child that failed to start, crashed or took too long: `result()` is None and the caller
scans the stored bytes instead (fail closed: never "no findings" for bytes nobody scanned).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from p2pnode.pi import secrets
from p2pnode.pi.hashing import new_hasher

log = logging.getLogger(__name__)

CHUNK = 4 * 1024 * 1024
MIN_BYTES = 16 * 1024 * 1024
"""Below this a child costs more to start (~0.1 s) than the scan it takes over."""
BASE_WAIT = 60.0
WAIT_PER_MB = 0.05
"""How long the parent waits for the child's answer after the last byte: generous (the scan
runs at ~100 MB/s on a loaded core), then it gives up and the caller scans in process."""


class ScanProcess:
    """The parent's side: start the child, report each piece fed, check and take its findings."""

    def __init__(self, path: Path, start: int) -> None:
        self.start = start
        self._end = start
        self._hasher = new_hasher()
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p))
        self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            [sys.executable, "-m", "p2pnode.pi.scanproc", str(path), str(start)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)

    def fed(self, data: memoryview) -> None:
        """The import read these bytes (the next ones of the file): the child may scan them."""
        self._hasher.update(data)
        self._end += len(data)
        self._tell(f"fed {self._end}\n")

    def result(self) -> list[secrets.Finding] | None:
        """The findings (offsets and lines from `start`) if the child scanned exactly the bytes
        fed, else None (logged)."""
        if self._proc is None:
            return None
        self._tell(f"done {self._end}\n")
        proc, self._proc = self._proc, None
        try:
            out, err = proc.communicate(timeout=BASE_WAIT + WAIT_PER_MB * (self._end - self.start) / 1e6)
        except subprocess.TimeoutExpired:
            _stop(proc)
            log.warning("the secret scan process took too long; scanning in this process instead")
            return None
        try:
            answer = json.loads(out)
            if answer["blake3"] != self._hasher.hexdigest() or answer["end"] != self._end:
                log.warning("the file changed while the secret scan read it; scanning the stored bytes")
                return None
            return [secrets.Finding(**f) for f in answer["findings"]]
        except (ValueError, KeyError, TypeError):
            log.warning("the secret scan process failed (exit %s): %s", proc.returncode,
                        err.decode(errors="replace").strip()[-500:])
            return None

    def close(self) -> None:
        """Stop the child if it still runs (the import failed); idempotent."""
        if self._proc is not None:
            proc, self._proc = self._proc, None
            _stop(proc)

    def _tell(self, message: str) -> None:
        if self._proc is None or self._proc.stdin is None:
            return
        try:
            self._proc.stdin.write(message.encode())
            self._proc.stdin.flush()
        except OSError:  # the child died: result() says so
            pass


def _stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(OSError):
        proc.kill()
    proc.communicate()


def scan_file(path: str, start: int) -> dict[str, object]:
    """The child's work: scan the file from `start` up to where the parent says it has read."""
    scanner = secrets.Scanner()
    hasher = new_hasher()
    pos = limit = start
    done = False
    fd = os.open(path, os.O_RDONLY)
    try:
        while pos < limit or not done:
            if pos < limit:
                data = os.pread(fd, min(CHUNK, limit - pos), pos)
                if not data:
                    raise OSError(f"{path} ended at {pos} bytes, before {limit}")
                hasher.update(data)
                scanner.feed(data)
                pos += len(data)
                continue
            message = sys.stdin.buffer.readline().split()
            if len(message) != 2 or message[0] not in (b"fed", b"done"):
                raise SystemExit("the parent stopped before the end")  # EOF: it died or gave up
            limit, done = int(message[1]), message[0] == b"done"
    finally:
        os.close(fd)
    findings = scanner.finish()
    return {"blake3": hasher.hexdigest(), "end": pos, "findings": [f.as_dict() for f in findings]}


def main() -> None:
    path, start = sys.argv[1], int(sys.argv[2])
    sys.stdout.write(json.dumps(scan_file(path, start)))


if __name__ == "__main__":
    main()
