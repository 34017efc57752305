"""The store service's frame codec and protocol errors, sans-IO: bytes in, frames out.

A frame is a 16-byte little-endian header `len u32, msg_type u16, flags u16, req_id u64`
followed by `len` payload bytes (docs/PROTOCOL.md, "Store service").  The decoder refuses
a frame whose announced length exceeds its limit before buffering it, so a hostile peer
cannot make a connection hold more than one maximum-size frame.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import ClassVar

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


@dataclass(frozen=True, slots=True)
class Frame:
    msg_type: int
    flags: int
    req_id: int
    payload: bytes


def encode_frame(msg_type: int, req_id: int, payload: bytes, flags: int = 0) -> bytes:
    return HEADER.pack(len(payload), msg_type, flags, req_id) + payload


class FrameDecoder:
    """Incremental decoder: feed it whatever the socket gave, get back the complete frames.

    After it raises a ProtocolError the stream has lost its framing; it raises again on
    every later feed.
    """

    def __init__(self, max_frame: int) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()
        self._failed: ProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes of a frame that has begun but not yet completed (0 between frames)."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[Frame]:
        if self._failed is not None:
            raise self._failed
        buf = self._buf
        buf += data
        frames: list[Frame] = []
        pos = 0
        end = len(buf)
        while end - pos >= HEADER_SIZE:
            length, msg_type, flags, req_id = HEADER.unpack_from(buf, pos)
            if flags & ~KNOWN_FLAGS:
                self._failed = MalformedFrame(
                    f"frame req_id={req_id} msg_type={msg_type}: "
                    f"unknown flag bits 0x{flags & ~KNOWN_FLAGS:04x}",
                    req_id,
                )
            elif length > self.max_frame:
                self._failed = FrameTooLarge(
                    f"frame req_id={req_id} msg_type={msg_type}: payload of {length} bytes "
                    f"exceeds the limit of {self.max_frame} bytes",
                    req_id,
                    length,
                    self.max_frame,
                )
            if self._failed is not None:
                del buf[:]
                raise self._failed
            start = pos + HEADER_SIZE
            if end - start < length:
                break
            with memoryview(buf) as view:  # one copy out of the buffer, not two
                frames.append(Frame(msg_type, flags, req_id, bytes(view[start : start + length])))
            pos = start + length
        if pos:
            del buf[:pos]
        return frames
