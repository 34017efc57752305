"""Every control endpoint of a running node (the local socket that the CLI drives: fetch with its
NDJSON stream, cancel, browse, follow*, live*, pair/wait, gc, rm, share, ...) fed wrong-typed,
oversized, control-character and path-like values in every field it reads: each answer is a
JSON error with an exit code, never a 500 (a /v1/fetch with `"peers": 1` was a TypeError, a share
of a 10,000-character name an OSError, both 500s with a traceback), and the node keeps answering.
A real in-process node on a real Unix socket."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import aiohttp
import pytest

from p2pnode.node.daemon import Node, NodeConfig
from p2pnode.paths import NodePaths

ROUTES = ("status", "share", "unshare", "read", "fetch", "cancel", "browse", "live", "unlive", "gc", "rm",
          "follow", "follow-events", "unfollow", "pair/wait", "pending")
FIELDS = ("pi", "peers", "branch", "target", "path", "key", "wait", "stream", "id", "cwd", "code",
          "background", "allow_secrets", "after", "to", "expires", "latest", "call", "args")
VALUES = (True, 1, -1, 1.5, 10**30, "", "x" * 10_000, "\x00\u009b\u202e", [1], {"a": {"b": 1}}, "../../..")


async def test_no_control_request_is_a_500(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    agent = tmp_path / "agent"
    agent.mkdir()
    config = NodeConfig(host="127.0.0.1", port=0, mdns=False, agent_dir=agent)
    node = Node(NodePaths(tmp_path / "home"), config)
    await node.start()
    sock = str(node.paths.control_socket)
    failed = []
    try:
        with caplog.at_level(logging.ERROR, logger="p2pnode"):
            async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=sock),
                                             timeout=aiohttp.ClientTimeout(total=30)) as s:
                for route in ROUTES:
                    for field in FIELDS:
                        for value in VALUES:
                            body = json.dumps({field: value, **({"wait": 0} if field != "wait" else {})})
                            async with s.post(f"http://node/v1/{route}", data=body) as r:
                                text = await r.text()
                                if r.status >= 500 or "raceback" in text:
                                    failed.append((route, field, repr(value)[:20], r.status, text[:120]))
                                elif r.status >= 400:
                                    code = json.loads(text)["exit_code"]
                                    assert code in (1, 3, 4, 5, 6, 7, 8), (route, field, text)
                async with s.post("http://node/v1/status", data=b"{}") as r:
                    assert r.status == 200 and (await r.json())["running"]
        assert failed == []
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text[:2000]
    finally:
        await node.close()


async def test_a_removed_or_replaced_control_socket_is_made_again(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`rm control.sock` (or a file put there) while the node runs: every command would find no
    node, and the store held by it; the node listens there again within CONTROL_CHECK_SECONDS."""
    import asyncio

    from p2pnode.node import daemon
    from p2pnode.node.control_client import socket_answers

    monkeypatch.setattr(daemon, "CONTROL_CHECK_SECONDS", 0.1)
    agent = tmp_path / "agent"
    agent.mkdir()
    config = NodeConfig(host="127.0.0.1", port=0, mdns=False, agent_dir=agent)
    node = Node(NodePaths(tmp_path / "home"), config)
    await node.start()
    sock = node.paths.control_socket
    try:
        for spoil in (sock.unlink, lambda: (sock.unlink(), sock.write_bytes(b"not a socket"))):
            spoil()
            assert not await asyncio.to_thread(socket_answers, sock)
            for _ in range(50):
                await asyncio.sleep(0.1)
                if await asyncio.to_thread(socket_answers, sock):
                    break
            assert await asyncio.to_thread(socket_answers, sock) and sock.stat().st_mode & 0o777 == 0o600
    finally:
        await node.close()
    assert not sock.exists()
