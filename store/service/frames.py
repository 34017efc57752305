"""The store service's frame codec and protocol errors, sans-IO: bytes in, frames out.

A frame is a 16-byte little-endian header `len u32, msg_type u16, flags u16, req_id u64`
followed by `len` payload bytes (docs/PROTOCOL.md, "Store service").  The decoder refuses
a frame whose announced length exceeds its limit before buffering it, so a hostile peer
cannot make a connection hold more than one maximum-size frame.  A bad header does not
swallow the good frames before it: the decoder hands those over and keeps the error for
its caller (`FrameDecoder.error`), who answers them first.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import ClassVar, NamedTuple

from store.errors import StoreError

HEADER = struct.Struct("<IHHQ")
HEADER_SIZE = HEADER.size  # 16

FLAG_REPLY = 0x0001
"""Set on every frame the server sends; clear on every request."""
KNOWN_FLAGS = FLAG_REPLY


class ErrorCode(IntEnum):
    """The numeric codes of ERROR replies (docs/PROTOCOL.md lists when each is sent)."""

    MALFORMED = 1
    FRAME_TOO_LARGE = 2
    UNSUPPORTED_VERSION = 3
    BAD_SEQUENCE = 4
    UNKNOWN_MESSAGE = 5
    TOO_MANY_IN_FLIGHT = 6
    READ_TIMEOUT = 7
    IDLE_TIMEOUT = 8
    SHUTTING_DOWN = 9
    BAD_REQUEST = 10
    REPLY_TOO_LARGE = 11
    PAYLOAD_TOO_LARGE = 12
    UNKNOWN_CONTEXT = 16
    UNKNOWN_TURN = 17
    UNKNOWN_BLOB = 18
    PARENT_CONFLICT = 19
    CORRUPT = 20
    STORE_CLOSED = 21
    STORE_ERROR = 22
    TURN_NOT_IN_CONTEXT = 23
    DAMAGED_PAYLOAD = 24
    STORE_FAILED = 25
    INTERNAL = 255


class ServiceError(StoreError):
    """An error the service reports with an ERROR code (not one of the engine's own errors).

    `req_id` is the request it answers (0: the connection as a whole); `arg0`/`arg1` carry
    the numbers docs/PROTOCOL.md lists for each code.
    """

    code: ClassVar[ErrorCode] = ErrorCode.INTERNAL

    def __init__(self, message: str, req_id: int = 0, arg0: int = 0, arg1: int = 0) -> None:
        super().__init__(message)
        self.req_id = req_id
        self.arg0 = arg0
        self.arg1 = arg1


class ProtocolError(ServiceError):
    """A peer broke the protocol; the server answers with ERROR and closes the connection."""

    code = ErrorCode.MALFORMED


class MalformedFrame(ProtocolError):
    code = ErrorCode.MALFORMED


class FrameTooLarge(ProtocolError):
    code = ErrorCode.FRAME_TOO_LARGE


class UnknownMessage(ProtocolError):
    code = ErrorCode.UNKNOWN_MESSAGE


class UnsupportedVersion(ProtocolError):
    code = ErrorCode.UNSUPPORTED_VERSION


class BadSequence(ProtocolError):
    code = ErrorCode.BAD_SEQUENCE


class ReadTimeout(ProtocolError):
    code = ErrorCode.READ_TIMEOUT


class IdleTimeout(ServiceError):
    code = ErrorCode.IDLE_TIMEOUT


class ShuttingDown(ServiceError):
    code = ErrorCode.SHUTTING_DOWN


class TooManyInFlight(ServiceError):
    code = ErrorCode.TOO_MANY_IN_FLIGHT


class BadRequest(ServiceError):
    code = ErrorCode.BAD_REQUEST


class ReplyTooLarge(ServiceError):
    code = ErrorCode.REPLY_TOO_LARGE


SERVICE_ERRORS: dict[int, type[ServiceError]] = {
    cls.code: cls
    for cls in (
        MalformedFrame, FrameTooLarge, UnknownMessage, UnsupportedVersion, BadSequence, ReadTimeout,
        IdleTimeout, ShuttingDown, TooManyInFlight, BadRequest, ReplyTooLarge, ServiceError,
    )
}  # fmt: skip
"""The class of each service-level code; the client raises these for ERROR replies."""


class Frame(NamedTuple):
    msg_type: int
    flags: int
    req_id: int
    payload: bytes | memoryview
    """bytes, or with FrameDecoder(copy=False) a view valid until the next call to the decoder."""


def encode_frame(msg_type: int, req_id: int, payload: bytes, flags: int = 0) -> bytes:
    return HEADER.pack(len(payload), msg_type, flags, req_id) + payload


MIN_BUFFER = 64 * 1024
"""The decoder's buffer starts this big and is never smaller."""
KEEP_BUFFER = 4 * 1024 * 1024
"""A buffer grown past this for one big frame is dropped once that frame is decoded."""


class FrameDecoder:
    """Incremental decoder: bytes in, complete frames out.

    Two ways in: `feed(data)` with whatever the socket gave, or `get_buffer()` then
    `buffer_updated(n)` (asyncio.BufferedProtocol), which lets the socket read straight into
    the decoder's buffer: each payload byte is then copied once, into its Frame, and a big
    reply does not pay for a growing buffer's reallocations.  The buffer is reused, so a
    connection's steady state allocates nothing but the payloads.

    With copy=False a frame's payload is a view of the buffer, valid only until the next
    call to the decoder: for a caller that decodes each frame at once (the client), which
    saves copying a big reply twice.

    A bad header (unknown flag bits, `len` over the limit) loses the stream's framing.  The
    call that meets it still returns the complete frames before it and records the error in
    `error`, for the caller to act on once it has handled those frames; every later call
    raises that error.
    """

    def __init__(self, max_frame: int, copy: bool = True) -> None:
        self.max_frame = max_frame
        self.copy = copy
        self._buf = bytearray(MIN_BUFFER)
        self._view = memoryview(self._buf)
        self._start = 0  # first byte not yet decoded
        self._end = 0  # end of the bytes received
        self._need = HEADER_SIZE  # bytes from _start that the next frame needs in full
        self._failed: ProtocolError | None = None

    @property
    def error(self) -> ProtocolError | None:
        """Why the stream lost its framing, once it has: nothing after the frames returned
        so far can be decoded."""
        return self._failed

    @property
    def buffered(self) -> int:
        """Bytes of a frame that has begun but not yet completed (0 between frames)."""
        return self._end - self._start

    def get_buffer(self) -> memoryview:
        """Where the next read should go: room for the rest of the current frame, but never
        more than twice what has arrived (or KEEP_BUFFER), so that a header announcing a huge
        frame does not make the connection hold that much memory before the bytes come."""
        if self._failed is not None:
            raise self._failed
        live = self.buffered
        want = min(max(self._need - live, 1), max(KEEP_BUFFER, live))
        if len(self._buf) - self._end < want:
            self._make_room(want)
        return self._view[self._end :]

    def buffer_updated(self, n: int) -> list[Frame]:
        """n bytes were written at the start of the last get_buffer(): the frames now complete
        (those before a bad header, which then sets `error`)."""
        if self._failed is not None:
            raise self._failed
        self._end += n
        return self._decode()

    def feed(self, data: bytes) -> list[Frame]:
        """The frames that data completes; like buffer_updated, it returns those before a bad
        header and sets `error`."""
        if self._failed is not None:
            raise self._failed
        frames: list[Frame] = []
        with memoryview(data) as src:
            pos = 0
            while pos < len(src) and self._failed is None:
                room = self.get_buffer()
                n = min(len(room), len(src) - pos)
                room[:n] = src[pos : pos + n]
                pos += n
                frames += self.buffer_updated(n)
        return frames

    def _make_room(self, want: int) -> None:
        """Move the undecoded bytes to the front, into a new buffer if this one is too small.
        A new buffer, never a resize: the transport may still hold a view of the old one."""
        live = self.buffered
        size = len(self._buf)
        if live + want > size or size > KEEP_BUFFER:
            size = max(MIN_BUFFER, live + want)
            buf = bytearray(size)
            buf[:live] = self._view[self._start : self._end]
            self._buf, self._view = buf, memoryview(buf)
        else:
            self._view[:live] = self._view[self._start : self._end]
        self._start, self._end = 0, live

    def _decode(self) -> list[Frame]:
        frames: list[Frame] = []
        buf, view = self._buf, self._view
        pos, end = self._start, self._end
        need = HEADER_SIZE
        while end - pos >= HEADER_SIZE:
            length, msg_type, flags, req_id = HEADER.unpack_from(buf, pos)
            if flags & ~KNOWN_FLAGS:
                return self._fail(frames, MalformedFrame(
                    f"frame req_id={req_id} msg_type={msg_type}: "
                    f"unknown flag bits 0x{flags & ~KNOWN_FLAGS:04x}",
                    req_id,
                ))  # fmt: skip
            if length > self.max_frame:
                return self._fail(frames, FrameTooLarge(
                    f"frame req_id={req_id} msg_type={msg_type}: payload of {length} bytes "
                    f"exceeds the limit of {self.max_frame} bytes",
                    req_id, length, self.max_frame,
                ))  # fmt: skip
            stop = pos + HEADER_SIZE + length
            if stop > end:
                need = HEADER_SIZE + length
                break
            payload = view[pos + HEADER_SIZE : stop]
            frames.append(Frame(msg_type, flags, req_id, bytes(payload) if self.copy else payload))
            pos = stop
        if pos == end:  # nothing left over: start again at the front for free
            pos = end = 0
            if len(buf) > KEEP_BUFFER:
                self._buf = bytearray(MIN_BUFFER)
                self._view = memoryview(self._buf)
        self._start, self._end, self._need = pos, end, need
        return frames

    def _fail(self, frames: list[Frame], exc: ProtocolError) -> list[Frame]:
        """Keep exc for the caller and hand over the frames decoded before the bad header.
        Their payloads are copies, or views of a buffer that is no longer written to."""
        self._failed = exc
        self._start = self._end = 0
        return frames
