"""GC against a one-shot fetch in another process (library/space.py, FETCHING_LOCK): with no
node running, `p2pnode fetch` opens the store only for each step and stages verified lines in
it between steps; a `p2pnode gc` run meanwhile in a second process is skipped, and runs once
the fetch is done.  Two real processes on one node home, a real peer over TLS on loopback."""
from __future__ import annotations

import asyncio
import contextlib
import json
import random
from pathlib import Path

from procnode import PY, Node

from p2pnode.paths import NodePaths
from p2pnode.peer.trust import TrustStore


class GatedRelay:
    """A TCP relay on loopback toward a holder: full speed until `slow_at` bytes went toward
    the fetcher (then `reached` is set), a trickle (16 KiB every 0.25 s: never a stall the
    fetcher drops) until `open` is set, then full speed again."""

    def __init__(self, target_port: int, slow_at: int) -> None:
        self.target_port, self.slow_at = target_port, slow_at
        self.relayed = 0
        self.reached, self.open = asyncio.Event(), asyncio.Event()
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        assert self.server
        self.server.close()
        await self.server.wait_closed()

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, toward_fetcher: bool) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await r.read(16384 if toward_fetcher else 65536):
                    w.write(data)
                    await w.drain()
                    if toward_fetcher:
                        self.relayed += len(data)
                        if self.relayed >= self.slow_at:
                            self.reached.set()
                            if not self.open.is_set():
                                await asyncio.sleep(0.25)
            for writer in (cw, sw):
                writer.transport.abort()

        await asyncio.gather(pipe(cr, sw, False), pipe(sr, cw, True))


async def gc_json(node: Node) -> dict:
    """`p2pnode gc --json` in its own process; tried again (bounded) when it met the store open
    for one of the fetch's steps (exit 7)."""
    for _ in range(50):
        proc = await asyncio.create_subprocess_exec(PY, "-m", "p2pnode", "gc", "--json", env=node.env,
                                                    stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        if proc.returncode == 0:
            return dict(json.loads(out))
        assert proc.returncode == 7, err
        await asyncio.sleep(0.1)
    raise AssertionError("p2pnode gc never found the store free")


async def test_gc_in_another_process_skips_while_a_one_shot_fetch_stages_lines(tmp_path: Path) -> None:
    a, b = Node(tmp_path, "a"), Node(tmp_path, "b")
    TrustStore(NodePaths(a.home).trust).trust(b.id)
    TrustStore(NodePaths(b.home).trust).trust(a.id)
    rnd = random.Random(3)
    path = a.agent / "sessions" / "--w--" / "2026-11-21T20-00-00-000Z_lease.jsonl"
    path.parent.mkdir(parents=True)
    header = (b'{"type":"session","version":3,"id":"lease",'
              b'"timestamp":"2026-11-21T20:00:00.000Z","cwd":"/w"}\n')
    path.write_bytes(header + b"".join(b'{"type":"custom","data":"' + rnd.randbytes(50_000).hex().encode()
                                       + b'"}\n' for _ in range(80)))  # 8 MB, incompressible
    branch = a.run("share", str(path)).stdout.split()[0]
    with a.serving() as port:
        relay = GatedRelay(port, slow_at=3_000_000)
        relay_port = await relay.start()
        try:
            fetch = await asyncio.create_subprocess_exec(
                PY, "-m", "p2pnode", "fetch", branch, "--from", f"127.0.0.1:{relay_port}", "--json",
                env=b.env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            await asyncio.wait_for(relay.reached.wait(), 60)
            during = await gc_json(b)  # lines are staged in b's store, not yet part of any session
            relay.open.set()
            out, err = await asyncio.wait_for(fetch.communicate(), 120)
        finally:
            await relay.close()
    assert during["skipped"] == "a fetch runs in another process" and during["bytes_freed"] == 0
    assert fetch.returncode == 0, err
    assert Path(json.loads(out)["path"]).read_bytes() == path.read_bytes()
    after = await gc_json(b)
    assert after["skipped"] is None
    assert b.run("cat", branch).stdout.encode() == path.read_bytes()
