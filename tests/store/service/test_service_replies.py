"""Exactly one reply per request carried out, whatever bad bytes follow the good ones.

A client of this test's own speaks the frame protocol in raw bytes laid out from
docs/PROTOCOL.md (struct only: no store.service frames, messages or client), over a
real Unix socket to a real server on a real store.  Each stream is N good APPEND_TURN /
GET_HEAD requests followed, in the same write, by one bad thing; it is sent in one write,
split in two at every byte, byte by byte, and in random chunks.  Afterwards every request
the server carried out has exactly one reply, every append happened exactly once (read
back from the store), and nothing after a violation was carried out.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import struct
import threading
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from store import Store
from store.service.limits import ServiceLimits
from store.service.server import StoreServer

HEADER = struct.Struct("<IHHQ")  # len, msg_type, flags, req_id
REPLY = 0x0001
HELLO, GET_HEAD, APPEND_TURN, ERROR = 1, 4, 5, 0xFFFF
MALFORMED, FRAME_TOO_LARGE = 1, 2
APPEND = struct.Struct("<QQQIII")  # context_id, expected_parent, type_tag, codec, opts, payload_len
TURN = struct.Struct("<QQIIQ32sIQ")
CONTEXT_HEAD = struct.Struct("<QQIIQ")
ERROR_REPLY = struct.Struct("<HHQQI")  # code, reserved, arg0, arg1, message_len
MAX_FRAME = 4096
BIG = 100_000  # appends this big run in the worker threads, not on the event loop


def frame(msg_type: int, req_id: int, payload: bytes, flags: int = 0) -> bytes:
    return HEADER.pack(len(payload), msg_type, flags, req_id) + payload


def append(ctx: int, req_id: int, payload: bytes) -> bytes:
    return frame(APPEND_TURN, req_id, APPEND.pack(ctx, 0, 7, 0, 0, len(payload)) + payload)


@dataclass
class Stream:
    data: bytes
    appends: dict[int, bytes]  # req_id -> payload of the appends that must be carried out
    reads: list[int]  # req_ids of the GET_HEADs that must be answered
    error: tuple[int, int] | None  # (req_id, code) of the ERROR the bad tail earns
    closes: bool  # the server ends the connection on its own (else on our EOF)
    never: bytes  # a payload that must not be appended


def stream(case: str, ctx: int, n: int, big: bool = False) -> Stream:
    """HELLO, n good requests (appends and GET_HEADs), then the bad tail of `case`."""
    data = [frame(HELLO, 1, struct.pack("<HH", 1, 1))]
    appends: dict[int, bytes] = {}
    reads: list[int] = []
    for req_id in range(2, n + 2):
        if req_id % 3 == 1:
            data.append(frame(GET_HEAD, req_id, struct.pack("<Q", ctx)))
            reads.append(req_id)
        else:
            body = f"{case} ctx {ctx} req {req_id} ".encode()
            appends[req_id] = body * (BIG // len(body)) if big else body
            data.append(append(ctx, req_id, appends[req_id]))
    never = f"{case} ctx {ctx} never".encode()
    after = append(ctx, 1000, never)  # a good frame after the violation: must not run
    closes = case in ("oversized", "flags", "req_id 0")
    if case == "oversized":
        tail, error = HEADER.pack(MAX_FRAME + 1, APPEND_TURN, 0, 99) + after, (99, FRAME_TOO_LARGE)
    elif case == "flags":
        tail, error = frame(GET_HEAD, 99, struct.pack("<Q", ctx), flags=0x0004) + after, (99, MALFORMED)
    elif case == "req_id 0":
        tail, error = append(ctx, 0, never) + after, (0, MALFORMED)
    elif case == "truncated":
        tail, error = after[:-3], None
    else:  # a bad payload: its own ERROR, and the requests after it are carried out
        assert case == "payload"
        body = f"{case} ctx {ctx} after".encode()
        tail = frame(APPEND_TURN, 99, b"\0" * 5) + append(ctx, 1000, body)
        error, never = (99, MALFORMED), b""
        appends[1000] = body
    return Stream(b"".join(data) + tail, appends, reads, error, closes, never)


def splits(data: bytes, how: str, rng: random.Random) -> Iterator[bytes]:
    if how == "whole":
        yield data
    elif how == "bytes":
        yield from (data[i : i + 1] for i in range(len(data)))
    elif how.startswith("at "):
        cut = int(how[3:])
        yield from (data[:cut], data[cut:])
    else:
        pos = 0
        while pos < len(data):
            n = rng.randint(1, 64 if how == "small chunks" else 8192)
            yield data[pos : pos + n]
            pos += n


def parse(received: bytes) -> list[tuple[int, int, bytes]]:
    """(msg_type, req_id, payload) of every frame; every one carries REPLY and is whole."""
    out, pos = [], 0
    while pos < len(received):
        length, msg_type, flags, req_id = HEADER.unpack_from(received, pos)
        assert flags == REPLY
        payload = received[pos + HEADER.size : pos + HEADER.size + length]
        assert len(payload) == length, "a reply was cut off"
        out.append((msg_type, req_id, payload))
        pos += HEADER.size + length
    return out


async def exchange(path: Path, chunks: Iterator[bytes]) -> bytes:
    """Send the chunks (each its own write, the server reading between them), half-close,
    and read until the server closes."""
    reader, writer = await asyncio.open_unix_connection(path)
    received = bytearray()

    async def read() -> None:
        while chunk := await reader.read(1 << 16):
            received.extend(chunk)

    reading = asyncio.ensure_future(read())
    try:
        for chunk in chunks:
            writer.write(chunk)
            await writer.drain()
            await asyncio.sleep(0)
        writer.write_eof()
    except ConnectionError:
        pass  # the server already ended the connection; what it sent is still to be read
    with contextlib.suppress(ConnectionError):
        await asyncio.wait_for(reading, 30)
    writer.close()
    return bytes(received)


def check(store: Store, ctx: int, s: Stream, received: bytes) -> None:
    replies = parse(received)
    counts = Counter(req_id for _t, req_id, _p in replies)
    expected = {1, *s.appends, *s.reads} | ({s.error[0]} if s.error else set())
    assert set(counts) == expected and set(counts.values()) == {1}, (counts, expected)
    by_id = {req_id: (msg_type, payload) for msg_type, req_id, payload in replies}
    for req_id in s.appends:
        assert by_id[req_id][0] == APPEND_TURN, by_id[req_id]
    for req_id in s.reads:
        msg_type, payload = by_id[req_id]
        assert msg_type == GET_HEAD and CONTEXT_HEAD.unpack(payload)[0] == ctx
    if s.error is not None:
        msg_type, payload = by_id[s.error[0]]
        assert msg_type == ERROR and ERROR_REPLY.unpack_from(payload)[0] == s.error[1]
        if s.closes:  # the connection's error comes last, after every earlier reply
            assert replies[-1][1] == s.error[0]
    # read back: each acknowledged append is in the store exactly once, nothing else is
    turns = store.get_last(ctx, 10_000)
    stored = Counter(store.payloads(turns))
    assert stored == Counter(s.appends.values())
    assert s.never not in stored
    by_turn = {t.turn_id: t for t in turns}
    for req_id, body in s.appends.items():  # each reply names the turn that holds its payload
        turn_id, *_rest, payload_hash, _flags, _created = TURN.unpack(by_id[req_id][1])
        assert store.payloads([by_turn[turn_id]]) == [body] and by_turn[turn_id].payload_hash == payload_hash


CASES = ["oversized", "flags", "payload", "truncated", "req_id 0"]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store.open(tmp_path / "store") as s:
        yield s


@pytest.fixture
async def server(store: Store, tmp_path: Path) -> AsyncIterator[StoreServer]:
    async with StoreServer(store, tmp_path / "s.sock", limits=ServiceLimits(max_frame=MAX_FRAME)) as srv:
        yield srv


@pytest.mark.parametrize("case", CASES)
async def test_every_request_carried_out_gets_one_reply_for_every_split(
    store: Store, server: StoreServer, case: str
) -> None:
    assert server.socket_path is not None
    rng = random.Random(case)
    length = len(stream(case, 0, 5).data)
    ways = ["whole", "bytes", "small chunks", "small chunks", *(f"at {i}" for i in range(1, length))]
    for how in ways:
        ctx = store.create_context().context_id
        s = stream(case, ctx, 5)
        received = await exchange(server.socket_path, splits(s.data, how, rng))
        check(store, ctx, s, received)
    assert len(ways) > 200


@pytest.mark.parametrize("case", CASES)
async def test_replies_of_writes_running_in_worker_threads_come_before_the_close(
    store: Store, tmp_path: Path, case: str
) -> None:
    """Big appends run in the thread pool; the violation arrives while they still run."""
    limits = ServiceLimits(max_frame=2 * BIG)
    async with StoreServer(store, tmp_path / "big.sock", limits=limits) as srv:
        assert srv.socket_path is not None
        rng = random.Random(case)
        for how in ("whole", "big chunks", "big chunks"):
            ctx = store.create_context().context_id
            s = stream(case, ctx, 12, big=True)
            if case == "oversized":  # over this server's larger limit
                s.data = s.data.replace(HEADER.pack(MAX_FRAME + 1, APPEND_TURN, 0, 99),
                                        HEADER.pack(2 * BIG + 1, APPEND_TURN, 0, 99))
            received = await exchange(srv.socket_path, splits(s.data, how, rng))
            check(store, ctx, s, received)


class HeldStore:
    """The real store, except that an append whose payload starts with b"held" waits for
    `release`.  The one stand-in of this file: a write that stays in a worker thread for as
    long as a test needs cannot be had from a real disk on demand."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def append_turn(self, context_id: int, payload: bytes, *args: Any, **kwargs: Any) -> Any:
        if payload.startswith(b"held"):
            self.release.wait(60)
        return self._store.append_turn(context_id, payload, *args, **kwargs)


@pytest.mark.parametrize("expires", [False, True])
async def test_a_connection_error_waits_for_the_writes_running_but_not_forever(
    store: Store, tmp_path: Path, expires: bool
) -> None:
    """A write still running in a worker when the bad header comes: its reply precedes the
    ERROR; past drain_timeout the connection closes without it (and the write still lands)."""
    held = HeldStore(store)
    ctx = store.create_context().context_id
    limits = ServiceLimits(max_frame=2 * BIG, drain_timeout=0.2 if expires else 60)
    held_payload = b"held" + bytes(BIG)  # big: it runs in the thread pool
    data = b"".join([
        frame(HELLO, 1, struct.pack("<HH", 1, 1)),
        append(ctx, 2, b"quick"),
        append(ctx, 3, held_payload),
        HEADER.pack(2 * BIG + 1, APPEND_TURN, 0, 99),
    ])  # fmt: skip
    async with StoreServer(held, tmp_path / "held.sock", limits=limits) as srv:
        assert srv.socket_path is not None
        if not expires:  # let the write finish a while after the bad header has arrived
            asyncio.get_running_loop().call_later(0.3, held.release.set)
        replies = parse(await exchange(srv.socket_path, iter([data])))
        held.release.set()
    answered = [req_id for _t, req_id, _p in replies]
    assert sorted(answered[:-1]) == ([1, 2] if expires else [1, 2, 3]) and answered[-1] == 99
    assert replies[-1][0] == ERROR and ERROR_REPLY.unpack_from(replies[-1][2])[0] == FRAME_TOO_LARGE
    assert store.payloads(store.get_last(ctx, 10)) in ([b"quick", held_payload], [held_payload, b"quick"])
