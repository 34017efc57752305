"""Hashing and compression of blobs, and the one bounded zstd decoder.

Every zstd frame the store or the node decodes comes from a file that may be damaged or from a
peer that may be hostile, so each goes through `decode_bounded`: it never produces more than
the expected length, whatever the frame's header claims, and refuses a frame that decodes to
anything but exactly that length.  The engine, the blob pack's checks, fsck and the peer
protocol (p2pnode/wire.py) all use it; nothing else calls zstd's decoder.

Why not `ZstdDecompressor.decompress(max_output_size=n)` alone: when the frame header declares
a content size, python-zstandard allocates that size and ignores `max_output_size` (a 16 KB
frame declaring 512 MiB allocated and produced 512 MiB).  So the frame is first measured
(header, blocks, checksum: one frame, nothing after it), then a declared size must equal the
expected length (one buffer of exactly that size, and zstd fails if the data would overflow it),
and a frame without one is read through a stream with a bounded window, stopping at
expected + 1 bytes.
"""
from __future__ import annotations

import io
import struct
import threading

import blake3
import zstandard

from store.layout import CODEC_RAW, CODEC_ZSTD

ZSTD_MAGIC = 0xFD2FB528
WINDOW_MAX = 1 << 23
"""Largest window a frame without a declared size may ask for (zstd level 19 uses 8 MiB); a
bigger expected length raises it to that length."""
THREADED_HASH = 1 << 20
"""Inputs at least this big are hashed on BLAKE3's own threads."""


class DecodeError(ValueError):
    """Stored or received bytes that do not decode to exactly the expected length."""


def blob_hash(data: bytes | memoryview) -> bytes:
    """BLAKE3-256 of a payload, the name of its blob."""
    threads = blake3.blake3.AUTO if len(data) >= THREADED_HASH else 1
    return blake3.blake3(data, max_threads=threads).digest()


_local = threading.local()


def compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's compressor for level (zstd contexts are not thread-safe, and costly to make)."""
    cached: tuple[int, zstandard.ZstdCompressor] | None = getattr(_local, "compressor", None)
    if cached is None or cached[0] != level:
        cached = (level, zstandard.ZstdCompressor(level=level))
        _local.compressor = cached
    return cached[1]


def _decompressor(window: int) -> zstandard.ZstdDecompressor:
    cached: tuple[int, zstandard.ZstdDecompressor] | None = getattr(_local, "decompressor", None)
    if cached is None or cached[0] != window:
        cached = (window, zstandard.ZstdDecompressor(max_window_size=window))
        _local.decompressor = cached
    return cached[1]


_BLOCK = struct.Struct("<I")


def frame_size(data: bytes | memoryview) -> int:
    """The length of the zstd frame at the start of data, from its header and block headers
    (nothing is decoded).  DecodeError when data does not start with a whole frame."""
    if len(data) < 6 or _BLOCK.unpack_from(data, 0)[0] != ZSTD_MAGIC:
        raise DecodeError("corrupt zstd frame: bad magic")
    try:
        pos = zstandard.frame_header_size(data)
    except zstandard.ZstdError as exc:
        raise DecodeError(f"corrupt zstd frame header ({exc})") from None
    checksum = data[4] & 0x04
    while True:
        if pos + 3 > len(data):
            raise DecodeError(f"corrupt zstd frame: cut short at byte {pos} of {len(data)}")
        header = _BLOCK.unpack_from(bytes(data[pos : pos + 3]) + b"\0")[0]
        last, kind, size = header & 1, (header >> 1) & 3, header >> 3
        if kind == 3:
            raise DecodeError(f"corrupt zstd frame: the block at byte {pos} has the reserved type")
        pos += 3 + (1 if kind == 1 else size)  # an RLE block stores one byte
        if last:
            break
    end = pos + (4 if checksum else 0)
    if end > len(data):
        raise DecodeError(f"corrupt zstd frame: cut short, needs {end} bytes, has {len(data)}")
    return end


def decode_bounded(data: bytes | memoryview, expected_len: int) -> bytes:
    """The bytes of one zstd frame that must decode to exactly expected_len bytes.  Never
    holds more than expected_len (+1) bytes of output, nor a window over WINDOW_MAX (or
    expected_len), whatever the frame claims; DecodeError on anything else (a declared size
    that differs, an overrun or underrun, trailing bytes, corrupt data)."""
    end = frame_size(data)
    if end != len(data):
        raise DecodeError(f"{len(data) - end} bytes after the zstd frame")
    declared = zstandard.frame_content_size(data)
    try:
        if declared != -1:  # -1: the header declares no size (zstandard.frame_content_size)
            if declared != expected_len:
                raise DecodeError(f"the zstd frame declares {declared} bytes, not {expected_len}")
            out = _decompressor(WINDOW_MAX).decompress(data, max_output_size=expected_len,
                                                       allow_extra_data=False)
        else:
            window = max(WINDOW_MAX, 1 << max(expected_len - 1, 1).bit_length())
            with _decompressor(window).stream_reader(io.BytesIO(data), read_across_frames=False) as r:
                out = r.read(expected_len + 1)
    except zstandard.ZstdError as exc:
        raise DecodeError(f"corrupt zstd data ({exc})") from None
    if len(out) != expected_len:
        more = "more than" if len(out) > expected_len else f"{len(out)} bytes, not"
        raise DecodeError(f"the zstd frame decompresses to {more} its declared {expected_len} bytes")
    return out


def decode_stored(codec: int, stored: bytes, raw_len: int) -> bytes:
    """A blob's raw bytes from its stored form (codec 0 raw, 1 zstd); DecodeError if they are
    not exactly raw_len bytes or the codec is unknown."""
    if codec == CODEC_ZSTD:
        return decode_bounded(stored, raw_len)
    if codec != CODEC_RAW:
        raise DecodeError(f"unknown codec {codec}")
    if len(stored) != raw_len:
        raise DecodeError(f"{len(stored)} raw bytes, not {raw_len}")
    return stored
