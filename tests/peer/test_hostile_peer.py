"""Peers that lie.  `LyingPeer` is a real HTTPS server (mutual TLS, the real pins) that speaks
the protocol honestly by default; each test overrides one answer.  The fetcher is the real
`fetch_branch` over a real library and store.  Every lie must be refused with a specific
error, and afterwards nothing new is stored and nothing that existed has changed.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import random
import shutil
import ssl
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import blake3
import pytest
import zstandard
from aiohttp import web

from p2pnode.errors import InvalidInput, NotFound, Refused, VerificationFailed
from p2pnode.library.api import Library
from p2pnode.paths import NodePaths
from p2pnode.peer import get, wire
from p2pnode.peer.address import PeerAddress
from p2pnode.peer.get import FetchResult, LineageError, _Fetch, fetch_branch
from p2pnode.peer.identity import Identity, load_or_create_identity
from p2pnode.peer.provider import NOT_FOUND_BODY, PeerServer
from p2pnode.peer.tls import client_context, server_context
from p2pnode.peer.trust import TrustStore
from p2pnode.pi.lines import LineRef
from p2pnode.pi.session import HostileHeader
from p2pnode.pi.sidecar import Sidecar
from store.config import StoreConfig

ALPHA = "sessions/--tmp-pi-harness-work-alpha--"
A1 = f"{ALPHA}/2026-11-21T19-26-27-092Z_01a1ff93-0313-7475-8d45-88a780e9fa37.jsonl"
A2 = f"{ALPHA}/2026-11-21T19-26-31-001Z_01a1ff93-1258-73ae-a9a4-6ce4a586df6a.jsonl"
A3 = f"{ALPHA}/2026-11-21T19-26-32-251Z_01a1ff93-173a-7744-89ad-bbc16c12cc22.jsonl"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def b3(data: bytes) -> bytes:
    return blake3.blake3(data).digest()


def split(data: bytes) -> list[bytes]:
    return data.splitlines(keepends=True)


class LyingPeer:
    """An honest protocol server over real mTLS unless a test swaps one of its handlers."""

    def __init__(self, identity: Identity, trust: TrustStore) -> None:
        self.identity, self.trust = identity, trust
        self.objects: dict[str, bytes] = {}  # sidecars and sessions by hex hash
        self.lines: dict[bytes, bytes] = {}
        self.manifests: dict[str, list[bytes]] = {}
        self.handlers: dict[str, Handler] = {"object": self.object, "lines": self.line_manifest,
                                             "batch": self.batch, "catalog": self.catalog}
        self.runner: web.AppRunner | None = None
        self.port = 0

    def add(self, data: bytes, parent: str | None = None) -> str:
        """Offer a session (any bytes) as a branch; returns the branch hash."""
        src = blake3.blake3(data).hexdigest()
        self.objects[src] = data
        self.manifests[src] = split(data)
        for line in split(data):
            self.lines[b3(line)] = line
        sidecar = Sidecar(src, parent).encode()
        self.objects[blake3.blake3(sidecar).hexdigest()] = sidecar
        return blake3.blake3(sidecar).hexdigest()

    async def start(self) -> PeerAddress:
        app = web.Application()
        app.router.add_get(wire.PATH_OBJECT, self._dispatch("object"))
        app.router.add_get(wire.PATH_LINES, self._dispatch("lines"))
        app.router.add_post(wire.PATH_BATCH, self._dispatch("batch"))
        app.router.add_get(wire.PATH_CATALOG, self._dispatch("catalog"))
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0, ssl_context=server_context(self.identity, self.trust))
        await site.start()
        self.port = self.runner.addresses[0][1]
        return PeerAddress(self.identity.node_id, "127.0.0.1", self.port)

    def _dispatch(self, name: str) -> Handler:
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self.handlers[name](request)  # looked up per request: tests swap them

        return handle

    async def close(self) -> None:
        if self.runner:
            await self.runner.cleanup()

    async def object(self, request: web.Request) -> web.StreamResponse:
        data = self.objects.get(request.match_info["hash"])
        if data is None:
            return web.Response(status=404)
        span = wire.parse_range(request.headers.get("Range"), len(data))
        if span:
            return web.Response(status=206, body=data[span[0]:span[1]], headers={
                "Content-Range": f"bytes {span[0]}-{span[1] - 1}/{len(data)}"})
        return web.Response(body=data)

    async def line_manifest(self, request: web.Request) -> web.StreamResponse:
        src = request.match_info["src"]
        if src not in self.manifests:
            return web.Response(status=404)
        refs = [LineRef(b3(ln), len(ln)) for ln in self.manifests[src]]
        return web.Response(body=wire.encode_line_manifest(bytes.fromhex(src), refs))

    async def catalog(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=404)  # a test that needs one swaps this handler

    def frames(self, hashes: list[bytes]) -> bytes:
        out = b""
        for h in hashes:
            line = self.lines[h]
            out += wire.encode_batch_frame(h, wire.CODEC_ZSTD, len(line), zstandard.compress(line))
        return out + wire.encode_batch_end(len(hashes))

    async def batch(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=self.frames(wire.decode_batch_request(await request.read())))


@pytest.fixture
def world(tmp_path: Path, corpus_dir: Path):
    """The fetching node (with one session of its own already shared and placed) and a liar
    that both sides trust."""
    me = load_or_create_identity(tmp_path / "me-id")
    liar_id = load_or_create_identity(tmp_path / "liar-id")
    my_trust, liar_trust = TrustStore(tmp_path / "me-trust.json"), TrustStore(tmp_path / "liar-trust.json")
    my_trust.trust(liar_id.node_id)
    liar_trust.trust(me.node_id)
    agent = tmp_path / "agent"
    (agent / A2).parent.mkdir(parents=True)
    shutil.copy(corpus_dir / A2, agent / A2)
    # no GC grace: a refused fetch's staged lines are garbage for the next GC (see `refused`)
    lib = Library.open(NodePaths(tmp_path / "home"), agent, StoreConfig(zstd_level=1, gc_grace_seconds=0))
    lib.share(str(agent / A2))
    yield {"lib": lib, "me": me, "trust": my_trust, "agent": agent, "liar": LyingPeer(liar_id, liar_trust),
           "corpus": corpus_dir, "tmp": tmp_path}
    lib.close()


def snapshot(w) -> tuple:
    """What must not change when a fetch is refused: the store's branches and every file."""
    infos = w["lib"].branches(include_unshared=True)
    branches = sorted(json.dumps(b.as_dict(), sort_keys=True) for b in infos)
    files = {str(p.relative_to(w["agent"])): p.read_bytes() for p in w["agent"].rglob("*") if p.is_file()}
    return branches, files


async def fetch(w, branch: str, peers: list[PeerAddress] | None = None, **kw) -> FetchResult:
    if peers is None:
        peers = [await w["liar"].start()]
    try:
        return await fetch_branch(w["lib"], branch, peers, w["me"], w["trust"], agent_dir=w["agent"], **kw)
    finally:
        await w["liar"].close()


async def refused(w, branch: str, error: type[Exception], match: str) -> None:
    before = snapshot(w)
    with pytest.raises(error, match=match):
        await fetch(w, branch)
    assert snapshot(w) == before
    # lines verified on arrival were staged, unreferenced: the store's GC collects them
    w["lib"].store.gc()
    assert not any(w["lib"].has_line(h) for h in w["liar"].lines if h not in _my_lines(w))


def trusted_client(w, tmp_path: Path) -> tuple[Identity, ssl.SSLContext]:
    """A client identity the world's node trusts, and its TLS context pinned to that node."""
    client = load_or_create_identity(tmp_path / "client")
    w["trust"].trust(client.node_id)
    client_trust = TrustStore(tmp_path / "client-trust.json")
    client_trust.trust(w["me"].node_id)
    return client, client_context(client, client_trust, w["me"].fingerprint)


def _my_lines(w) -> set[bytes]:
    return {b3(ln) for ln in split((w["corpus"] / A2).read_bytes())}


async def test_honest_liar_baseline(world) -> None:
    """The test server, unmodified, is a correct peer: the scenarios below differ by one lie."""
    branch = world["liar"].add((world["corpus"] / A1).read_bytes())
    result = await fetch(world, branch)
    assert Path(result.path or "").read_bytes() == (world["corpus"] / A1).read_bytes()


async def test_wrong_bytes_in_a_line(world) -> None:
    liar = world["liar"]
    branch = liar.add((world["corpus"] / A1).read_bytes())
    victim = next(iter(liar.lines))
    liar.lines[victim] = liar.lines[victim].replace(b'"', b"'", 1)
    await refused(world, branch, VerificationFailed, f"line blob {victim.hex()}: the received bytes hash")


async def test_truncated_and_extra_bytes_in_a_batch(world) -> None:
    liar = world["liar"]
    branch = liar.add((world["corpus"] / A1).read_bytes())

    async def truncated(request: web.Request) -> web.StreamResponse:
        return web.Response(body=liar.frames(wire.decode_batch_request(await request.read()))[:-60])

    liar.handlers["batch"] = truncated
    await refused(world, branch, VerificationFailed, "truncated")

    async def extra(request: web.Request) -> web.StreamResponse:
        return web.Response(body=liar.frames(wire.decode_batch_request(await request.read())) + b"\0")

    liar.handlers["batch"] = extra
    await refused(world, branch, VerificationFailed, "extra bytes after the end frame")


async def test_wrong_bytes_for_the_whole_session(world) -> None:
    """Fallback path: no line manifests, the session blob is served with one byte changed."""
    liar = world["liar"]
    data = (world["corpus"] / A1).read_bytes()
    branch = liar.add(data)
    liar.objects[blake3.blake3(data).hexdigest()] = data[:-2] + b"X\n"
    liar.manifests.clear()
    await refused(world, branch, VerificationFailed, "session .*: the received bytes hash to")


async def test_a_frame_announcing_more_than_its_line_is_refused_before_its_bytes(world) -> None:
    """A batch frame whose head declares 200 MiB for a line of the manifest's few hundred
    bytes: refused at the head (its body is never buffered), where the limit alone (256 MiB a
    line) let the fetcher take in 200 MiB first."""
    liar = world["liar"]
    branch = liar.add((world["corpus"] / A1).read_bytes())

    async def inflated(request: web.Request) -> web.StreamResponse:
        first = wire.decode_batch_request(await request.read())[0]
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(wire.BATCH_FRAME.pack(first, wire.CODEC_RAW, 200 << 20, 200 << 20))
        for _ in range(64):  # 4 MiB of the body, then nothing: a fetcher still reading would wait
            await response.write(b"\0" * (64 << 10))
        for _ in range(600):  # until the fetcher hangs up (or 30 s)
            if request.transport is None or request.transport.is_closing():
                break
            await asyncio.sleep(0.05)
        return response

    liar.handlers["batch"] = inflated
    await refused(world, branch, VerificationFailed, "where the manifest says")


async def test_manifest_that_lies_about_the_session(world) -> None:
    """Every line is genuine, but the manifest leaves one out: the re-hash to src catches it."""
    liar = world["liar"]
    data = (world["corpus"] / A1).read_bytes()
    branch = liar.add(data)
    src = blake3.blake3(data).hexdigest()
    liar.manifests[src] = liar.manifests[src][:-1]
    await refused(world, branch, VerificationFailed, "does not hash to it")


async def test_manifest_that_cuts_lines_elsewhere(world) -> None:
    """Genuine bytes that hash to src, but cut into "lines" that are not the file's lines (two
    glued together): the store keeps one turn per line, so this manifest is a lie too."""
    liar = world["liar"]
    data = (world["corpus"] / A1).read_bytes()
    branch = liar.add(data)
    src = blake3.blake3(data).hexdigest()
    cut = liar.manifests[src]
    liar.manifests[src] = [cut[0], cut[1] + cut[2], *cut[3:]]
    liar.lines[b3(cut[1] + cut[2])] = cut[1] + cut[2]
    await refused(world, branch, VerificationFailed, "does not cut it at its newlines")


@pytest.mark.parametrize("sidecar, match", [
    (b'{"type":"branch","version":1,"src":"' + b"a" * 64 + b'","parent":null,"pad":"' + b"x" * 5000 + b'"}',
     "limit 4096"),
    (b'{"type":"branch","version":2,"src":"' + b"a" * 64 + b'","parent":null}',
     r"version 2; this p2pnode reads version 1 only \(made by a newer p2pnode"),
    (b'{"type":"branch","version":true,"src":"' + b"a" * 64 + b'","parent":null}', "version True"),
    (b'{"type":"branch","version":1.0,"src":"' + b"a" * 64 + b'","parent":null}', "version 1.0"),
    (b'{"type":"branch","version":1,"version":1,"src":"' + b"a" * 64 + b'","parent":null}', "duplicate keys"),
    (b'{"type":"branch","version":1,"src":"' + b"A" * 64 + b'","parent":null}', "not 64 lowercase hex"),
    (b"[" * 4000 + b"]" * 96, "nested too deeply"),
])
async def test_oversized_and_invalid_sidecars(world, sidecar: bytes, match: str) -> None:
    """Bytes that hash to the branch asked for but are no valid sidecar: invalid input (exit 4)."""
    world["liar"].objects[blake3.blake3(sidecar).hexdigest()] = sidecar
    await refused(world, blake3.blake3(sidecar).hexdigest(), InvalidInput, match)
    assert InvalidInput.exit_code == 4


async def test_sidecar_that_does_not_hash_to_the_branch(world) -> None:
    """A parent "cycle" as a peer can try it: X's parent is Y, and for Y it serves X's sidecar."""
    liar = world["liar"]
    fake_parent = "f" * 64
    x = liar.add((world["corpus"] / A1).read_bytes(), parent=fake_parent)
    liar.objects[fake_parent] = liar.objects[x]
    await refused(world, x, VerificationFailed, f"sidecar of branch {fake_parent}: bytes hash to {x}")


async def test_cycle_detector(world) -> None:
    """A true cycle would need a BLAKE3 collision, so the detector is exercised directly: walk()
    gets sidecars from a pool that skips the hash check (the only stand-in in this module)."""
    a, b = "a" * 64, "b" * 64
    sidecars = {a: Sidecar("1" * 64, b), b: Sidecar("2" * 64, a)}

    class NoHashPool:
        async def run(self, what, op):
            branch = what.split()[3]  # "sidecar of branch <hash> (an ancestor of ...)"
            return sidecars[branch].encode(), sidecars[branch]

    job = _Fetch(world["lib"], NoHashPool(), wire.DEFAULT_LIMITS, None)  # type: ignore[arg-type]
    with pytest.raises(LineageError, match=f"parent cycle at branch {a}"):
        await job.walk(a)


async def test_ten_thousand_deep_chain(world) -> None:
    liar = world["liar"]
    parent = None
    for i in range(10_000):  # a genuine chain: every sidecar hashes right
        sidecar = Sidecar(blake3.blake3(str(i).encode()).hexdigest(), parent).encode()
        parent = blake3.blake3(sidecar).hexdigest()
        liar.objects[parent] = sidecar
    assert parent is not None
    await refused(world, parent, LineageError, "deeper than 256 generations")


async def test_zstd_bomb(world) -> None:
    liar = world["liar"]
    branch = liar.add((world["corpus"] / A1).read_bytes())
    # 16 MiB in ~500 bytes, its size left out of the frame header (a declared size that is not
    # the line's is refused before decompressing: tests/peer/test_wire.py)
    bomb = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * (16 << 20))

    async def bombing(request: web.Request) -> web.StreamResponse:
        hashes = wire.decode_batch_request(await request.read())
        h = hashes[0]
        assert len(bomb) <= wire.max_stored_len(len(liar.lines[h]))  # passes the frame checks
        body = wire.encode_batch_frame(h, wire.CODEC_ZSTD, len(liar.lines[h]), bomb)
        return web.Response(body=body + wire.encode_batch_end(1))

    liar.handlers["batch"] = bombing
    await refused(world, branch, VerificationFailed, "decompresses to more than its declared")


@pytest.mark.parametrize("field, value, match", [
    ("cwd", "/tmp/../../etc", "'..' component"),
    ("id", "../../../../outside", "the id is not"),
    ("id", "x\u0000y", "the id is not"),
    ("timestamp", "2026/11/21", "timestamp"),
    ("cwd", "/" + "a" * 5000, "over 4096 characters"),
])
async def test_hostile_header_paths(world, field: str, value: str, match: str) -> None:
    data = (world["corpus"] / A1).read_bytes()
    first, rest = data.split(b"\n", 1)
    header = json.loads(first)
    header[field] = value
    branch = world["liar"].add(json.dumps(header).encode() + b"\n" + rest)
    await refused(world, branch, HostileHeader, match)


async def test_existing_different_file_is_kept(world) -> None:
    """A file of another content at the target path: kept; the fetch reports the conflict."""
    data = (world["corpus"] / A1).read_bytes()
    target = world["agent"] / A1
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(b"my own local edits\n")
    result = await fetch(world, world["liar"].add(data))
    assert result.conflict and "already exists with different content" in result.conflict
    assert target.read_bytes() == b"my own local edits\n"
    assert world["lib"].session_bytes(result.src) == data  # the verified bytes are in the store


async def test_server_with_the_wrong_key(world, tmp_path: Path) -> None:
    impostor = load_or_create_identity(tmp_path / "impostor")
    world["trust"].trust(impostor.node_id)  # even a trusted node may not stand in for another
    real = world["liar"].identity
    world["liar"].identity = impostor
    world["liar"].trust.trust(world["me"].node_id)
    branch = world["liar"].add((world["corpus"] / A1).read_bytes())
    peer = await world["liar"].start()
    before = snapshot(world)
    with pytest.raises(Refused, match=f"server is {impostor.node_id}, expected {real.node_id}"):
        await fetch(world, branch, [PeerAddress(real.node_id, peer.host, peer.port)])
    assert snapshot(world) == before


async def test_untrusted_server_is_not_dialled(world, tmp_path: Path) -> None:
    stranger = load_or_create_identity(tmp_path / "stranger")
    with pytest.raises(Refused, match="is not trusted here"):
        await fetch_branch(world["lib"], "a" * 64, [PeerAddress(stranger.node_id, "127.0.0.1", 9)],
                           world["me"], world["trust"])


async def test_one_liar_among_honest_peers(world, tmp_path: Path) -> None:
    """The liar sends wrong bytes for every line it is asked for and is dropped; the honest
    peer delivers.  The honest peer answers its batches only once the fetch has dropped the
    liar (or after 10 s): else, on a loaded machine, the honest answer (to its own groups, or
    to the liar's taken over as the fetch ends) could complete the fetch while the lie was
    still unread, as a fetch should, with nobody to drop."""
    liar = world["liar"]
    data = (world["corpus"] / A1).read_bytes()
    branch = liar.add(data)
    honest = LyingPeer(load_or_create_identity(tmp_path / "honest"), TrustStore(tmp_path / "h-trust.json"))
    honest.trust.trust(world["me"].node_id)
    world["trust"].trust(honest.identity.node_id)
    honest.add(data)
    for victim in liar.lines:
        liar.lines[victim] = b"garbage\n"
    dropped_liar = asyncio.Event()
    loop = asyncio.get_running_loop()

    class OnDrop(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("dropping peer"):
                loop.call_soon_threadsafe(dropped_liar.set)

    async def after_the_drop(request: web.Request) -> web.StreamResponse:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(10):
                await dropped_liar.wait()
        return await honest.batch(request)

    honest.handlers["batch"] = after_the_drop
    on_drop = OnDrop()
    downloader_log = logging.getLogger("p2pnode.peer.downloader")
    downloader_log.addHandler(on_drop)
    level = downloader_log.level
    downloader_log.setLevel(logging.INFO)
    try:
        peers = [await liar.start(), await honest.start()]
        result = await fetch(world, branch, peers)
    finally:
        downloader_log.removeHandler(on_drop)
        downloader_log.setLevel(level)
        await honest.close()
    assert Path(result.path or "").read_bytes() == data
    (dropped,) = result.dropped_peers.values()
    assert "failed verification" in dropped


async def test_the_whole_session_fallback_holds_no_more_than_a_run_in_memory(world) -> None:
    """Fallback path, a liar announcing 96 MiB of garbage as the session: the fetch is refused
    by the hash with a few MB of Python memory at its peak (the bytes go to a temp file), where
    it had held all of them (up to max_session, 8 GiB) before checking."""
    liar = world["liar"]
    data = (world["corpus"] / A1).read_bytes()
    branch = liar.add(data)
    liar.manifests.clear()
    src = blake3.blake3(data).hexdigest()
    size = 96 << 20

    async def garbage(request: web.Request) -> web.StreamResponse:
        if request.match_info["hash"] != src:
            return await liar.object(request)
        response = web.StreamResponse(headers={"Content-Length": str(size)})
        await response.prepare(request)
        for _ in range(size >> 20):
            await response.write(os.urandom(1 << 20))
        return response

    liar.handlers["object"] = garbage
    tracemalloc.start()
    try:
        await refused(world, branch, VerificationFailed, f"session {src}: the received bytes hash to")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 24 << 20, f"{peak >> 20} MiB at the peak"


@pytest.mark.parametrize("run", [4096, 100_000])
async def test_the_whole_session_fallback_in_runs_is_byte_identical(world, monkeypatch: pytest.MonkeyPatch,
                                                                   run: int) -> None:
    """Fallback path read back in runs smaller than the session (lines cut across runs)."""
    monkeypatch.setattr(get, "READ_BACK", run)
    liar = world["liar"]
    data = (world["corpus"] / A3).read_bytes()  # 1.4 MB, image lines of ~700 KB
    assert len(data) > 10 * run
    branch = liar.add(data)
    liar.manifests.clear()
    result = await fetch(world, branch)
    assert Path(result.path or "").read_bytes() == data
    assert world["lib"].session_bytes(blake3.blake3(data).hexdigest()) == data


async def test_cut_whole_blob_resumes_with_range(world) -> None:
    """Fallback path, link cut mid-body: the next request asks only for the rest (Range)."""
    liar = world["liar"]
    data = (world["corpus"] / A1).read_bytes()
    branch = liar.add(data)
    liar.manifests.clear()
    src = blake3.blake3(data).hexdigest()
    ranges: list[str | None] = []

    async def cutting(request: web.Request) -> web.StreamResponse:
        if request.match_info["hash"] != src:
            return await liar.object(request)
        ranges.append(request.headers.get("Range"))
        if len(ranges) > 1:
            return await liar.object(request)
        response = web.StreamResponse(headers={"Content-Length": str(len(data))})
        await response.prepare(request)
        await response.write(data[:3000])
        request.transport.close()  # the link drops
        return response

    liar.handlers["object"] = cutting
    result = await fetch(world, branch)
    assert ranges == [None, "bytes=3000-"]
    assert Path(result.path or "").read_bytes() == data


# --- the real server: what a peer may and may not get -------------------------------------------


async def test_server_answers_unshared_and_unknown_hashes_alike(world, tmp_path: Path) -> None:
    lib = world["lib"]
    corpus = world["corpus"]
    agent = world["agent"]
    (agent / A1).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(corpus / A1, agent / A1)
    hidden = lib.share(str(agent / A1))
    lib.unshare(hidden.branch)
    shown = lib.branches()[0]
    client, tls = trusted_client(world, tmp_path)
    server = PeerServer(lib, world["me"], world["trust"])
    await server.start("127.0.0.1", 0)
    conn = aiohttp.TCPConnector(ssl=tls)
    base = f"https://127.0.0.1:{server.port}"
    hidden_line = b3(split((corpus / A1).read_bytes())[3])
    try:
        async with aiohttp.ClientSession(connector=conn) as s:
            answers = []
            for h in (hidden.branch, hidden.src, hidden_line.hex(), "0" * 64, "../../etc/passwd", "ABC"):
                async with s.get(base + wire.PATH_OBJECT.format(hash=h)) as r:
                    answers.append((r.status, await r.read()))
            async with s.get(base + wire.PATH_LINES.format(src=hidden.src)) as r:
                answers.append((r.status, await r.read()))
            shown_object = base + wire.PATH_OBJECT.format(hash=lib.branches()[0].src)
            for method, url in [("POST", shown_object), ("PUT", shown_object), ("DELETE", shown_object),
                                ("HEAD", shown_object), ("POST", base + wire.PATH_CATALOG),
                                ("OPTIONS", base + wire.PATH_CATALOG), ("GET", base + wire.PATH_BATCH)]:
                async with s.request(method, url) as r:  # a known path, another method
                    body = NOT_FOUND_BODY if method == "HEAD" else await r.read()  # HEAD: no body
                    answers.append((r.status, body))
            assert set(answers) == {(404, NOT_FOUND_BODY)}
            async with s.post(base + wire.PATH_BATCH, data=hidden_line) as r:
                assert await r.read() == wire.encode_batch_end(0)
            async with s.get(base + wire.PATH_CATALOG) as r:
                catalog = wire.decode_catalog(await r.read())
            assert [b.branch for b in catalog.branches] == [shown.branch]
            url = base + wire.PATH_OBJECT.format(hash=shown.src)
            async with s.get(url, headers={"Range": "bytes=10-19"}) as r:
                assert r.status == 206 and await r.read() == (corpus / A2).read_bytes()[10:20]
            too_big = b"\0" * (wire.DEFAULT_LIMITS.max_batch_request + 32)
            async with s.post(base + wire.PATH_BATCH, data=too_big) as r:
                assert r.status == 413  # request size limit
    finally:
        await server.close()


async def test_server_streams_a_batch_in_groups(world, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch read from the store in many small groups (each read while the previous one is
    sent) arrives whole and in order; hashes not offered are left out wherever they fall."""
    monkeypatch.setattr("p2pnode.peer.provider.GROUP_BYTES", 300)
    lib, corpus, agent = world["lib"], world["corpus"], world["agent"]
    (agent / A1).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(corpus / A1, agent / A1)
    lib.unshare(lib.share(str(agent / A1)).branch)
    shown = [b3(ln) for ln in split((corpus / A2).read_bytes())]
    hidden = [b3(ln) for ln in split((corpus / A1).read_bytes()) if b3(ln) not in set(shown)]
    asked = [h for pair in itertools.zip_longest(shown, hidden) for h in pair if h]  # interleaved
    client, tls = trusted_client(world, tmp_path)
    server = PeerServer(lib, world["me"], world["trust"])
    await server.start("127.0.0.1", 0)
    conn = aiohttp.TCPConnector(ssl=tls)
    try:
        async with aiohttp.ClientSession(connector=conn) as s, \
                s.post(f"https://127.0.0.1:{server.port}{wire.PATH_BATCH}", data=b"".join(asked)) as r:
            decoder = wire.BatchDecoder(asked)
            blobs = decoder.feed(await r.read())
            decoder.finish()
    finally:
        await server.close()
    assert len(shown) > 5 and hidden
    assert [b.hash for b in blobs] == shown
    assert b"".join(wire.decode_blob(b) for b in blobs) == (corpus / A2).read_bytes()


async def test_server_refuses_untrusted_client_and_untrust_cuts_live(world, tmp_path: Path) -> None:
    lib = world["lib"]
    branch = lib.branches()[0].branch
    client = load_or_create_identity(tmp_path / "client")
    client_trust = TrustStore(tmp_path / "client-trust.json")
    client_trust.trust(world["me"].node_id)
    server = PeerServer(lib, world["me"], world["trust"])
    await server.start("127.0.0.1", 0)
    other_home = NodePaths(tmp_path / "client-home")
    try:
        with Library.open(other_home, tmp_path / "client-agent") as other:
            peer = PeerAddress(world["me"].node_id, "127.0.0.1", server.port)
            with pytest.raises(Refused, match=f"ask them to run: p2pnode trust {client.node_id}"):
                await fetch_branch(other, branch, [peer], client, client_trust)
            assert other.branches(include_unshared=True) == []
            world["trust"].trust(client.node_id)
            ctx_conn = aiohttp.TCPConnector(ssl=client_context(client, client_trust, world["me"].fingerprint))
            async with aiohttp.ClientSession(connector=ctx_conn) as s:
                url = f"https://127.0.0.1:{server.port}" + wire.PATH_CATALOG
                async with s.get(url) as r:
                    assert r.status == 200
                assert client.fingerprint in server._transports  # one live connection
                tls = client_context(client, client_trust, world["me"].fingerprint)
                idle_reader, idle = await asyncio.open_connection("127.0.0.1", server.port, ssl=tls)
                for _ in range(100):  # handshake done, no request: counted, not in _transports
                    if len(server._connections.get(client.fingerprint, ())) == 2:
                        break
                    await asyncio.sleep(0.02)
                world["trust"].untrust(client.node_id)  # aborts both on the loop's next turn
                await asyncio.sleep(0.05)
                assert client.fingerprint not in server._transports
                with pytest.raises(ConnectionResetError):  # not left to the 10 s idle timeout
                    async with asyncio.timeout(2):
                        await idle_reader.read()
                idle.close()
                with pytest.raises(aiohttp.ClientError):
                    async with s.get(url) as r:
                        await r.read()
    finally:
        await server.close()


async def test_not_offered_anywhere(world) -> None:
    with pytest.raises(NotFound, match="not offered by any peer"):
        await fetch(world, "e" * 64)
    with pytest.raises(InvalidInput, match="branch hash"):
        await fetch_branch(world["lib"], "not-a-hash", [], world["me"], world["trust"])


def test_placement_never_leaves_partial_files(tmp_path: Path, corpus_dir: Path) -> None:
    """Publishing uses a hidden temp file + link: the sessions dir holds the whole file or none."""
    from p2pnode.pi.placement import place_session

    data = (corpus_dir / A1).read_bytes()
    placed = place_session(tmp_path, data, blake3.blake3(data).hexdigest())
    assert placed.written and placed.path == tmp_path / A1
    assert [p.name for p in placed.path.parent.iterdir()] == [placed.path.name]
    assert oct(os.stat(placed.path).st_mode & 0o777) == "0o644"
    again = place_session(tmp_path, data, blake3.blake3(data).hexdigest())
    assert not again.written


def share_big(w) -> str:
    """A session of 24 MB that does not compress (more than the socket buffers hold), shared:
    its src."""
    path = w["agent"] / "sessions" / "--w--" / "2026-11-21T20-00-00-000Z_big.jsonl"
    path.parent.mkdir(parents=True)
    header = b'{"type":"session","version":3,"id":"big","timestamp":"2026-11-21T20:00:00.000Z","cwd":"/w"}\n'
    rnd = random.Random(5)
    body = b"".join(b'{"type":"custom","data":"' + rnd.randbytes(300_000).hex().encode() + b'"}\n'
                    for _ in range(40))
    path.write_bytes(header + body)
    return w["lib"].share(str(path)).src


async def test_per_peer_request_limit_and_slow_reader(world, tmp_path: Path) -> None:
    """A peer that stops reading holds its one allowed request (a second one gets 429) until
    the slow-reader timeout cuts it off."""
    lib = world["lib"]
    big_src = share_big(world)
    client, tls = trusted_client(world, tmp_path)
    server = PeerServer(lib, world["me"], world["trust"],
                        wire.Limits(max_concurrent_requests=1, slow_reader_timeout=1.5))
    await server.start("127.0.0.1", 0)
    base = f"https://127.0.0.1:{server.port}"

    def session() -> aiohttp.ClientSession:
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls))

    try:
        async with session() as slow, session() as other:
            async with slow.get(base + wire.PATH_OBJECT.format(hash=big_src)) as stalled:
                assert stalled.status == 200
                await asyncio.sleep(0.3)  # the server is now blocked writing to us
                async with other.get(base + wire.PATH_CATALOG) as second:
                    assert second.status == 429
                await asyncio.sleep(2.5)  # past the slow-reader timeout
                with pytest.raises(aiohttp.ClientPayloadError):
                    await stalled.read()
            async with other.get(base + wire.PATH_CATALOG) as after:  # the slot is free again
                assert after.status == 200
    finally:
        await server.close()


@pytest.mark.parametrize("ask", ["object", "batch"])
async def test_a_peer_that_stops_reading_is_disconnected_at_the_slow_reader_timeout(
        world, tmp_path: Path, ask: str) -> None:
    """Its connection is gone at slow_reader_timeout, not only its request: aborted, where a
    TLS close would first wait (asyncio's 30 s) for the peer to take what is buffered, holding
    one of its connection slots meanwhile."""
    lib = world["lib"]
    big_src = share_big(world)
    client, tls = trusted_client(world, tmp_path)
    server = PeerServer(lib, world["me"], world["trust"], wire.Limits(slow_reader_timeout=1.0))
    await server.start("127.0.0.1", 0)
    try:
        _reader, writer = await asyncio.open_connection("127.0.0.1", server.port, ssl=tls)
        if ask == "object":
            writer.write(f"GET {wire.PATH_OBJECT.format(hash=big_src)} HTTP/1.1\r\nHost: p\r\n\r\n".encode())
        else:
            body = b"".join(r.hash for r in lib.line_manifest(big_src))
            head = f"POST {wire.PATH_BATCH} HTTP/1.1\r\nHost: p\r\nContent-Length: {len(body)}\r\n\r\n"
            writer.write(head.encode() + body)
        t0 = time.monotonic()
        while not server._connections and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.02)
        assert server._connections  # authenticated and being served; the test never reads
        while server._connections and time.monotonic() - t0 < 20:
            await asyncio.sleep(0.05)
        assert not server._connections and time.monotonic() - t0 < 1.0 + 2.0
        writer.close()
    finally:
        await server.close()
