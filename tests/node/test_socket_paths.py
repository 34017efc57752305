"""A node whose home is too long for a Unix socket (a deep --home; pytest's temp dirs on macOS,
~81 bytes before the test's own dirs) serves and is driven all the same: its sockets move to a
private per-user dir under the temp dir (paths.socket_path), which must be this user's alone.
A real `p2pnode serve` process and the real CLI."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from procnode import Node

from p2pnode.errors import InvalidInput
from p2pnode.paths import SUN_PATH_MAX, NodePaths, socket_path


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temp dir with a short path (pytest's are long for an ordinary user, and on macOS):
    where the sockets of a long home go; removed after."""
    path = Path(tempfile.mkdtemp(prefix="p2s", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path)


def _long_home(root: Path) -> Path:
    home = root / ("h" * (SUN_PATH_MAX + 10 - len(os.fsencode(root))))
    assert len(os.fsencode(home / "control.sock")) > SUN_PATH_MAX
    return home


def test_a_short_home_keeps_its_sockets(tmp_path: Path) -> None:
    home = Path("/tmp/short")
    assert NodePaths(home).control_socket == home / "control.sock"
    assert NodePaths(home).store_socket == home / "store.sock"


def test_a_long_home_gets_short_private_socket_paths(tmp_path: Path, short_tmp: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(short_tmp))
    home, other = _long_home(tmp_path / "a"), _long_home(tmp_path / "b")
    control, store = NodePaths(home).control_socket, NodePaths(home).store_socket
    assert control.parent == store.parent == short_tmp / f"p2pnode-{os.getuid()}"
    assert len(os.fsencode(control)) <= SUN_PATH_MAX and control != store
    assert (control.parent.stat().st_mode & 0o777) == 0o700
    assert NodePaths(other).control_socket != control  # keyed by the home
    assert NodePaths(home).control_socket == control  # and the same each time: client and node agree


@pytest.mark.parametrize("spoil", ["open to others", "a symlink", "a file"])
def test_a_socket_dir_not_ours_alone_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                spoil: str) -> None:
    """Another local user could plant a socket where the CLI would send its commands."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    shared = tmp_path / f"p2pnode-{os.getuid()}"
    if spoil == "open to others":
        shared.mkdir(mode=0o755)
        shared.chmod(0o755)
    elif spoil == "a symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        shared.symlink_to(tmp_path / "elsewhere")
    else:
        shared.write_bytes(b"")
    with pytest.raises(InvalidInput, match="this user's alone"):
        socket_path(_long_home(tmp_path / "x"), "control.sock")


def test_a_node_with_a_long_home_serves_and_is_driven(tmp_path: Path, short_tmp: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    node = Node(tmp_path, "n")
    node.home = _long_home(tmp_path / "n")
    node.env.update(P2PNODE_HOME=str(node.home), TMPDIR=str(short_tmp))  # the node's and the CLI's
    monkeypatch.setattr("tempfile.tempdir", str(short_tmp))  # and this test's
    sock = NodePaths(node.home).control_socket
    assert not sock.is_relative_to(node.home)
    with node.node_running():
        status = json.loads(node.run("status", "--json").stdout)
        assert status["running"] and Path(status["home"]) == node.home
        assert node.run("ls", "--json").returncode == 0  # through the node: the store is its
    assert not sock.exists()  # removed as the node stopped
    assert not json.loads(node.run("status", "--json").stdout)["running"]
