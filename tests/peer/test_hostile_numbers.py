"""Bad numbers from a trusted client, against the real peer server over real mutual TLS: a Range
of thousands of digits (Python's int() refuses over 4,300: that was a 500 and a traceback),
generations in `?wait=` that are not decimal integers, and `?after=` lists that are not hashes.
Each is a clear 4xx or a correct answer, never a 500."""
from __future__ import annotations

from pathlib import Path

import aiohttp
from test_hostile_peer import trusted_client, world  # noqa: F401

from p2pnode.peer import wire
from p2pnode.peer.provider import PeerServer


async def test_bad_numbers_are_4xx_never_500(world, tmp_path: Path) -> None:  # noqa: F811
    lib = world["lib"]
    shown = lib.branches()[0]
    client, tls = trusted_client(world, tmp_path)
    server = PeerServer(lib, world["me"], world["trust"])
    await server.start("127.0.0.1", 0)
    base = f"https://127.0.0.1:{server.port}"
    obj = base + wire.PATH_OBJECT.format(hash=shown.src)
    big = "9" * 4400  # over int()'s 4,300 digits, under aiohttp's 8,190-byte header line
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls)) as s:
            for bad in (f"bytes={big}-", f"bytes=-{big}0", f"bytes=0-{big}",
                        "bytes=99999999999999999999-"):
                async with s.get(obj, headers={"Range": bad}) as r:
                    if bad.startswith(("bytes=0-", "bytes=-")):  # the whole object, as RFC 9110 says
                        assert r.status == 206 and len(await r.read()) == shown.size, bad[:30]
                    else:
                        assert r.status == 416, bad[:30]
                        assert r.headers["Content-Range"] == f"bytes */{shown.size}"
            for wait in ("", "-1", "+1", "1e3", "0x10", "\u0661", "9" * 20, "9223372036854775808", big):
                async with s.get(base + wire.PATH_CATALOG, params={"wait": wait}) as r:
                    assert r.status == 400, wait[:30]
            lines = base + wire.PATH_LINES.format(src=shown.src)
            for after in (",", "x" * 64, ",".join([shown.src] * 17), shown.src + ",", "\u0661" * 64):
                async with s.get(lines, params={"after": after}) as r:
                    assert r.status == 400, after[:30]
            async with s.get(lines, params={"after": "a" * 64}) as r:  # a version it does not hold
                assert r.status == 200 and (await r.read())[:4] == wire.LINE_MANIFEST_MAGIC
    finally:
        await server.close()
    assert wire.parse_range(f"bytes=0-{big}", 100) == (0, 100)
