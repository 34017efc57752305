"""Client of the store service: asyncio with pipelining, plus a small blocking wrapper.

Every method sends one request and awaits its reply; run many at once (asyncio.gather) and
they share the connection, up to the server's max_in_flight.  An ERROR reply raises the
same exception class the engine would have raised (UnknownContext, ParentConflict, ...),
or a ServiceError subclass for the service's own codes (store/service/frames.py).
"""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, cast

from store.errors import StoreError
from store.service import messages as m
from store.service.errors import exception_from
from store.service.frames import (
    FLAG_REPLY,
    HEADER_SIZE,
    FrameDecoder,
    FrameTooLarge,
    MalformedFrame,
    ProtocolError,
    encode_frame,
)
from store.types import ContextHead, Patch, Turn, TurnInput
from sysio import eventloop

R = TypeVar("R")

HELLO_MAX_FRAME = 1 << 20
"""The frame limit before the server has announced its own."""


class ConnectionClosed(StoreError):
    def __init__(self, pending: int) -> None:
        super().__init__(f"the store service connection closed with {pending} requests unanswered")


def _read_opts(payloads: bool, patched: bool) -> int:
    if patched:
        return m.READ_PAYLOADS | m.READ_PATCHED
    return m.READ_PAYLOADS if payloads else 0


class _ClientProtocol(asyncio.BufferedProtocol):
    """Matches reply frames to pending requests by req_id.  Buffered: the socket reads
    straight into the frame decoder's buffer."""

    def __init__(self) -> None:
        self.decoder = FrameDecoder(HELLO_MAX_FRAME, copy=False)  # each reply is decoded at once
        self.transport: asyncio.Transport | None = None
        self.pending: dict[int, tuple[m.Request, asyncio.Future[Any]]] = {}
        self.writable = asyncio.Event()
        self.writable.set()
        self.closed: StoreError | None = None
        self.lost = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def get_buffer(self, sizehint: int) -> memoryview:
        try:
            return self.decoder.get_buffer()
        except ProtocolError:  # the stream broke and is being aborted: drop what still comes
            return memoryview(bytearray(HEADER_SIZE))

    def buffer_updated(self, nbytes: int) -> None:
        try:
            for frame in self.decoder.buffer_updated(nbytes):
                if not frame.flags & FLAG_REPLY:
                    raise MalformedFrame(f"server frame req_id={frame.req_id} lacks the reply flag")
                # A request leaves `pending` only once its reply decoded; a bad reply aborts the
                # connection, and connection_lost fails everything still pending.
                entry = self.pending.get(frame.req_id)
                if frame.msg_type == m.MsgType.ERROR:
                    err = m.ErrorReply.decode(frame.payload)
                    exc = exception_from(err, entry[0] if entry else None, frame.req_id)
                    if entry is None:  # about the whole connection: it is closing
                        self.closed = exc
                        continue
                    self._settle(frame.req_id, error=exc)
                    continue
                if entry is None:
                    raise MalformedFrame(f"reply to req_id {frame.req_id}, which is not pending")
                req = entry[0]
                if frame.msg_type != req.MSG_TYPE:
                    raise MalformedFrame(f"reply msg_type {frame.msg_type} to a {req.MSG_TYPE.name} request")
                self._settle(frame.req_id, result=req.decode_reply(frame.payload))
            if self.decoder.error is not None:  # after the replies before the bad header
                raise self.decoder.error
        except ProtocolError as exc:
            self.closed = exc
            if self.transport is not None:
                self.transport.abort()

    def _settle(self, req_id: int, result: Any = None, error: BaseException | None = None) -> None:
        fut = self.pending.pop(req_id)[1]
        if fut.done():  # the caller was cancelled
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def connection_lost(self, exc: Exception | None) -> None:
        closed = self.closed or ConnectionClosed(len(self.pending))
        self.closed = closed
        for _req, fut in self.pending.values():
            if not fut.done():
                fut.set_exception(closed)
        self.pending.clear()
        self.writable.set()
        if not self.lost.done():
            self.lost.set_result(None)


class StoreClient:
    """One connection to a store service.  Use `await StoreClient.connect(path)`."""

    def __init__(self, protocol: _ClientProtocol) -> None:
        self._proto = protocol
        self._next_id = 0
        self._slots = asyncio.Semaphore(1)
        self.server_info: m.HelloReply | None = None

    @classmethod
    async def connect(
        cls, path: str | os.PathLike[str] | None = None, *, tcp: tuple[str, int] | None = None,
        timeout: float = 10.0,
    ) -> StoreClient:  # fmt: skip
        loop = asyncio.get_running_loop()
        if path is not None:
            opening = loop.create_unix_connection(_ClientProtocol, os.fspath(path))
        elif tcp is not None:
            opening = loop.create_connection(_ClientProtocol, tcp[0], tcp[1])
        else:
            raise ValueError("connect needs a socket path or a TCP address")
        _transport, proto = await asyncio.wait_for(opening, timeout)
        client = cls(proto)
        try:
            info = await asyncio.wait_for(client._call(m.Hello()), timeout)
        except BaseException:
            await client.close()
            raise
        client.server_info = info
        proto.decoder.max_frame = info.max_frame
        client._slots = asyncio.Semaphore(info.max_in_flight)
        return client

    async def close(self) -> None:
        if self._proto.transport is not None:
            self._proto.transport.close()
        await self._proto.lost

    async def __aenter__(self) -> StoreClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, req: m.Request[R]) -> R:
        payload = req.encode()
        limit = self._proto.decoder.max_frame if self.server_info else HELLO_MAX_FRAME
        if len(payload) > limit:
            what = req.MSG_TYPE.name
            raise FrameTooLarge(f"{what} request of {len(payload)} bytes exceeds max_frame {limit}")
        async with self._slots:
            proto = self._proto
            if not proto.writable.is_set():
                await proto.writable.wait()
            if proto.closed is not None or proto.transport is None or proto.transport.is_closing():
                raise proto.closed or ConnectionClosed(len(proto.pending))
            self._next_id = self._next_id % 0xFFFF_FFFF_FFFF_FFFF + 1  # 0 is reserved
            req_id = self._next_id
            fut: asyncio.Future[R] = asyncio.get_running_loop().create_future()
            proto.pending[req_id] = (req, fut)
            proto.transport.write(encode_frame(req.MSG_TYPE, req_id, payload))
            try:
                return await fut
            finally:
                proto.pending.pop(req_id, None)

    # --- one method per message -----------------------------------------------------------

    async def create_context(self, base_turn_id: int = 0) -> ContextHead:
        return await self._call(m.CtxCreate(base_turn_id))

    async def fork(self, turn_id: int) -> ContextHead:
        return await self._call(m.CtxFork(turn_id))

    async def get_head(self, context_id: int) -> ContextHead:
        return await self._call(m.GetHead(context_id))

    async def delete_context(self, context_id: int) -> None:
        await self._call(m.CtxDelete(context_id))

    async def get_turn(self, turn_id: int) -> Turn:
        return await self._call(m.GetTurn(turn_id))

    async def append_turn(
        self, context_id: int, payload: bytes, type_tag: int = 0, codec: int = 0,
        expected_parent: int | None = None,
    ) -> Turn:  # fmt: skip
        opts, expected = (0, 0) if expected_parent is None else (m.EXPECT_PARENT, expected_parent)
        return await self._call(m.AppendTurn(context_id, payload, type_tag, codec, expected, opts))

    async def append_turns(
        self, context_id: int, turns: Iterable[TurnInput], expected_parent: int | None = None
    ) -> list[Turn]:
        opts, expected = (0, 0) if expected_parent is None else (m.EXPECT_PARENT, expected_parent)
        return (await self._call(m.AppendBatch(context_id, list(turns), expected, opts))).turns

    async def get_last(
        self, context_id: int, n: int, payloads: bool = False, patched: bool = False
    ) -> m.TurnList:
        return await self._call(m.GetLast(context_id, n, _read_opts(payloads, patched)))

    async def get_before(
        self, context_id: int, before_turn_id: int, limit: int, payloads: bool = False, patched: bool = False
    ) -> m.TurnList:
        return await self._call(m.GetBefore(context_id, before_turn_id, limit, _read_opts(payloads, patched)))

    async def range_by_depth(
        self, context_id: int, start_depth: int, limit: int, payloads: bool = False, patched: bool = False
    ) -> m.TurnList:
        req = m.GetRangeByDepth(context_id, start_depth, limit, _read_opts(payloads, patched))
        return await self._call(req)

    async def chain(self, turn_id: int, payloads: bool = False, patched: bool = False) -> m.TurnList:
        return await self._call(m.GetChain(turn_id, _read_opts(payloads, patched)))

    async def get_blob(self, blob_hash: bytes, verify: bool = False) -> bytes:
        return await self._call(m.GetBlob(blob_hash, m.VERIFY_HASH if verify else 0))

    async def put_blob(self, data: bytes) -> bytes:
        return await self._call(m.PutBlob(data))

    async def patch(self, target_turn_id: int, new_payload: bytes) -> Patch:
        return await self._call(m.PatchTurn(target_turn_id, new_payload))

    async def tombstone(self, target_turn_id: int) -> Patch:
        return await self._call(m.Tombstone(target_turn_id))

    async def payload_of(self, turn_id: int, as_of_seq: int | None = None) -> bytes | None:
        if as_of_seq is None:
            return await self._call(m.GetPayload(turn_id))
        return await self._call(m.GetPayload(turn_id, as_of_seq, m.AS_OF))


class SyncStoreClient:
    """Blocking wrapper for synchronous code: the StoreClient methods, run on a private loop.

    Not for use inside a running event loop (use StoreClient there).
    """

    def __init__(
        self, path: str | os.PathLike[str] | None = None, *, tcp: tuple[str, int] | None = None,
        timeout: float = 10.0,
    ) -> None:  # fmt: skip
        self._loop = eventloop.new_event_loop()
        try:
            self._client = self._loop.run_until_complete(StoreClient.connect(path, tcp=tcp, timeout=timeout))
        except BaseException:
            self._loop.close()
            raise

    @property
    def server_info(self) -> m.HelloReply | None:
        return self._client.server_info

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_") or not inspect.iscoroutinefunction(getattr(StoreClient, name, None)):
            raise AttributeError(name)
        method = getattr(self._client, name)
        return lambda *args, **kwargs: self._loop.run_until_complete(method(*args, **kwargs))

    def close(self) -> None:
        if not self._loop.is_closed():
            self._loop.run_until_complete(self._client.close())
            self._loop.close()

    def __enter__(self) -> SyncStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
