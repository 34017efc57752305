"""The C heap of a long transfer: glibc's allocator tuned so freed buffers go back to the OS;
buffers that the kernel reads into fast.

A fetch's line buffers are allocated on one thread (decode, on a worker) and freed on another
(the getter's, the event loop's).  glibc gives each thread an arena of its own (up to 8 per
core) that keeps what was freed into it: on a 2 GB one-shot fetch six arenas held 17-38 MB
each, ~115 MB of a 290 MB peak RSS; with one arena 213 MB at the same CPU (docs/BENCHMARKS.md,
helper "rss").  Where the C library is not glibc (macOS, musl) both calls do nothing.
"""
from __future__ import annotations

import ctypes
import functools
import mmap

M_ARENA_MAX = -8
"""glibc's mallopt parameter: how many malloc arenas threads may create."""


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(None)  # the process's own symbols: libc among them (no ldconfig child)
    except OSError:
        return None
    return lib if hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt") else None


def one_arena() -> None:
    """Threads started from now on allocate from the arena the threads before them use: call it
    first thing in a process that will move big sessions, before its worker threads start."""
    if (libc := _glibc()) is not None:
        libc.mallopt(M_ARENA_MAX, 1)


def give_back_freed() -> None:
    """Return the heap's freed pages to the OS (before a step whose own peak comes on top)."""
    if (libc := _glibc()) is not None:
        libc.malloc_trim(0)


def read_buffer(size: int) -> memoryview:
    """A buffer for `readinto` that starts on a page boundary (an anonymous mapping, on every
    OS).  A bytearray this big is malloc'd 16 bytes past one, and the kernel's copy from the
    page cache into such an address was several times slower (docs/BENCHMARKS.md, 2026-11-29
    (16))."""
    return memoryview(mmap.mmap(-1, size))
