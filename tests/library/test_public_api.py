"""The package's public API: every name `p2pnode` exports resolves to the module that owns
it, and importing the package alone loads none of the store's dependencies."""
from __future__ import annotations

import subprocess
import sys

import p2pnode
from p2pnode.errors import Refused
from p2pnode.library.api import Library


def test_every_exported_name_resolves() -> None:
    for name in p2pnode.__all__:
        assert getattr(p2pnode, name) is not None, name
    assert p2pnode.Library is Library and p2pnode.Refused is Refused


def test_importing_the_package_loads_no_store() -> None:
    code = "import sys, p2pnode; print('store' in sys.modules, 'zstandard' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "False"]
