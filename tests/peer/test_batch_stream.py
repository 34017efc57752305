"""Batches as one zstd stream (wire.BatchStreamEncoder / BatchStreamDecoder): the documented
bytes, the negotiation with a real PeerServer both ways, and a decoder that refuses every
damaged or lying input with a WireError (never a crash, never more memory than declared)."""
from __future__ import annotations

import random
import shutil
import struct
from pathlib import Path

import aiohttp
import blake3
import pytest
import zstandard
from corpus import A1
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2pnode.library.api import Library
from p2pnode.paths import NodePaths
from p2pnode.peer import batches, wire
from p2pnode.peer.identity import load_or_create_identity
from p2pnode.peer.provider import PeerServer
from p2pnode.peer.tls import client_context
from p2pnode.peer.trust import TrustStore
from store.layout import CODEC_RAW, CODEC_ZSTD
from store.types import StoredBlob

LINES = [b'{"type":"message"}\n', b'{"type":"message","n":2}\n']
# docs/PROTOCOL.md quotes this vector: two lines through one zstd-3 stream, then the end frame.
STREAM_VECTOR = (
    "c118a2b546b9ec05fcaeafcd5cba71ecf7e7881f1308efdfef3e20cbb608776d"  # hash of line 1
    "0001" "13000000" "1c000000"  # codec 0x0100 (stream), raw_len 19, stored_len 28
    "28b52ffd0058"  # zstd frame header: magic, no content size, no checksum, window 2 MiB
    "980000" "7b2274797065223a226d657373616765227d0a"  # raw block of 19 bytes: line 1
    "362a456c0eda40fa3e53f56e67c1fcf6d4af137d5d58a4e27f46b16444b7a9e9"  # hash of line 2
    "0001" "19000000" "11000000"  # codec 0x0100, raw_len 25, stored_len 17
    "740000" "402c226e223a327d0a0100364f20"  # compressed block of 14 bytes (a match into line 1)
    + "00" * 32 + "ffff" "02000000" "00000000"  # end frame: 2 blobs
)


def h(data: bytes) -> bytes:
    return blake3.blake3(data).digest()


def encode(lines: list[bytes], level: int = wire.STREAM_LEVEL) -> bytes:
    """A stream batch response, as the provider makes it from zstd-1 stored lines."""
    enc = wire.BatchStreamEncoder(level)
    out = b""
    for line in lines:
        stored = StoredBlob(h(line), CODEC_ZSTD, len(line), zstandard.compress(line, 1))
        out += b"".join(enc.frame_parts(stored))
    return out + wire.encode_batch_end(len(lines))


def decode(body: bytes, wanted: list[bytes], chunk: int = 1 << 20) -> list[bytes]:
    """What a fetcher makes of a response body fed in `chunk`-byte pieces."""
    decoder = wire.BatchDecoder(wanted, stream=True)
    stream = wire.BatchStreamDecoder()
    out = []
    for i in range(0, len(body), chunk):
        out += [wire.decode_blob(b, stream) for b in decoder.feed(body[i : i + chunk])]
    decoder.finish()
    return out


def test_stream_test_vector() -> None:
    body = bytes.fromhex(STREAM_VECTOR)
    assert len(body) == 171
    assert decode(body, [h(ln) for ln in LINES]) == LINES
    assert decode(encode(LINES), [h(ln) for ln in LINES]) == LINES


def test_a_stream_carries_what_whole_stream_zstd_would() -> None:
    rng = random.Random(3)
    words = [f"word{i}" for i in range(300)]
    lines = [(" ".join(rng.choices(words, k=rng.randint(50, 2000))) + "\n").encode() for _ in range(300)]
    whole = len(zstandard.ZstdCompressor(level=wire.STREAM_LEVEL).compress(b"".join(lines)))
    per_line = sum(len(zstandard.compress(ln, 1)) for ln in lines)
    frames = len(encode(lines)) - len(lines) * wire.BATCH_FRAME.size - wire.BATCH_FRAME.size
    assert frames <= whole * 1.05  # a flush ends a block: a header, fresh entropy tables
    assert frames < per_line
    assert decode(encode(lines), [h(ln) for ln in lines], chunk=4093) == lines


def test_a_line_over_the_stream_line_max_goes_as_it_is_stored() -> None:
    """A stream response carries a line over STREAM_LINE_MAX as its stored per-line frame (not
    decoded and compressed again: a 200 MB line was held three times over on each side), and
    the lines after it go on in the stream, with the lines before it as history."""
    data = random.Random(5).randbytes(wire.STREAM_LINE_MAX // 2).hex().encode()
    big = b'{"type":"custom","data":"' + data + b'"}\n'
    assert len(big) > wire.STREAM_LINE_MAX
    lines = [LINES[0], big, LINES[1]]
    body = encode(lines)
    decoder = wire.BatchDecoder([h(ln) for ln in lines], stream=True)
    blobs = decoder.feed(body)
    decoder.finish()
    assert [b.codec for b in blobs] == [wire.CODEC_ZSTD_STREAM, CODEC_ZSTD, wire.CODEC_ZSTD_STREAM]
    assert blobs[1].stored == zstandard.compress(big, 1)  # the store's bytes, as they are
    assert blobs[2].stored == bytes.fromhex("740000402c226e223a327d0a0100364f20")  # a match into line 1
    assert decode(body, [h(ln) for ln in lines], chunk=65521) == lines


def test_a_stream_segment_is_refused_unless_asked_for() -> None:
    body = encode(LINES)
    with pytest.raises(wire.WireError, match="unknown codec 256"):
        wire.BatchDecoder([h(ln) for ln in LINES]).feed(body)
    blob = wire.BatchBlob(h(LINES[0]), wire.CODEC_ZSTD_STREAM, len(LINES[0]), body[42:70])
    with pytest.raises(wire.WireError, match="outside a stream batch"):
        wire.decode_blob(blob)


def frame(line: bytes, data: bytes, raw_len: int | None = None) -> wire.BatchBlob:
    return wire.BatchBlob(h(line), wire.CODEC_ZSTD_STREAM, len(line) if raw_len is None else raw_len, data)


HEADER = bytes.fromhex("28b52ffd0058")


def block(kind: int, size: int, payload: bytes, last: int = 0) -> bytes:
    return struct.pack("<I", size << 3 | kind << 1 | last)[:3] + payload


@pytest.mark.parametrize(("data", "raw_len", "match"), [
    (b"not zstd at all", 15, "does not open a zstd frame"),
    (HEADER + block(0, 19, LINES[0], last=1), 19, "a last, reserved or oversized block"),
    (HEADER + block(3, 19, LINES[0]), 19, "a last, reserved or oversized block"),
    (HEADER + block(0, 19, LINES[0][:10]), 19, "cut inside the block"),
    (HEADER + block(0, 19, LINES[0])[:2], 19, "cut inside a block header"),
    (HEADER + block(0, 19, LINES[0]), 18, "more than its declared 18 bytes"),
    (HEADER + block(0, 19, LINES[0]), 20, "decompresses to 19 bytes, not 20"),
    # a bomb: RLE blocks of 128 KiB each, 4 bytes apiece, declared as 19 bytes: stops at one
    (HEADER + block(1, 128 << 10, b"a") * 1000, 19, "more than its declared 19 bytes"),
    (HEADER + block(1, (1 << 21) - 1, b"a"), 19, "oversized block"),
    (HEADER + block(2, 19, bytes(19)), 19, "corrupt zstd stream"),
])
def test_lying_stream_segments_are_refused(data: bytes, raw_len: int, match: str) -> None:
    with pytest.raises(wire.WireError, match=match):
        wire.decode_blob(frame(LINES[0], data, raw_len), wire.BatchStreamDecoder())


def test_a_segment_that_decodes_to_other_bytes_is_a_hash_mismatch() -> None:
    other = b'{"type":"massage"}\n'
    with pytest.raises(wire.HashMismatch):
        wire.decode_blob(frame(LINES[0], HEADER + block(0, 19, other)), wire.BatchStreamDecoder())


def test_a_window_over_the_limit_is_refused() -> None:
    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=27)
    data = zstandard.ZstdCompressor(compression_params=params).compressobj()
    seg = data.compress(LINES[0]) + data.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
    with pytest.raises(wire.WireError, match="bad frame header|corrupt"):
        wire.decode_blob(frame(LINES[0], seg), wire.BatchStreamDecoder())
    with pytest.raises(ValueError, match="window"):
        wire.BatchStreamEncoder(22)


FUZZ_LINES = [(f'{{"n":{i},"text":"' + "abc def " * (i * 37 % 300) + '"}\n').encode() for i in range(40)]
FUZZ_BODY = encode(FUZZ_LINES)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cut=st.integers(0, len(FUZZ_BODY)), flips=st.lists(st.integers(0, len(FUZZ_BODY) * 8 - 1), max_size=3),
       lie=st.one_of(st.none(), st.tuples(st.integers(0, len(FUZZ_LINES) - 1), st.integers(0, 1 << 20))),
       chunk=st.integers(1, 5000))
def test_fuzzed_stream_batches_never_crash(cut: int, flips: list[int], lie: tuple[int, int] | None,
                                           chunk: int) -> None:
    """Truncation, bit flips and lying raw lengths: a WireError (HashMismatch is one), or
    exactly the lines sent; never another exception."""
    body = bytearray(FUZZ_BODY[:cut] if cut < len(FUZZ_BODY) else FUZZ_BODY)
    for bit in flips:
        if bit // 8 < len(body):
            body[bit // 8] ^= 1 << (bit % 8)
    if lie is not None:  # rewrite one frame's raw_len
        pos = 0
        for _ in range(lie[0]):
            pos += wire.BATCH_FRAME.size + struct.unpack_from("<I", FUZZ_BODY, pos + 38)[0]
        if pos + 38 <= len(body):
            body[pos + 34 : pos + 38] = struct.pack("<I", lie[1])
    try:
        out = decode(bytes(body), [h(ln) for ln in FUZZ_LINES], chunk)
    except wire.WireError:
        return
    assert out == FUZZ_LINES


# --- negotiation with a real server ---------------------------------------------------------------


@pytest.fixture
def served(tmp_path: Path, corpus_dir: Path):
    """A library offering a real Pi session, and a client TLS context both sides trust."""
    agent = tmp_path / "agent"
    (agent / A1).parent.mkdir(parents=True)
    shutil.copy(corpus_dir / A1, agent / A1)
    lib = Library.open(NodePaths(tmp_path / "home"), agent)
    lib.share(str(agent / A1))
    me, client = load_or_create_identity(tmp_path / "me"), load_or_create_identity(tmp_path / "client")
    trust, client_trust = TrustStore(tmp_path / "trust.json"), TrustStore(tmp_path / "client-trust.json")
    trust.trust(client.node_id)
    client_trust.trust(me.node_id)
    yield lib, me, trust, client_context(client, client_trust, me.fingerprint)
    lib.close()


@pytest.mark.parametrize(("server_stream", "ask"), [(True, True), (True, False), (False, True)])
async def test_the_server_streams_only_when_asked_and_able(served, corpus_dir: Path, server_stream: bool,
                                                           ask: bool) -> None:
    lib, me, trust, tls = served
    lines = (corpus_dir / A1).read_bytes().splitlines(keepends=True)
    hashes = list(dict.fromkeys(h(ln) for ln in lines))
    server = PeerServer(lib, me, trust, wire.Limits(serve_stream_batches=server_stream))
    await server.start("127.0.0.1", 0)
    headers = {wire.BATCH_FORMAT_HEADER: wire.BATCH_FORMAT_STREAM} if ask else {}
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls)) as s, \
                s.post(f"https://127.0.0.1:{server.port}{wire.PATH_BATCH}", data=b"".join(hashes),
                       headers=headers) as r:
            answered = r.headers.get(wire.BATCH_FORMAT_HEADER)
            body = await r.read()
    finally:
        await server.close()
    streamed = server_stream and ask
    assert answered == (wire.BATCH_FORMAT_STREAM if streamed else None)
    decoder = wire.BatchDecoder(hashes, stream=ask)
    blobs = decoder.feed(body)
    decoder.finish()
    codecs = {b.codec for b in blobs}
    assert codecs == {wire.CODEC_ZSTD_STREAM} if streamed else codecs <= {CODEC_RAW, CODEC_ZSTD}
    stream = wire.BatchStreamDecoder()
    assert b"".join(wire.decode_blob(b, stream) for b in blobs) == b"".join(dict.fromkeys(lines))


def test_a_stream_batchs_lines_are_stored_at_the_stores_level_and_other_blobs_as_they_came() -> None:
    """batches._as_stored: the lines of a stream answer, decoded, are kept as the store keeps a
    line (zstd at the library's level, raw where that does not shrink it: an image's random
    bytes), all of a run compressed in one call; a per-line frame in the same answer stays as
    it came."""
    text = b'{"type":"message","content":"' + b"the same words again " * 400 + b'"}\n'
    noise = random.Random(5).randbytes(50_000) + b"\n"
    framed = b'{"type":"message","n":3}\n'
    decoded = decode(encode([text, noise]), [h(text), h(noise)])
    blobs = [wire.BatchBlob(h(text), wire.CODEC_ZSTD_STREAM, len(text), b""),
             wire.BatchBlob(h(noise), wire.CODEC_ZSTD_STREAM, len(noise), b""),
             wire.BatchBlob(h(framed), CODEC_RAW, len(framed), framed)]
    stored = batches._as_stored(blobs, [*decoded, framed])
    assert [b.codec for b in stored] == [CODEC_ZSTD, CODEC_RAW, CODEC_RAW]
    assert zstandard.decompress(stored[0].stored) == text and len(stored[0].stored) < len(text) // 10
    assert stored[1].stored == noise and stored[2] is blobs[2]
    assert [b.hash for b in stored] == [h(text), h(noise), h(framed)]
