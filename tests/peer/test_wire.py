"""The sans-IO protocol messages: exact bytes, and refusal of every malformed input."""
from __future__ import annotations

import blake3
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.errors import InvalidInput
from p2pnode.peer import wire
from p2pnode.pi.lines import LineRef

LINE = b'{"type":"message"}\n'
LINE_HASH = "c118a2b546b9ec05fcaeafcd5cba71ecf7e7881f1308efdfef3e20cbb608776d"
# docs/PROTOCOL.md quotes this vector: one raw line blob, then the end frame.
BATCH_VECTOR = (
    "c118a2b546b9ec05fcaeafcd5cba71ecf7e7881f1308efdfef3e20cbb608776d"  # hash
    "0000" "13000000" "13000000"  # codec 0 (raw), raw_len 19, stored_len 19
    "7b2274797065223a226d657373616765227d0a"  # the stored bytes
    + "00" * 32 + "ffff" "01000000" "00000000"  # end frame: zero hash, 0xFFFF, 1 blob, 0
)


def h(data: bytes) -> bytes:
    return blake3.blake3(data).digest()


def test_batch_test_vector() -> None:
    assert h(LINE).hex() == LINE_HASH
    body = wire.encode_batch_frame(h(LINE), wire.CODEC_RAW, len(LINE), LINE) + wire.encode_batch_end(1)
    assert body.hex() == BATCH_VECTOR
    dec = wire.BatchDecoder([h(LINE)])
    (blob,) = dec.feed(bytes.fromhex(BATCH_VECTOR))
    dec.finish()
    assert wire.decode_blob(blob) == LINE


def _batch(blobs: list[bytes], codec: int = wire.CODEC_ZSTD) -> bytes:
    out = b""
    for b in blobs:
        stored = zstandard.ZstdCompressor().compress(b) if codec == wire.CODEC_ZSTD else b
        out += wire.encode_batch_frame(h(b), codec, len(b), stored)
    return out + wire.encode_batch_end(len(blobs))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=300), min_size=1, max_size=8, unique=True),
       st.lists(st.integers(min_value=1, max_value=97), min_size=1, max_size=20),
       st.sampled_from([wire.CODEC_RAW, wire.CODEC_ZSTD]))
def test_batch_decodes_whatever_the_chunking(blobs: list[bytes], cuts: list[int], codec: int) -> None:
    body = _batch(blobs, codec)
    dec = wire.BatchDecoder([h(b) for b in blobs])
    got, pos, i = [], 0, 0
    while pos < len(body):
        step = cuts[i % len(cuts)]
        got += dec.feed(body[pos : pos + step])
        pos, i = pos + step, i + 1
    dec.finish()
    assert [wire.decode_blob(b) for b in got] == blobs


@pytest.mark.parametrize("mutate, message", [
    (lambda body: body[:-5], "truncated"),
    (lambda body: body + b"x", "extra bytes"),
    (lambda body: body[:-42], "truncated"),
])
def test_batch_truncated_or_extra(mutate, message) -> None:
    dec = wire.BatchDecoder([h(LINE)])
    with pytest.raises(wire.WireError, match=message):
        dec.feed(mutate(_batch([LINE])))
        dec.finish()


def test_batch_refuses_unrequested_duplicate_and_bad_frames() -> None:
    other = b"other\n"
    with pytest.raises(wire.WireError, match="not requested"):
        wire.BatchDecoder([h(LINE)]).feed(_batch([other]))
    twice = wire.encode_batch_frame(h(LINE), 0, len(LINE), LINE) * 2 + wire.encode_batch_end(2)
    with pytest.raises(wire.WireError, match="sent twice"):
        wire.BatchDecoder([h(LINE)]).feed(twice)
    with pytest.raises(wire.WireError, match="unknown codec 7"):
        wire.BatchDecoder([h(LINE)]).feed(wire.encode_batch_frame(h(LINE), 7, len(LINE), LINE))
    with pytest.raises(wire.WireError, match="exceeds the limit"):
        wire.BatchDecoder([h(LINE)], wire.Limits(max_blob=10)).feed(_batch([LINE]))
    with pytest.raises(wire.WireError, match="impossible"):
        wire.BatchDecoder([h(LINE)]).feed(wire.BATCH_FRAME.pack(h(LINE), 0, len(LINE), len(LINE) + 1))
    with pytest.raises(wire.WireError, match="bad end frame"):
        wire.BatchDecoder([h(LINE)]).feed(wire.encode_batch_end(3))


def test_batch_refuses_a_length_other_than_the_manifests_at_the_frame_head() -> None:
    """A frame head declaring 200 MiB for a line the manifest says is 23 bytes is refused
    from its head alone: nothing of the body it announces is waited for or buffered."""
    dec = wire.BatchDecoder([h(LINE)], lengths={h(LINE): len(LINE)})
    with pytest.raises(wire.WireError, match=f"raw length {200 << 20}, where the manifest says {len(LINE)}"):
        dec.feed(wire.BATCH_FRAME.pack(h(LINE), wire.CODEC_RAW, 200 << 20, 200 << 20))
    assert [wire.decode_blob(b) for b in wire.BatchDecoder([h(LINE)], lengths={h(LINE): len(LINE)})
            .feed(_batch([LINE]))] == [LINE]


def test_a_frame_whose_length_is_not_the_manifests_is_read_within_checkable() -> None:
    """The manifest is not trusted either: a frame declaring less than its manifest length is
    read (its bytes tell which of the two lies), one declaring more only within `checkable`
    raw bytes beyond the manifest over the whole answer (the rest refused from its head)."""
    shorter = wire.BatchDecoder([h(LINE)], lengths={h(LINE): len(LINE) + 2})
    assert [wire.decode_blob(b) for b in shorter.feed(_batch([LINE]))] == [LINE]
    longer = wire.BatchDecoder([h(LINE)], lengths={h(LINE): len(LINE) - 2}, checkable=2)
    assert [wire.decode_blob(b) for b in longer.feed(_batch([LINE]))] == [LINE]
    other = b'{"type":"other"}\n'
    two = wire.BatchDecoder([h(LINE), h(other)], lengths={h(LINE): len(LINE) - 2, h(other): len(other) - 1},
                            checkable=2)
    said = f"raw length {len(other)}, where the manifest says {len(other) - 1}"
    with pytest.raises(wire.WireError, match=said):
        two.feed(_batch([LINE, other]))


def test_wrong_bytes_and_zstd_bomb_are_refused() -> None:
    wrong = wire.BatchBlob(h(LINE), wire.CODEC_RAW, len(LINE), LINE.replace(b"m", b"M"))
    with pytest.raises(wire.HashMismatch, match=LINE_HASH):
        wire.decode_blob(wrong)
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 << 20))  # 64 MiB in a few KB
    assert len(bomb) < 10_000
    with pytest.raises(wire.WireError, match="declares 67108864 bytes, not 100"):
        wire.decode_blob(wire.BatchBlob(h(b"\0" * 100), wire.CODEC_ZSTD, 100, bomb))
    quiet = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * (64 << 20))
    with pytest.raises(wire.WireError, match="more than its declared 100 bytes"):
        wire.decode_blob(wire.BatchBlob(h(b"\0" * 100), wire.CODEC_ZSTD, 100, quiet))

    with pytest.raises(wire.WireError, match="corrupt"):
        wire.decode_blob(wire.BatchBlob(h(LINE), wire.CODEC_ZSTD, len(LINE), b"\x28\xb5\x2f\xfd garbage"))


def test_batch_request_limits() -> None:
    assert wire.decode_batch_request(h(LINE) + h(b"x")) == [h(LINE), h(b"x")]
    with pytest.raises(wire.WireError, match="32-byte"):
        wire.decode_batch_request(b"\0" * 33)
    with pytest.raises(wire.WireError, match="exceeds"):
        wire.decode_batch_request(b"\0" * 32 * 5, wire.Limits(max_batch_hashes=4))


def test_line_manifest_roundtrip_and_refusals() -> None:
    src = h(LINE * 2)
    refs = [LineRef(h(LINE), len(LINE))] * 2
    body = wire.encode_line_manifest(src, refs)
    assert len(body) == wire.LINE_MANIFEST_HEAD.size + 2 * 36
    assert wire.decode_line_manifest(body, src) == refs
    with pytest.raises(wire.WireError, match="the peer sent the manifest of"):
        wire.decode_line_manifest(body, h(b"other"))
    with pytest.raises(wire.WireError, match="do not hold exactly"):
        wire.decode_line_manifest(body + b"\0", src)
    with pytest.raises(wire.WireError, match="exceeds the limit"):
        wire.decode_line_manifest(body, src, wire.Limits(max_manifest_lines=1))
    with pytest.raises(wire.WireError, match="length 0"):
        wire.decode_line_manifest(wire.encode_line_manifest(src, [LineRef(h(b""), 0)]), src)
    with pytest.raises(wire.WireError, match="magic"):
        wire.decode_line_manifest(b"XXXX" + body[4:], src)


def test_catalog_roundtrip_and_refusals() -> None:
    entry = wire.CatalogEntry(branch="a" * 64, src="b" * 64, parent=None, size=10, lines=2,
                              header={"id": "x", "timestamp": "t", "cwd": "/w", "parent_session": None},
                              title="hello")
    msg = wire.CatalogMessage(generation=7, node_id="NODE", branches=[entry])
    assert wire.decode_catalog(wire.encode_catalog(msg)) == msg
    bad = wire.encode_catalog(msg).replace(b"a" * 64, b"A" * 64)
    with pytest.raises(wire.WireError, match="malformed catalog"):
        wire.decode_catalog(bad)
    with pytest.raises(wire.WireError, match="exceeds the limit"):
        wire.decode_catalog(wire.encode_catalog(msg), wire.Limits(max_catalog_bytes=10))
    with pytest.raises(wire.WireError, match="malformed"):
        wire.decode_catalog(b"[1, 2]")


def test_ticket_roundtrip_and_damage() -> None:
    t = wire.Ticket(branch=h(b"branch"), node=h(b"node"),
                    addresses=(("192.168.1.20", 22000), ("fe80::1", 22000), ("127.0.0.1", 1)))
    text = wire.encode_ticket(t)
    assert text.startswith("p2p1:") and wire.is_ticket(text)
    assert wire.decode_ticket(text) == t
    assert wire.decode_ticket("  " + text.upper().replace("P2P1:", "p2p1:") + "\n") == t
    damaged = text[:30] + ("a" if text[30] != "a" else "b") + text[31:]
    with pytest.raises(wire.InvalidTicket, match="checksum"):
        wire.decode_ticket(damaged)
    with pytest.raises(wire.InvalidTicket, match="too short"):
        wire.decode_ticket("p2p1:aaaa")
    with pytest.raises(wire.InvalidTicket, match="does not start"):
        wire.decode_ticket("x" + text)


def test_range_parsing() -> None:
    assert wire.parse_range(None, 100) is None
    assert wire.parse_range("bytes=10-", 100) == (10, 100)
    assert wire.parse_range("bytes=10-19", 100) == (10, 20)
    assert wire.parse_range("bytes=-5", 100) == (95, 100)
    assert wire.parse_range("bytes=90-500", 100) == (90, 100)
    for bad in ("bytes=100-", "bytes=5-2", "bytes=-", "items=1-2", "bytes=1-2,4-5"):
        with pytest.raises(wire.RangeNotSatisfiable):
            wire.parse_range(bad, 100)


def test_hash_text_check() -> None:
    assert wire.check_hex_hash(LINE_HASH) == LINE_HASH
    for bad in (LINE_HASH.upper(), LINE_HASH[:-1], "../etc/passwd"):
        with pytest.raises(InvalidInput):
            wire.check_hex_hash(bad)
