"""The peer transfer protocol's messages, sans-IO: bytes in, checked records out.

Over 400 lines on purpose: every message of the peer protocol (limits, catalog, line manifests,
batch frames and their streaming decoder, tickets) in the one sans-IO place PROTOCOL.md points to.

Every struct layout of the protocol is here, explicit little-endian.  Nothing in this
module does I/O; provider.py and get.py are the asyncio layers.  Anything decoded from a
peer is checked against `Limits` and raises a `WireError` naming what was wrong.

Endpoints (all under the version prefix, see docs/PROTOCOL.md):
  GET  /v1/catalog          JSON catalog of offered branches, with a generation number
                            (?wait=<generation>: answered when the generation differs, or after
                            Limits.catalog_wait seconds)
  GET  /v1/object/<hash>    a sidecar, session or line blob by BLAKE3 hash; honours Range
  GET  /v1/lines/<src>      the line manifest of a session version (binary, below);
                            ?after=<held>,... the lines after a held version's (version 2)
  POST /v1/batch            body: N × 32-byte hashes; response: framed blobs (below)
Each in that one form only (check_request_target): no percent-encoding, `..` or other query.
"""
from __future__ import annotations

import base64
import ipaddress
import json
import re
import struct
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import zstandard

from p2pnode.errors import InvalidInput, VerificationFailed
from p2pnode.pi.lines import REF, LineRef, LineRefs
from p2pnode.pi.session import well_formed
from p2pnode.pi.sidecar import is_hash_hex
from store.codec import ZSTD_MAGIC, DecodeError, blob_hash, decode_stored
from store.layout import CODEC_RAW, CODEC_ZSTD
from store.types import StoredBlob

PROTOCOL_VERSION = 1
PREFIX = f"/v{PROTOCOL_VERSION}"
PATH_CATALOG = f"{PREFIX}/catalog"
PATH_OBJECT = PREFIX + "/object/{hash}"
PATH_LINES = PREFIX + "/lines/{src}"
PATH_BATCH = f"{PREFIX}/batch"
QUERY_PARAMETER = {PATH_CATALOG: "wait", PATH_LINES: "after"}
"""The one query parameter an endpoint takes (by its path above); the others take none."""
_TARGET_PATH = re.compile(r"(?:/[A-Za-z0-9_-]+)+")
_TARGET_QUERY = re.compile(r"([a-z]+)=([0-9a-f,]*)")

HASH_LEN = 32
CODEC_END = 0xFFFF  # a batch's end frame; the blob codecs are the store's (CODEC_RAW, CODEC_ZSTD)
CODEC_ZSTD_STREAM = 0x0100
"""A blob frame whose bytes are the next whole blocks of the response's one zstd stream
(negotiated with BATCH_FORMAT_HEADER; never a store codec)."""
BATCH_FORMAT_HEADER = "X-P2P-Batch"
BATCH_FORMAT_STREAM = "zstd-stream"
"""A fetcher that sends `X-P2P-Batch: zstd-stream` accepts CODEC_ZSTD_STREAM frames; a server
that uses them answers with the same header.  An old peer ignores it: per-line frames."""
LINK_RATE_HEADER = "X-P2P-Link-Rate"
"""Sent by a fetcher that offers the stream: the bytes per second it receives from this peer
while its reads wait on the socket (a decimal integer; peer/pace.py)."""
FETCH_BYTES_HEADER = "X-P2P-Fetch-Bytes"
"""Sent with the offer: the raw bytes of the lines the fetch asks for in all (a decimal integer)."""
STREAM_LANE_HEADER = "X-P2P-Stream-Lane"
STREAM_CONTINUE_HEADER = "X-P2P-Stream-Continue"
"""Sent by a fetcher with the offer: a lane (0 to MAX_STREAM_LANES - 1, a sequence of its batch
requests to this server, one at a time) and how many stream answers of the lane's zstd frame
it decoded.  A server that streams answers with STREAM_CONTINUE_HEADER: that same number if
the answer continues the lane's frame (its encoder carried exactly that many answers in
full), else 0 (a new frame).  The fetcher refuses any other number."""
MAX_STREAM_LANES = 8
STREAM_WINDOW_HEADER = "X-P2P-Stream-Window"
"""Sent by a fetcher with a lane's headers: the log2 of the largest zstd window it decodes in
that lane (a decimal integer; absent: STREAM_CONTINUED_WINDOW_LOG).  A lane's stream takes
the smaller of it and LANE_WINDOW_LOG_MAX, where the server's budget allows."""
STREAM_CONTINUED_WINDOW_LOG = 23
"""zstd window of a stream that may go on across a connection's answers where the fetcher
named none (8 MiB): a Pi session repeats itself at distances of a few MB, beyond one answer."""
LANE_WINDOW_LOG_MIN, LANE_WINDOW_LOG_MAX = 10, 24
"""The windows a lane's stream may have (zstd's smallest; 16 MiB): on the benchmark's
session, three lanes at level 3 carry 0.221 of raw with 8 MiB of history, 0.174 with 16 MiB
and long-distance matching, for less CPU; 32 MiB (0.155) cost each side 75 MB more
(docs/BENCHMARKS.md, 2026-11-29 (22))."""
STREAM_LEVEL = 3
"""zstd level of a batch stream (docs/BENCHMARKS.md: ratio and CPU per MB of levels 1-6)."""
STREAM_LINE_MAX = 8 << 20
"""A line over this many raw bytes goes in a stream response as it is stored (codec 0 or 1:
a per-line frame, which every fetcher that offers the stream takes among its segments), not
through the stream: decoded and compressed into the stream, a 200 MB line was held about three
times over on each side (727 MB on the server, 723 MB in the fetcher), for a few percent
fewer bytes."""
ZSTD_BLOCK_MAX = 128 << 10
"""The most one zstd block holds, compressed or decompressed (the format's Block_Maximum_Size)."""

LINE_MANIFEST_MAGIC = b"P2LM"
LINE_MANIFEST_HEAD = struct.Struct("<4sH32sI")  # magic, version, src hash, line count
LINE_ENTRY = REF  # line hash, line length
LINE_MANIFEST_AFTER_HEAD = struct.Struct("<4sH32s32sII")  # magic, 2, src, base src, first line, count
MAX_AFTER = 16
"""Held versions a fetcher may name in `?after=` (comma-separated hex)."""
BATCH_FRAME = struct.Struct("<32sHII")  # hash, codec, raw_len, stored_len; then stored bytes
TICKET_PREFIX = "p2p1:"
TICKET_HEAD = struct.Struct("<B32s32sB")  # version, branch hash, node fingerprint, address count
TICKET_V4 = struct.Struct("<B4sH")  # 4, IPv4 address, port
TICKET_V6 = struct.Struct("<B16sH")  # 6, IPv6 address, port
TICKET_CRC = struct.Struct("<I")  # CRC-32 of everything before it: catches copy-paste damage


@dataclass(frozen=True)
class Limits:
    """What a node accepts from, and grants to, one peer."""

    max_sidecar: int = 4096
    max_catalog_bytes: int = 16 << 20
    max_manifest_lines: int = 4_000_000
    max_blob: int = 256 << 20
    """Largest single line blob (raw length)."""
    max_session: int = 8 << 30
    max_batch_hashes: int = 4096
    batch_target_bytes: int = 4 << 20
    """A fetcher asks for at most about this many raw bytes per batch request."""
    max_chain_depth: int = 256
    max_concurrent_requests: int = 8
    """Per peer, on the server; more get 429."""
    slow_reader_timeout: float = 30.0
    """Seconds a server waits for a peer to take the next chunk, and a fetcher for the next bytes."""
    connect_timeout: float = 10.0
    """A fetcher's bound on TCP connect plus TLS handshake to a peer."""
    progress_timeout: float = 5.0
    progress_bytes: int = 64 << 10
    """A fetcher drops a peer whose request, in any phase (connect, TLS, headers, sidecar,
    manifest, batch, blob), has not finished and has moved fewer than `progress_bytes` body
    bytes in the last `progress_timeout` seconds: a stall, a 1 byte/s trickle or endless
    `102 Processing` answers cost at most that long per attempt (a LAN link moves 64 KiB in ms)."""
    stall_timeout: float = 2.0
    """A fetcher drops a holder that has batch requests outstanding and, in the last
    `stall_timeout` seconds, has had no line verified and has moved fewer than `progress_bytes`
    bytes (the bytes count only for a line too big to arrive in that time); its lines go to
    the other holders.  The batch phase's stricter form of `progress_timeout`."""
    hedge_timeout: float = 0.5
    """A fetcher also asks the other holders, before any group nobody is serving yet, for the
    groups of a holder that by the same measure has stalled for `hedge_timeout` seconds (it
    stays in the fetch until `stall_timeout`): a cut holder's lines do not hold the fetch's
    in-order cursor for the whole `stall_timeout` (what arrives meanwhile beyond the look-ahead
    goes through the store and is read back).  A false alarm costs one copy of its groups."""
    stream_batches: bool = True
    """Fetcher: offer to take batches as one zstd stream (CODEC_ZSTD_STREAM: a third fewer
    bytes on the wire, for about 0.01 s more CPU per MB on the two sides) unless per-line frames
    were measured to deliver clearly more (peer/pace.py, FetchPace); the server decides
    (LinkPace)."""
    serve_stream_batches: bool = True
    """Server: make stream batches, where the fetcher offered them and peer/pace.py's rule
    calls for them (a small transfer, or a link slower than `stream_link_rate`)."""
    stream_small_bytes: int = 8 << 20
    """Server: a fetch of at most this many raw bytes in all (FETCH_BYTES_HEADER) gets stream
    batches when it offers them: a small transfer (a +1 % append) pays next to no CPU for it."""
    stream_link_rate: int = 20_000_000
    """Server: a link slower than this many bytes per second (the slower of the server's and
    the fetcher's measures) gets stream batches, at the highest zstd level the server's
    measured CPU affords at the link's pace (peer/pace.py), continued across the fetcher's lane."""
    fetch_timeout: float = 3600.0
    """Total bound on one fetch run by the node (`/v1/fetch`)."""
    request_timeout: float = 10.0
    """Server: seconds a connection has to deliver a request's headers (from the handshake or
    the previous answer) and, separately, its body; then it is closed (slowloris, a huge
    Content-Length with a few bytes)."""
    max_request_fields: int = 16
    max_request_field: int = 8190
    """Server: the fields of a request's head and of its chunked body's trailer section, counted
    together, and the bytes of each (name and value: a Range of 4,400 digits is answered, 416):
    both sections at most 128 KiB in all; past either bound the request is 400 and the
    connection closed (aiohttp's parser counts trailers with the headers; its own 128 fields
    let a peer's trailers take 1 MiB per request).  A fetcher sends at most 8 fields."""
    tls_handshake_timeout: float = 5.0
    """Server: seconds an incoming connection has to complete its TLS handshake."""
    max_connections_per_peer: int = 16
    """Server: authenticated connections of one trusted peer at once; more are closed after
    the handshake (each holds TLS buffers and up to 32 parsed pipelined requests)."""
    max_handshakes_per_source: int = 8
    max_handshakes: int = 128
    """Server: connections not yet past the TLS handshake (not yet known to be trusted), per
    source address and in all; more are closed at once.  Each costs a 256 KiB TLS buffer."""
    catalog_wait: float = 20.0
    """Server: the longest a `GET /v1/catalog?wait=<generation>` is held open before it is
    answered with the unchanged catalog (change notification, docs/PROTOCOL.md)."""
    max_waiting_per_peer: int = 2
    """Server: catalog requests of one peer waiting for a change at once; more get 429."""

    @property
    def max_batch_request(self) -> int:
        return self.max_batch_hashes * HASH_LEN


DEFAULT_LIMITS = Limits()


class WireError(VerificationFailed):
    """A peer sent a malformed or lying message."""


class HashMismatch(WireError):
    """Bytes a peer sent hash to something else than what was asked for (not the store's
    BlobMismatch: this one is the peer's fault and ends that peer's part in a fetch)."""

    def __init__(self, expected: bytes, got: bytes, what: str = "blob") -> None:
        super().__init__(f"{what} {expected.hex()}: the received bytes hash to {got.hex()}")
        self.expected = expected


class InvalidTicket(InvalidInput):
    def __init__(self, text: str, reason: str) -> None:
        super().__init__(f"invalid ticket {text[:24]!r}...: {reason}")


def check_hex_hash(text: str, what: str = "hash") -> str:
    """A 64-character lowercase hex hash, or InvalidInput."""
    if not is_hash_hex(text):
        raise InvalidInput(f"{what} {str(text)[:80]!r} is not 64 lowercase hex characters")
    return text


# --- catalog ---------------------------------------------------------------------------


@dataclass(frozen=True)
class CatalogEntry:
    branch: str
    src: str
    parent: str | None
    size: int
    lines: int
    header: dict
    """Summary of the session header: id, timestamp, cwd, parent_session (strings or None)."""
    title: str | None = None
    previous: str | None = None
    """The branch of the older version of the same Pi session this one grew from (None: a first
    version, or a peer that does not say)."""
    version: int | None = None
    """Its place among the sharer's versions of that session (1 = first); None from older peers."""


@dataclass(frozen=True)
class CatalogMessage:
    generation: int
    node_id: str
    branches: list[CatalogEntry] = field(default_factory=list)


_HEADER_KEYS = ("id", "timestamp", "cwd", "parent_session")


def encode_catalog(catalog: CatalogMessage) -> bytes:
    doc = {
        "version": PROTOCOL_VERSION,
        "generation": catalog.generation,
        "node": catalog.node_id,
        "branches": [
            {"branch": e.branch, "src": e.src, "parent": e.parent, "size": e.size, "lines": e.lines,
             "header": {k: e.header.get(k) for k in _HEADER_KEYS}, "title": e.title,
             "previous": e.previous, "version": e.version}
            for e in catalog.branches
        ],
    }
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False)
    try:
        return text.encode()
    except UnicodeEncodeError:  # a lone surrogate kept from before well_formed: escaped, as JSON allows
        return json.dumps(doc, separators=(",", ":")).encode()


def decode_catalog(data: bytes, limits: Limits = DEFAULT_LIMITS) -> CatalogMessage:
    if len(data) > limits.max_catalog_bytes:
        raise WireError(f"catalog of {len(data)} bytes exceeds the limit of {limits.max_catalog_bytes}")
    try:
        doc = json.loads(data)
        if doc["version"] != PROTOCOL_VERSION:
            raise WireError(f"catalog has protocol version {doc['version']!r}, expected {PROTOCOL_VERSION}")
        entries = []
        for b in doc["branches"]:
            header = b["header"]
            if not isinstance(header, dict) or not all(
                header.get(k) is None or isinstance(header.get(k), str) for k in _HEADER_KEYS
            ):
                raise WireError(f"catalog entry {str(b.get('branch'))[:64]}: bad header summary")
            parent = b["parent"]
            entries.append(CatalogEntry(
                branch=check_hex_hash(b["branch"], "catalog branch"),
                src=check_hex_hash(b["src"], "catalog src"),
                parent=None if parent is None else check_hex_hash(parent, "catalog parent"),
                size=_nonneg_int(b["size"]), lines=_nonneg_int(b["lines"]),
                header={k: None if header.get(k) is None else well_formed(header[k]) for k in _HEADER_KEYS},
                title=well_formed(b["title"]) if isinstance(b.get("title"), str) else None,
                previous=_optional_hash(b.get("previous"), "catalog previous"),
                version=_optional_version(b.get("version")),
            ))
        generation = _nonneg_int(doc["generation"])
        node = doc["node"]
        if not isinstance(node, str):
            raise WireError("catalog node id is not a string")
    except WireError:
        raise
    except (ValueError, KeyError, TypeError, InvalidInput) as exc:
        raise WireError(f"malformed catalog: {exc}") from exc
    except RecursionError:
        raise WireError("malformed catalog: JSON nested too deeply") from None
    return CatalogMessage(generation, node, entries)


def _optional_hash(v: object, what: str) -> str | None:
    """A catalog entry's optional hash field: absent or null (an older peer) is None."""
    if v is None:
        return None
    if not isinstance(v, str):
        raise ValueError(f"{what} is not a string")
    return check_hex_hash(v, what)


def _optional_version(v: object) -> int | None:
    """A catalog entry's `version`: absent or null (an older peer) is None, else 1 or more."""
    if v is None:
        return None
    if (n := _nonneg_int(v)) == 0:
        raise ValueError("version 0 (versions count from 1)")
    return n


def parse_count_header(text: str | None) -> int | None:
    """LINK_RATE_HEADER's or FETCH_BYTES_HEADER's value, or None when absent or not a decimal
    integer below 10**15 (they only steer the batch format: a bad one is ignored, not refused)."""
    if text is None or not text.isascii() or not text.isdigit() or len(text) > 15:
        return None
    return int(text)


def parse_window_header(text: str | None) -> int:
    """STREAM_WINDOW_HEADER's value within [LANE_WINDOW_LOG_MIN, LANE_WINDOW_LOG_MAX];
    STREAM_CONTINUED_WINDOW_LOG where absent or not a decimal integer (ignored, as the other
    headers that only steer the batch format)."""
    n = parse_count_header(text)
    return STREAM_CONTINUED_WINDOW_LOG if n is None else min(LANE_WINDOW_LOG_MAX, max(LANE_WINDOW_LOG_MIN, n))


def check_request_target(target: str, endpoint: str | None) -> None:
    """A request target as sent, in the one form PROTOCOL.md gives it ("Request targets"), else
    WireError saying what is not: a server that decoded `%61` or `..` before routing would
    serve one object under many names.  `endpoint`: the path (above) it was routed to, None
    for none (its query is not looked at: the answer is 404)."""
    path, has_query, query = target.partition("?")
    if not _TARGET_PATH.fullmatch(path):
        raise WireError(f"request target {target[:100]!r} is not canonical: only ASCII letters, digits, "
                        "'-' and '_' between single '/' (no percent-encoding, no '.' or '..' segment, "
                        "no empty segment, no fragment)")
    if not has_query or endpoint is None:
        return
    name = QUERY_PARAMETER.get(endpoint)
    given = _TARGET_QUERY.fullmatch(query)
    if name is None or given is None or given.group(1) != name:
        takes = f"only ?{name}= (lowercase hex, digits, commas)" if name else "no query"
        raise WireError(f"request target {target[:100]!r} is not canonical: {endpoint} takes {takes}")


def parse_wait(text: str) -> int:
    """The generation in `GET /v1/catalog?wait=<generation>`: a decimal integer, 0 to 2**63-1."""
    if not text.isascii() or not text.isdigit() or len(text) > 19 or int(text) >= 1 << 63:
        raise WireError(f"catalog wait={text[:24]!r} is not a generation number")
    return int(text)


def _nonneg_int(v: object) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"{v!r} is not a non-negative integer")
    return v


# --- line manifests ---------------------------------------------------------------------


def encode_line_manifest(src: bytes, lines: Sequence[LineRef]) -> bytes:
    return LINE_MANIFEST_HEAD.pack(LINE_MANIFEST_MAGIC, 1, src, len(lines)) + LineRefs.of(lines).entries


def decode_line_manifest(data: bytes, src: bytes, limits: Limits = DEFAULT_LIMITS) -> list[LineRef]:
    """The manifest of session `src`.  Only its shape is checked here: the lines are
    verified one by one as they arrive, and their concatenation is re-hashed to `src`."""
    what = f"line manifest of {src.hex()}"
    if len(data) < LINE_MANIFEST_HEAD.size:
        raise WireError(f"{what}: {len(data)} bytes is shorter than its header")
    magic, version, got_src, count = LINE_MANIFEST_HEAD.unpack_from(data)
    if magic != LINE_MANIFEST_MAGIC or version != 1:
        raise WireError(f"{what}: bad magic or version ({magic!r}, {version})")
    if got_src != src:
        raise WireError(f"{what}: the peer sent the manifest of {got_src.hex()}")
    if count > limits.max_manifest_lines:
        raise WireError(f"{what}: {count} lines exceeds the limit of {limits.max_manifest_lines}")
    if len(data) != LINE_MANIFEST_HEAD.size + count * LINE_ENTRY.size:
        raise WireError(f"{what}: {len(data)} bytes do not hold exactly {count} entries")
    lines = [LineRef(h, n) for h, n in LINE_ENTRY.iter_unpack(data[LINE_MANIFEST_HEAD.size:])]
    total = 0
    for i, line in enumerate(lines):
        if line.length == 0 or line.length > limits.max_blob:
            raise WireError(f"{what}: line {i} has length {line.length} (allowed 1..{limits.max_blob})")
        total += line.length
    if total > limits.max_session:
        raise WireError(f"{what}: {total} bytes in total exceeds the limit of {limits.max_session}")
    return lines


@dataclass(frozen=True)
class ManifestAfter:
    """The lines of session `src` after the first `first` lines, which are the lines of version
    `base` (one the fetcher named in `?after=`) up to its last newline."""

    base: bytes
    first: int
    lines: list[LineRef]


def encode_line_manifest_after(src: bytes, base: bytes, first: int, lines: Sequence[LineRef]) -> bytes:
    return (LINE_MANIFEST_AFTER_HEAD.pack(LINE_MANIFEST_MAGIC, 2, src, base, first, len(lines))
            + LineRefs.of(lines).entries)


def encode_after_query(held: list[str]) -> str:
    return ",".join(held[:MAX_AFTER])


def decode_after_query(text: str | None) -> list[str]:
    """The held versions a fetcher named (WireError for anything but up to MAX_AFTER hashes)."""
    if not text:
        return []
    held = text.split(",")
    if len(held) > MAX_AFTER or not all(is_hash_hex(h) for h in held):
        raise WireError(f"after: up to {MAX_AFTER} comma-separated 64-hex-digit hashes")
    return held


def decode_any_line_manifest(data: bytes, src: bytes, after: list[str],
                             limits: Limits = DEFAULT_LIMITS) -> list[LineRef] | ManifestAfter:
    """A version-1 manifest (the whole session: the peer did not use `after`), or a version-2
    one whose base must be one of `after` and whose lines are checked as version 1's are."""
    if len(data) >= 6 and data[:4] == LINE_MANIFEST_MAGIC and struct.unpack_from("<H", data, 4)[0] == 2:
        what = f"line manifest of {src.hex()}"
        if len(data) < LINE_MANIFEST_AFTER_HEAD.size:
            raise WireError(f"{what}: {len(data)} bytes is shorter than its header")
        _, _, got_src, base, first, count = LINE_MANIFEST_AFTER_HEAD.unpack_from(data)
        if got_src != src or base.hex() not in after:
            raise WireError(f"{what}: the peer sent the manifest of {got_src.hex()} after {base.hex()}")
        if first + count > limits.max_manifest_lines:
            raise WireError(f"{what}: {first + count} lines exceeds the limit of {limits.max_manifest_lines}")
        head = LINE_MANIFEST_HEAD.pack(LINE_MANIFEST_MAGIC, 1, src, count)
        lines = decode_line_manifest(head + data[LINE_MANIFEST_AFTER_HEAD.size:], src, limits)
        return ManifestAfter(base, first, lines)
    return decode_line_manifest(data, src, limits)


# --- batches ----------------------------------------------------------------------------


def encode_batch_request(hashes: Iterable[bytes]) -> bytes:
    return b"".join(hashes)


def decode_batch_request(body: bytes, limits: Limits = DEFAULT_LIMITS) -> list[bytes]:
    if len(body) % HASH_LEN or not body:
        raise WireError(f"batch request of {len(body)} bytes is not a non-empty list of 32-byte hashes")
    if len(body) > limits.max_batch_request:
        raise WireError(f"batch request of {len(body) // HASH_LEN} hashes exceeds {limits.max_batch_hashes}")
    return [body[i : i + HASH_LEN] for i in range(0, len(body), HASH_LEN)]


def batch_frame_parts(blob_hash: bytes, codec: int, raw_len: int, stored: bytes) -> tuple[bytes, bytes]:
    """A blob frame as (header, stored bytes), so that a sender can join many without copies."""
    return BATCH_FRAME.pack(blob_hash, codec, raw_len, len(stored)), stored


def encode_batch_frame(blob_hash: bytes, codec: int, raw_len: int, stored: bytes) -> bytes:
    return b"".join(batch_frame_parts(blob_hash, codec, raw_len, stored))


def encode_batch_end(count: int) -> bytes:
    """The closing frame: zero hash, codec 0xFFFF, raw_len = number of blobs sent, stored_len 0."""
    return BATCH_FRAME.pack(bytes(HASH_LEN), CODEC_END, count, 0)


BatchBlob = StoredBlob
"""A received blob frame is the store's own record (the wire's codec numbers are the store's),
so a fetcher can hand it to `put_stored_blobs` as it is."""


def max_stored_len(raw_len: int) -> int:
    """The most a zstd frame of `raw_len` bytes can take (ZSTD_compressBound, rounded up)."""
    return raw_len + (raw_len >> 7) + 1024


class BatchDecoder:
    """Incremental parser of a batch response.  `feed()` returns the frames completed so far.

    A frame is refused (WireError) if its hash was not asked for or came twice, its codec is
    unknown (or a stream segment that was not asked for), or its lengths exceed the limits; all
    before its bytes are buffered.  Bytes after the end frame are refused too.

    `lengths` (each hash's raw length in the line manifest, which is not trusted either): a
    frame declaring another length is one the frame's sender or the manifest lies about, and
    only its bytes tell which (the caller compares the verified line's length).  One declaring
    less is read; one declaring more only while the answer's frames declare at most `checkable`
    raw bytes more than the manifest in all (an answer costs about what was asked for), else
    it is refused from its head.
    """

    def __init__(self, wanted: Iterable[bytes], limits: Limits = DEFAULT_LIMITS,
                 stream: bool = False, lengths: Mapping[bytes, int] | None = None,
                 checkable: int = 0) -> None:
        self._wanted = set(wanted)
        self._lengths = lengths
        self._checkable = checkable
        self._limits = limits
        self._codecs = (CODEC_RAW, CODEC_ZSTD, CODEC_ZSTD_STREAM) if stream else (CODEC_RAW, CODEC_ZSTD)
        """CODEC_ZSTD_STREAM only where it was asked for (BATCH_FORMAT_HEADER)."""
        self._buf = bytearray()
        self._head: tuple[bytes, int, int, int] | None = None
        self.received = 0
        self.done = False

    def feed(self, data: bytes) -> list[BatchBlob]:
        if self.done and data:
            raise WireError(f"batch response: {len(data)} extra bytes after the end frame")
        out: list[BatchBlob] = []
        pos = 0
        with memoryview(data) as view:
            while not self.done:
                need = BATCH_FRAME.size if self._head is None else self._head[3]
                if self._buf or len(data) - pos < need:  # a header or blob cut by a chunk boundary
                    take = min(need - len(self._buf), len(data) - pos)
                    self._buf += view[pos : pos + take]
                    pos += take
                    if len(self._buf) < need:
                        break
                    piece, at = bytes(self._buf), 0
                    self._buf.clear()
                else:
                    piece, at = data, pos
                    pos += need
                if self._head is None:
                    self._head = self._check_head(*BATCH_FRAME.unpack_from(piece, at))
                    self.done = self._head[1] == CODEC_END
                else:
                    stored = piece if at == 0 and len(piece) == need else bytes(view[at : at + need])
                    out.append(BatchBlob(self._head[0], self._head[1], self._head[2], stored))
                    self._head = None
                    self.received += 1
            if self.done and pos < len(data):
                raise WireError(f"batch response: {len(data) - pos} extra bytes after the end frame")
        return out

    def finish(self) -> None:
        """Call at end of body: a stream without its end frame was cut short."""
        if not self.done:
            raise WireError(f"batch response truncated after {self.received} blobs (no end frame)")

    def _check_head(self, blob_hash: bytes, codec: int, raw_len: int, stored_len: int) -> tuple:
        if codec == CODEC_END:
            if blob_hash != bytes(HASH_LEN) or stored_len != 0 or raw_len != self.received:
                raise WireError(f"batch response: bad end frame (says {raw_len} blobs, got {self.received})")
            return (blob_hash, codec, raw_len, stored_len)
        what = f"batch frame for {blob_hash.hex()}"
        if blob_hash not in self._wanted:
            raise WireError(f"{what}: not requested, or sent twice")
        self._wanted.discard(blob_hash)
        if codec not in self._codecs:
            raise WireError(f"{what}: unknown codec {codec}")
        if raw_len > self._limits.max_blob:
            raise WireError(f"{what}: raw length {raw_len} exceeds the limit of {self._limits.max_blob}")
        listed = raw_len if self._lengths is None else self._lengths[blob_hash]
        if raw_len > listed:
            self._checkable -= raw_len - listed
            if self._checkable < 0:
                raise WireError(f"{what}: raw length {raw_len}, where the manifest says {listed} "
                                     "(more than can be read to check which of the two lies)")
        bound = raw_len if codec == CODEC_RAW else max_stored_len(raw_len)
        if stored_len > bound or (codec == CODEC_RAW and stored_len != raw_len):
            raise WireError(f"{what}: stored length {stored_len} impossible for raw length {raw_len}")
        return (blob_hash, codec, raw_len, stored_len)


def decode_blob(blob: BatchBlob, stream: BatchStreamDecoder | None = None) -> bytes:
    """The raw bytes of a received blob, decoded by the store's bounded decoder (never more
    than its declared length, whatever the zstd frame claims), or by the response's `stream`
    for a stream segment, and verified against its hash."""
    try:
        if blob.codec == CODEC_ZSTD_STREAM:
            if stream is None:
                raise DecodeError("a zstd stream segment outside a stream batch")
            raw = stream.decode(blob.stored, blob.raw_len)
        else:
            raw = decode_stored(blob.codec, blob.stored, blob.raw_len)
    except DecodeError as exc:
        raise WireError(f"blob {blob.hash.hex()}: {exc}") from None
    got = blob_hash(raw)
    if got != blob.hash:
        raise HashMismatch(blob.hash, got, "line blob")
    return raw


class BatchStreamEncoder:
    """The sending side of a stream batch: every line of one response goes through one zstd
    stream, flushed at the end of each line (the frame is never ended), so that each blob
    frame holds whole blocks that decode to exactly that line with the lines before it as
    history: the wire carries about what whole-stream zstd would (a flush costs a block
    header), and each line is still verified on its own as it arrives."""

    def __init__(self, level: int = STREAM_LEVEL, window_log: int | None = None) -> None:
        """`window_log`: a lane's stream, with that window, and zstd's long-distance matching
        where it is over 8 MiB (it finds the session's repeats across the whole window; within
        8 MiB it cost 15 % more CPU for 6 % fewer bytes); None: a stream of one answer, at the
        level's own window."""
        params = (zstandard.ZstdCompressionParameters.from_level(level) if window_log is None
                  else zstandard.ZstdCompressionParameters.from_level(
                      level, window_log=window_log, enable_ldm=window_log > STREAM_CONTINUED_WINDOW_LOG))
        if params.window_log > (STREAM_CONTINUED_WINDOW_LOG if window_log is None else LANE_WINDOW_LOG_MAX):
            raise ValueError(f"zstd level {level} uses a window of 2**{params.window_log} bytes, over "
                             f"what a stream may have")
        self.level = level
        self.window_log = params.window_log
        self.answers = 0
        """Answers this stream carried in full (a continued stream's next answer says so)."""
        self._stream = zstandard.ZstdCompressor(compression_params=params).compressobj()

    @staticmethod
    def streams(raw_len: int) -> bool:
        """Whether a line of `raw_len` bytes goes through the stream (else as it is stored)."""
        return raw_len <= STREAM_LINE_MAX

    def frame_parts(self, blob: StoredBlob) -> tuple[bytes, bytes]:
        """A stored line as a stream frame (header, bytes): decoded (the store's bounded
        decoder), then compressed into the stream; one over STREAM_LINE_MAX as it is stored."""
        if not self.streams(blob.raw_len):
            return batch_frame_parts(blob.hash, blob.codec, blob.raw_len, blob.stored)
        raw = blob.stored if blob.codec == CODEC_RAW else decode_stored(blob.codec, blob.stored, blob.raw_len)
        data = self._stream.compress(raw) + self._stream.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
        return batch_frame_parts(blob.hash, CODEC_ZSTD_STREAM, blob.raw_len, data)


_BLOCK_HEAD = struct.Struct("<I")  # a zstd block header is the low 3 bytes


class BatchStreamDecoder:
    """The receiving side of a stream batch: the segments of one response, decoded in the
    order they came.  Each segment must be whole zstd blocks (the first one opens with the
    frame header) that decode to exactly the declared length; the decoder is fed one block at
    a time and a block yields at most ZSTD_BLOCK_MAX bytes, so a lying segment costs at most
    its declared length plus one block of memory, whatever it claims; the window is bounded
    by `2**window_log` (what the fetcher offered: a frame asking for more is refused).
    Sans-IO, not thread-safe: one thread at a time, in order.  A stream continued across a
    connection's answers (STREAM_CONTINUE_HEADER) is one decoder fed the answers' segments in
    the order the answers came."""

    def __init__(self, window_log: int = STREAM_CONTINUED_WINDOW_LOG) -> None:
        self._stream = zstandard.ZstdDecompressor(max_window_size=1 << window_log).decompressobj()
        self._started = False
        self.answers = 0
        """Answers whose segments this decoder was given in full (the fetcher counts them)."""

    def decode(self, data: bytes | memoryview, raw_len: int) -> bytes:
        """The raw bytes of the next segment; DecodeError for anything but exactly `raw_len`
        bytes out of whole blocks (a cut block, a last block ending the frame, corrupt data)."""
        view = memoryview(data)
        pos = self._open(view)
        out = bytearray()
        try:
            while pos < len(view):
                if pos + 3 > len(view):
                    raise DecodeError(f"zstd stream segment cut inside a block header at byte {pos}")
                head = _BLOCK_HEAD.unpack(bytes(view[pos : pos + 3]) + b"\0")[0]
                last, kind, size = head & 1, (head >> 1) & 3, head >> 3
                if last or kind == 3 or size > ZSTD_BLOCK_MAX:
                    raise DecodeError(f"zstd stream segment: a last, reserved or oversized block "
                                      f"at byte {pos}")
                end = pos + 3 + (1 if kind == 1 else size)
                if end > len(view):
                    raise DecodeError(f"zstd stream segment cut inside the block at byte {pos}")
                out += self._stream.decompress(view[pos:end])
                pos = end
                if len(out) > raw_len:
                    raise DecodeError(f"zstd stream segment decompresses to more than its declared "
                                      f"{raw_len} bytes")
        except zstandard.ZstdError as exc:
            raise DecodeError(f"corrupt zstd stream ({exc})") from None
        if len(out) != raw_len:
            raise DecodeError(f"zstd stream segment decompresses to {len(out)} bytes, not {raw_len}")
        return bytes(out)

    def _open(self, view: memoryview) -> int:
        """Past the frame header at the start of the first segment (its window is checked by
        the decompressor): where the first block starts."""
        if self._started:
            return 0
        if len(view) < 6 or _BLOCK_HEAD.unpack_from(view, 0)[0] != ZSTD_MAGIC:
            raise DecodeError("zstd stream: the first segment does not open a zstd frame")
        try:
            size = zstandard.frame_header_size(view)
            self._stream.decompress(view[:size])
        except zstandard.ZstdError as exc:
            raise DecodeError(f"zstd stream: bad frame header ({exc})") from None
        self._started = True
        return size


# --- Range ------------------------------------------------------------------------------


class RangeNotSatisfiable(Exception):
    pass


def _range_number(digits: str) -> int:
    """A Range position; one of more than 19 digits is past any object (and never handed to
    int(), which refuses over 4,300 digits): 2**63."""
    return int(digits) if len(digits) <= 19 else 1 << 63


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """A single `bytes=a-b` / `bytes=a-` / `bytes=-n` range → (start, end exclusive); None = whole."""
    if not header:
        return None
    m = re.fullmatch(r"(?i:bytes)=([0-9]*)-([0-9]*)", header.strip())  # ASCII digits only; the unit's
    # name is case-insensitive (RFC 9110, 14.1)
    if not m or (not m.group(1) and not m.group(2)):
        raise RangeNotSatisfiable(header)
    if not m.group(1):
        n = _range_number(m.group(2))
        if n == 0 or size == 0:  # a suffix of zero bytes is unsatisfiable (RFC 9110, 14.1.1)
            raise RangeNotSatisfiable(header)
        return (max(0, size - n), size)
    start = _range_number(m.group(1))
    end = min(size, _range_number(m.group(2)) + 1) if m.group(2) else size
    if start >= size or end <= start:
        raise RangeNotSatisfiable(header)
    return (start, end)


# --- tickets ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Ticket:
    """Everything needed to fetch a branch without discovery: what, from whom, where."""

    branch: bytes
    node: bytes
    """The sharer's node fingerprint (nodeid.format_node_id shows it)."""
    addresses: tuple[tuple[str, int], ...]


MAX_TICKET_ADDRESSES = 16


def encode_ticket(ticket: Ticket) -> str:
    addrs = ticket.addresses[:MAX_TICKET_ADDRESSES]
    out = bytearray(TICKET_HEAD.pack(1, ticket.branch, ticket.node, len(addrs)))
    for host, port in addrs:
        ip = ipaddress.ip_address(host)
        layout = TICKET_V4 if ip.version == 4 else TICKET_V6
        out += layout.pack(ip.version, ip.packed, port)
    out += TICKET_CRC.pack(zlib.crc32(out))
    return TICKET_PREFIX + base64.b32encode(bytes(out)).decode().rstrip("=").lower()


def is_ticket(text: str) -> bool:
    return text.strip().lower().startswith(TICKET_PREFIX)


def decode_ticket(text: str) -> Ticket:
    body = text.strip().lower()
    if not body.startswith(TICKET_PREFIX):
        raise InvalidTicket(text, f"does not start with {TICKET_PREFIX}")
    b32 = body[len(TICKET_PREFIX):].upper()
    try:
        raw = base64.b32decode(b32 + "=" * (-len(b32) % 8))
    except ValueError as exc:
        raise InvalidTicket(text, "not base32") from exc
    if len(raw) < TICKET_HEAD.size + TICKET_CRC.size:
        raise InvalidTicket(text, "too short")
    (crc,) = TICKET_CRC.unpack_from(raw, len(raw) - TICKET_CRC.size)
    raw = raw[: -TICKET_CRC.size]
    if zlib.crc32(raw) != crc:
        raise InvalidTicket(text, "checksum mismatch (damaged in copy-paste?)")
    version, branch, node, count = TICKET_HEAD.unpack_from(raw)
    if version != 1:
        raise InvalidTicket(text, f"unknown version {version}")
    pos, addrs = TICKET_HEAD.size, []
    for _ in range(count):
        layout = TICKET_V4 if raw[pos : pos + 1] == b"\x04" else TICKET_V6
        if raw[pos : pos + 1] not in (b"\x04", b"\x06") or pos + layout.size > len(raw):
            raise InvalidTicket(text, "bad address entry")
        _, packed, port = layout.unpack_from(raw, pos)
        addrs.append((str(ipaddress.ip_address(packed)), port))
        pos += layout.size
    if pos != len(raw):
        raise InvalidTicket(text, f"{len(raw) - pos} unexpected trailing bytes")
    return Ticket(branch, node, tuple(addrs))
