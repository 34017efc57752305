"""A TCP relay on loopback in front of one holder, for the tests that need a slow, cut or
vanishing peer: real bytes of a real peer, only paced or cut on their way to the fetcher."""
from __future__ import annotations

import asyncio
import contextlib


class Relay:
    """Relays every connection to `target_port`, counting the bytes sent toward the fetcher
    (`relayed`), the connections made (`connections`) and those still open (`open`).

    `rate`: bytes per second toward the fetcher, per connection (None: as fast as it goes),
    once `slow_from` bytes went toward it in all, and until `fast` is set.
    `cut_after`: once that many bytes went toward the fetcher in all, every connection is cut
    and new ones are refused (a holder that goes away mid-transfer; `cut` says it happened).
    `drop_first_after`: the first connection is cut after exactly that many bytes toward the
    fetcher, later ones are relayed whole (a link that drops once).
    `reached` is set once `notify_at` bytes went toward the fetcher.
    `hold`: seconds each connection's first bytes toward the fetcher are held back (a busy node
    slow to start its answers)."""

    def __init__(self, target_port: int, *, rate: int | None = None, slow_from: int = 0,
                 cut_after: int | None = None, drop_first_after: int | None = None,
                 notify_at: int = 0, hold: float = 0.0) -> None:
        self.target_port, self.rate, self.slow_from, self.hold = target_port, rate, slow_from, hold
        self.cut_after, self.drop_first_after, self.notify_at = cut_after, drop_first_after, notify_at
        self.relayed = self.connections = self.open = 0
        self.cut = False
        self.reached, self.fast = asyncio.Event(), asyncio.Event()
        self.live: set[asyncio.StreamWriter] = set()
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        assert self.server
        self.server.close()
        for w in list(self.live):
            w.transport.abort()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.server.wait_closed(), 5)

    async def __aenter__(self) -> int:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _paced(self) -> bool:
        return self.rate is not None and self.relayed >= self.slow_from and not self.fast.is_set()

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        if self.cut:
            cw.transport.abort()
            return
        self.connections += 1
        budget = self.drop_first_after if self.connections == 1 else None
        sr, sw = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.live.update((cw, sw))
        self.open += 1

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, toward_fetcher: bool) -> None:
            sent = 0
            piece = max(1, self.rate // 10) if toward_fetcher and self.rate else 65536
            held = toward_fetcher and self.hold > 0
            with contextlib.suppress(ConnectionError):
                while data := await r.read(piece):
                    if held:
                        await asyncio.sleep(self.hold)
                        held = False
                    if toward_fetcher and budget is not None and sent + len(data) > budget:
                        w.write(data[: budget - sent])
                        break
                    w.write(data)
                    await w.drain()
                    if not toward_fetcher:
                        continue
                    sent += len(data)
                    self.relayed += len(data)
                    if self.relayed >= self.notify_at:
                        self.reached.set()
                    if self.cut_after is not None and self.relayed >= self.cut_after:
                        self.cut = True
                        for live in list(self.live):
                            live.transport.abort()
                        break
                    if self._paced():
                        await asyncio.sleep(len(data) / (self.rate or 1))
            for writer in (cw, sw):
                writer.transport.abort()
                self.live.discard(writer)

        try:
            await asyncio.gather(pipe(cr, sw, False), pipe(sr, cw, True))
        finally:
            self.open -= 1
