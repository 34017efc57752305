"""The secret scan in pieces (secrets.Scanner) and in a child process (pi/scanproc.py): the
same findings as one scan of all the bytes, on a real Pi session with every kind of key
planted; a child that did not scan exactly the bytes fed is never believed."""
from __future__ import annotations

from pathlib import Path

import pytest
from secretkeys import PLANTED, plant

from p2pnode.pi import scanproc, secrets

DATA = Path(__file__).resolve().parents[1] / "data"
REAL = next(DATA.glob("pi-corpus-1.5.2/sessions/*/*a271-70bf-bc80-66a3334c5c30.jsonl"))


def planted_session() -> bytes:
    data = REAL.read_bytes()
    for i, (_, value) in enumerate(PLANTED):
        data = plant(data, ("toolResult", "user", "bash")[i % 3], value)[0]
    return data


def pieces(data: bytes, size: int) -> list[memoryview]:
    view = memoryview(data)
    return [view[i:i + size] for i in range(0, len(data), size)]


@pytest.mark.parametrize("size", [1, 7, 4096, 1 << 20])
def test_scanner_in_pieces_finds_what_one_scan_finds(size: int) -> None:
    data = planted_session()
    whole = secrets.scan(data)
    assert sorted(f.kind for f in whole) == sorted(k for k, _ in PLANTED)
    scanner = secrets.Scanner()
    for piece in pieces(data, size):
        scanner.feed(piece)
    assert scanner.finish() == whole


def test_scanner_counts_from_the_first_byte_fed_and_scans_a_last_line_without_newline() -> None:
    data = planted_session()
    cut = data.index(b"\n", len(data) // 2) + 1
    scanner = secrets.Scanner()
    scanner.feed(data[cut:].rstrip(b"\n"))
    tail = secrets.scan(data[cut:].rstrip(b"\n"))
    assert tail and scanner.finish() == tail


def run_child(path: Path, start: int, fed: bytes, piece: int = 1 << 16) -> list[secrets.Finding] | None:
    child = scanproc.ScanProcess(path, start)
    try:
        for view in pieces(fed, piece):
            child.fed(view)
        return child.result()
    finally:
        child.close()


def test_the_child_finds_what_one_scan_finds(tmp_path: Path) -> None:
    data = planted_session()
    path = tmp_path / "s.jsonl"
    path.write_bytes(data)
    assert run_child(path, 0, data) == secrets.scan(data)


def test_the_child_scans_from_start_and_not_past_what_was_fed(tmp_path: Path) -> None:
    """A grown file: only the new bytes; Pi appending meanwhile: not the bytes after."""
    one = planted_session()
    data = one * 3
    start, end = len(one), 2 * len(one)
    path = tmp_path / "s.jsonl"
    path.write_bytes(data)  # the file holds more than was fed: the child stops at `end`
    found = run_child(path, start, data[start:end])
    assert found == secrets.scan(one) and len(secrets.scan(data)) == 3 * len(found)


def test_bytes_that_differ_from_what_was_fed_give_no_answer(tmp_path: Path) -> None:
    """The file rewritten under the share (same size): the child's findings are refused."""
    data = planted_session()
    path = tmp_path / "s.jsonl"
    path.write_bytes(data.replace(b"sk-", b"SK-", 1))
    assert run_child(path, 0, data) is None


def test_a_file_shorter_than_what_was_fed_gives_no_answer(tmp_path: Path) -> None:
    data = planted_session()
    path = tmp_path / "s.jsonl"
    path.write_bytes(data[: len(data) // 2])
    assert run_child(path, 0, data) is None


def test_close_stops_a_child_that_was_never_answered(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    path.write_bytes(planted_session())
    child = scanproc.ScanProcess(path, 0)
    proc = child._proc
    child.close()
    assert proc is not None and proc.poll() is not None and child.result() is None
