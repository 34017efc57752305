"""store/codec.py: the one bounded zstd decoder, against hostile frames.

Memory is checked as the peak resident size of a fresh child process (zstd allocates with
malloc, which tracemalloc does not see), not by timing."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import zstandard

from store.codec import DecodeError, blob_hash, decode_bounded, decode_stored, frame_size
from store.layout import CODEC_RAW, CODEC_ZSTD

REPO = Path(__file__).resolve().parents[2]
DATA = os.urandom(2000) + b"compressible " * 4000


def with_declared_size(frame: bytes, size: int) -> bytes:
    """The frame with its header's content size rewritten (same field width), as a liar sends it."""
    fhd = frame[4]
    width = {0: 1 if fhd & 0x20 else 0, 1: 2, 2: 4, 3: 8}[fhd >> 6]
    at = 5 + (0 if fhd & 0x20 else 1) + (0, 1, 2, 4)[fhd & 3]
    value = size - 256 if width == 2 else size
    fmt = {1: "<B", 2: "<H", 4: "<I", 8: "<Q"}[width]
    return frame[:at] + struct.pack(fmt, value) + frame[at + width :]


@pytest.mark.parametrize("content_size", [True, False])
def test_good_frames_decode_to_exactly_their_bytes(content_size: bool) -> None:
    for data in (DATA, b"", b"x"):
        frame = zstandard.ZstdCompressor(write_content_size=content_size, write_checksum=True).compress(data)
        assert frame_size(frame) == len(frame)
        assert decode_bounded(frame, len(data)) == data
        assert decode_stored(CODEC_ZSTD, frame, len(data)) == data
    assert decode_stored(CODEC_RAW, DATA, len(DATA)) == DATA
    assert blob_hash(DATA) == blob_hash(memoryview(DATA))


@pytest.mark.parametrize(("frame", "expected", "why"), [
    (zstandard.compress(DATA), len(DATA) - 1, "declares"),
    (zstandard.compress(DATA), len(DATA) + 1, "declares"),
    (zstandard.ZstdCompressor(write_content_size=False).compress(DATA), len(DATA) - 1, "more than"),
    (zstandard.ZstdCompressor(write_content_size=False).compress(DATA), len(DATA) + 1, "not"),
    (with_declared_size(zstandard.compress(DATA), 300), 300, "corrupt"),  # claims 300, emits 54 KB
    (with_declared_size(zstandard.compress(DATA), len(DATA) + 5000), len(DATA) + 5000, "corrupt"),
    (zstandard.compress(DATA) + b"x", len(DATA), "after the zstd frame"),
    (zstandard.compress(DATA) + zstandard.compress(b"more"), len(DATA), "after the zstd frame"),
    (zstandard.compress(DATA)[:-7], len(DATA), "cut short"),
    (b"\x28\xb5\x2f\xfd garbage", 5, "cut short"),
    (b"not zstd at all", 5, "magic"),
    (b"", 0, "magic"),
])
def test_hostile_frames_are_refused(frame: bytes, expected: int, why: str) -> None:
    with pytest.raises(DecodeError, match=why):
        decode_bounded(frame, expected)


def test_raw_and_unknown_codecs_are_checked() -> None:
    with pytest.raises(DecodeError, match="raw bytes"):
        decode_stored(CODEC_RAW, b"abc", 4)
    with pytest.raises(DecodeError, match="unknown codec 7"):
        decode_stored(7, b"abc", 3)


BOMB_CHILD = textwrap.dedent(
    """
    import json, resource, sys, zstandard
    from store.codec import DecodeError, decode_bounded

    def bomb(declare: bool) -> bytes:
        # 1 GiB of zeros, compressed a chunk at a time (never held whole)
        c = zstandard.ZstdCompressor(level=1, write_content_size=declare)
        obj = c.compressobj(size=(1 << 30) if declare else -1)
        chunk = bytes(1 << 20)
        out = b"".join(obj.compress(chunk) for _ in range(1024)) + obj.flush()
        return out

    def lie(frame: bytes) -> bytes:  # the declared size of 1 GiB rewritten to 100, same width
        fhd = frame[4]
        width = {2: 4, 3: 8}[fhd >> 6]
        at = 5 + (0 if fhd & 0x20 else 1)
        return frame[:at] + (100).to_bytes(width, "little") + frame[at + width:]

    frames = [bomb(True), bomb(False)]
    frames.append(lie(frames[0]))
    assert zstandard.frame_content_size(frames[2]) == 100
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    errors = []
    for f in frames:
        for expected in (100, 16 << 10):
            try:
                decode_bounded(f, expected)
                errors.append("decoded")
            except DecodeError as exc:
                errors.append(str(exc))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"sizes": [len(f) for f in frames], "grew_kib": peak - base, "errors": errors}))
    """
)


def test_a_bomb_never_costs_more_than_a_bounded_amount_of_memory() -> None:
    """1 GiB of zeros in a few hundred KB, with and without a declared size, and with a
    declared size rewritten to 100, against expected lengths of 100 B and 16 KiB."""
    proc = subprocess.run([sys.executable, "-c", BOMB_CHILD], cwd=REPO, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()
    out = json.loads(proc.stdout)
    assert all(size < 1 << 20 for size in out["sizes"]), out["sizes"]
    assert "decoded" not in out["errors"], out["errors"]
    # a window of at most 8 MiB and 16 KiB of output; 1 GiB would show as ~1,000,000 KiB
    assert out["grew_kib"] < 32 << 10, out
