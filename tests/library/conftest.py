"""Fixtures of the library tests: a Library over a node home, on the `agent` dir each module
makes (a copy of a corpus)."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from p2pnode.library.api import Library
from p2pnode.paths import NodePaths


@pytest.fixture
def lib(agent: Path, tmp_path: Path) -> Iterator[Library]:
    with Library.open(NodePaths(tmp_path / "node"), agent_dir=agent) as lib:
        yield lib
