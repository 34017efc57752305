"""Fuzzing the frame protocol: the sans-IO decoders, then a live server with clients watching.

Everything is seeded: a failure replays with the same inputs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from store import Store, Turn, TurnInput
from store.service import messages as m
from store.service.client import StoreClient
from store.service.frames import FLAG_REPLY, HEADER, ErrorCode, FrameDecoder, ProtocolError, encode_frame
from store.service.limits import ServiceLimits
from store.service.server import StoreServer

HASH = bytes(range(32))


def templates(contexts: list[int], turns: list[int], blob_hash: bytes) -> list[m.Request]:
    """One or more valid requests of every type, aimed at things that exist (or nearly)."""
    rng = random.Random(0)
    ctx, turn = contexts[0], turns[-1]
    reqs: list[m.Request] = [
        m.Hello(),
        m.Hello(0, 9),
        m.CtxCreate(0),
        m.CtxCreate(turn),
        m.CtxFork(turn),
        m.GetHead(ctx),
        m.CtxDelete(contexts[-1]),
        m.GetTurn(turn),
        m.AppendTurn(ctx, b"fuzz payload " * 3, 5, 6),
        m.AppendTurn(ctx, b"", expected_parent=turn, opts=m.EXPECT_PARENT),
        m.AppendBatch(ctx, [TurnInput(b"a"), TurnInput(b"bb", 1, 2)]),
        m.GetLast(ctx, 5, m.READ_PAYLOADS),
        m.GetLast(ctx, 64, m.READ_PAYLOADS | m.READ_PATCHED),
        m.GetBefore(ctx, turn, 3, 0),
        m.GetRangeByDepth(ctx, 1, 4, m.READ_PAYLOADS),
        m.GetChain(turn, m.READ_PAYLOADS),
        m.GetBlob(blob_hash, m.VERIFY_HASH),
        m.GetBlob(HASH),
        m.PutBlob(os.urandom(40)),
        m.PatchTurn(turns[0], b"patched"),
        m.Tombstone(turns[1]),
        m.GetPayload(turns[0], 1, m.AS_OF),
    ]
    return reqs + [m.GetLast(rng.choice(contexts), rng.randint(0, 10), 1) for _ in range(5)]


def frames_of(reqs: list[m.Request], rng: random.Random) -> list[bytes]:
    return [encode_frame(r.MSG_TYPE, rng.getrandbits(64), r.encode()) for r in reqs]


def mutate(rng: random.Random, frames: list[bytes]) -> bytes:
    """A valid frame (or two) bent in one of the ways that break real parsers."""
    data = bytearray(rng.choice(frames))
    kind = rng.randrange(10)
    if kind == 0:  # bit flips
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif kind == 1:  # random bytes overwritten
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif kind == 2:  # truncated
        del data[rng.randrange(len(data)) :]
    elif kind == 3:  # bytes inserted
        pos = rng.randrange(len(data) + 1)
        data[pos:pos] = rng.randbytes(rng.randint(1, 16))
    elif kind == 4:  # len field lies
        struct.pack_into(
            "<I", data, 0, rng.choice([0, 1, len(data), len(data) - 17, 2**31, 2**32 - 1, 65536]) % 2**32
        )
    elif kind == 5:  # another msg_type
        struct.pack_into("<H", data, 4, rng.choice([0, 18, 255, 0xFFFF, rng.randrange(65536)]))
    elif kind == 6:  # flags
        struct.pack_into("<H", data, 6, rng.randrange(65536))
    elif kind == 7:  # a u32/u64 payload field set to an edge value
        if len(data) >= 24:
            pos = rng.randrange(16, len(data) - 7)
            struct.pack_into("<Q", data, pos, rng.choice([0, 2**32 - 1, 2**64 - 1, 2**63, 1]))
    elif kind == 8:  # two frames glued, the second cut short
        other = rng.choice(frames)
        data += other[: rng.randrange(len(other) + 1)]
    else:  # pure noise
        data = bytearray(rng.randbytes(rng.randint(0, 64)))
    return bytes(data)


REPLY_DECODERS = [m.TurnList.decode, m.ErrorReply.decode, m.HelloReply.decode, m.decode_turn, m.decode_blob]


def test_hundreds_of_thousands_of_mutated_frames_at_the_decoders() -> None:
    rng = random.Random(20261121)
    reqs = templates([1, 2, 3], [1, 2, 3, 4], HASH)
    frames = frames_of(reqs, rng)
    turn = Turn(5, 4, 1, 2, 3, HASH, 0, 123)
    replies = [
        m.TurnList([turn, turn], [b"x", None], 5, 1).encode(),
        m.ErrorReply(ErrorCode.PARENT_CONFLICT, "e", 2, 3).encode(),
        m.HelloReply(1, 2, 3, 4, 5, 6, 7).encode(),
        m.encode_turn(turn),
        m.encode_maybe_payload(b"blob"),
    ]
    counts = {"inputs": 0, "frames": 0, "requests": 0, "refused": 0}
    for _ in range(300_000):
        data = mutate(rng, frames)
        counts["inputs"] += 1
        dec = FrameDecoder(1 << 16)
        cut = rng.randrange(len(data) + 1)
        try:
            for frame in dec.feed(data[:cut]) + dec.feed(data[cut:]):
                counts["frames"] += 1
                req = m.decode_request(frame.msg_type, frame.payload)
                counts["requests"] += 1
                assert req.encode() == frame.payload  # strict decoding: one encoding per message
            if dec.error is not None:  # a bad header after the frames handed over
                raise dec.error
        except ProtocolError:
            counts["refused"] += 1
        if counts["inputs"] % 8 == 0:  # the client's reply decoders get the same treatment
            reply = mutate(rng, replies)
            for decode in REPLY_DECODERS:
                with contextlib.suppress(ProtocolError):
                    decode(reply)
    # every path was exercised: frames cut apart and reassembled, requests decoded, refusals
    assert counts["frames"] > 100_000 and counts["requests"] > 50_000 and counts["refused"] > 50_000, counts


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.lists(st.integers(0, 300), max_size=5))
def test_decoder_takes_any_bytes_in_any_chunks(data: bytes, cuts: list[int]) -> None:
    dec = FrameDecoder(128)
    bounds = [0, *sorted(cuts), len(data)]
    try:
        for a, b in zip(bounds, bounds[1:], strict=False):
            for frame in dec.feed(data[a:b]):
                assert len(frame.payload) <= 128
                with contextlib.suppress(ProtocolError):
                    m.decode_request(frame.msg_type, frame.payload)
    except ProtocolError:
        pass
    assert dec.buffered <= HEADER.size + 128


# --- the live server ----------------------------------------------------------------------


async def fuzz_connection(path: Path, data: bytes, hello: bool) -> list[int]:
    """Send HELLO (maybe) and the fuzz bytes, half-close, read replies until the server closes.

    Returns the error codes received; asserts every reply is a well-formed reply frame.
    """
    reader, writer = await asyncio.open_unix_connection(path)
    if hello:
        writer.write(encode_frame(m.MsgType.HELLO, 1, m.Hello().encode()))
    writer.write(data)
    try:
        await writer.drain()
        writer.write_eof()
    except ConnectionError:
        pass  # the server already hung up on an early protocol error
    received = b""
    try:
        while chunk := await asyncio.wait_for(reader.read(1 << 16), 10):
            received += chunk
    except ConnectionError:
        pass
    writer.close()
    codes = []
    for frame in FrameDecoder(1 << 20).feed(received):
        assert frame.flags == FLAG_REPLY
        if frame.msg_type == m.MsgType.ERROR:
            codes.append(m.ErrorReply.decode(frame.payload).code)
        else:
            assert frame.msg_type in m.REQUESTS
    return codes


async def test_live_server_survives_thousands_of_mutated_frames_and_others_are_unaffected(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="store.service.server")
    rng = random.Random(7)
    limits = ServiceLimits(
        max_frame=1 << 16, max_payload=1 << 15, max_in_flight=16, read_timeout=2, idle_timeout=5
    )
    with Store.open(tmp_path / "store") as store:
        contexts = [store.create_context().context_id for _ in range(6)]
        turns = [store.append_turn(contexts[0], b"turn %d" % i).turn_id for i in range(4)]
        blob_hash = store.put_blob(b"a blob")
        canary_ctx = store.create_context().context_id
        forbidden = struct.pack("<Q", canary_ctx)
        frames = frames_of(templates(contexts, turns, blob_hash), rng)
        async with StoreServer(store, tmp_path / "s.sock", limits=limits) as server:
            canary = await StoreClient.connect(server.socket_path)
            canary_payloads: list[bytes] = []
            fuzzing = True

            async def watch() -> int:
                """A well-behaved client appending and reading back the whole time."""
                parent, rounds = 0, 0
                while fuzzing or rounds < 3:
                    payload = os.urandom(rng.randint(1, 2000))
                    expected = parent if canary_payloads else 0
                    t = await canary.append_turn(canary_ctx, payload, expected_parent=expected)
                    canary_payloads.append(payload)
                    parent = t.turn_id
                    got = await canary.get_last(canary_ctx, 8, payloads=True)
                    assert got.payloads == canary_payloads[-8:]
                    rounds += 1
                return rounds

            slots = asyncio.Semaphore(24)
            sent = 0

            async def one() -> list[int]:
                nonlocal sent
                n = rng.randint(1, 12)
                stream = b"".join(
                    rng.choice(frames) if rng.random() < 0.3 else mutate(rng, frames) for _ in range(n)
                )
                if forbidden in stream:  # never touch the canary's context
                    return []
                sent += n
                async with slots:
                    return await fuzz_connection(tmp_path / "s.sock", stream, hello=rng.random() < 0.9)

            watcher = asyncio.ensure_future(watch())
            results = await asyncio.gather(*(one() for _ in range(1500)))
            fuzzing = False
            assert await asyncio.wait_for(watcher, 60) >= 3
            codes = [c for r in results for c in r]
            assert sent > 8000
            assert ErrorCode.INTERNAL not in codes
            assert {ErrorCode.MALFORMED, ErrorCode.UNKNOWN_MESSAGE, ErrorCode.FRAME_TOO_LARGE} <= set(codes)
            await canary.close()
            for _ in range(100):  # every fuzz connection is gone, none leaked
                if not server.connections:
                    break
                await asyncio.sleep(0.05)
            assert not server.connections
        full = store.get_last(canary_ctx, 10**6)
        assert store.payloads(full) == canary_payloads
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
