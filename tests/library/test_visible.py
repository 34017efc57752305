"""What a peer may be served (Library._visible) is kept up to date by extending the last map
when branches were only added, and rebuilt otherwise: either way it is what a rebuild from
nothing gives, through shares, re-shares, grown versions, audiences, unshares and expiry."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
from test_share import agent  # noqa: F401  (the corpus, as test_share copies it)

from p2pnode.library import access
from p2pnode.library.api import Library

ALICE = "a" * 56
BOB = "b" * 56
PEERS = (None, ALICE, BOB)


def _kinds(lib: Library, peer: str | None) -> dict[str, str]:
    return {h: kind for h, (kind, _) in lib._visible(peer).items()}


def _from_nothing(lib: Library, peer: str | None) -> dict[str, str]:
    kept, served = dict(lib._access), lib._served
    lib._access.clear()
    lib._served = None
    try:
        return _kinds(lib, peer)
    finally:
        lib._access.clear()
        lib._access.update(kept)
        lib._served = served


def test_the_kept_map_is_always_a_rebuilt_one(lib: Library, agent: Path,  # noqa: F811
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(7)
    files = sorted((agent / "sessions").rglob("*.jsonl"))
    clock = [access.now_ms()]
    monkeypatch.setattr(access, "now_ms", lambda: clock[0])
    shared: list[str] = []
    for step in range(60):
        op = rng.choice(["share", "share", "share", "grow", "unshare", "time"])
        if op in ("share", "grow") or not shared:
            path = rng.choice(files)
            if op == "grow":
                with open(path, "ab") as f:
                    f.write(b'{"type":"custom","id":"%08x","parentId":null,"data":{}}\n' % step)
            to = rng.choice([None, [ALICE], [BOB], [ALICE, BOB]])
            expires = rng.choice([None, "1h", "never"])
            shared.append(lib.share(str(path), to=to, expires=expires).branch)
        elif op == "unshare":
            lib.unshare(rng.choice(shared))
        else:
            clock[0] += 2 * 3600 * 1000  # past every "1h"
        for peer in rng.sample(PEERS, 2):
            assert _kinds(lib, peer) == _from_nothing(lib, peer), f"step {step} ({op}), peer {peer}"


def test_a_new_share_walks_only_its_own_lines(lib: Library, agent: Path,  # noqa: F811
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Another session shared: the map of a peer gains its lines (and its new ancestors'),
    without the versions offered before being walked again."""
    files = sorted((agent / "sessions").rglob("*.jsonl"))
    for path in files[:3]:
        lib.share(str(path))
    lib._visible(ALICE)
    before = {b.branch for b in lib.branches()}
    lib.share(str(files[3]))
    added = {b.src for b in lib.branches() if b.branch not in before}
    walked: list[str] = []
    known = lib._known_line_hashes
    monkeypatch.setattr(lib, "_known_line_hashes", lambda src: walked.append(src) or known(src))
    lib._visible(ALICE)
    assert added and set(walked) == added
    monkeypatch.undo()
    assert _kinds(lib, ALICE) == _from_nothing(lib, ALICE)
