"""Compresses new blobs on a thread of its own while their writers wait for the fdatasync.

A durable append of a small new blob puts the raw bytes into its head WAL record (that copy is
what makes it durable) and hands the blob here; zstd then runs beside the writer's WAL write
and fdatasync instead of before them.  The writer waits for its blob to reach the pack before
it returns, so an acknowledged turn's blob is always in the pack (unsynced, as before) and
callers see no difference.  Until then the raw bytes are "in flight": readers and other
writers find them here.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable


class Compactor:
    """One worker thread; `pack(hash, raw)` compresses and appends one blob to the pack."""

    def __init__(self, pack: Callable[[bytes, bytes], None]) -> None:
        self._pack = pack
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[bytes] = deque()
        self._raw: dict[bytes, bytes] = {}
        self._errors: dict[bytes, BaseException] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="store-compactor", daemon=True)
        self._thread.start()

    def raw(self, h: bytes) -> bytes | None:
        """The raw bytes of an in-flight blob (not yet in the pack), else None."""
        return self._raw.get(h)

    def submit(self, h: bytes, raw: bytes) -> None:
        """Caller holds the blob's shard lock and found it neither in the pack nor in flight."""
        with self._cond:
            self._raw[h] = raw
            self._queue.append(h)
            self._cond.notify_all()

    def wait(self, hashes: Iterable[bytes]) -> None:
        """Return once these blobs are in the pack; raise the error that kept one out."""
        with self._cond:
            for h in hashes:
                while h in self._raw:
                    self._cond.wait()
                error = self._errors.pop(h, None)
                if error is not None:
                    raise error

    def drain(self) -> None:
        """Wait until every blob in flight now is in the pack (a checkpoint drops the WAL
        copies).  Raises if one could not be packed: its WAL copy must then stay."""
        with self._cond:
            for h in list(self._raw):
                while h in self._raw:
                    self._cond.wait()
            for h, error in self._errors.items():
                raise OSError(f"blob {h.hex()} did not reach the pack: {error}") from error

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                h = self._queue.popleft()
                raw = self._raw[h]
            error: BaseException | None = None
            try:
                self._pack(h, raw)
            except BaseException as exc:  # noqa: BLE001 - handed to the writer waiting for h
                error = exc
            with self._cond:
                del self._raw[h]  # only now: a lookup finds h here or in the pack
                if error is not None:
                    self._errors[h] = error
                self._cond.notify_all()
