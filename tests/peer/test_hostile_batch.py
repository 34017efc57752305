"""Amplification through a batch request, against the real peer server over real mutual TLS: a
trusted client naming one line 4096 times (128 KiB asked) got 4096 copies of it (a 256 MiB line:
1 TiB to read, compress and send); each line is served once, plain or as a zstd stream."""
from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from test_hostile_peer import A2, b3, split, trusted_client, world  # noqa: F401

from p2pnode.peer import wire
from p2pnode.peer.provider import PeerServer


@pytest.mark.parametrize("stream", [False, True])
async def test_a_hash_repeated_in_a_batch_is_served_once(world, tmp_path: Path, stream: bool) -> None:  # noqa: F811
    lines = split((world["corpus"] / A2).read_bytes())
    biggest = max(lines, key=len)
    asked = [b3(biggest)] * 4096
    client, tls = trusted_client(world, tmp_path)
    server = PeerServer(world["lib"], world["me"], world["trust"])
    await server.start("127.0.0.1", 0)
    headers = {wire.BATCH_FORMAT_HEADER: wire.BATCH_FORMAT_STREAM} if stream else {}
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls)) as s, \
                s.post(f"https://127.0.0.1:{server.port}{wire.PATH_BATCH}", data=b"".join(asked),
                       headers=headers) as r:
            assert r.status == 200
            body = await r.read()
            streamed = r.headers.get(wire.BATCH_FORMAT_HEADER) == wire.BATCH_FORMAT_STREAM
    finally:
        await server.close()
    assert streamed == stream
    if not stream:
        blobs = wire.BatchDecoder([b3(biggest)]).feed(body)
        assert [b.hash for b in blobs] == [b3(biggest)]
    assert len(body) < 2 * len(biggest) + 200  # one copy, not 4096
    end = wire.BATCH_FRAME.unpack(body[-wire.BATCH_FRAME.size:])
    assert end[1] == wire.CODEC_END and end[2] == 1
