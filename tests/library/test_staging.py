"""What a streaming fetch needs from the library and the store (issue 12): line manifests built
from the index without reading a line, and staging of lines a fetch verified on arrival."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import zstandard

from p2pnode.errors import VerificationFailed
from p2pnode.library.api import Library
from p2pnode.paths import NodePaths
from p2pnode.pi.lines import split_lines
from store import StoredBlob
from store.codec import blob_hash
from store.errors import CorruptRecord, UnknownBlob
from store.files import blobpack
from store.layout import CODEC_RAW, CODEC_ZSTD

SESSION = ("sessions/--tmp-pi-harness-work-alpha--/"
           "2026-11-21T19-26-31-001Z_01a1ff93-1258-73ae-a9a4-6ce4a586df6a.jsonl")


@pytest.fixture
def agent(corpus_dir: Path, tmp_path: Path) -> Path:
    agent = tmp_path / "agent"
    shutil.copytree(corpus_dir / "sessions", agent / "sessions")
    return agent


@pytest.mark.parametrize("folded", [True, False])
def test_line_manifest_reads_no_line(agent: Path, tmp_path: Path, folded: bool,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The serving side's manifest comes from the turn records and the blob index: with the
    stored bytes of the session's biggest line damaged in blobs.pack (so that any read of it
    fails, as session_bytes shows), the manifest is still whole and right.  Where the close
    left the session's blobs to the next open's scan (not `folded` into blobs.idx), that scan
    finds the damaged record, and the manifest says which blob is damaged."""
    if folded:
        monkeypatch.setattr(blobpack, "FOLD_BYTES", 0)
    paths = NodePaths(tmp_path / "node")
    data = (agent / SESSION).read_bytes()
    lines = split_lines(data)
    with Library.open(paths, agent) as lib:
        src = lib.share(str(agent / SESSION)).src
        biggest = max(lines, key=len)
        stored = lib.store.get_stored_blob(blob_hash(biggest)).stored
    pack = paths.store / "blobs.pack"
    raw = bytearray(pack.read_bytes())
    at = raw.find(stored)
    assert at >= 0 and len(stored) > 64
    raw[at + len(stored) // 2] ^= 0xFF
    pack.write_bytes(bytes(raw))
    with Library.open(paths, agent) as lib:
        if not folded:
            with pytest.raises(CorruptRecord, match=f"blob {blob_hash(biggest).hex()} is damaged"):
                lib.line_manifest(src)
            return
        refs = lib.line_manifest(src)
        assert [(r.hash, r.length) for r in refs] == [(blob_hash(x), len(x)) for x in lines]
        with pytest.raises(VerificationFailed):
            lib.session_bytes(src)
        assert lib.store.raw_lengths([blob_hash(lines[0])]) == [len(lines[0])]
        with pytest.raises(UnknownBlob):
            lib.store.raw_lengths([b"\x01" * 32])


def test_staged_lines_are_kept_as_sent_and_raw_ones_compressed(tmp_path: Path) -> None:
    """stage_lines (put_stored_blobs(verified=True)): a zstd blob is kept byte for byte, a raw
    one is compressed as put_blob would; both are there after the store is reopened, and
    read back as the lines they are."""
    paths = NodePaths(tmp_path / "node")
    text = b'{"type":"custom","data":"' + b"abc" * 20_000 + b'"}\n'
    noise = os.urandom(50_000)
    zstd = zstandard.ZstdCompressor(level=1).compress(text)
    with Library.open(paths) as lib:
        lib.stage_lines([StoredBlob(blob_hash(text), CODEC_ZSTD, len(text), zstd),
                         StoredBlob(blob_hash(noise), CODEC_RAW, len(noise), noise),
                         StoredBlob(blob_hash(text + b"x"), CODEC_RAW, len(text) + 1, text + b"x")])
    with Library.open(paths) as lib:
        assert lib.store.get_stored_blob(blob_hash(text)).stored == zstd
        assert lib.store.get_stored_blob(blob_hash(noise)).codec == CODEC_RAW  # incompressible
        assert lib.store.get_stored_blob(blob_hash(text + b"x")).codec == CODEC_ZSTD
        assert lib.line(blob_hash(text)) == text and lib.line(blob_hash(noise)) == noise
