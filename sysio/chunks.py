"""Many small buffers written as few big ones, without copying the big ones."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

Buffer = bytes | memoryview


def joined_runs(parts: Iterable[Buffer], limit: int) -> Iterator[Buffer]:
    """`parts` in order, consecutive ones joined up to `limit` bytes (one syscall or write per
    run, not per part); a part over it goes alone, as it is: a 256 MiB line is not copied."""
    run: list[Buffer] = []
    size = 0
    for part in parts:
        if run and size + len(part) > limit:
            yield run[0] if len(run) == 1 else b"".join(run)
            run, size = [], 0
        run.append(part)
        size += len(part)
    if run:
        yield run[0] if len(run) == 1 else b"".join(run)
