"""Getting a set of lines from the peers of a fetch: batch requests, and each received blob
decoded and verified against its hash before it is handed on.

get.py decides which lines are missing and what to do with a verified one (the `Received`
callback); this module decides how they are asked for; downloader.py which peer is asked
(downloader.Share: all holders at once) and what its failure means.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

from p2pnode.library.api import ZSTD_LEVEL
from p2pnode.peer import wire
from p2pnode.peer.downloader import PeerPool, Share
from p2pnode.peer.link import PeerLink
from p2pnode.peer.pace import FetchPace, Measures
from p2pnode.pi.lines import LineRef
from store.api import PREPARE_THREADS
from store.codec import compressor
from store.layout import CODEC_RAW, CODEC_ZSTD

BATCHES_IN_FLIGHT = 3
"""Batch requests per holder at once, so that it prepares one while we verify another."""
LANE_WINDOWS_BYTES = 48 << 20
"""The most window all lanes' stream decoders of a fetch may hold (lane_window_log)."""
GROUPS_PER_HOLDER = 128
MIN_GROUP_BYTES = 256 << 10
"""A session's missing lines are cut into at least GROUPS_PER_HOLDER groups per holder (of
at least MIN_GROUP_BYTES raw bytes, at most `Limits.batch_target_bytes`): with groups as big
as the target, a 16 MB session was four requests, so a second holder got one of them and
the end game re-asked most of the rest, and a kill -9 lost every line still in flight
(BATCHES_IN_FLIGHT whole groups).  Small groups share the lines out evenly among holders,
keep the end game's re-asks short and what a kill loses small (about 3/128 of a session)."""
DECODE_RUN = 1 << 20
"""Raw bytes of received blobs handed to a worker thread at a time for decoding."""

CHECKABLE_MIN = 1 << 20
"""Raw bytes a batch answer may declare beyond the line manifest's lengths and still be read to
find out which of the two lies (wire.BatchDecoder's `checkable`): at least this, or as much as
the request asked for."""


class ManifestLengthWrong(Exception):
    """A line arrived genuine (it hashes to its hash) with a length other than its line
    manifest's: the manifest lied, not the holder that sent the line.  Not a peer's failure
    (the downloader does not judge it): it ends get_lines, for the fetch to drop the manifest."""


Received = Callable[[list[wire.BatchBlob], list[bytes]], Awaitable[None]]
"""received(blobs, their verified raw bytes): called as runs of blobs are verified, each line
once.  A blob that came as a zstd stream segment (which cannot be stored as it came: it needs
the stream) is handed on as the store would keep it: zstd at the library's level if that
shrinks it, else raw."""
Have = Callable[[bytes], bool]
"""have(line hash): True once a line was received (it is not asked for again)."""


async def get_lines(pool: PeerPool, what: str, missing: list[LineRef], limits: wire.Limits,
                    have: Have, received: Received, sized_as: int | None = None,
                    not_shared: Callable[[], float] | None = None, hint: Measures | None = None,
                    keep: Callable[[Measures], None] | None = None) -> None:
    """Every line of `missing` from the pool's peers, handed to `received` once verified: the
    lines are shared out among all holders (downloader.Share); a broken link or a dropped
    holder leaves its lines not received yet to the others.  `sized_as`: the raw bytes the
    groups are sized for, when not `missing`'s (a resumed fetch is cut as the fetch it
    continues: smaller groups are smaller zstd streams, which compress worse).  `not_shared`:
    the CPU seconds so far of work the received lines do not cause (pace.FetchPace); `hint`:
    what a stopped run of this fetch measured of the batch formats, and `keep`: where this
    one's measures go, for a run after it (FetchPace.hint and .keep)."""
    wanted = [r for r in missing if not have(r.hash)]
    holders = sum(1 for p in pool.peers if not p.dropped)
    total = sum(r.length for r in wanted) if sized_as is None else sized_as
    groups = _groups(wanted, limits, group_bytes(total, holders, limits))
    share = Share(pool, what, groups, BATCHES_IN_FLIGHT)
    pace = FetchPace(sum(r.length for r in wanted), live=share.delivering, hint=hint)
    if not_shared is not None:
        pace.not_shared = not_shared
    if keep is not None:
        pace.keep = keep
    lanes = Lanes(lane_window_log(holders))

    async def ask(peer: PeerLink, group: list[LineRef]) -> None:
        with lanes.take(peer) as lane:
            await _batch(peer, group, limits, functools.partial(_hand_on, share, peer, received), pace, lane)

    await share.run(ask)


def lane_window_log(holders: int) -> int:
    """The window a lane's stream may have in a fetch from `holders` holders: the largest, up
    to wire.LANE_WINDOW_LOG_MAX, whose decoders (BATCHES_IN_FLIGHT lanes per holder) hold at
    most LANE_WINDOWS_BYTES in all, and never under 8 MiB (16 MiB for one holder, 8 from two)."""
    lanes = max(1, holders) * BATCHES_IN_FLIGHT
    log = wire.LANE_WINDOW_LOG_MAX
    while log > wire.STREAM_CONTINUED_WINDOW_LOG and lanes << log > LANE_WINDOWS_BYTES:
        log -= 1
    return log


def group_bytes(total: int, holders: int, limits: wire.Limits) -> int:
    """Raw bytes per batch request of a fetch of `total` raw bytes: GROUPS_PER_HOLDER groups
    per holder or more, each within [MIN_GROUP_BYTES, batch_target_bytes] (a smaller
    configured target wins)."""
    even = total // (GROUPS_PER_HOLDER * max(1, holders))
    return min(limits.batch_target_bytes, max(MIN_GROUP_BYTES, even))


def _groups(missing: list[LineRef], limits: wire.Limits, target: int) -> list[list[LineRef]]:
    """The lines in batches of at most max_batch_hashes and about `target` raw bytes."""
    groups: list[list[LineRef]] = [[]]
    size = 0
    for ref in missing:
        if len(groups[-1]) >= limits.max_batch_hashes or size >= target:
            groups.append([])
            size = 0
        groups[-1].append(ref)
        size += ref.length
    return [g for g in groups if g]


async def _hand_on(share: Share, peer: PeerLink, received: Received, blobs: list[wire.BatchBlob],
                   raws: list[bytes]) -> None:
    """Verified blobs to `received`, but only those no other holder delivered first."""
    first = share.verified(peer, blobs)
    kept = [(b, raw) for b, raw, new in zip(blobs, raws, first, strict=True) if new]
    if kept:
        await received([b for b, _ in kept], [raw for _, raw in kept])


def _as_stored(blobs: list[wire.BatchBlob], raws: list[bytes]) -> list[wire.BatchBlob]:
    """The blobs as the store keeps a line: a stream segment's line at the store's zstd level
    (raw where that does not shrink it), all those of a run in one call on zstd's own threads,
    which lets go of the GIL once for the run, not once a line (the event loop and the staging
    step took it back between lines); any other blob as it came."""
    at = [i for i, blob in enumerate(blobs) if blob.codec == wire.CODEC_ZSTD_STREAM]
    if not at:
        return blobs
    lines: list[bytes | bytearray | memoryview] = [raws[i] for i in at]  # the type zstandard's stubs want
    packed = compressor(ZSTD_LEVEL).multi_compress_to_buffer(lines, threads=PREPARE_THREADS)
    stored = list(blobs)
    for k, i in enumerate(at):
        frame, raw, line_hash = packed[k], raws[i], blobs[i].hash
        stored[i] = (wire.BatchBlob(line_hash, CODEC_ZSTD, len(raw), frame.tobytes()) if len(frame) < len(raw)
                     else wire.BatchBlob(line_hash, CODEC_RAW, len(raw), raw))
    return stored


@dataclass
class Lane:
    """A sequence of batch requests to one holder, one at a time, whose stream answers may
    continue one zstd frame (wire.STREAM_LANE_HEADER): `stream` is its decoder once an
    answer was decoded in full (None: the next answer opens a new frame)."""

    number: int
    window_log: int = wire.STREAM_CONTINUED_WINDOW_LOG
    """The largest window its decoders take (wire.STREAM_WINDOW_HEADER)."""
    stream: wire.BatchStreamDecoder | None = None

    def headers(self) -> dict[str, str]:
        if self.number >= wire.MAX_STREAM_LANES:
            return {}
        return {wire.STREAM_LANE_HEADER: str(self.number),
                wire.STREAM_CONTINUE_HEADER: str(self.stream.answers if self.stream is not None else 0),
                wire.STREAM_WINDOW_HEADER: str(self.window_log)}

    def decoder(self, continues: int | None) -> wire.BatchStreamDecoder:
        """The decoder of a stream answer that says it continues after `continues` answers
        (None or 0: it opens a new frame); WireError if that is not where the lane is (the
        batch fails as for a corrupt frame: the holder is dropped, the others asked)."""
        if not continues:
            return wire.BatchStreamDecoder(self.window_log)
        if self.stream is None or self.stream.answers != continues:
            held = 0 if self.stream is None else self.stream.answers
            raise wire.WireError(f"a stream answer continues after {continues} answers in lane "
                                   f"{self.number}, which holds {held}")
        return self.stream


class Lanes:
    """Each holder's lanes: a request takes a free one (or a new one) and gives it back when
    its answer was decoded in full; a request that failed leaves its lane's frame behind."""

    def __init__(self, window_log: int = wire.STREAM_CONTINUED_WINDOW_LOG) -> None:
        self._free: dict[object, list[Lane]] = {}
        self._made: dict[object, int] = {}
        self._window_log = window_log

    @contextlib.contextmanager
    def take(self, holder: object) -> Iterator[Lane]:
        free = self._free.setdefault(holder, [])
        if free:
            lane = free.pop()
        else:
            lane = Lane(self._made.get(holder, 0), self._window_log)
            self._made[holder] = lane.number + 1
        try:
            yield lane
        except BaseException:
            lane.stream = None
            raise
        finally:
            free.append(lane)


async def _batch(peer: PeerLink, group: list[LineRef], limits: wire.Limits, verified: Received,
                 pace: FetchPace, lane: Lane) -> None:
    """One batch request.  Received blobs are decompressed and hashed on worker threads
    (both release the GIL) in runs of about DECODE_RUN bytes, while the next bytes are read;
    the runs of a zstd stream response are decoded in order, one after the other, and the
    stream goes on in the request's `lane`.  Lines the peer leaves out are not an
    error: it does not serve them (the Share asks elsewhere).  What the answer cost (wire
    bytes, the decoding threads' CPU) goes to `pace`."""
    body = wire.encode_batch_request(r.hash for r in group)
    link = pace.link(peer, False)
    offer = pace.offer(peer, limits)
    headers = {"Content-Type": "application/octet-stream", **offer}
    if wire.BATCH_FORMAT_HEADER in headers:
        headers.update(lane.headers())
    lengths = {r.hash: r.length for r in group}
    decoder = wire.BatchDecoder(list(lengths), limits, stream=wire.BATCH_FORMAT_HEADER in headers,
                                lengths=lengths, checkable=max(CHECKABLE_MIN, sum(lengths.values())))
    decoding: list[asyncio.Future[None]] = []
    run: list[wire.BatchBlob] = []
    run_bytes = wire_bytes = 0
    stream: wire.BatchStreamDecoder | None = None

    def verify_run() -> None:
        after = decoding[-1] if decoding and stream is not None else None
        decoding.append(asyncio.ensure_future(_verify(run, stream, after, verified, pace, lengths)))

    try:
        async with peer.request("POST", wire.PATH_BATCH, data=body, headers=headers) as resp:
            peer._check(resp, f"batch of {len(group)} lines")
            if resp.headers.get(wire.BATCH_FORMAT_HEADER) == wire.BATCH_FORMAT_STREAM:
                stream = lane.decoder(wire.parse_count_header(resp.headers.get(wire.STREAM_CONTINUE_HEADER)))
                link = pace.link(peer, True)
            while True:
                chunk = b""
                link.waiting()  # the rate this link delivers at while we wait on it (peer/pace.py)
                try:
                    chunk = await resp.read_some()
                finally:
                    link.moved(len(chunk))
                if not chunk:
                    break
                peer.bytes_received += len(chunk)
                wire_bytes += len(chunk)
                for blob in decoder.feed(chunk):
                    run.append(blob)
                    run_bytes += blob.raw_len
                if run_bytes >= DECODE_RUN:
                    verify_run()
                    run, run_bytes = [], 0
            decoder.finish()
        if run:
            verify_run()
        await asyncio.gather(*decoding)
        if stream is not None:
            stream.answers += 1
            lane.stream = stream
        pace.answered(wire_bytes)
    finally:  # a failure stops the rest; what was verified is kept
        pace.ended(offer)
        link.fold()
        for f in decoding:
            f.cancel()
        await asyncio.gather(*decoding, return_exceptions=True)


async def _verify(blobs: list[wire.BatchBlob], stream: wire.BatchStreamDecoder | None,
                  after: asyncio.Future[None] | None, verified: Received, pace: FetchPace,
                  lengths: dict[bytes, int]) -> None:
    """Decode and verify a run of blobs on a worker thread (wire.decode_blob), then hand them
    on; a stream's run waits for the run before it (`after`), whose blocks come first.  A
    genuine line of another length than the manifest's proves the manifest wrong: the lines
    before it are handed on, then ManifestLengthWrong."""
    if after is not None:
        await after
    stored, raws, cpu = await asyncio.to_thread(_decode_all, blobs, stream)
    pace.decoded(stream is not None, sum(len(r) for r in raws), cpu)
    wrong = next((i for i, raw in enumerate(raws) if len(raw) != lengths[stored[i].hash]), None)
    if wrong is None:
        await verified(stored, raws)
        return
    if wrong:
        await verified(stored[:wrong], raws[:wrong])
    line = stored[wrong].hash
    raise ManifestLengthWrong(f"line {line.hex()} is {len(raws[wrong])} bytes (its bytes hash to it), where "
                              f"the line manifest says {lengths[line]}")


def _decode_all(blobs: list[wire.BatchBlob], stream: wire.BatchStreamDecoder | None
                ) -> tuple[list[wire.BatchBlob], list[bytes], float]:
    """(the blobs as the store keeps them, their raw bytes, this thread's CPU seconds for it)."""
    cpu = time.thread_time()
    raws = [wire.decode_blob(b, stream) for b in blobs]
    return _as_stored(blobs, raws), raws, time.thread_time() - cpu
