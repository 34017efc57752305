"""A scriptable discovery endpoint for lab tests and bench_lan: one per host namespace.

    ip netns exec <ns> python tests/mdns_agent.py [NODE_ID]

Reads one command per line on stdin, answers one JSON line on stdout:
    announce PORT GEN BRANCH,BRANCH|-     -> {"ok": true}
    wait NODE_ID MIN_GEN TIMEOUT          -> the peer once seen with gen >= MIN_GEN, else null
    addr NODE_ID ADDR TIMEOUT             -> the peer once it announces ADDR, else null
    gone NODE_ID TIMEOUT                  -> {"gone": bool}
    holders BRANCH TIMEOUT [lan]          -> node ids holding BRANCH (lan: by subtype query only)
    peers                                 -> the peer table
SIGTERM/SIGINT or EOF: goodbye and exit.  Its whole life is bounded (LIFE seconds).
"""
from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2pnode.discovery.mdns import Discovery  # noqa: E402

LIFE = 120.0
T = TypeVar("T")


async def until(pred: Callable[[], T | None], timeout: float, d: Discovery) -> T | None:
    deadline = time.monotonic() + timeout
    while (result := pred()) is None and (left := deadline - time.monotonic()) > 0:
        await d.wait_change(min(left, 0.2))
    return result


async def serve(d: Discovery, line: str) -> object:
    cmd, *args = line.split()
    if cmd == "announce":
        await d.announce(int(args[0]), int(args[1]), [] if args[2] == "-" else args[2].split(","))
        return {"ok": True}
    if cmd == "wait":
        node, gen, timeout = args[0], int(args[1]), float(args[2])
        peer = await until(lambda: p if (p := d.peers.get(node)) and p.generation >= gen else None,
                           timeout, d)
        return peer.as_dict() if peer else None
    if cmd == "addr":
        node, addr, timeout = args[0], args[1], float(args[2])
        peer = await until(lambda: p if (p := d.peers.get(node)) and addr in p.addresses else None,
                           timeout, d)
        return peer.as_dict() if peer else None
    if cmd == "gone":
        gone = await until(lambda: True if args[0] not in d.peers else None, float(args[1]), d)
        return {"gone": bool(gone)}
    if cmd == "holders":
        found = await d.find_holders(args[0], float(args[1]), from_table=args[2:] != ["lan"])
        return sorted(p.node_id for p in found)
    if cmd == "peers":
        return {k: p.as_dict() for k, p in d.peers.items()}
    raise ValueError(f"unknown command {line!r}")


async def main() -> None:
    d = Discovery(sys.argv[1] if len(sys.argv) > 1 else None)
    await d.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print(json.dumps({"ready": True}), flush=True)
    deadline = loop.time() + LIFE
    try:
        while not stop.is_set() and loop.time() < deadline:
            read = asyncio.ensure_future(reader.readline())
            stopped = asyncio.ensure_future(stop.wait())
            await asyncio.wait({read, stopped}, timeout=deadline - loop.time(),
                               return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if not read.done():
                read.cancel()
                break
            line = read.result().decode().strip()
            if not line:
                break
            print(json.dumps(await serve(d, line)), flush=True)
    finally:
        await d.close()


if __name__ == "__main__":
    asyncio.run(main())
