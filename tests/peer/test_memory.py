"""sysio/memory.py: the fetch's heap settings are glibc's where glibc is, and nothing elsewhere.
A child process checks what a one-shot fetch's process gets (its own arena setting): real
glibc, no mock.  Read buffers start on a page boundary."""
from __future__ import annotations

import ctypes
import mmap
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from sysio import memory

GLIBC = platform.libc_ver()[0] == "glibc"


def test_glibc_is_found_where_it_is_and_nothing_is_called_elsewhere() -> None:
    assert (memory._glibc() is not None) == (GLIBC and sys.platform == "linux")
    memory.give_back_freed()  # harmless in any process, any number of times


@pytest.mark.skipif(not GLIBC, reason="needs glibc: elsewhere one_arena does nothing (checked above)")
def test_threads_started_after_one_arena_share_the_main_arena() -> None:
    """Eight threads each keep a 1 MiB-ish set of small allocations: with one arena, glibc's
    malloc_info lists one heap; without, one per thread (up to 8 per core)."""
    code = """
import ctypes, sys, threading
from sysio import memory
if sys.argv[1] == "one":
    memory.one_arena()
libc = ctypes.CDLL(None)
keep = []
def work():
    keep.append([bytearray(200) for _ in range(5000)])
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
size = ctypes.c_size_t()
buf = ctypes.c_char_p()
libc.open_memstream.restype = ctypes.c_void_p
f = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
libc.malloc_info(0, ctypes.c_void_p(f))
libc.fclose(ctypes.c_void_p(f))
print(ctypes.string_at(buf, size.value).decode().count("<heap nr="))
"""
    one = subprocess.run([sys.executable, "-c", code, "one"], capture_output=True, text=True, check=True)
    many = subprocess.run([sys.executable, "-c", code, "default"], capture_output=True, text=True, check=True)
    assert int(one.stdout) == 1 and int(many.stdout) > 1, (one.stdout, many.stdout)


def test_a_read_buffer_starts_on_a_page_and_takes_a_files_bytes(tmp_path: Path) -> None:
    buf = memory.read_buffer(1 << 20)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    assert address % mmap.PAGESIZE == 0 and len(buf) == 1 << 20 and not buf.readonly
    path = tmp_path / "f"
    path.write_bytes(b"x" * 5000)
    with open(path, "rb", buffering=0) as f:
        assert f.readinto(buf) == 5000 and buf[:5000] == b"x" * 5000
