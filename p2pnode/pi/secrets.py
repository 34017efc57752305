"""The secret scan `share` runs before anything leaves (sans-IO: bytes in, findings out).

A best-effort pass over a session's bytes for credentials that tools commonly print
(docs/SECURITY.md says what it cannot catch).  Every pattern starts with one of a few
literals, so one Aho-Corasick pass (ahocorasick-rs, several GB/s, the GIL released) finds
every place a finding can start, and only there is the pattern's regex tried: the same
findings as a `re.finditer` pass per pattern (tests/pi/test_secrets_differential.py keeps that
reference), at a fraction of the cost.  Only the lines that matched are parsed as JSON, to say
which entry holds a finding and where in it.  A candidate glued to a longer run of key-like
characters is passed over: long base64 runs (images) and hex hashes never start a finding.
`scripts/bench_share.py` measures the whole scan.
"""
from __future__ import annotations

import bisect
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from ahocorasick_rs import BytesAhoCorasick, MatchKind

from p2pnode.errors import InvalidInput
from p2pnode.pi.lines import count_newlines


@dataclass(frozen=True, slots=True)
class Pattern:
    kind: str
    literals: tuple[bytes, ...]
    """Every match of `regex` starts with one of these (the prefilter looks for them only)."""
    regex: re.Pattern[bytes]
    shown: int
    """How many leading characters of the value a masked finding shows (the public prefix)."""
    group: int = 0
    """The group holding the secret itself (0: the whole match)."""
    variants: tuple[tuple[bytes, str, int], ...] = ()
    """(value prefix, kind, shown) for one pattern that finds several kinds."""

    def kind_of(self, value: bytes) -> tuple[str, int]:
        return next(((k, n) for p, k, n in self.variants if value.startswith(p)), (self.kind, self.shown))


def _p(kind: str, literals: tuple[bytes, ...], regex: bytes, shown: int, group: int = 0,
       variants: tuple[tuple[bytes, str, int], ...] = ()) -> Pattern:
    return Pattern(kind, literals, re.compile(regex), shown, group, variants)


_URL_PASSWORD = rb"[^\s/@\"'\\:<>{}$*]"
PATTERNS: tuple[Pattern, ...] = (
    _p("openai-key", (b"sk-", b"sk_live_"),
       rb"sk(?:-ant-[A-Za-z0-9_-]{20,300}|-(?:proj|svcacct|admin)-[A-Za-z0-9_-]{20,300}"
       rb"|-[A-Za-z0-9]{32,200}|_live_[A-Za-z0-9]{20,200})", 3,
       variants=((b"sk-ant-", "anthropic-key", 7), (b"sk-proj-", "openai-key", 8),
                 (b"sk_live_", "stripe-key", 8))),
    _p("aws-access-key-id", (b"AKIA", b"ASIA", b"AIza"), rb"A(?:[KS]IA[0-9A-Z]{16}|Iza[0-9A-Za-z_-]{35})", 4,
       variants=((b"AIza", "google-api-key", 4),)),
    _p("github-token", (b"ghp_", b"gho_", b"github_pat_", b"glpat-"),
       rb"g(?:h[po]_[A-Za-z0-9]{36}|ithub_pat_[A-Za-z0-9_]{40,255}|lpat-[A-Za-z0-9_-]{20,64})", 4,
       variants=((b"github_pat_", "github-token", 11), (b"glpat-", "gitlab-token", 6))),
    _p("slack-token", (b"xoxa-", b"xoxb-", b"xoxp-", b"xoxr-"), rb"xox[abpr]-[A-Za-z0-9-]{10,200}", 5),
    _p("aws-secret-key", (b"ecret",),
       rb"ecret_?[Aa]ccess_?[Kk]ey[\\\"' ]*[=:][\\\"' ]*([A-Za-z0-9/+]{40})", 0, 1),
    _p("aws-secret-key", (b"ECRET_ACCESS_KEY",),
       rb"ECRET_ACCESS_KEY[\\\"' ]*[=:][\\\"' ]*([A-Za-z0-9/+]{40})", 0, 1),
    _p("npm-token", (b"npm_",), rb"npm_[A-Za-z0-9]{36}", 4),
    _p("huggingface-token", (b"hf_",), rb"hf_[A-Za-z0-9]{34,40}", 3),
    _p("private-key", (b"-----BEGIN ",),
       rb"-----BEGIN [A-Z0-9 ]{0,40}PRIVATE KEY-----(?:[^\"\\\n]|\\.){0,65536}?"
       rb"(?:-----END [A-Z0-9 ]{0,40}PRIVATE KEY-----|(?=[\"\n])|$)", 11),
    _p("password-in-url", (b"://",),
       rb"://[A-Za-z0-9._%+-]{1,128}:(" + _URL_PASSWORD + rb"{3,256})@[A-Za-z0-9.-]{1,253}", 0, 1),
    _p("jwt", (b"eyJ",), rb"eyJ[A-Za-z0-9_-]{8,2000}\.eyJ[A-Za-z0-9_-]{8,8000}\.[A-Za-z0-9_-]{16,2000}", 3),
)

_LITERALS: tuple[tuple[bytes, int], ...] = tuple(
    (lit, i) for i, p in enumerate(PATTERNS) for lit in p.literals)
"""(literal, index of its pattern), in the prefilter's order."""
_PREFILTER = BytesAhoCorasick([lit for lit, _ in _LITERALS], matchkind=MatchKind.LeftmostFirst)
"""Leftmost-first and non-overlapping: 6x faster than reporting every overlapping match, but
blind to a literal that starts inside (or at) one it reported, e.g. sk-----BEGIN, xoxb-----BEGIN,
AKIASIA: `_HIDDEN` lists those, and each is checked where it could be."""


def _hidden(lit: bytes, own: int) -> tuple[tuple[int, bytes, int], ...]:
    """(offset, literal, pattern) of every other literal that could start at that offset of a
    reported `lit` (their bytes agree where they overlap), in offset order."""
    return tuple((k, other, i) for k in range(len(lit)) for j, (other, i) in enumerate(_LITERALS)
                 if (k, j) != (0, own) and (other.startswith(lit[k:]) or lit[k:].startswith(other)))


_HIDDEN = tuple(_hidden(lit, j) for j, (lit, _) in enumerate(_LITERALS))


_KEYLIKE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/_-")
"""Characters a finding must not be glued to: base64 (both alphabets) and hex runs."""
_PLACEHOLDERS = re.compile(rb"(?i)^(?:password|passwd|pass|pw|secret|changeme|x+|\.+|_+|-+)$")


@dataclass(frozen=True, slots=True)
class Finding:
    kind: str
    masked: str
    """The first few characters, '…', the last 4 (e.g. sk-ant-…4f2a): never the secret."""
    line: int
    """1-based line number in the session file."""
    entry: str
    """The Pi entry type of that line: its JSON `type`, and for messages `message/<role>`
    (with the tool's name for a tool result), or `not JSON`."""
    where: str
    """The JSON path of the string holding it, e.g. message.content[2].text ('' if unknown)."""
    start: int
    end: int
    """Byte offsets of the secret in the scanned bytes (what --redact replaces)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def mask(value: bytes, shown: int) -> str:
    """The finding as printed: its public prefix (at least 2 characters), '…', the last 4 when
    the value is long enough that they do not give it away."""
    text = value.decode("utf-8", "replace")
    head = text[:max(2, min(shown, len(text) // 3))]
    tail = text[-4:] if len(text) >= 16 else ""
    return f"{head}…{tail}"


def _glued(data: bytes, start: int, end: int, limit: int, pattern: Pattern) -> bool:
    """Whether a candidate is part of a longer key-like run (base64, hashes): not a finding."""
    if pattern.group:  # labelled values and URL passwords are anchored by their label
        return False
    before = data[start - 1] if start > 0 else 0
    after = data[end] if end < limit else 0
    if before in _KEYLIKE and not (start >= 2 and data[start - 2] == ord("\\")):  # \n before it: an escape
        return True
    return pattern.kind != "private-key" and after in _KEYLIKE


def _candidates(data: bytes, lo: int, limit: int) -> list[list[int]]:
    """Per pattern, every position in data[lo:limit] where one of its literals starts, in order."""
    found: list[list[int]] = [[] for _ in PATTERNS]
    with memoryview(data) as view:
        hits = _PREFILTER.find_matches_as_indexes(view[lo:limit])  # the GIL released meanwhile
    for j, at, _ in hits:
        start = lo + at
        found[_LITERALS[j][1]].append(start)
        for k, other, i in _HIDDEN[j]:
            if data.startswith(other, start + k, limit):
                found[i].append(start + k)
    return [sorted(set(positions)) for positions in found]


def _matches(data: bytes, lo: int, limit: int) -> list[tuple[Pattern, int, int]]:
    """(pattern, start, end) of every finding in data[lo:limit], in file order: each pattern's
    matches as `finditer` finds them (each starts after the previous one ends), the patterns
    taken in order, a match overlapping an earlier-taken finding dropped (one secret, one
    finding: a JWT in a URL...)."""
    starts: list[int] = []
    taken: list[tuple[int, int, Pattern]] = []
    for pattern, positions in zip(PATTERNS, _candidates(data, lo, limit), strict=True):
        after = 0
        for pos in positions:
            if pos < after or (m := pattern.regex.match(data, pos, limit)) is None:
                continue
            after = m.end()
            start, end = m.span(pattern.group)
            if _glued(data, *m.span(), limit, pattern):
                continue
            if pattern.kind == "password-in-url" and _PLACEHOLDERS.match(data[start:end]):
                continue
            at = bisect.bisect_left(starts, end)  # the taken spans are disjoint: one neighbour to check
            if at and taken[at - 1][1] > start:
                continue
            starts.insert(at, start)
            taken.insert(at, (start, end, pattern))
    return [(pattern, start, end) for start, end, pattern in taken]


def scan(data: bytes) -> list[Finding]:
    """Every finding in a session's bytes, in file order."""
    return _scan(data, 0, len(data))


def _scan(data: bytes, lo: int, limit: int) -> list[Finding]:
    """`scan` of data[lo:limit], whole lines (lo is 0 or just after a newline), in place: the
    offsets are data's, the lines are counted from lo."""
    findings: list[Finding] = []
    line_no, counted_to = 1, lo
    for pattern, start, end in _matches(data, lo, limit):
        line_no += count_newlines(data, counted_to, start)
        counted_to = start
        line_start = data.rfind(b"\n", 0, start) + 1
        line_end = data.find(b"\n", start, limit)
        line = bytes(data[line_start:line_end if line_end >= 0 else limit])
        value = bytes(data[start:end])
        entry, where = _locate(line, value)
        kind, shown = pattern.kind_of(value)
        findings.append(Finding(kind, mask(value, shown), line_no, entry, where, start, end))
    return findings


class Scanner:
    """The scan of bytes that arrive in pieces (a file as it is read): whole lines are scanned
    as they complete, so a key is never cut in two; findings count lines and offsets from the
    first byte fed.  The same findings as `scan` of all the bytes at once.  A piece fed as
    `bytes` (immutable) is scanned where it is, and a line begun in one piece is kept as
    references to the pieces until its newline comes, then joined once: the import hands each
    chunk it read to its splitter too, which keeps the same pieces, so a 200 MB image line is
    not held a second time while it is read.  Any other buffer (a memoryview the caller may
    reuse) is copied first."""

    def __init__(self) -> None:
        self.findings: list[Finding] = []
        self._pending: list[bytes | memoryview] = []
        """The start of a line still being fed (it did not end in the pieces so far)."""
        self._offset = 0
        """Stream offset of the first byte not scanned yet (the pending line's, if any)."""
        self._lines = 0

    def feed(self, data: bytes | memoryview) -> None:
        if not isinstance(data, bytes):
            data = bytes(data)
        lo = 0
        if self._pending:  # a line begun earlier: scanned once its newline comes
            lo = data.find(b"\n") + 1  # in the new bytes only: a long line costs O(its size)
            if not lo:
                self._pending.append(data)
                return
            self._pending.append(memoryview(data)[:lo])
            self._scan_pending()
        cut = data.rfind(b"\n", lo) + 1
        if cut > lo:
            self._scan(data, lo, cut)
        if max(lo, cut) < len(data):
            self._pending.append(memoryview(data)[max(lo, cut):])

    def finish(self) -> list[Finding]:
        """The findings of everything fed (a last line without a newline included)."""
        self._scan_pending()
        return self.findings

    def _scan_pending(self) -> None:
        line = b"".join(self._pending)
        self._pending.clear()  # before the scan: the pieces may go while it runs
        self._scan(line, 0, len(line))

    def _scan(self, data: bytes, lo: int, limit: int) -> None:
        """Scan data[lo:limit], the next whole lines of the stream."""
        at = self._offset - lo
        self.findings += [replace(f, line=f.line + self._lines, start=f.start + at, end=f.end + at)
                          for f in _scan(data, lo, limit)]
        self._offset += limit - lo
        self._lines += count_newlines(data, lo, limit)


def _locate(line: bytes, secret: bytes) -> tuple[str, str]:
    """(entry type, JSON path) of a secret in one line, parsing only that line."""
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):
        return "not JSON", ""
    if not isinstance(obj, dict):
        return "not JSON", ""
    entry = str(obj.get("type", "?"))
    message = obj.get("message")
    if entry == "message" and isinstance(message, dict):
        entry += f"/{message.get('role', '?')}"
        if isinstance(message.get("toolName"), str):
            entry += f" ({message['toolName']})"
    try:
        needle = json.loads(b'"' + secret + b'"')
    except (ValueError, RecursionError):
        needle = secret.decode("utf-8", "replace")
    return entry, _path_of(obj, needle, "") or ""


def _path_of(node: Any, needle: str, path: str) -> str | None:
    """The first path whose string value (or key) contains the needle; JSON inside a string
    (a tool call's arguments) is the string's path."""
    if isinstance(node, str):
        return path if needle in node else None
    if isinstance(node, dict):
        for key, value in node.items():
            child = f"{path}.{key}" if path else str(key)
            if needle in str(key):
                return child
            if (found := _path_of(value, needle, child)) is not None:
                return found
    elif isinstance(node, list):
        for i, value in enumerate(node):
            if (found := _path_of(value, needle, f"{path}[{i}]")) is not None:
                return found
    return None


def marker(kind: str) -> bytes:
    """What --redact puts in place of a secret (JSON-safe: no quote, no backslash)."""
    return f"[REDACTED:{kind}]".encode()


def redaction(findings: Sequence[Finding], start: int, end: int) -> Iterator[tuple[int, int] | bytes]:
    """What --redact writes for the scanned bytes [start, end): the ranges (lo, hi) of them
    kept as they are and, between those, the marker of each finding that starts in the range,
    in order.  No finding holds a newline: bytes cut just after one cut none in two."""
    at = start
    for finding in sorted(findings, key=lambda f: f.start):
        if start <= finding.start < end:
            yield at, finding.start
            yield marker(finding.kind)
            at = finding.end
    yield at, end


def redact(data: bytes, findings: Sequence[Finding]) -> bytes:
    """The bytes with each finding replaced by its marker, everything else byte-identical."""
    return b"".join(piece if isinstance(piece, bytes) else data[piece[0]:piece[1]]
                    for piece in redaction(findings, 0, len(data)))


class SecretsFound(InvalidInput):
    """`share` refused: the scan found secrets in the session or the lineage it would offer."""

    def __init__(self, found: list[tuple[str, Finding]], redacted: bool = False,
                 copy: str | None = None) -> None:
        """`redacted`: under `share --redact`; `copy`: the redacted copy it wrote (kept beside
        the session; None: the session itself had nothing to redact)."""
        self.found = found
        lines = [f"share refused: the secret scan found {len(found)} possible secret(s); nothing was offered"]
        lines += [f"  {path}:{f.line}: {f.kind} {f.masked} in {f.entry}"
                  + (f" at {f.where}" if f.where else "") for path, f in found]
        if redacted:  # the session itself was redacted: what is left is in its lineage
            what = f"the redacted copy {copy}" if copy is not None else "the session"
            lines.append(f"they are in the session's lineage, which --redact leaves as it is: share {what} "
                         "with --no-lineage, or redact the ancestor first, or --allow-secrets")
        else:
            lines.append("rotate any real key shown above; then share with --redact (a redacted copy is "
                         "shared instead) or --allow-secrets (shared as it is, marked in `ls`)")
        super().__init__("\n".join(lines))
