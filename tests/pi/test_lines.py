"""The one line splitter: streamed in any chunks it cuts as split_lines does, and is_split
accepts exactly its cuts."""
from __future__ import annotations

import io
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2pnode.peer import wire
from p2pnode.pi.lines import (
    LineRef,
    LineRefs,
    LineSplitter,
    count_newlines,
    is_split,
    line_runs,
    ref_runs,
    split_lines,
)

DATA = st.binary(max_size=200).map(lambda b: b.replace(b"\x00", b"\n"))


@given(DATA, st.lists(st.integers(min_value=0, max_value=200), max_size=8))
def test_chunks_cut_as_the_whole(data: bytes, cuts: list[int]) -> None:
    splitter, lines, start = LineSplitter(), [], 0
    for cut in sorted(cuts) + [len(data)]:
        lines += splitter.feed(data[start:max(start, cut)])
        start = max(start, cut)
    if (rest := splitter.rest()) is not None:
        lines.append(rest)
    assert lines == split_lines(data)
    assert b"".join(lines) == data
    assert is_split(lines)


@given(DATA, st.integers(min_value=1, max_value=64), st.integers(min_value=0, max_value=220))
def test_a_files_runs_of_lines_are_its_lines_up_to_the_size(data: bytes, chunk: int, size: int) -> None:
    """line_runs: a file read in chunks, stopped at `size`, cuts as split_lines cuts those bytes."""
    runs = list(line_runs(io.BytesIO(data), chunk, size))
    assert all(runs) and [line for run in runs for line in run] == split_lines(data[:size])
    assert [line for run in line_runs(io.BytesIO(data), chunk) for line in run] == split_lines(data)


def test_other_cuts_are_refused() -> None:
    assert is_split([b"a\n", b"b"])
    assert not is_split([b"a", b"\n"])
    assert not is_split([b"a\nb\n"])
    assert split_lines(b"a\r\nb\rc") == [b"a\r\n", b"b\rc"]


@pytest.mark.parametrize("line_bytes", [1, 7, 300, 5000, 3 << 20])
def test_count_newlines_agrees_with_count_for_short_and_long_lines(line_bytes: int):
    rng = random.Random(line_bytes)
    data = bytearray()
    while len(data) < 6 << 20:
        data += b"x" * rng.randint(0, 2 * line_bytes) + b"\n"
    for lo, hi in [(0, len(data)), (1, len(data) - 1), (12345, 4 << 20), (5, 5), (len(data) - 1, len(data))]:
        assert count_newlines(data, lo, hi) == data.count(b"\n", lo, hi)
        assert count_newlines(bytes(data), lo, hi) == data.count(b"\n", lo, hi)


@given(st.lists(st.tuples(st.binary(min_size=32, max_size=32), st.integers(1, 2**32 - 1)), max_size=40),
       st.integers(-45, 45), st.integers(-45, 45))
def test_packed_refs_read_as_the_list_they_pack(pairs: list[tuple[bytes, int]], a: int, b: int) -> None:
    """LineRefs (a cached manifest, 36 bytes a line) reads exactly as the list of LineRef it
    packs: index, slice, iteration, concatenation, hashes; its bytes are a manifest's body."""
    refs = [LineRef(h, n) for h, n in pairs]
    packed = LineRefs.packed([h for h, _ in pairs], [n for _, n in pairs])
    assert packed == LineRefs.of(refs) == refs and len(packed) == len(refs) and list(packed) == refs
    assert list(packed[a:b]) == refs[a:b] and list(packed[::2]) == refs[::2]
    for i in (a, b):
        if -len(refs) <= i < len(refs):
            assert packed[i] == refs[i]
        else:
            with pytest.raises(IndexError):
                packed[i]
    assert list(packed[:a] + refs[a:]) == refs and packed.hashes() == [r.hash for r in refs]
    assert wire.encode_line_manifest(bytes(32), packed) == wire.encode_line_manifest(bytes(32), refs)
    assert [r for run in ref_runs(packed, 1 << 31) for r in run] == refs


def test_ref_runs_end_at_the_line_that_reaches_the_limit() -> None:
    refs = [LineRef(bytes(32), n) for n in (3, 3, 5, 1, 1)]
    assert [[r.length for r in run] for run in ref_runs(refs, 6)] == [[3, 3], [5, 1], [1]]
    with pytest.raises(ValueError):
        LineRefs(b"x" * 35)
