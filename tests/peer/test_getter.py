"""The getter's assembly without a network (sans-IO): what `ready` hands out in joined parts,
the session hash over them, a line nested deeper than Python's parser kept verbatim, and the
placed file's hash read in pieces (hashing.prefix_hasher)."""
from __future__ import annotations

import json
import random
from pathlib import Path

import blake3
import pytest
from test_stream_fetch import pi_session

from p2pnode.errors import VerificationFailed
from p2pnode.peer.getter import READY_PART, SessionGetter
from p2pnode.pi import hashing
from p2pnode.pi.lines import LineRef, split_lines
from p2pnode.pi.session import titles_after


def _assemble(data: bytes, seed: int, starts_with: tuple[str, int] | None = None
              ) -> tuple[SessionGetter, list[bytes]]:
    """Every line of `data` handed to a getter in a shuffled order, in runs, as a fetch does;
    the parts `ready` handed out."""
    lines = split_lines(data)
    refs = [LineRef(blake3.blake3(line).digest(), len(line)) for line in lines]
    getter = SessionGetter(blake3.blake3(data).hexdigest(), refs, [r.hash for r in refs],
                           starts_with=starts_with)
    order = list(zip(refs, lines, strict=True))
    random.Random(seed).shuffle(order)
    parts: list[bytes] = []
    for at, (ref, line) in enumerate(order):
        getter.arrived(ref.hash, line)
        if at % 7 == 0:
            parts += getter.ready()
    parts += getter.ready()
    return getter, parts


@pytest.mark.parametrize("newline_at_end", [True, False])
def test_ready_hands_out_the_file_in_joined_parts(newline_at_end: bool) -> None:
    data = pi_session(3_000_000, seed=11, image_bytes=100_000)
    data = data if newline_at_end else data.rstrip(b"\n")
    getter, parts = _assemble(data, seed=1)
    done = getter.finish()
    assert b"".join(parts) == data and done.placed_hex == done.src
    lines = split_lines(data)
    assert len(parts) < len(lines) / 3  # lines joined, not one part (one write) each
    assert max(map(len, parts)) < READY_PART + max(map(len, lines))
    size, hasher = done.complete  # where a later version continues: after the last whole line
    last_start = len(data) - len(lines[-1])
    assert size == (len(data) if newline_at_end else last_start)
    assert hasher.hexdigest() == blake3.blake3(data[:size]).hexdigest()


def test_lines_next_in_file_order_are_kept_whatever_their_size() -> None:
    """A run of lines that continues the cursor (the header, then a line bigger than the
    buffer's limit) is kept for the next `ready`, not left to the store to be read back;
    lines beyond a gap still wait within the limit."""
    header = b'{"type":"session","version":3,"id":"t","timestamp":"2026-11-21T19:00:00.000Z","cwd":"/w"}\n'
    lines = [header, b"x" * 5000 + b"\n", b"y" * 3000 + b"\n", b"z" * 4000 + b"\n"]
    refs = [LineRef(blake3.blake3(line).digest(), len(line)) for line in lines]
    getter = SessionGetter(blake3.blake3(b"".join(lines)).hexdigest(), refs, [r.hash for r in refs],
                           ahead_limit=1000)
    getter.arrived(refs[0].hash, lines[0])
    getter.arrived(refs[1].hash, lines[1])  # next after the header: kept, though over the limit
    getter.arrived(refs[3].hash, lines[3])  # after a gap, over the limit: left to the store
    assert getter.from_store() == []  # the cursor waits on line 3 (outstanding), nothing to read back
    assert b"".join(getter.ready()) == lines[0] + lines[1]
    getter.arrived(refs[2].hash, lines[2])
    assert b"".join(getter.ready()) == lines[2] and getter.from_store() == [refs[3].hash]


def test_lines_before_the_header_are_handed_out_after_it() -> None:
    """Pi's header is not the first line: it is handed out first (every Pi reads it there), the
    session's hash stays that of the lines in their order."""
    session = pi_session(1_000_000, seed=12, image_bytes=50_000)
    header, rest = session.split(b"\n", 1)
    before = b"not json\n# nor this\n"
    getter, parts = _assemble(before + header + b"\n" + rest, seed=2)
    done = getter.finish()
    assert b"".join(parts) == header + b"\n" + before + rest
    assert done.placed_hex == blake3.blake3(b"".join(parts)).hexdigest() != done.src


@pytest.mark.parametrize("seed", [3, 4])
def test_the_titles_are_those_of_the_lines_read_in_order(seed: int) -> None:
    """The name (the last session_info) and the first user message, as titles_after finds them
    line by line, though the getter looks for them only in the parts that have their marks."""
    lines = split_lines(pi_session(3_000_000, seed=13, image_bytes=100_000))
    rng = random.Random(seed)
    for n in (2, 3):
        name = {"type": "session_info", "id": f"{n:08x}", "parentId": None, "name": f"name {n}"}
        lines.insert(rng.randrange(1, len(lines)), json.dumps(name).encode() + b"\n")
    getter, _ = _assemble(b"".join(lines), seed=seed)
    done = getter.finish()
    expected: tuple[str | None, str | None] = (None, None)
    for line in lines:
        expected = titles_after(line, *expected)
    assert (done.name, done.first_user) == expected and expected[0] and expected[1]


def test_a_line_nested_deeper_than_pythons_parser_is_kept_verbatim() -> None:
    """Pi's JSON.parse takes nesting Python's parser does not: such a line is shared (verbatim,
    like any line), so it is fetched too (it was refused past 512 levels, exit 4); the title
    search takes it for no JSON."""
    deep = b'{"type":"message","message":{"role":"user","content":' + b"[" * 5000 + b"]" * 5000 + b"}}\n"
    header = pi_session(10_000, seed=13).split(b"\n", 1)[0] + b"\n"
    data = header + deep
    lines = split_lines(data)
    refs = [LineRef(blake3.blake3(line).digest(), len(line)) for line in lines]
    getter = SessionGetter(blake3.blake3(data).hexdigest(), refs, [r.hash for r in refs])
    for ref, line in zip(refs, lines, strict=True):
        getter.arrived(ref.hash, line)
    assert b"".join(getter.ready()) == data and getter.finish().src == blake3.blake3(data).hexdigest()
    assert getter.first_user is None


def test_a_placed_file_is_hashed_in_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = random.Random(4).randbytes(100_003)
    path = tmp_path / "placed.jsonl"
    path.write_bytes(data)
    monkeypatch.setattr(hashing, "PREFIX_CHUNK", 4096)
    assert hashing.prefix_hasher(path, len(data)).hexdigest() == blake3.blake3(data).hexdigest()
    assert hashing.prefix_hasher(path, 5000).hexdigest() == blake3.blake3(data[:5000]).hexdigest()


def test_a_newer_versions_start_is_checked_as_it_is_hashed() -> None:
    """`starts_with` (the version named, when a newer one is fetched instead): the hash of the
    first `size` bytes is compared as the hash passes them, where a line ends there; a start
    that differs stops the assembly; a size inside a line is left to the caller."""
    data = pi_session(2_000_000, seed=12, image_bytes=50_000)
    lines = split_lines(data)
    cut = sum(map(len, lines[: len(lines) // 2]))
    older = data[:cut]
    getter, parts = _assemble(data, seed=2, starts_with=(blake3.blake3(older).hexdigest(), cut))
    assert b"".join(parts) == data and getter.finish().start_checked
    other = older.replace(b"look at image", b"LOOK AT IMAGE")
    assert other != older
    with pytest.raises(VerificationFailed, match="does not start with its bytes"):
        _assemble(data, seed=3, starts_with=(blake3.blake3(other).hexdigest(), cut))
    mid = cut + len(lines[len(lines) // 2]) // 2  # inside a line: not checked here
    getter, parts = _assemble(data, seed=4, starts_with=(blake3.blake3(data[:mid]).hexdigest(), mid))
    assert b"".join(parts) == data and not getter.finish().start_checked


def _runs_getter(lines: list[bytes]) -> tuple[SessionGetter, list[LineRef]]:
    """A getter of `lines` none of which is to come from a peer (all held, read back in runs)."""
    refs = [LineRef(blake3.blake3(line).digest(), len(line)) for line in lines]
    return SessionGetter(blake3.blake3(b"".join(lines)).hexdigest(), refs, ()), refs


def test_a_run_taken_whole_is_handed_out_as_one_block_with_the_titles_in_it() -> None:
    """A fork's run read whole from its parent's placed file (heldlines.held_run): handed out
    as the block itself, not cut into lines and joined again; each line is still checked, the
    titles found in it are those titles_after finds line by line, and the session's last line
    goes the per-line way (the state before it is what a later version continues from)."""
    lines = split_lines(pi_session(2_000_000, seed=14, image_bytes=50_000))
    name = {"type": "session_info", "id": "0000beef", "parentId": None, "name": "in the run"}
    lines.insert(len(lines) // 2, json.dumps(name).encode() + b"\n")
    getter, refs = _runs_getter(lines)
    first = getter.from_store()
    getter.read_back(first[:1], lines[:1])  # the header the way of any line
    parts = list(getter.ready())
    run = b"".join(lines[1:])
    block = getter.take_run(run, len(lines) - 1)
    assert len(block) == 1 and isinstance(block[0], memoryview) and block[0].obj is run
    parts += [bytes(b) for b in block] + list(getter.ready())
    done = getter.finish()
    assert b"".join(parts) == b"".join(lines) and done.src == done.placed_hex
    expected: tuple[str | None, str | None] = (None, None)
    for line in lines:
        expected = titles_after(line, *expected)
    assert (done.name, done.first_user) == expected and expected[0] == "in the run"
    assert done.complete[1].hexdigest() == blake3.blake3(b"".join(lines)).hexdigest()


def test_a_run_not_cut_as_its_manifest_says_is_a_lie_and_a_run_before_the_header_goes_line_by_line() -> None:
    """The lines' lengths in the manifest must cut the block at its newlines (ManifestLied);
    a run that holds the header (the header scan) is handed out by `ready`, line by line."""
    lines = split_lines(pi_session(500_000, seed=15, image_bytes=20_000))
    getter, refs = _runs_getter(lines)
    whole = getter.take_run(b"".join(lines[:10]), 10)
    assert whole == [] and b"".join(getter.ready()) == b"".join(lines[:10])
    wrong = [*refs[:10], LineRef(refs[10].hash, refs[10].length - 1),
             LineRef(refs[11].hash, refs[11].length + 1), *refs[12:]]
    lying = SessionGetter(getter.src, wrong, ())
    lying.read_back([r.hash for r in wrong[:1]], lines[:1])
    list(lying.ready())
    with pytest.raises(VerificationFailed, match="line 11 of its manifest is not the file cut at its"):
        lying.take_run(b"".join(lines[1:20]), 19)
