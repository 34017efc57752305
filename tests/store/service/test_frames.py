"""The sans-IO frame codec and message layouts: round trips, strictness, the documented vectors."""

from __future__ import annotations

import random
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from store.service import messages as m
from store.service.frames import (
    FLAG_REPLY,
    HEADER_SIZE,
    KEEP_BUFFER,
    ErrorCode,
    Frame,
    FrameDecoder,
    FrameTooLarge,
    MalformedFrame,
    ProtocolError,
    UnknownMessage,
    encode_frame,
)
from store.types import ContextHead, Patch, Turn, TurnInput

PROTOCOL_MD = Path(__file__).resolve().parents[3] / "docs" / "PROTOCOL.md"

HASH_A = bytes(range(32))
HASH_B = bytes(range(32, 64))
T41 = Turn(41, 40, 2, 0x1122334455667788, 6, HASH_A, 0, 1_700_000_000_000)
T42 = Turn(42, 41, 3, 0x1122334455667788, 6, HASH_B, 0, 1_700_000_000_123)
HEAD = ContextHead(7, 42, 3, 1_699_999_999_000, 0)


@dataclass(frozen=True)
class Vector:
    """One documented frame: what it says, and how to rebuild and decode it."""

    description: str
    msg_type: int
    flags: int
    req_id: int
    value: Any
    payload: bytes
    decode: Any


def request(desc: str, req_id: int, req: m.Request) -> Vector:
    return Vector(
        desc, req.MSG_TYPE, 0, req_id, req, req.encode(), lambda p: m.decode_request(req.MSG_TYPE, p)
    )


def reply(desc: str, req_id: int, req: m.Request, value: Any, payload: bytes) -> Vector:
    return Vector(desc, req.MSG_TYPE, FLAG_REPLY, req_id, value, payload, req.decode_reply)


PARENT_CONFLICT = m.ErrorReply(
    ErrorCode.PARENT_CONFLICT, "context 7: expected parent turn 40, but the head is turn 41", 40, 41
)

VECTORS: dict[str, Vector] = {
    "hello_request": request("HELLO, client speaks version 1 only", 1, m.Hello(1, 1)),
    "hello_reply": reply(
        "HELLO reply: version 1, default limits",
        1,
        m.Hello(),
        m.HelloReply(1, 268500992, 268435456, 128, 65536, 300000, 30000),
        m.HelloReply(1, 268500992, 268435456, 128, 65536, 300000, 30000).encode(),
    ),
    "ctx_create_request": request("CTX_CREATE of an empty context", 2, m.CtxCreate(0)),
    "ctx_create_from_turn_request": request("CTX_CREATE whose head is turn 42", 3, m.CtxCreate(42)),
    "context_head_reply": reply(
        "ContextHead reply (CTX_CREATE, CTX_FORK, GET_HEAD): context 7, head turn 42 at depth 3",
        3,
        m.CtxCreate(42),
        HEAD,
        m.encode_context_head(HEAD),
    ),  # fmt: skip
    "ctx_fork_request": request("CTX_FORK at turn 42", 4, m.CtxFork(42)),
    "get_head_request": request("GET_HEAD of context 7", 5, m.GetHead(7)),
    "ctx_delete_request": request("CTX_DELETE of context 7", 6, m.CtxDelete(7)),
    "ctx_delete_reply": reply("CTX_DELETE reply (empty payload)", 6, m.CtxDelete(7), None, b""),
    "get_turn_request": request("GET_TURN 42", 7, m.GetTurn(42)),
    "append_turn_request": request(
        "APPEND_TURN to context 7 of 'hello', type_tag 0x1122334455667788, codec 6, expected parent 41",
        8,
        m.AppendTurn(7, b"hello", 0x1122334455667788, 6, 41, m.EXPECT_PARENT),
    ),  # fmt: skip
    "turn_reply": reply(
        "Turn reply (APPEND_TURN, GET_TURN): turn 42, parent 41, depth 3",
        8,
        m.AppendTurn(7, b"hello"),
        T42,
        m.encode_turn(T42),
    ),  # fmt: skip
    "parent_conflict_error": Vector(
        "ERROR answering request 9: PARENT_CONFLICT, expected 40, head is 41",
        m.MsgType.ERROR,
        FLAG_REPLY,
        9,
        PARENT_CONFLICT,
        PARENT_CONFLICT.encode(),
        m.ErrorReply.decode,
    ),  # fmt: skip
    "append_batch_request": request(
        "APPEND_BATCH to context 7, no expected parent: 'a' (type 1, codec 0) then 'bc' (type 2, codec 6)",
        10,
        m.AppendBatch(7, [TurnInput(b"a", 1, 0), TurnInput(b"bc", 2, 6)]),
    ),  # fmt: skip
    "append_batch_reply": reply(
        "APPEND_BATCH reply: TurnList of turns 41 and 42, no payloads, head depth 3",
        10,
        m.AppendBatch(7, []),
        m.TurnList([T41, T42], None, 0, 3),
        m.TurnList([T41, T42], None, 0, 3).encode(),
    ),  # fmt: skip
    "get_last_request": request("GET_LAST 64 turns of context 7, payloads patched", 11, m.GetLast(7, 64, 3)),
    "get_last_reply": reply(
        "GET_LAST reply: turns 41 ('hi') and 42 (tombstoned), next cursor 41, head depth 3",
        11,
        m.GetLast(7, 64, 3),
        m.TurnList([T41, T42], [b"hi", None], 41, 3),
        m.TurnList([T41, T42], [b"hi", None], 41, 3).encode(),
    ),  # fmt: skip
    "get_before_request": request(
        "GET_BEFORE turn 41 in context 7, 16 turns, metadata only", 12, m.GetBefore(7, 41, 16)
    ),
    "get_range_by_depth_request": request(
        "GET_RANGE_BY_DEPTH of context 7 from depth 2, 10 turns, with payloads",
        13,
        m.GetRangeByDepth(7, 2, 10, 1),
    ),
    "get_range_by_depth_reply": reply(
        "GET_RANGE_BY_DEPTH reply: turns 41 ('hi') and 42 ('ok') at depths 2, 3; next cursor 41",
        13,
        m.GetRangeByDepth(7, 2, 10, 1),
        m.TurnList([T41, T42], [b"hi", b"ok"], 41, 3),
        m.TurnList([T41, T42], [b"hi", b"ok"], 41, 3).encode(),
    ),  # fmt: skip
    "get_chain_request": request("GET_CHAIN of turn 42, metadata only", 14, m.GetChain(42)),
    "get_blob_request": request("GET_BLOB 000102..1f, re-hashed", 15, m.GetBlob(HASH_A, m.VERIFY_HASH)),
    "get_blob_reply": reply("GET_BLOB reply: 'hello'", 15, m.GetBlob(HASH_A), b"hello", b"\x05\0\0\0hello"),
    "put_blob_request": request("PUT_BLOB of 'hello'", 16, m.PutBlob(b"hello")),
    "put_blob_reply": reply("PUT_BLOB reply: the 32-byte hash", 16, m.PutBlob(b""), HASH_A, HASH_A),
    "patch_request": request("PATCH turn 42 with 'fixed'", 17, m.PatchTurn(42, b"fixed")),
    "patch_reply": reply(
        "Patch reply to PATCH: target 42, new hash 2021..3f, flags 1 (replace), seq 5",
        17,
        m.PatchTurn(42, b""),
        Patch(42, HASH_B, 1, 5),
        m.encode_patch(Patch(42, HASH_B, 1, 5)),
    ),  # fmt: skip
    "tombstone_request": request("TOMBSTONE turn 42", 18, m.Tombstone(42)),
    "tombstone_reply": reply(
        "Patch reply to TOMBSTONE: target 42, hash all zero, flags 2 (tombstone), seq 6",
        18,
        m.Tombstone(42),
        Patch(42, bytes(32), 2, 6),
        m.encode_patch(Patch(42, bytes(32), 2, 6)),
    ),  # fmt: skip
    "get_payload_request": request(
        "GET_PAYLOAD of turn 42 as of patch seq 4", 19, m.GetPayload(42, 4, m.AS_OF)
    ),
    "get_payload_absent_reply": reply(
        "GET_PAYLOAD reply: the turn is tombstoned", 19, m.GetPayload(42), None, b"\xff\xff\xff\xff"
    ),
}


# --- frames -------------------------------------------------------------------------------


def test_header_is_16_bytes_little_endian() -> None:
    frame = encode_frame(0x0102, 0x0A0B0C0D0E0F1011, b"xyz", FLAG_REPLY)
    assert HEADER_SIZE == 16
    assert frame[:16] == bytes.fromhex("030000000201010011100f0e0d0c0b0a")
    assert frame[16:] == b"xyz"


def test_decoder_reassembles_frames_split_at_every_byte() -> None:
    frames = [Frame(i % 7 + 1, 0, i, bytes([i]) * i) for i in range(40)]
    stream = b"".join(encode_frame(f.msg_type, f.req_id, f.payload, f.flags) for f in frames)
    for chunk in (1, 2, 3, 15, 16, 17, 1000):
        dec = FrameDecoder(1000)
        got: list[Frame] = []
        for i in range(0, len(stream), chunk):
            got += dec.feed(stream[i : i + chunk])
            fed = min(i + chunk, len(stream))
            assert dec.buffered == fed - sum(HEADER_SIZE + len(f.payload) for f in got)
        assert got == frames
        assert dec.buffered == 0


def test_reading_into_the_decoders_buffer_gives_the_same_frames() -> None:
    """get_buffer/buffer_updated (asyncio.BufferedProtocol), with reads of any size, big frames
    that outgrow the buffer, and copy=False views that stay right until the next call."""
    rng = random.Random(5)
    frames = [Frame(1, 0, i, rng.randbytes(rng.choice([0, 7, 5000, 200_000, 5 << 20]))) for i in range(30)]
    stream = b"".join(encode_frame(f.msg_type, f.req_id, f.payload, f.flags) for f in frames)
    for copy in (True, False):
        dec = FrameDecoder(8 << 20, copy=copy)
        got: list[Frame] = []
        pos = 0
        while pos < len(stream):
            room = dec.get_buffer()
            n = min(len(room), rng.choice([1, 100, 65536, 1 << 22]), len(stream) - pos)
            room[:n] = stream[pos : pos + n]
            pos += n
            got += [f._replace(payload=bytes(f.payload)) for f in dec.buffer_updated(n)]
        assert got == frames and dec.buffered == 0
        assert len(dec._buf) <= KEEP_BUFFER  # a buffer grown for a 5 MiB frame was let go


def test_a_huge_announced_frame_is_not_allocated_before_its_bytes_come() -> None:
    dec = FrameDecoder(1 << 30)
    dec.feed(struct.pack("<IHHQ", 1 << 30, 1, 0, 1))
    assert len(dec.get_buffer()) <= KEEP_BUFFER  # later, at most twice what came
    for _ in range(3):
        room = dec.get_buffer()
        room[:] = bytes(len(room))
        assert dec.buffer_updated(len(room)) == []
    assert dec.buffered < 5 * KEEP_BUFFER


def test_decoder_refuses_an_oversized_frame_from_its_header_alone() -> None:
    dec = FrameDecoder(100)
    good = encode_frame(1, 5, b"x" * 100)
    # the good frames of the same read are handed over; the error waits in dec.error
    assert dec.feed(good + struct.pack("<IHHQ", 101, 1, 0, 77)) == [Frame(1, 0, 5, b"x" * 100)]
    assert isinstance(dec.error, FrameTooLarge)  # no payload sent: refused before buffering it
    assert dec.error.req_id == 77 and dec.error.arg0 == 101 and dec.error.arg1 == 100
    assert "101 bytes exceeds the limit of 100" in str(dec.error)
    with pytest.raises(FrameTooLarge):  # the stream has lost its framing: it stays failed
        dec.feed(encode_frame(1, 6, b""))


@pytest.mark.parametrize("copy", [True, False])
def test_decoder_refuses_unknown_flag_bits_after_the_frames_before_them(copy: bool) -> None:
    dec = FrameDecoder(100, copy=copy)
    good = [Frame(1, 0, i, bytes([i]) * i) for i in range(1, 4)]
    stream = b"".join(encode_frame(f.msg_type, f.req_id, bytes(f.payload)) for f in good)
    got = dec.feed(stream + encode_frame(1, 9, b"", flags=0x0002) + encode_frame(1, 10, b""))
    assert [f._replace(payload=bytes(f.payload)) for f in got] == good
    assert isinstance(dec.error, MalformedFrame) and dec.error.req_id == 9
    assert "unknown flag bits 0x0002" in str(dec.error)
    with pytest.raises(MalformedFrame):
        dec.get_buffer()


# --- messages -----------------------------------------------------------------------------


u64 = st.integers(0, 2**64 - 1)
u32 = st.integers(0, 2**32 - 1)
blob = st.binary(max_size=64)
read_opts = st.sampled_from([0, m.READ_PAYLOADS, m.READ_PAYLOADS | m.READ_PATCHED])
requests = st.one_of(
    st.builds(m.Hello, st.integers(0, 65535), st.integers(0, 65535)),
    st.builds(m.CtxCreate, u64),
    st.builds(m.CtxFork, u64),
    st.builds(m.GetHead, u64),
    st.builds(m.CtxDelete, u64),
    st.builds(m.GetTurn, u64),
    st.builds(m.AppendTurn, u64, blob, u64, u32, u64, st.just(m.EXPECT_PARENT)),
    st.builds(m.AppendTurn, u64, blob, u64, u32),
    st.builds(m.AppendBatch, u64, st.lists(st.builds(TurnInput, blob, u64, u32), min_size=1, max_size=5)),
    st.builds(
        m.AppendBatch, u64, st.lists(st.builds(TurnInput, blob, u64, u32), min_size=1, max_size=5), u64,
        st.just(m.EXPECT_PARENT),
    ),  # fmt: skip
    st.builds(m.GetLast, u64, u32, read_opts),
    st.builds(m.GetBefore, u64, u64, u32, read_opts),
    st.builds(m.GetRangeByDepth, u64, u32, u32, read_opts),
    st.builds(m.GetChain, u64, read_opts),
    st.builds(m.GetBlob, st.binary(min_size=32, max_size=32), st.sampled_from([0, m.VERIFY_HASH])),
    st.builds(m.PutBlob, blob),
    st.builds(m.PatchTurn, u64, blob),
    st.builds(m.Tombstone, u64),
    st.builds(m.GetPayload, u64, u64, st.just(m.AS_OF)),
    st.builds(m.GetPayload, u64),
)
turns = st.builds(Turn, u64, u64, u32, u64, u32, st.binary(min_size=32, max_size=32), u32, u64)


@settings(max_examples=400, deadline=None)
@given(requests)
def test_every_request_round_trips(req: m.Request) -> None:
    assert m.decode_request(req.MSG_TYPE, req.encode()) == req


@settings(max_examples=200, deadline=None)
@given(st.lists(turns, max_size=6), st.booleans(), u64, u32, st.data())
def test_turn_lists_round_trip(
    ts: list[Turn], with_payloads: bool, cursor: int, depth: int, data: Any
) -> None:
    payloads = (
        data.draw(st.lists(st.none() | blob, min_size=len(ts), max_size=len(ts))) if with_payloads else None
    )
    tl = m.TurnList(ts, payloads, cursor, depth)
    assert m.TurnList.decode(tl.encode()) == tl


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 65535), st.text(max_size=50), u64, u64)
def test_error_replies_round_trip(code: int, text: str, a0: int, a1: int) -> None:
    err = m.ErrorReply(code, text, a0, a1)
    assert m.ErrorReply.decode(err.encode()) == err


def test_error_message_is_capped() -> None:
    err = m.ErrorReply(ErrorCode.INTERNAL, "x" * 5000)
    assert len(m.ErrorReply.decode(err.encode()).message) == m.MAX_ERROR_MESSAGE


@pytest.mark.parametrize("name", [n for n, v in VECTORS.items() if not v.flags])
def test_requests_are_strict_about_length(name: str) -> None:
    v = VECTORS[name]
    for cut in range(len(v.payload)):
        with pytest.raises(MalformedFrame):
            m.decode_request(v.msg_type, v.payload[:cut])
    with pytest.raises(MalformedFrame, match="trailing|expected"):
        m.decode_request(v.msg_type, v.payload + b"\0")


@pytest.mark.parametrize(
    "req",
    [m.GetLast(1, 1, 4), m.GetLast(1, 1, m.READ_PATCHED), m.AppendTurn(1, b"", opts=2), m.GetBlob(HASH_A, 2)],
)
def test_requests_refuse_unknown_option_bits(req: m.Request) -> None:
    with pytest.raises(MalformedFrame, match="option bits|READ_PATCHED without"):
        m.decode_request(req.MSG_TYPE, req.encode())


@pytest.mark.parametrize(
    "req",
    [m.AppendTurn(1, b"", expected_parent=5), m.AppendBatch(1, [TurnInput(b"")], 5), m.GetPayload(1, 3)],
)
def test_fields_without_their_option_bit_must_be_zero(req: m.Request) -> None:
    with pytest.raises(MalformedFrame, match="option bit is not set"):
        m.decode_request(req.MSG_TYPE, req.encode())


def test_unknown_message_type_and_empty_batch_are_refused() -> None:
    with pytest.raises(UnknownMessage, match="unknown msg_type 999"):
        m.decode_request(999, b"")
    with pytest.raises(MalformedFrame, match="count is 0"):
        m.decode_request(m.MsgType.APPEND_BATCH, m.AppendBatch(1, []).encode())


def test_absent_payload_is_refused_where_a_payload_is_required() -> None:
    with pytest.raises(MalformedFrame, match="absent payload"):
        m.decode_request(m.MsgType.PUT_BLOB, b"\xff\xff\xff\xff")


@pytest.mark.parametrize(
    ("client", "expected"),
    [((1, 1), 1), ((1, 9), 1), ((0, 1), 1), ((2, 5), None), ((0, 0), None), ((1, 0), None)],
)
def test_version_negotiation(client: tuple[int, int], expected: int | None) -> None:
    assert m.Hello(*client).negotiate() == expected


# --- the vectors in docs/PROTOCOL.md ------------------------------------------------------


def documented_vectors() -> dict[str, bytes]:
    """name -> frame bytes, from the `name: description` + indented hex lines of PROTOCOL.md."""
    text = PROTOCOL_MD.read_text()
    section = text.split("## Store service", 1)[1].split("\n## ", 1)[0]
    vectors: dict[str, bytes] = {}
    name = None
    for line in section.splitlines():
        head = re.match(r"^(\w+): ", line)
        if head and head.group(1) in VECTORS:
            name = head.group(1)
            vectors[name] = b""
        elif name and re.fullmatch(r"  [0-9a-f ]+", line):
            vectors[name] += bytes.fromhex(line)
        else:
            name = None
    return vectors


def test_protocol_md_documents_every_vector() -> None:
    assert sorted(documented_vectors()) == sorted(VECTORS)


@pytest.mark.parametrize("name", sorted(VECTORS))
def test_protocol_md_vector(name: str) -> None:
    v = VECTORS[name]
    doc = documented_vectors()[name]
    assert doc == encode_frame(v.msg_type, v.req_id, v.payload, v.flags)
    (frame,) = FrameDecoder(1 << 20).feed(doc)
    assert (frame.msg_type, frame.flags, frame.req_id) == (v.msg_type, v.flags, v.req_id)
    assert v.decode(frame.payload) == v.value


def test_every_message_type_has_a_documented_request() -> None:
    documented = {VECTORS[n].msg_type for n in VECTORS if not VECTORS[n].flags}
    assert documented == set(m.REQUESTS)


# --- a quick seeded mutation pass (the long one is in test_service_fuzz.py) ---------------


def test_decoder_and_messages_survive_mutated_vectors() -> None:
    rng = random.Random(1)
    frames = [encode_frame(v.msg_type, v.req_id, v.payload, v.flags) for v in VECTORS.values()]
    for _ in range(2000):
        data = bytearray(rng.choice(frames))
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        try:
            for f in FrameDecoder(1 << 16).feed(bytes(data)):
                m.decode_request(f.msg_type, f.payload)
        except ProtocolError:
            pass
