"""Branch sidecars: canonical bytes, the documented test vectors, and validation of received ones."""
from __future__ import annotations

import json
import re
from pathlib import Path

import blake3
import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2pnode.errors import VerificationFailed
from p2pnode.pi.sidecar import MAX_SIDECAR_BYTES, InvalidSidecar, Sidecar, parse_sidecar

# The test vectors of docs/FORMAT.md: A1 of the corpus as a root, A6 (its --fork) as its child.
A1_SRC = "7746019033b885a7522e1cf942cd52e8d569078f42f98601f00bf7500991a6dd"
A6_SRC = "093cf8f12c1ffa3b3f32b896e167cafb8f0628fceec2c478a3f416209f7bc253"
ROOT_BYTES = (b'{"type":"branch","version":1,"src":"7746019033b885a7522e1cf942cd52e8d569078f42f98601f00bf75'
              b'00991a6dd","parent":null}')
ROOT_BRANCH = "28383c817592b2526d57ed3e079458b35a2f2fa6d64f0e7efb34652d116dabe1"
CHILD_BYTES = (b'{"type":"branch","version":1,"src":"093cf8f12c1ffa3b3f32b896e167cafb8f0628fceec2c478a3f41620'
               b'9f7bc253","parent":"28383c817592b2526d57ed3e079458b35a2f2fa6d64f0e7efb34652d116dabe1"}')
CHILD_BRANCH = "6eb63c6a52007224de0e67d182f0522429f6c5137995832fe23793f9480ede9b"

hex64 = st.binary(min_size=32, max_size=32).map(bytes.hex)


def test_vectors_match_canonical_bytes_and_an_independent_blake3() -> None:
    assert blake3.blake3(ROOT_BYTES).hexdigest() == ROOT_BRANCH
    assert blake3.blake3(CHILD_BYTES).hexdigest() == CHILD_BRANCH
    root = Sidecar(A1_SRC, None)
    child = Sidecar(A6_SRC, root.branch)
    assert root.encode() == ROOT_BYTES and root.branch == ROOT_BRANCH
    assert child.encode() == CHILD_BYTES and child.branch == CHILD_BRANCH
    assert not ROOT_BYTES.endswith(b"\n") and b" " not in CHILD_BYTES


def test_format_doc_carries_the_vectors() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "FORMAT.md").read_text()
    for text in (ROOT_BYTES.decode(), CHILD_BYTES.decode(), ROOT_BRANCH, CHILD_BRANCH):
        assert text in doc


def test_canonical_form_is_compact_json_in_key_order() -> None:
    data = Sidecar(A6_SRC, ROOT_BRANCH).encode()
    assert data == json.dumps({"type": "branch", "version": 1, "src": A6_SRC, "parent": ROOT_BRANCH},
                              separators=(",", ":")).encode()


@given(hex64, st.one_of(st.none(), hex64))
def test_round_trip(src: str, parent: str | None) -> None:
    sidecar = Sidecar(src, parent)
    assert parse_sidecar(sidecar.encode(), expected_branch=sidecar.branch) == sidecar


def test_non_canonical_bytes_are_accepted_by_their_own_hash() -> None:
    data = b'{ "parent": null, "src": "%s", "version": 1, "type": "branch", "note": "x" }\n' % A1_SRC.encode()
    parsed = parse_sidecar(data, expected_branch=blake3.blake3(data).hexdigest())
    assert parsed == Sidecar(A1_SRC, None)
    assert parsed.branch == ROOT_BRANCH  # re-encoding gives the canonical branch, not the received one


def test_wrong_hash_is_a_verification_failure() -> None:
    with pytest.raises(VerificationFailed, match=CHILD_BRANCH):
        parse_sidecar(ROOT_BYTES, expected_branch=CHILD_BRANCH)


@pytest.mark.parametrize(
    ("data", "complaint"),
    [
        (b"\xff\xfe", "not UTF-8 JSON"),
        (b"[1,2]", "not a JSON object"),
        (b'{"type":"tree","version":1,"src":"%s","parent":null}' % A1_SRC.encode(), "type 'tree'"),
        (b'{"type":"branch","version":2,"src":"%s","parent":null}' % A1_SRC.encode(), "version 2"),
        (b'{"type":"branch","version":true,"src":"%s","parent":null}' % A1_SRC.encode(), "version True"),
        (b'{"type":"branch","version":1,"src":"%s","parent":null}' % A1_SRC.upper().encode(), "src"),
        (b'{"type":"branch","version":1,"src":"%s","parent":"abc"}' % A1_SRC.encode(), "parent 'abc'"),
        (b'{"type":"branch","version":1,"src":"%s"}' % A1_SRC.encode(), "lacks"),
        (b'{"type":"branch","version":1,"src":"%s","src":"%s","parent":null}'
         % (A1_SRC.encode(), A6_SRC.encode()),
         "duplicate"),
        (b'{"type":"branch","version":1,"src":1,"parent":null}', "src 1"),
        (b" " * (MAX_SIDECAR_BYTES + 1), "over the limit"),
    ],
)
def test_invalid_sidecars_are_refused_with_the_reason(data: bytes, complaint: str) -> None:
    with pytest.raises(InvalidSidecar, match=re.escape(complaint)):
        parse_sidecar(data)


def test_constructor_refuses_bad_hashes() -> None:
    with pytest.raises(InvalidSidecar):
        Sidecar("g" * 64, None)
    with pytest.raises(InvalidSidecar):
        Sidecar(A1_SRC, A1_SRC[:-1])
