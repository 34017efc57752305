"""Getting a set of lines from the peers of a fetch: batch requests, and each received blob
decoded and verified against its hash before it is handed on.

get.py decides which lines are missing and what to do with a verified one (the `Received`
callback); this module decides how they are asked for; downloader.py which peer is asked and
what its failure means.
"""
from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable

from p2pnode.peer import wire
from p2pnode.peer.downloader import PeerPool
from p2pnode.peer.link import PeerLink
from p2pnode.pi.lines import LineRef

BATCHES_IN_FLIGHT = 3
DECODE_RUN = 1 << 20
"""Raw bytes of received blobs handed to a worker thread at a time for decoding."""

Received = Callable[[list[wire.BatchBlob], list[bytes]], Awaitable[None]]
"""received(blobs as sent, their verified raw bytes): called as runs of blobs are verified."""
Have = Callable[[bytes], bool]
"""have(line hash): True once a line was received (it is not asked for again after a retry)."""


async def get_lines(pool: PeerPool, what: str, missing: list[LineRef], limits: wire.Limits,
                    have: Have, received: Received) -> None:
    """Every line of `missing` from the pool's peers, handed to `received` once verified; a
    broken link or a dropped peer continues with the lines not received yet."""
    await pool.run(what, functools.partial(_from_peer, missing=missing, limits=limits, have=have,
                                           received=received))


async def _from_peer(peer: PeerLink, missing: list[LineRef], limits: wire.Limits, have: Have,
                     received: Received) -> None:
    """Ask `peer` for the missing lines not received yet, in batches of bounded size,
    BATCHES_IN_FLIGHT at a time so that the peer prepares one while we verify another."""
    groups: list[list[LineRef]] = [[]]
    size = 0
    for ref in missing:
        if have(ref.hash):
            continue
        if len(groups[-1]) >= limits.max_batch_hashes or size >= limits.batch_target_bytes:
            groups.append([])
            size = 0
        groups[-1].append(ref)
        size += ref.length
    slots = asyncio.Semaphore(BATCHES_IN_FLIGHT)

    async def one(group: list[LineRef]) -> None:
        async with slots:
            await _batch(peer, group, limits, received)

    tasks = [asyncio.create_task(one(g)) for g in groups if g]
    try:
        await asyncio.gather(*tasks)
    finally:  # on the first failure, stop the others (what they verified is kept)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _batch(peer: PeerLink, group: list[LineRef], limits: wire.Limits, received: Received) -> None:
    """One batch request.  Received blobs are decompressed and hashed on worker threads
    (both release the GIL) in runs of about DECODE_RUN bytes, while the next bytes are read."""
    decoder = wire.BatchDecoder([r.hash for r in group], limits)
    body = wire.encode_batch_request(r.hash for r in group)
    decoding: list[asyncio.Future[None]] = []
    run: list[wire.BatchBlob] = []
    run_bytes = 0
    try:
        async with peer.request("POST", wire.PATH_BATCH, data=body,
                                headers={"Content-Type": "application/octet-stream"}) as resp:
            peer._check(resp, f"batch of {len(group)} lines")
            async for chunk in resp.content.iter_any():
                peer.bytes_received += len(chunk)
                for blob in decoder.feed(chunk):
                    run.append(blob)
                    run_bytes += blob.raw_len
                if run_bytes >= DECODE_RUN:
                    decoding.append(asyncio.ensure_future(_verify(run, received)))
                    run, run_bytes = [], 0
            decoder.finish()
        if run:
            decoding.append(asyncio.ensure_future(_verify(run, received)))
        await asyncio.gather(*decoding)
    finally:  # a failure stops the rest; what was verified is kept
        for f in decoding:
            f.cancel()
        await asyncio.gather(*decoding, return_exceptions=True)
    if decoder.received != len(group):
        raise wire.WireError(f"peer sent {decoder.received} of the {len(group)} line blobs asked for")


async def _verify(blobs: list[wire.BatchBlob], received: Received) -> None:
    """Decode and verify a run of blobs on a worker thread (wire.decode_blob), then hand them on."""
    raws = await asyncio.to_thread(_decode_all, blobs)
    await received(blobs, raws)


def _decode_all(blobs: list[wire.BatchBlob]) -> list[bytes]:
    return [wire.decode_blob(b) for b in blobs]
