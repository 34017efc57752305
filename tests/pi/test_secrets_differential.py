"""The one-pass secret scan (an Aho-Corasick prefilter, then each pattern's regex anchored at
its candidates) against the scan it replaced, kept here as the reference: one `re.finditer`
pass per pattern, the patterns in order, a span overlapping an earlier finding dropped.  Both
must give exactly the same findings on the Pi corpora of tests/data, on every key the other
secret tests plant, and on many generated and hostile inputs: every literal mixed, glued and
unglued, overlapping each other (a literal starting inside another's: the leftmost-first
prefilter does not report it), fed to `Scanner` in pieces cut anywhere."""
from __future__ import annotations

import base64
import json
import random
import string
from pathlib import Path

import pytest
from secretkeys import PLANTED, plant

from p2pnode.pi import secrets

CORPORA = sorted((Path(__file__).resolve().parents[1] / "data").glob("pi-corpus-*/sessions/*/*.jsonl"))
REAL = next(p for p in CORPORA if p.name.endswith("a271-70bf-bc80-66a3334c5c30.jsonl"))  # pi 1.5.2, alpha


def reference_glued(data: bytes, start: int, end: int, pattern: secrets.Pattern) -> bool:
    if pattern.group:
        return False
    before = data[start - 1] if start > 0 else 0
    after = data[end] if end < len(data) else 0
    if before in secrets._KEYLIKE and not (start >= 2 and data[start - 2] == ord("\\")):
        return True
    return pattern.kind != "private-key" and after in secrets._KEYLIKE


def reference_scan(data: bytes) -> list[secrets.Finding]:
    """The scan as it was before the prefilter: 11 `finditer` passes (pi/secrets.py at 080452e)."""
    taken: list[tuple[int, int]] = []
    found: list[tuple[secrets.Pattern, int, int]] = []
    for pattern in secrets.PATTERNS:
        for m in pattern.regex.finditer(data):
            start, end = m.span(pattern.group)
            if reference_glued(data, *m.span(), pattern):
                continue
            if pattern.kind == "password-in-url" and secrets._PLACEHOLDERS.match(data[start:end]):
                continue
            if any(s < end and start < e for s, e in taken):
                continue
            taken.append((start, end))
            found.append((pattern, start, end))
    findings = []
    line_no, counted_to = 1, 0
    for pattern, start, end in sorted(found, key=lambda t: t[1]):
        line_no += data.count(b"\n", counted_to, start)
        counted_to = start
        line_start = data.rfind(b"\n", 0, start) + 1
        line_end = data.find(b"\n", start)
        line = data[line_start:line_end if line_end >= 0 else len(data)]
        entry, where = secrets._locate(line, data[start:end])
        kind, shown = pattern.kind_of(data[start:end])
        findings.append(secrets.Finding(kind, secrets.mask(data[start:end], shown), line_no, entry, where,
                                        start, end))
    return findings


def in_pieces(data: bytes, rng: random.Random, cuts: list[int] | None = None) -> list[secrets.Finding]:
    """`Scanner` fed `data` cut at `cuts` (default: random places, pieces of 1 byte up), each
    piece as bytes (scanned in place) or a memoryview (copied), at random."""
    if cuts is None:
        cuts = sorted(rng.sample(range(1, len(data)), min(max(0, len(data) - 1), rng.randint(0, 12))))
    scanner = secrets.Scanner()
    view = memoryview(data)
    for lo, hi in zip([0, *cuts], [*cuts, len(data)], strict=True):
        scanner.feed(data[lo:hi] if rng.random() < 0.5 else view[lo:hi])
    return scanner.finish()


def assert_same(data: bytes, rng: random.Random | None = None) -> list[secrets.Finding]:
    expected = reference_scan(data)
    assert secrets.scan(data) == expected, data[:2000]
    assert in_pieces(data, rng or random.Random(len(data))) == expected, data[:2000]
    return expected


LITERALS = [b"sk-", b"sk_live_", b"AKIA", b"ASIA", b"AIza", b"ghp_", b"gho_", b"github_pat_", b"glpat-",
            b"xoxa-", b"xoxb-", b"xoxp-", b"xoxr-", b"ecret", b"ECRET_ACCESS_KEY", b"npm_", b"hf_",
            b"-----BEGIN ", b"://", b"eyJ"]
"""Where the patterns can start, written out here (not taken from secrets.py)."""
KEYLIKE = string.ascii_letters + string.digits + "+/_-"
ALPHABETS = [string.ascii_letters + string.digits, string.ascii_uppercase + string.digits,
             string.ascii_letters + string.digits + "_-", KEYLIKE, "abcdef0123456789", "A", "x"]
TOKENS = [
    b'"', b"\n", b"\\n", b"\\", b'\\"', b" ", b":", b"@", b"=", b".", b"/", b"-", b"_", b"{", b"}", b"$",
    b"'", b"\t", b"*", b"<", b">", b"%", b"+", b"://", b"-----", b"PRIVATE KEY-----", b" RSA ", b"OPENSSH ",
    b"-----END RSA PRIVATE KEY-----", b"-----END OPENSSH PRIVATE KEY-----", b"aws_secret_access_key = ",
    b"secretAccessKey: ", b"AWS_SECRET_ACCESS_KEY=", b'SECRET_ACCESS_KEY\\"=\\"', b"s", b"S",
    b"password", b"changeme", b"xxx", b"...", b"___", b"user", b"postgres://app:", b"@db.internal:5432",
    b"eyJhbGciOiJIUzI1NiJ9.", b"ant-api03-", b"proj-", b"admin-", b"svcacct-", b"live_", b"pat_",
    b"AKIASIA", b"ASIAKIA", b"AIzaAIza", b"sk-sk-", b"xoxb-xoxp-", b"eyJeyJ", b":///", b"hf_hf_",
    "é€".encode(), b"\x00", b"\xff",
]


def hostile(rng: random.Random, parts: int) -> bytes:
    """Literals, their prefixes, planted keys, key-like runs and the bytes around them, mixed."""
    out = []
    for _ in range(parts):
        roll = rng.random()
        if roll < 0.3:
            lit = rng.choice(LITERALS)
            cut = rng.randrange(1, len(lit) + 1)
            changed = lit[:cut - 1] + bytes([rng.randrange(32, 127)])
            out.append(rng.choice([lit, lit, lit, lit[:cut], changed]))
        elif roll < 0.55:
            out.append("".join(rng.choice(rng.choice(ALPHABETS)) for _ in range(rng.choice(
                [1, 3, 8, 16, 20, 32, 35, 36, 40, 41, rng.randrange(1, 120)]))).encode())
        elif roll < 0.65:
            value = rng.choice(PLANTED)[1].encode()
            out.append(value if rng.random() < 0.7 else value[:rng.randrange(1, len(value))])
        else:
            out.append(rng.choice(TOKENS))
    return b"".join(out)


@pytest.mark.parametrize("path", CORPORA, ids=lambda p: p.name)
def test_every_corpus_file(path: Path) -> None:
    data = path.read_bytes()
    assert assert_same(data) == []


@pytest.mark.parametrize(("kind", "value"), PLANTED, ids=[f"{k}-{i}" for i, (k, _) in enumerate(PLANTED)])
@pytest.mark.parametrize("where", ["toolResult", "user", "bash"])
def test_every_planted_key_in_every_place(where: str, kind: str, value: str) -> None:
    data, line_no, _ = plant(REAL.read_bytes(), where, value)
    found = assert_same(data)
    assert [(f.kind, f.line) for f in found] == [(kind, line_no)]


def test_every_key_planted_at_once_and_redacted() -> None:
    data = REAL.read_bytes()
    for i, (_, value) in enumerate(PLANTED):
        data = plant(data, ("toolResult", "user", "bash")[i % 3], value)[0]
    found = assert_same(data)
    assert sorted(f.kind for f in found) == sorted(k for k, _ in PLANTED)
    assert assert_same(secrets.redact(data, found)) == []


def test_base64_and_hashes() -> None:
    rng = random.Random(7)
    noise = base64.b64encode(rng.randbytes(1_000_000))
    urlsafe = base64.urlsafe_b64encode(rng.randbytes(1_000_000))
    hashes = b" ".join(rng.randbytes(32).hex().encode() for _ in range(2000))
    data = b"\n".join([noise, urlsafe, hashes, noise[:999] + b"AIza" + b"A" * 35 + urlsafe[:999]])
    assert assert_same(data, rng) == []


# Literals that start inside (or at) another's match: the prefilter reports the first only.
OVERLAPS = [
    b'"sk-----BEGIN RSA PRIVATE KEY-----\\nabc\\n-----BEGIN RSA PRIVATE KEY-----\\nxyz\\n'
    b'-----END RSA PRIVATE KEY-----"',
    b'"xoxb-----BEGIN EC PRIVATE KEY-----\\n-----BEGIN EC PRIVATE KEY-----\\nq\\n'
    b'-----END EC PRIVATE KEY-----"',
    b'"glpat-----BEGIN PRIVATE KEY-----\\n-----BEGIN PRIVATE KEY-----\\n"',
    b" AKIASIA" + b"0123456789ABCDEF" + b" AKIA" + b"0123456789ABCDEF ",
    b" AKIASIAAKIA0123456789ABCDEFGHIJ AKIA0123456789ABCDEF ",
    b" ASIAKIAZZZZZZZZZZZZZZZZ\\nAKIA0123456789ABCDEF\n ASIAAIza" + b"a" * 35 + b" ",
]


@pytest.mark.parametrize("data", OVERLAPS)
def test_a_literal_inside_another(data: bytes) -> None:
    assert_same(data)
    assert_same(data * 3)


def test_a_hidden_literal_changes_what_finditer_finds() -> None:
    """The first case: the private key glued to `sk` is no finding, but its match covers the
    second BEGIN, which a search starting after `sk-` alone would report."""
    assert assert_same(OVERLAPS[0]) == []
    assert [f.kind for f in assert_same(OVERLAPS[0].replace(b"sk-----", b"sk- ---", 1))] == ["private-key"]


@pytest.mark.parametrize("seed", range(8))
def test_every_pattern_starts_with_one_of_its_literals(seed: int) -> None:
    """What the prefilter relies on: wherever a pattern's regex matches (tried at every
    position), the bytes there start with one of the literals it declares."""
    rng = random.Random(500 + seed)
    data = b"".join(hostile(rng, 40) for _ in range(30))
    for pattern in secrets.PATTERNS:
        for pos in range(len(data)):
            if pattern.regex.match(data, pos):
                assert data.startswith(pattern.literals, pos), (pattern.kind, data[pos:pos + 40])


@pytest.mark.parametrize("seed", range(40))
def test_generated_hostile_inputs(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(60):
        assert_same(hostile(rng, rng.randrange(1, 80)), rng)


@pytest.mark.parametrize("seed", range(6))
def test_hostile_bytes_inside_real_sessions_fed_in_pieces(seed: int) -> None:
    """Real JSON lines with hostile runs spliced in anywhere, and Scanner pieces cut at every
    literal and line edge as well as at random places."""
    rng = random.Random(1000 + seed)
    data = bytearray(rng.choice(CORPORA).read_bytes())
    for _ in range(40):
        at = rng.randrange(len(data) + 1)
        data[at:at] = hostile(rng, rng.randrange(1, 10))
    data_b = bytes(data)
    expected = assert_same(data_b, rng)
    edges = sorted({i + k for lit in LITERALS for i in _occurrences(data_b, lit) for k in range(len(lit) + 1)}
                   | {i + 1 for i in _occurrences(data_b, b"\n")})
    cuts = [c for c in edges if 0 < c < len(data_b)]
    assert in_pieces(data_b, rng, cuts) == expected
    assert in_pieces(data_b, rng, cuts[::3]) == expected


def _occurrences(data: bytes, needle: bytes) -> list[int]:
    found, at = [], data.find(needle)
    while at >= 0:
        found.append(at)
        at = data.find(needle, at + 1)
    return found


def test_json_lines_of_keys_in_every_field() -> None:
    """Findings located in JSON (entry type and path) the same way, many per line."""
    rng = random.Random(99)
    lines = []
    for n in range(300):
        content = [{"type": "text", "text": hostile(rng, 30).decode("utf-8", "replace")} for _ in range(3)]
        obj = {"type": "message", "id": str(n), "message": {"role": rng.choice(["user", "toolResult"]),
                                                           "toolName": "bash", "content": content}}
        lines.append(json.dumps(obj, ensure_ascii=rng.random() < 0.5).encode())
    data = b"\n".join(lines) + b"\n"
    assert len(assert_same(data, rng)) > 50


@pytest.mark.parametrize(("lines", "width"), [(5000, 1), (200_000, 40), (50, 100_000)])
def test_line_numbers_over_short_and_long_lines(lines: int, width: int) -> None:
    """Line counting hops over long lines and counts short ones: the same numbers either way."""
    rng = random.Random(lines)
    rows = [b"x" * width for _ in range(lines)]
    for i in rng.sample(range(lines), 20):
        rows[i] = b"k " + PLANTED[2][1].encode() + b" " + rows[i]
    data = b"\n".join(rows)
    assert len(assert_same(data, rng)) == 20
