"""Fixtures shared by every test module, and the suite's rules on root and on skips.

Tests that need root carry the marker `lab` (network namespaces) or `root` (device-mapper,
mount namespaces); run by an ordinary user they are skipped with skips.NEEDS_ROOT, and
`.ci/run` runs them in its second, root, part.  With P2PNODE_STRICT_SKIPS=1 (set by `.ci/run`)
a skip that skips.skip_allowed refuses fails the run; developers' runs are unaffected.  The
hooks live in tests/skips.py (a plugin of its own, so that they can be tested).
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from ordinary import OrdinaryUser, ordinary_user
from skips import (  # noqa: F401  (the hooks: pytest finds them in this module)
    pytest_collection_modifyitems,
    pytest_runtest_logreport,
    pytest_sessionfinish,
    pytest_terminal_summary,
)

DATA = Path(__file__).resolve().parent / "data"
CORPUS = DATA / "pi-corpus-0.73.1"  # real files written by pi 0.73.1 (@mariozechner/pi-coding-agent)
CORPUS_NEW = DATA / "pi-corpus-1.5.2"  # real files written by pi 1.5.2 (@earendil-works/pi-coding-agent)


@pytest.fixture(scope="session", autouse=True)
def socket_dir_removed() -> Iterator[None]:
    """The suite leaves no `p2pnode-<uid>` socket dir in the temp dir that it made (a node whose
    home is too long for its sockets puts them there, and leaves the dir for the next one)."""
    path = Path(tempfile.gettempdir()) / f"p2pnode-{os.getuid()}"
    existed = path.exists()
    yield
    if not existed:
        with contextlib.suppress(OSError):  # not empty: a node still runs (not this suite's)
            path.rmdir()


@pytest.fixture(scope="session")
def corpus_dir() -> Path:
    return CORPUS


@pytest.fixture(scope="session")
def corpus_manifest(corpus_dir: Path) -> dict:
    return json.loads((corpus_dir / "manifest.json").read_text())


@pytest.fixture(scope="session")
def corpus_new_dir() -> Path:
    return CORPUS_NEW


@pytest.fixture(scope="session")
def corpus_new_manifest(corpus_new_dir: Path) -> dict:
    return json.loads((corpus_new_dir / "manifest.json").read_text())


@pytest.fixture
def node_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An isolated node state dir and Pi agent dir for one test."""
    home = tmp_path / "node"
    agent = tmp_path / "agent"
    agent.mkdir()
    monkeypatch.setenv("P2PNODE_HOME", str(home))
    monkeypatch.setenv("PI_CODING_AGENT_DIR", str(agent))
    return home


@pytest.fixture
def ordinary() -> Iterator[OrdinaryUser]:
    """An ordinary user for `p2pnode` processes (tests/ordinary.py): `nobody` when run as root."""
    with ordinary_user() as user:
        if isinstance(user, str):
            pytest.skip(user)
        yield user


# --- LAN lab (tests/lab.py): one namespace lab per test session -------------------------

LAB_HOSTS = 5  # h1..h3: trusted nodes, h4: an untrusted node, h5: a host without p2pnode


@pytest.fixture(scope="session")
def lab():
    """Bridge + LAB_HOSTS host namespaces; skips with the reason where namespaces are absent."""
    from lab import Lab, unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    built = Lab.create(LAB_HOSTS)
    try:
        yield built
    finally:
        built.down()
