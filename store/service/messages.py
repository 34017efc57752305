"""Payload layouts of every store-service message, sans-IO (docs/PROTOCOL.md, "Store service").

Each request is a dataclass whose fields mirror its wire layout; it encodes itself, decodes
itself strictly (exact length, no unknown option bits) and decodes its own reply.  The
thirteen of one fixed layout share that code (_Fixed) and differ only in a table of
ClassVars (layout, reply decoder, option bits); the four with variable-length parts
(APPEND_TURN, APPEND_BATCH, PUT_BLOB, PATCH) keep their own.  They are
not frozen: each request builds one on both ends, and a frozen dataclass's __init__ costs
five times as much.  The
server answers with the same msg_type and FLAG_REPLY set, or with an ERROR frame.

Over ~400 lines because it is the whole message table of the protocol, in the order of
docs/PROTOCOL.md's tables, which tests/store/service/test_frames.py checks against it.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from operator import attrgetter
from typing import Any, ClassVar, Generic, TypeVar, cast

from store.service.frames import ErrorCode, MalformedFrame, UnknownMessage
from store.types import ContextHead, Patch, Turn, TurnInput

PROTOCOL_VERSION = 1
MIN_VERSION = 1
MAX_VERSION = 1


class MsgType(IntEnum):
    HELLO = 1
    CTX_CREATE = 2
    CTX_FORK = 3
    GET_HEAD = 4
    APPEND_TURN = 5
    APPEND_BATCH = 6
    GET_LAST = 7
    GET_BEFORE = 8
    GET_RANGE_BY_DEPTH = 9
    GET_BLOB = 10
    PUT_BLOB = 11
    GET_CHAIN = 12
    PATCH = 13
    TOMBSTONE = 14
    GET_PAYLOAD = 15
    CTX_DELETE = 16
    GET_TURN = 17
    ERROR = 0xFFFF


# Option bits, each valid only in the messages named.
READ_PAYLOADS = 0x1  # GET_LAST, GET_BEFORE, GET_RANGE_BY_DEPTH, GET_CHAIN: payloads follow the turns
READ_PATCHED = 0x2  # ... with the latest patches applied (needs READ_PAYLOADS)
EXPECT_PARENT = 0x1  # APPEND_TURN, APPEND_BATCH: fail with PARENT_CONFLICT unless head == expected_parent
VERIFY_HASH = 0x1  # GET_BLOB: re-hash the blob before answering
AS_OF = 0x1  # GET_PAYLOAD: apply only patches with seq <= as_of_seq
LIST_HAS_PAYLOADS = 0x1  # TurnList.flags

Buffer = bytes | memoryview
"""What the decoders read: a frame's payload, copied out or a view of the receive buffer."""
ABSENT = 0xFFFF_FFFF
"""A payload length meaning "no payload" (a tombstoned turn in a patched read)."""
MAX_ERROR_MESSAGE = 1024
PART_BYTES = 64 * 1024
"""TurnList.encode_parts joins small items into pieces of about this size."""

# Every struct layout of the protocol, little-endian, in one place.
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
HASH = struct.Struct("<32s")
HELLO = struct.Struct("<HH")  # min_version, max_version
HELLO_REPLY = struct.Struct("<HHIIIIII")  # version, reserved, max_frame, max_payload, max_in_flight,
#                                           max_turns, idle_timeout_ms, read_timeout_ms
APPEND_TURN = struct.Struct("<QQQIII")  # context_id, expected_parent, type_tag, codec, opts, payload_len
APPEND_BATCH = struct.Struct("<QQII")  # context_id, expected_parent, opts, count
BATCH_ITEM = struct.Struct("<QII")  # type_tag, codec, payload_len
GET_LAST = struct.Struct("<QII")  # context_id, limit, opts
GET_BEFORE = struct.Struct("<QQII")  # context_id, before_turn_id, limit, opts
GET_RANGE = struct.Struct("<QIII")  # context_id, start_depth, limit, opts
GET_CHAIN = struct.Struct("<QI")  # turn_id, opts
GET_BLOB = struct.Struct("<32sI")  # hash, opts
PATCH = struct.Struct("<QI")  # target_turn_id, payload_len
GET_PAYLOAD = struct.Struct("<QQI")  # turn_id, as_of_seq, opts
TURN = struct.Struct("<QQIIQ32sIQ")  # turn_id, parent, depth, codec, type_tag, payload_hash, flags, created
CONTEXT_HEAD = struct.Struct("<QQIIQ")  # context_id, head_turn_id, head_depth, flags, created_at
PATCH_RECORD = struct.Struct("<Q32sIQ")  # target_turn_id, new_payload_hash, flags, seq
TURN_LIST = struct.Struct("<QIII")  # next_cursor, head_depth, count, flags
ERROR = struct.Struct("<HHQQI")  # code, reserved, arg0, arg1, message_len


class MalformedMessage(MalformedFrame):
    """A frame's payload does not match its message's layout."""


class _Reader:
    """Strict cursor over one payload: every read is bounds-checked, trailing bytes are an error."""

    __slots__ = ("buf", "pos", "what")

    def __init__(self, buf: Buffer, what: str) -> None:
        self.buf = buf
        self.pos = 0
        self.what = what

    def unpack(self, layout: struct.Struct) -> tuple:
        end = self.pos + layout.size
        if end > len(self.buf):
            raise MalformedMessage(f"{self.what}: truncated at byte {self.pos} of {len(self.buf)}")
        values = layout.unpack_from(self.buf, self.pos)
        self.pos = end
        return values

    def raw(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.buf):
            raise MalformedMessage(
                f"{self.what}: {n} bytes announced at byte {self.pos}, only {len(self.buf) - self.pos} follow"
            )
        data = bytes(self.buf[self.pos : end])  # a copy only when buf is a view
        self.pos = end
        return data

    def sized(self, allow_absent: bool = False) -> bytes | None:
        """A `len u32` then `len` bytes; len == ABSENT means none, where allowed."""
        (n,) = self.unpack(U32)
        if n == ABSENT:
            if allow_absent:
                return None
            raise MalformedMessage(f"{self.what}: absent payload where one is required")
        return self.raw(n)

    def done(self) -> None:
        if self.pos != len(self.buf):
            raise MalformedMessage(f"{self.what}: {len(self.buf) - self.pos} trailing bytes")


def _fixed(layout: struct.Struct, payload: Buffer, what: str) -> tuple:
    if len(payload) != layout.size:
        raise MalformedMessage(f"{what}: payload is {len(payload)} bytes, expected {layout.size}")
    return layout.unpack(payload)


def _check_opts(opts: int, allowed: int, what: str) -> None:
    if opts & ~allowed:
        raise MalformedMessage(f"{what}: unknown option bits 0x{opts & ~allowed:x}")


def _check_unused(value: int, opts: int, bit: int, field: str, what: str) -> None:
    """A field that only means something with an option bit must be 0 without it."""
    if value and not opts & bit:
        raise MalformedMessage(f"{what}: {field} is {value} but its option bit is not set")


def _sized(data: bytes) -> bytes:
    return U32.pack(len(data)) + data


# --- records shared by several replies ---------------------------------------------------


def encode_turn(t: Turn) -> bytes:
    return TURN.pack(
        t.turn_id, t.parent_turn_id, t.depth, t.codec, t.type_tag,
        t.payload_hash, t.flags, t.created_at_unix_ms,
    )  # fmt: skip


def _turn(v: tuple) -> Turn:
    turn_id, parent, depth, codec, type_tag, payload_hash, flags, created = v
    return Turn(turn_id, parent, depth, type_tag, codec, payload_hash, flags, created)


def decode_turn(payload: Buffer) -> Turn:
    return _turn(_fixed(TURN, payload, "Turn"))


def encode_context_head(h: ContextHead) -> bytes:
    return CONTEXT_HEAD.pack(h.context_id, h.head_turn_id, h.head_depth, h.flags, h.created_at_unix_ms)


def decode_context_head(payload: Buffer) -> ContextHead:
    context_id, head, depth, flags, created = _fixed(CONTEXT_HEAD, payload, "ContextHead")
    return ContextHead(context_id, head, depth, created, flags)


def encode_patch(p: Patch) -> bytes:
    return PATCH_RECORD.pack(p.target_turn_id, p.new_payload_hash, p.flags, p.seq)


def decode_patch(payload: Buffer) -> Patch:
    return Patch(*_fixed(PATCH_RECORD, payload, "Patch"))


def encode_maybe_payload(data: bytes | None) -> bytes:
    return U32.pack(ABSENT) if data is None else _sized(data)


def decode_maybe_payload(payload: Buffer) -> bytes | None:
    r = _Reader(payload, "payload reply")
    data = r.sized(allow_absent=True)
    r.done()
    return data


def decode_blob(payload: Buffer) -> bytes:
    r = _Reader(payload, "GET_BLOB reply")
    data = r.sized()
    r.done()
    assert data is not None
    return data


def decode_hash(payload: Buffer) -> bytes:
    return _fixed(HASH, payload, "PUT_BLOB reply")[0]


def decode_empty(payload: Buffer) -> None:
    if payload:
        raise MalformedMessage(f"empty reply expected, got {len(payload)} bytes")


@dataclass(slots=True)
class TurnList:
    """Turns in chronological order; `payloads` (one per turn, None = tombstoned) when asked for."""

    turns: list[Turn]
    payloads: list[bytes | None] | None = None
    next_cursor: int = 0
    """GET_LAST/GET_BEFORE: pass as before_turn_id for the next older page; 0 at the root."""
    head_depth: int = 0
    """The context's head depth (GET_CHAIN: the depth of the asked turn)."""

    def encode(self) -> bytes:
        return b"".join(self.encode_parts())

    def encode_parts(self) -> list[bytes]:
        """The encoding in pieces to write one after another: small items joined in runs of
        about PART_BYTES, a big payload a piece of its own, so a reply of many payloads is
        never copied whole into one big new buffer (whose fresh pages cost more than the copy)."""
        flags = 0 if self.payloads is None else LIST_HAS_PAYLOADS
        run = [TURN_LIST.pack(self.next_cursor, self.head_depth, len(self.turns), flags)]
        run += [encode_turn(t) for t in self.turns]
        if self.payloads is None:
            return [b"".join(run)]
        parts: list[bytes] = []
        size = 0
        for p in self.payloads:
            if p is None:
                run.append(U32.pack(ABSENT))
                continue
            run.append(U32.pack(len(p)))
            if len(p) >= PART_BYTES:
                parts += [b"".join(run), p]
                run, size = [], 0
                continue
            run.append(p)
            size += len(p)
            if size >= PART_BYTES:
                parts.append(b"".join(run))
                run, size = [], 0
        if run:
            parts.append(b"".join(run))
        return parts

    @classmethod
    def decode(cls, payload: Buffer) -> TurnList:
        r = _Reader(payload, "TurnList")
        next_cursor, head_depth, count, flags = r.unpack(TURN_LIST)
        _check_opts(flags, LIST_HAS_PAYLOADS, "TurnList")
        turns = [_turn(v) for v in TURN.iter_unpack(r.raw(count * TURN.size))]
        payloads = [r.sized(allow_absent=True) for _ in range(count)] if flags else None
        r.done()
        return cls(turns, payloads, next_cursor, head_depth)


@dataclass(slots=True)
class HelloReply:
    version: int
    max_frame: int
    max_payload: int
    max_in_flight: int
    max_turns: int
    idle_timeout_ms: int
    read_timeout_ms: int

    def encode(self) -> bytes:
        return HELLO_REPLY.pack(
            self.version, 0, self.max_frame, self.max_payload, self.max_in_flight,
            self.max_turns, self.idle_timeout_ms, self.read_timeout_ms,
        )  # fmt: skip

    @classmethod
    def decode(cls, payload: Buffer) -> HelloReply:
        version, reserved, *limits = _fixed(HELLO_REPLY, payload, "HELLO reply")
        if reserved:
            raise MalformedMessage("HELLO reply: reserved field is not 0")
        return cls(version, *limits)


@dataclass(slots=True)
class ErrorReply:
    code: int
    message: str
    arg0: int = 0
    arg1: int = 0

    def encode(self) -> bytes:
        text = self.message.encode("utf-8")[:MAX_ERROR_MESSAGE]
        return ERROR.pack(self.code, 0, self.arg0, self.arg1, len(text)) + text

    @classmethod
    def decode(cls, payload: Buffer) -> ErrorReply:
        r = _Reader(payload, "ERROR")
        code, _reserved, arg0, arg1, n = r.unpack(ERROR)
        text = r.raw(n)
        r.done()
        return cls(code, text.decode("utf-8", errors="replace"), arg0, arg1)

    def code_name(self) -> str:
        try:
            return ErrorCode(self.code).name
        except ValueError:
            return f"code {self.code}"


# --- requests -----------------------------------------------------------------------------

R = TypeVar("R")


class Request(Generic[R]):
    """A request; R is what its reply decodes to."""

    __slots__ = ()
    MSG_TYPE: ClassVar[MsgType]

    @classmethod
    def decode(cls, payload: Buffer) -> Request[Any]:
        raise NotImplementedError

    def encode(self) -> bytes:
        raise NotImplementedError

    def decode_reply(self, payload: Buffer) -> R:
        raise NotImplementedError


class _Fixed(Request[R]):
    """A request of one fixed layout whose fields are the dataclass's, in wire order: the
    table of ClassVars below says all that differs between them."""

    __slots__ = ()
    LAYOUT: ClassVar[struct.Struct]
    REPLY: ClassVar[Callable[..., Any]]
    """Decodes the reply payload (a staticmethod)."""
    OPTS: ClassVar[int | None] = None
    """The option bits the `opts` field may carry; None: the request has no `opts`."""
    WHAT: ClassVar[str]
    VALUES: ClassVar[Callable[..., tuple]]
    """The field values in wire order, as a tuple."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "MSG_TYPE" in cls.__dict__:  # not on _Read, which is a kind, not a request
            cls.WHAT = cls.MSG_TYPE.name
            fields = tuple(cls.__annotations__)  # the dataclass fields, in wire order
            get = attrgetter(*fields)
            cls.VALUES = staticmethod(get if len(fields) > 1 else lambda req: (get(req),))

    def encode(self) -> bytes:
        return self.LAYOUT.pack(*self.VALUES(self))

    @classmethod
    def decode(cls, payload: Buffer) -> Request[Any]:
        req = cls(*_fixed(cls.LAYOUT, payload, cls.WHAT))
        req.check()
        return req

    def check(self) -> None:
        """Refuse option bits (and fields they govern) that the request does not know."""
        if self.OPTS is not None:
            _check_opts(getattr(self, "opts"), self.OPTS, self.WHAT)  # noqa: B009 - only some have opts

    def decode_reply(self, payload: Buffer) -> R:
        return cast(R, self.REPLY(payload))


@dataclass(slots=True)
class Hello(_Fixed[HelloReply]):
    MSG_TYPE = MsgType.HELLO
    LAYOUT = HELLO
    REPLY = staticmethod(HelloReply.decode)
    min_version: int = MIN_VERSION
    max_version: int = MAX_VERSION

    def negotiate(self) -> int | None:
        """The highest version both sides speak, or None."""
        best = min(self.max_version, MAX_VERSION)
        return best if best >= max(self.min_version, MIN_VERSION) else None


@dataclass(slots=True)
class CtxCreate(_Fixed[ContextHead]):
    MSG_TYPE = MsgType.CTX_CREATE
    LAYOUT = U64
    REPLY = staticmethod(decode_context_head)
    base_turn_id: int = 0


@dataclass(slots=True)
class CtxFork(_Fixed[ContextHead]):
    MSG_TYPE = MsgType.CTX_FORK
    LAYOUT = U64
    REPLY = staticmethod(decode_context_head)
    turn_id: int


@dataclass(slots=True)
class GetHead(_Fixed[ContextHead]):
    MSG_TYPE = MsgType.GET_HEAD
    LAYOUT = U64
    REPLY = staticmethod(decode_context_head)
    context_id: int


@dataclass(slots=True)
class CtxDelete(_Fixed[None]):
    MSG_TYPE = MsgType.CTX_DELETE
    LAYOUT = U64
    REPLY = staticmethod(decode_empty)
    context_id: int


@dataclass(slots=True)
class GetTurn(_Fixed[Turn]):
    MSG_TYPE = MsgType.GET_TURN
    LAYOUT = U64
    REPLY = staticmethod(decode_turn)
    turn_id: int


@dataclass(slots=True)
class AppendTurn(Request[Turn]):
    MSG_TYPE = MsgType.APPEND_TURN
    context_id: int
    payload: bytes
    type_tag: int = 0
    codec: int = 0
    expected_parent: int = 0
    opts: int = 0

    def encode(self) -> bytes:
        return (
            APPEND_TURN.pack(
                self.context_id, self.expected_parent, self.type_tag, self.codec, self.opts, len(self.payload)
            )
            + self.payload
        )

    @classmethod
    def decode(cls, payload: Buffer) -> AppendTurn:
        r = _Reader(payload, "APPEND_TURN")
        ctx, expected, type_tag, codec, opts, n = r.unpack(APPEND_TURN)
        _check_opts(opts, EXPECT_PARENT, "APPEND_TURN")
        _check_unused(expected, opts, EXPECT_PARENT, "expected_parent", "APPEND_TURN")
        data = r.raw(n)
        r.done()
        return cls(ctx, data, type_tag, codec, expected, opts)

    def decode_reply(self, payload: Buffer) -> Turn:
        return decode_turn(payload)


@dataclass(slots=True)
class AppendBatch(Request[TurnList]):
    MSG_TYPE = MsgType.APPEND_BATCH
    context_id: int
    turns: list[TurnInput]
    expected_parent: int = 0
    opts: int = 0

    def encode(self) -> bytes:
        parts = [APPEND_BATCH.pack(self.context_id, self.expected_parent, self.opts, len(self.turns))]
        for t in self.turns:
            parts += [BATCH_ITEM.pack(t.type_tag, t.codec, len(t.payload)), t.payload]
        return b"".join(parts)

    @classmethod
    def decode(cls, payload: Buffer) -> AppendBatch:
        r = _Reader(payload, "APPEND_BATCH")
        ctx, expected, opts, count = r.unpack(APPEND_BATCH)
        _check_opts(opts, EXPECT_PARENT, "APPEND_BATCH")
        _check_unused(expected, opts, EXPECT_PARENT, "expected_parent", "APPEND_BATCH")
        if count == 0:
            raise MalformedMessage("APPEND_BATCH: count is 0")
        turns = []
        for _ in range(count):
            type_tag, codec, n = r.unpack(BATCH_ITEM)
            turns.append(TurnInput(r.raw(n), type_tag, codec))
        r.done()
        return cls(ctx, turns, expected, opts)

    def decode_reply(self, payload: Buffer) -> TurnList:
        return TurnList.decode(payload)


class _Read(_Fixed[TurnList]):
    """GET_LAST, GET_BEFORE, GET_RANGE_BY_DEPTH, GET_CHAIN: read options, a TurnList back."""

    __slots__ = ()
    REPLY = staticmethod(TurnList.decode)
    OPTS = READ_PAYLOADS | READ_PATCHED
    opts: int  # each subclass's last field

    def check(self) -> None:
        _Fixed.check(self)
        if self.opts & READ_PATCHED and not self.opts & READ_PAYLOADS:
            raise MalformedMessage(f"{self.WHAT}: READ_PATCHED without READ_PAYLOADS")


@dataclass(slots=True)
class GetLast(_Read):
    MSG_TYPE = MsgType.GET_LAST
    LAYOUT = GET_LAST
    context_id: int
    limit: int
    opts: int = 0


@dataclass(slots=True)
class GetBefore(_Read):
    MSG_TYPE = MsgType.GET_BEFORE
    LAYOUT = GET_BEFORE
    context_id: int
    before_turn_id: int
    limit: int
    opts: int = 0


@dataclass(slots=True)
class GetRangeByDepth(_Read):
    MSG_TYPE = MsgType.GET_RANGE_BY_DEPTH
    LAYOUT = GET_RANGE
    context_id: int
    start_depth: int
    limit: int
    opts: int = 0


@dataclass(slots=True)
class GetChain(_Read):
    MSG_TYPE = MsgType.GET_CHAIN
    LAYOUT = GET_CHAIN
    turn_id: int
    opts: int = 0


@dataclass(slots=True)
class GetBlob(_Fixed[bytes]):
    MSG_TYPE = MsgType.GET_BLOB
    LAYOUT = GET_BLOB
    REPLY = staticmethod(decode_blob)
    OPTS = VERIFY_HASH
    blob_hash: bytes
    opts: int = 0


@dataclass(slots=True)
class PutBlob(Request[bytes]):
    MSG_TYPE = MsgType.PUT_BLOB
    data: bytes

    def encode(self) -> bytes:
        return _sized(self.data)

    @classmethod
    def decode(cls, payload: Buffer) -> PutBlob:
        r = _Reader(payload, "PUT_BLOB")
        data = r.sized()
        r.done()
        assert data is not None
        return cls(data)

    def decode_reply(self, payload: Buffer) -> bytes:
        return decode_hash(payload)


@dataclass(slots=True)
class PatchTurn(Request[Patch]):
    MSG_TYPE = MsgType.PATCH
    target_turn_id: int
    payload: bytes

    def encode(self) -> bytes:
        return PATCH.pack(self.target_turn_id, len(self.payload)) + self.payload

    @classmethod
    def decode(cls, payload: Buffer) -> PatchTurn:
        r = _Reader(payload, "PATCH")
        target, n = r.unpack(PATCH)
        data = r.raw(n)
        r.done()
        return cls(target, data)

    def decode_reply(self, payload: Buffer) -> Patch:
        return decode_patch(payload)


@dataclass(slots=True)
class Tombstone(_Fixed[Patch]):
    MSG_TYPE = MsgType.TOMBSTONE
    LAYOUT = U64
    REPLY = staticmethod(decode_patch)
    target_turn_id: int


@dataclass(slots=True)
class GetPayload(_Fixed[bytes | None]):
    MSG_TYPE = MsgType.GET_PAYLOAD
    LAYOUT = GET_PAYLOAD
    REPLY = staticmethod(decode_maybe_payload)
    OPTS = AS_OF
    turn_id: int
    as_of_seq: int = 0
    opts: int = 0

    def check(self) -> None:
        _Fixed.check(self)  # not super(): a slots dataclass is a new class, without its cell
        _check_unused(self.as_of_seq, self.opts, AS_OF, "as_of_seq", self.WHAT)


REQUESTS: dict[int, type[Request]] = {
    cls.MSG_TYPE: cls
    for cls in (
        Hello, CtxCreate, CtxFork, GetHead, AppendTurn, AppendBatch, GetLast, GetBefore, GetRangeByDepth,
        GetBlob, PutBlob, GetChain, PatchTurn, Tombstone, GetPayload, CtxDelete, GetTurn,
    )
}  # fmt: skip


def decode_request(msg_type: int, payload: Buffer) -> Request:
    """The request in a frame's payload; UnknownMessage or MalformedMessage when it is not one."""
    cls = REQUESTS.get(msg_type)
    if cls is None:
        raise UnknownMessage(f"unknown msg_type {msg_type}")
    return cls.decode(payload)
