"""GC against a one-shot fetch in another process (library/space.py, FETCHING_LOCK): with no
node running, `p2pnode fetch` opens the store only for each step and stages verified lines in
it between steps; a `p2pnode gc` run meanwhile in a second process is skipped, and runs once
the fetch is done.  Two real processes on one node home, a real peer over TLS on loopback."""
from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

from procnode import PY, Node
from relay import Relay

from p2pnode.paths import NodePaths
from p2pnode.peer.trust import TrustStore


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
        relay = Relay(port, rate=64_000, slow_from=3_000_000)
        relay_port = await relay.start()
        try:
            fetch = await asyncio.create_subprocess_exec(
                PY, "-m", "p2pnode", "fetch", branch, "--from", f"127.0.0.1:{relay_port}", "--json",
                env=b.env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            await asyncio.wait_for(relay.reached.wait(), 60)
            during = await gc_json(b)  # lines are staged in b's store, not yet part of any session
            relay.fast.set()
            out, err = await asyncio.wait_for(fetch.communicate(), 120)
        finally:
            await relay.close()
    assert during["skipped"] == "a fetch runs in another process" and during["bytes_freed"] == 0
    assert fetch.returncode == 0, err
    assert Path(json.loads(out)["path"]).read_bytes() == path.read_bytes()
    after = await gc_json(b)
    assert after["skipped"] is None
    assert b.run("cat", branch).stdout.encode() == path.read_bytes()
