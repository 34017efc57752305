"""The streaming fetch (issue 12): lines staged as they are verified, the file placed only after
the commit, and a fetch killed with SIGKILL (the one-shot CLI, or the node doing it) resumed
with only what was not yet verified crossing the wire.

Real processes on loopback (tests/procnode.py), real Pi-shaped sessions with base64 image lines
as pi writes them (docs: /work/shared/notes/pi-session-format.md), a TCP relay that tells when
a share of the transfer has gone through (tests/relay.py).
"""
from __future__ import annotations

import asyncio
import base64
import json
import random
import signal
import subprocess
from pathlib import Path

import blake3
import pytest
from procnode import PEAK_RSS, PY, Node, peak_kb
from relay import Relay
from skips import KERNEL_LIMITATION

from p2pnode.library.api import Library
from p2pnode.paths import NodePaths
from p2pnode.peer.trust import TrustStore

SESSION_ID = "01a1ff93-0000-7000-8000-00000000c0de"
RELPATH = f"sessions/--w--/2026-11-21T20-00-00-000Z_{SESSION_ID}.jsonl"


def pi_session(size: int, seed: int, image_bytes: int = 400_000) -> bytes:
    """A Pi-shaped session of about `size` bytes: a header, then user prompts, assistant
    answers and `read` tool results whose content is a base64 PNG-like image, as pi stores them."""
    rnd = random.Random(seed)
    out = [json.dumps({"type": "session", "version": 3, "id": SESSION_ID,
                       "timestamp": "2026-11-21T20:00:00.000Z", "cwd": "/w"}).encode() + b"\n"]
    total, n = len(out[0]), 0
    while total < size:
        n += 1
        if n % 3 == 1:
            message = {"role": "user", "content": [{"type": "text", "text": f"look at image {n}"}]}
        elif n % 3 == 2:
            data = base64.b64encode(b"\x89PNG\r\n\x1a\n" + rnd.randbytes(image_bytes)).decode()
            message = {"role": "toolResult", "toolCallId": f"call_{n}", "toolName": "read",
                       "content": [{"type": "text", "text": "Read image file [image/png]"},
                                   {"type": "image", "data": data, "mimeType": "image/png"}],
                       "isError": False, "timestamp": 1795289192453 + n}
        else:
            words = "word " * rnd.randrange(50, 500)
            message = {"role": "assistant", "content": [{"type": "text", "text": words}]}
        line = json.dumps({"type": "message", "id": f"{n:08x}", "parentId": f"{n - 1:08x}",
                           "timestamp": "2026-11-21T20:00:01.000Z", "message": message},
                          separators=(",", ":")).encode() + b"\n"
        out.append(line)
        total += len(line)
    return b"".join(out)


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Node, Node, Node, Path]:
    """A shares a 40 MB session; B fetches it (killed on the way); C fetches it once, clean."""
    a, b, c = (Node(tmp_path, n) for n in "abc")
    for x in (a, b, c):
        for y in (a, b, c):
            if x is not y:
                TrustStore(NodePaths(x.home).trust).trust(y.id)
    path = a.agent / RELPATH
    path.parent.mkdir(parents=True)
    path.write_bytes(pi_session(40_000_000, seed=12))
    return a, b, c, path


def placed_sessions(node: Node) -> list[Path]:
    return list(node.agent.rglob("*.jsonl"))


async def fetch_killed_at(node: Node, branch: str, port: int, at_bytes: int, *, staged: bool = False,
                          victim: _AsyncPopen | None = None) -> int:
    """Run `p2pnode fetch` through a relay and SIGKILL it (or `victim`, the node doing the
    fetch) once `at_bytes` went through the relay toward the fetcher, or (`staged`) once the
    fetcher's store has taken in that many bytes of lines: what the fetch has verified, not what
    waits in socket buffers (on a loaded machine the relay runs megabytes ahead of the fetch).
    Returns the bytes relayed toward the fetcher when it was killed."""
    proxy = Relay(port, notify_at=0 if staged else at_bytes)
    proxy_port = await proxy.start()
    pack = NodePaths(node.home).store / "blobs.pack"
    start = pack.stat().st_size if pack.exists() else 0
    try:
        proc = await asyncio.create_subprocess_exec(
            PY, "-m", "p2pnode", "fetch", branch, "--from", f"127.0.0.1:{proxy_port}", env=node.env,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        try:
            if staged:
                for _ in range(6000):  # bounded: 60 s
                    if pack.exists() and pack.stat().st_size - start >= at_bytes:
                        break
                    await asyncio.sleep(0.01)
            else:
                await asyncio.wait_for(proxy.reached.wait(), 60)
        finally:
            (victim or proc).send_signal(signal.SIGKILL)
            relayed = proxy.relayed
            await (victim or proc).wait()
            if victim is not None:
                await asyncio.wait_for(proc.wait(), 30)
    finally:
        await proxy.close()
    return relayed


class _AsyncPopen:
    """A subprocess.Popen (procnode's node) seen through the two calls fetch_killed_at makes."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc

    def send_signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    async def wait(self) -> int:
        return await asyncio.to_thread(self.proc.wait, 30)


def check_complete(node: Node, result: dict, original: Path) -> None:
    """Byte-identical where Pi finds it, no temp file left beside it, the store clean."""
    placed = Path(result["path"])
    assert placed.read_bytes() == original.read_bytes()
    assert not [p for p in placed.parent.iterdir() if p.name.startswith(".p2pnode-")]
    fsck = node.run("fsck", check=False)
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr


async def test_cli_killed_at_half_resumes_with_the_rest(pair) -> None:
    """SIGKILL the one-shot fetch at ~50 % (half the wire bytes verified and staged): nothing
    where Pi looks, and the rerun moves no more than 55 % of what a whole fetch moves."""
    a, b, c, path = pair
    branch = a.run("share", str(path)).stdout.split()[0]
    with a.serving() as port:
        clean = c.fetch_json(branch, "--from", f"127.0.0.1:{port}")
        relayed = await fetch_killed_at(b, branch, port, clean["bytes_received"] // 2, staged=True)
        assert placed_sessions(b) == []
        assert json.loads(b.run("ls", "--all", "--json").stdout) == []
        kept = NodePaths(b.home).fetching / f"{clean['src']}.lines"  # the manifest, not asked for again
        assert kept.exists()
        resumed = b.fetch_json(branch, "--from", f"127.0.0.1:{port}")
    check_complete(b, resumed, path)
    assert not kept.exists()
    whole = clean["bytes_received"]
    print(f"killed at {relayed / whole:.3f} relayed: the rerun moved {resumed['bytes_received'] / whole:.3f}")
    assert resumed["bytes_received"] <= 0.55 * clean["bytes_received"], (resumed, clean)
    assert resumed["lines_fetched"] < clean["lines_fetched"]


async def test_cli_killed_at_random_points(pair) -> None:
    """Several kills in a row at random points, each run continuing the last: never a session
    file before the commit; the last run completes byte-identical, the store clean."""
    a, b, c, path = pair
    rnd = random.Random(5)
    branch = a.run("share", str(path)).stdout.split()[0]
    with a.serving() as port:
        clean = c.fetch_json(branch, "--from", f"127.0.0.1:{port}")
        for _ in range(3):
            await fetch_killed_at(b, branch, port, int(clean["bytes_received"] * rnd.uniform(0.05, 0.3)))
            assert placed_sessions(b) == []
        resumed = b.fetch_json(branch, "--from", f"127.0.0.1:{port}")
    check_complete(b, resumed, path)
    assert resumed["bytes_received"] < clean["bytes_received"]


async def test_node_killed_mid_fetch_resumes(pair) -> None:
    """The node runs the fetch (the CLI waits on it) and is SIGKILLed at ~50 %: nothing placed;
    with the node started again the fetch completes with the rest only."""
    a, b, c, path = pair
    branch = a.run("share", str(path)).stdout.split()[0]
    with a.serving() as port:
        clean = c.fetch_json(branch, "--from", f"127.0.0.1:{port}")
        with b.node_running() as node:
            await fetch_killed_at(b, branch, port, clean["bytes_received"] // 2, staged=True,
                                  victim=_AsyncPopen(node))
        assert placed_sessions(b) == []
        NodePaths(b.home).control_socket.unlink()  # the killed node left it; node_running waits for it
        with b.node_running():
            resumed = b.fetch_json(branch, "--from", f"127.0.0.1:{port}")
    check_complete(b, resumed, path)
    assert resumed["bytes_received"] <= 0.55 * clean["bytes_received"], (resumed, clean)


@pytest.mark.skipif(not Path("/proc/self/status").exists(),
                    reason=KERNEL_LIMITATION + "no /proc/<pid>/status (VmHWM) for a peak RSS: not Linux")
def test_a_300_mb_session_is_fetched_in_bounded_memory(tmp_path: Path) -> None:
    """A 300 MB session of image lines fetched by the one-shot CLI: its peak RSS (VmHWM, read
    by the fetching process itself as it exits) stays under 160 MB, about half the session
    (before streaming it was ~55 MB + 2.4x the session)."""
    a, b = Node(tmp_path, "a"), Node(tmp_path, "b")
    for x, y in ((a, b), (b, a)):
        TrustStore(NodePaths(x.home).trust).trust(y.id)
    path = a.agent / RELPATH
    path.parent.mkdir(parents=True)
    path.write_bytes(pi_session(300_000_000, seed=30))
    with Library.open(NodePaths(a.home), a.agent) as lib:
        branch = lib.share(str(path)).branch
    with a.serving() as port:
        proc = subprocess.run([PY, "-c", PEAK_RSS, "fetch", branch, "--from", f"127.0.0.1:{port}", "--json"],
                              env=b.env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert Path(result["path"]).stat().st_size == path.stat().st_size
    assert blake3.blake3(Path(result["path"]).read_bytes()).hexdigest() == result["src"]
    peak = peak_kb(proc.stderr)
    print(f"fetch of {path.stat().st_size} bytes: peak RSS {peak} kB")
    assert peak < 160_000, f"peak RSS {peak} kB"
