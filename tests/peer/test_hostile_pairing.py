"""Hostile clients on the pairing port (p2pnode/peer/pairlink.py): an untrusted host on the LAN
that holds the listener (idle or trickling connections, junk, oversize lines, a connection flood)
must not keep the real joiner out, and one that guesses gets exactly one guess per code.  Real
TCP on loopback, the real listener and the real joiner."""
from __future__ import annotations

import asyncio
import contextlib
import sys
import time

import pytest

from p2pnode.errors import P2PNodeError, PeerUnavailable, Refused
from p2pnode.peer import pairlink
from p2pnode.peer.nodeid import format_node_id
from p2pnode.peer.pairing import Code, CodeExpired, Joiner, Party, Waiter, WrongCode
from p2pnode.peer.pairlink import PairingListener, join
from p2pnode.peer.pgpwords import EVEN, ODD

CODE = Code.parse("7-crossover-clockwork")
BOB = Party(format_node_id(bytes([0x11]) * 32), "bob")      # joins
ALICE = Party(format_node_id(bytes([0x22]) * 32), "alice")  # waits


@contextlib.asynccontextmanager
async def listening(ttl: float = 60.0):
    paired: list[Party] = []
    listener = PairingListener(Waiter(CODE, ALICE, time.monotonic(), ttl=ttl), paired.append)
    await listener.start("127.0.0.1")
    try:
        yield listener, paired
    finally:
        await listener.close()


async def attacker(port: int, source: str = "127.0.0.1") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes:
    """What the listener sent before it closed the connection (fails if still open)."""
    return await asyncio.wait_for(reader.read(), seconds)


async def joined(listener: PairingListener, code: Code = CODE) -> Party:
    """The real joiner's run: the waiter it paired with."""
    return await asyncio.wait_for(join(Joiner(code, BOB), [("127.0.0.1", listener.port)]), 30)


async def test_idle_and_trickling_connections_do_not_hold_the_listener() -> None:
    """Connections that send nothing, or one byte a second, never take the exchange: the real
    joiner arriving meanwhile pairs at once, and the code is not spent by the idle ones."""
    async with listening() as (listener, paired):
        idle = [await attacker(listener.port) for _ in range(2)]
        trickler = await attacker(listener.port)
        trickler[1].write(b'{"type"')
        await trickler[1].drain()
        await asyncio.sleep(0.3)  # the attackers are accepted first
        started = time.monotonic()
        assert await joined(listener) == ALICE
        assert time.monotonic() - started < pairlink.STEP_TIMEOUT  # not after the idle ones' deadline
        assert paired == [BOB] and await listener.wait() == BOB
        for _, writer in [*idle, trickler]:
            writer.close()


async def test_a_silent_connection_is_closed_after_the_first_message_deadline(monkeypatch) -> None:
    monkeypatch.setattr(pairlink, "FIRST_MESSAGE_TIMEOUT", 0.5)
    async with listening() as (listener, _):
        reader, writer = await attacker(listener.port)
        assert b'"type":"error"' in await closed_within(reader, 5)  # told, then closed
        writer.close()
        assert not listener.waiter.attempted and not listener.result.done()


@pytest.mark.parametrize("junk", [b"GET / HTTP/1.1\r\n\r\n", b"\xff\xfe\x00garbage\n", b"[" * 5000 + b"\n",
                                  b'{"type":"pake","version":1,"channel":8,"msg":"AA=="}\n',
                                  b'{"type":"pake","version":1,"channel":7,"msg":"not base64"}\n',
                                  b'{"type":"ok","mac":"AA=="}\n', b"x" * 3000 + b"\n"])
async def test_junk_is_refused_without_spending_the_code(junk: bytes) -> None:
    """Garbage, an oversize line, a wrong channel, a message out of turn: the attacker is told and
    cut off, the code stays unspent, and the real joiner pairs after it."""
    async with listening() as (listener, paired):
        reader, writer = await attacker(listener.port)
        writer.write(junk)
        await writer.drain()
        said = await closed_within(reader, 5)
        assert said == b"" or b'"type":"error"' in said
        writer.close()
        assert not listener.waiter.attempted
        assert await joined(listener) == ALICE and paired == [BOB]


@pytest.mark.skipif(sys.platform != "linux", reason="needs 127.0.0.2 on loopback (Linux routes all of 127/8)")
async def test_a_connection_flood_from_one_host_does_not_keep_others_out(
        caplog: pytest.LogCaptureFixture) -> None:
    """200 connections from 127.0.0.2 are bounded per source (the rest closed at once, logged
    ten a minute: a host reconnecting as fast as it is closed wrote a line each), and a joiner
    from 127.0.0.1 pairs meanwhile."""
    caplog.set_level("INFO", logger="p2pnode.peer.pairlink")
    async with listening() as (listener, paired):
        flood = []
        for _ in range(200):
            with contextlib.suppress(OSError):
                flood.append(await attacker(listener.port, "127.0.0.2"))
        await asyncio.sleep(0.3)
        still_open = 0
        for reader, _ in flood:
            with contextlib.suppress(TimeoutError, OSError):
                await asyncio.wait_for(reader.read(), 0.01)
                continue
            still_open += 1
        assert still_open <= pairlink.MAX_PENDING_PER_SOURCE
        closing = [r for r in caplog.records if "closing a connection from" in r.getMessage()]
        assert len(closing) == 10
        assert await joined(listener) == ALICE and paired == [BOB]
        for _, writer in flood:
            writer.close()


async def test_one_guess_per_code_then_the_listener_is_gone() -> None:
    """A brute-forcer's wrong guess burns the code (the user sees it fail); a second guess, even the
    right code, finds no listener."""
    wrong = Code(7, (ODD[1], EVEN[1]))
    async with listening() as (listener, paired):
        with pytest.raises(Refused) as told:  # the waiter's "wrong code", exit 8 on both sides
            await joined(listener, wrong)
        assert "did not match" in str(told.value) and Refused.exit_code == 8
        with pytest.raises(WrongCode):
            await listener.wait()
        with pytest.raises(PeerUnavailable):
            await joined(listener)
        assert paired == []


async def test_a_second_pake_during_an_exchange_does_not_burn_it(monkeypatch) -> None:
    """While the real joiner's exchange runs, an attacker's own SPAKE2 message is turned away; it
    cannot spoil the exchange in progress."""
    async with listening() as (listener, paired):
        joiner = Joiner(CODE, BOB)
        reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
        writer.write(joiner.start())
        step = joiner.receive(await reader.readline())  # the exchange now runs (the code is spent)
        other_r, other_w = await attacker(listener.port)
        other_w.write(Joiner(CODE, BOB).start())
        await other_w.drain()
        said = await closed_within(other_r, 5)
        assert said == b"" or b'"type":"error"' in said
        assert step.send is not None
        writer.write(step.send)
        final = joiner.receive(await reader.readline())
        assert final.peer == ALICE and final.send is not None
        writer.write(final.send)
        await writer.drain()
        assert await asyncio.wait_for(listener.wait(), 10) == BOB and paired == [BOB]
        writer.close()
        other_w.close()


async def test_a_hostile_waiter_cannot_hang_the_joiner(monkeypatch) -> None:
    """A fake waiter that accepts and trickles bytes, or sends a huge line: the joiner gives up
    within its step deadline with a clear error."""
    monkeypatch.setattr(pairlink, "STEP_TIMEOUT", 1.0)

    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            for _ in range(30):
                writer.write(b" ")
                await writer.drain()
                await asyncio.sleep(0.2)

    async def huge(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            writer.write(b"x" * 100_000)
            await writer.drain()
            await asyncio.sleep(5)

    for serve in (trickle, huge):
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        started = time.monotonic()
        with pytest.raises(P2PNodeError):
            await asyncio.wait_for(join(Joiner(CODE, BOB), [("127.0.0.1", port)]), 10)
        assert time.monotonic() - started < 5
        server.close()


async def test_an_expired_code_ends_the_wait() -> None:
    async with listening(ttl=0.3) as (listener, _):
        with pytest.raises(CodeExpired):
            await listener.wait()

