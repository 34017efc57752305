"""The secret scan (p2pnode/pi/secrets.py) on real Pi session files from tests/data: keys of
each kind planted where tools print them, and the clean corpora (both pi versions)."""
from __future__ import annotations

import base64
import json
import random
from pathlib import Path

import pytest
from secretkeys import PLANTED, plant

from p2pnode.pi import secrets

CORPORA = sorted((Path(__file__).resolve().parents[1] / "data").glob("pi-corpus-*/sessions/*/*.jsonl"))
REAL = next(p for p in CORPORA if p.name.endswith("a271-70bf-bc80-66a3334c5c30.jsonl"))  # pi 1.5.2, alpha


def test_both_corpora_are_clean() -> None:
    """No false positive on any committed session (images, hashes, code, system prompts)."""
    assert len(CORPORA) >= 30
    assert {p.parts[-4] for p in CORPORA} == {"pi-corpus-0.73.1", "pi-corpus-1.5.2"}
    for path in CORPORA:
        assert secrets.scan(path.read_bytes()) == [], path


@pytest.mark.parametrize(("kind", "value"), PLANTED, ids=[f"{k}-{i}" for i, (k, _) in enumerate(PLANTED)])
def test_planted_in_a_tool_result_is_found_and_masked(kind: str, value: str) -> None:
    data, line_no, path = plant(REAL.read_bytes(), "toolResult", value)
    findings = secrets.scan(data)
    assert [(f.kind, f.line, f.entry, f.where) for f in findings] == [
        (kind, line_no, "message/toolResult (bash)", path)]
    f = findings[0]
    assert value not in f.masked and "…" in f.masked
    head, _, tail = f.masked.partition("…")
    secret = json.loads(b'"' + data[f.start:f.end] + b'"')  # the value (a URL's password...), unescaped
    assert secret in value and secret.startswith(head) and len(head) <= max(2, len(secret) // 3)
    if len(secret) >= 16:
        assert tail == secret[-4:]


@pytest.mark.parametrize("where", ["user", "bash"])
@pytest.mark.parametrize(("kind", "value"), PLANTED[:4] + PLANTED[-3:])
def test_planted_in_a_user_message_or_a_bash_command(where: str, kind: str, value: str) -> None:
    data, line_no, path = plant(REAL.read_bytes(), where, value)
    findings = secrets.scan(data)
    entry = "message/user" if where == "user" else "message/assistant"
    assert [(f.kind, f.line, f.entry, f.where) for f in findings] == [(kind, line_no, entry, path)]


def test_every_kind_is_planted() -> None:
    kinds = {p.kind for p in secrets.PATTERNS} | {v[1] for p in secrets.PATTERNS for v in p.variants}
    assert {k for k, _ in PLANTED} == kinds


def test_base64_images_and_hashes_are_not_secrets() -> None:
    """Long base64 runs hold every 4-letter prefix somewhere; hex hashes are everywhere in
    this project's own sessions: neither starts a finding."""
    rng = random.Random(7)
    noise = base64.b64encode(rng.randbytes(3_000_000)).decode()
    planted = noise[:1000] + "AIza" + "A" * 35 + "AKIA" + "B" * 16 + "ghp_" + "c" * 36 + noise[1000:2000]
    hashes = " ".join(rng.randbytes(32).hex() for _ in range(2000))
    lines = [json.dumps({"type": "message", "message": {"role": "toolResult", "content": [
        {"type": "image", "data": text, "mimeType": "image/png"}]}}) for text in (noise, planted)]
    lines.append(json.dumps({"type": "message", "message": {"role": "user", "content": hashes}}))
    data = REAL.read_bytes() + "\n".join(lines).encode() + b"\n"
    assert secrets.scan(data) == []


def test_redact_changes_only_the_secrets() -> None:
    data = REAL.read_bytes()
    values = [v for _, v in PLANTED]
    for i, value in enumerate(values):
        data = plant(data, ("toolResult", "user", "bash")[i % 3], value)[0]
    findings = secrets.scan(data)
    assert sorted(f.kind for f in findings) == sorted(k for k, _ in PLANTED)
    redacted = secrets.redact(data, findings)
    assert secrets.scan(redacted) == []
    for value in values:
        assert value.encode() not in redacted
    before, after = data.split(b"\n"), redacted.split(b"\n")
    assert len(before) == len(after)
    changed = {f.line - 1 for f in findings}
    for i, (old, new) in enumerate(zip(before, after, strict=True)):
        if i in changed:
            assert new != old and b"[REDACTED:" in new
            json.loads(new)  # still valid JSON
        else:
            assert new == old


def planted_session() -> bytes:
    data = REAL.read_bytes()
    for i, (_, value) in enumerate(PLANTED):
        data = plant(data, ("toolResult", "user", "bash")[i % 3], value)[0]
    return data


@pytest.mark.parametrize("size", [1, 7, 4096, 1 << 20])
@pytest.mark.parametrize("piece", [memoryview, bytes], ids=["copied", "in-place"])
def test_scanner_in_pieces_finds_what_one_scan_finds(size: int, piece: type) -> None:
    """Pieces as `bytes` (the import's chunks) are scanned where they are, other buffers copied:
    the same findings either way."""
    data = planted_session()
    whole = secrets.scan(data)
    assert sorted(f.kind for f in whole) == sorted(k for k, _ in PLANTED)
    scanner = secrets.Scanner()
    view = memoryview(data)
    for i in range(0, len(data), size):
        scanner.feed(piece(view[i:i + size]))
    assert scanner.finish() == whole


def test_scanner_counts_from_the_first_byte_fed_and_scans_a_last_line_without_newline() -> None:
    data = planted_session()
    cut = data.index(b"\n", len(data) // 2) + 1
    scanner = secrets.Scanner()
    scanner.feed(data[cut:].rstrip(b"\n"))
    tail = secrets.scan(data[cut:].rstrip(b"\n"))
    assert tail and scanner.finish() == tail


def test_scanner_copies_what_it_keeps() -> None:
    """The import reuses its read buffer: a piece fed and then overwritten is scanned as fed."""
    value = PLANTED[2][1].encode()
    buf = bytearray(b"one line\nk " + value)  # the key's line is not complete yet
    scanner = secrets.Scanner()
    scanner.feed(memoryview(buf))
    buf[:] = b"x" * len(buf)
    scanner.feed(memoryview(b" tail\n"))
    assert [(f.kind, f.line, f.start) for f in scanner.finish()] == [("openai-key", 2, 11)]
