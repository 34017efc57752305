"""What a command loads: each CLI start pays for the modules it imports, so `share` and `fetch`
through the running node load neither the store, TLS nor the HTTP client (the node does the work), a
one-shot `fetch --from` never starts mDNS nor loads an X.509 library, and the progress bar's
rich is loaded only when stderr may be a terminal.  Real processes; the modules loaded are read
from sys.modules."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from corpus import B5
from procnode import PY, Node

from p2pnode.node.follow import newest_to_fetch
from p2pnode.paths import NodePaths
from p2pnode.peer import wire
from p2pnode.peer.address import PeerAddress
from p2pnode.peer.identity import load_or_create_identity
from p2pnode.peer.trust import TrustStore
from p2pnode.pi.sidecar import Sidecar

HEAVY = ("aiohttp", "cryptography", "rich", "zeroconf", "store", "asyncio")

RUN_AND_LIST = (
    "import json, sys\n"
    "from p2pnode.cli.main import main\n"
    "code = main(sys.argv[1:])\n"
    f"heavy = sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))\n"
    "print('LOADED ' + json.dumps(heavy), file=sys.stderr)\n"
    "sys.exit(code)\n"
)


def loaded(node: Node, *args: str) -> tuple[dict, list[str]]:
    """Run `p2pnode ARGS --json` as node (stdout and stderr piped); its answer and what it loaded."""
    proc = subprocess.run([PY, "-c", RUN_AND_LIST, *args, "--json"], env=node.env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    line = next(s for s in proc.stderr.splitlines() if s.startswith("LOADED "))
    return json.loads(proc.stdout), json.loads(line.removeprefix("LOADED "))


@pytest.fixture
def team(tmp_path: Path, corpus_dir: Path) -> tuple[Node, Node]:
    a, b = Node(tmp_path, "a"), Node(tmp_path, "b")
    shutil.copytree(corpus_dir / "sessions", a.agent / "sessions")
    TrustStore(NodePaths(a.home).trust).trust(b.id)
    TrustStore(NodePaths(b.home).trust).trust(a.id)
    return a, b


def test_share_through_the_node_and_a_one_shot_fetch_load_what_they_need(team: tuple[Node, Node]) -> None:
    a, b = team
    with a.node_running():
        shared, heavy = loaded(a, "share", str(a.agent / B5))
        assert shared["ticket"] and shared["fetch"].startswith("p2pnode fetch ")
        assert heavy == []  # the node shared it and answered the hand-off: one control round trip
        _, heavy = loaded(a, "status")
        assert heavy == []
    c = Node(a.home.parents[1], "c")
    TrustStore(NodePaths(a.home).trust).trust(c.id)
    TrustStore(NodePaths(c.home).trust).trust(a.id)
    with a.serving() as port:
        with c.node_running():
            handed, heavy = loaded(c, "fetch", shared["branch"], "--from", f"127.0.0.1:{port}")
        assert handed["branch"] == shared["branch"] and handed["path"]
        assert heavy == []  # c's node fetched it: the CLI parsed the target and waited
        fetched, heavy = loaded(b, "fetch", shared["branch"], "--from", f"127.0.0.1:{port}")
    assert fetched["branch"] == shared["branch"] and fetched["path"]
    assert "zeroconf" not in heavy and "rich" not in heavy  # --from: no mDNS; stderr a pipe: no bar
    assert "aiohttp" not in heavy  # the fetcher's HTTPS client is peer/https.py (aiohttp: the server's)
    assert "store" in heavy  # it does fetch, into the store
    assert "cryptography" not in heavy  # over TLS, with the identity read without an X.509 stack


@pytest.mark.parametrize("env, drawn", [({}, False), ({"FORCE_COLOR": "1"}, True)])
def test_the_progress_bar_loads_rich_only_when_it_may_draw(env: dict[str, str], drawn: bool) -> None:
    script = ("import sys\nfrom p2pnode.cli.progress import TransferBar\n"
              "print(TransferBar([]).enabled, 'rich' in sys.modules)")
    clean = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    proc = subprocess.run([sys.executable, "-c", script], env=dict(clean, **env), capture_output=True,
                          text=True, timeout=60, check=True)
    assert proc.stdout.split() == [str(drawn), str(drawn)]


async def test_a_fetch_by_prefix_does_not_ask_for_the_catalogs_it_resolved_with(tmp_path: Path) -> None:
    """offers.resolve_prefix hands the catalogs it read to newest_to_fetch (`known`): the newest
    version is found in them, with no second connection (nobody listens at the address)."""
    nobody = PeerAddress(None, "127.0.0.1", 9)
    first, grown = Sidecar("cd" * 32, None), Sidecar("ef" * 32, None)
    header = {"id": "01a1ff93-0000-0000-0000-000000000001", "timestamp": None, "cwd": "/p",
              "parent_session": None}
    catalog = wire.CatalogMessage(1, "n", [
        wire.CatalogEntry(first.branch, first.src, None, 100, 2, header, version=1),
        wire.CatalogEntry(grown.branch, grown.src, None, 200, 4, header, previous=first.branch, version=2)])

    async def no_lan(target: str) -> list[PeerAddress]:
        return []

    ident, trust = load_or_create_identity(tmp_path / "me"), TrustStore(tmp_path / "trust.json")
    newest = await newest_to_fetch(first.branch, [nobody], ident, trust, no_lan, known={nobody: catalog})
    assert (newest.branch, newest.peers, newest.extends) == (grown.branch, [nobody], (first.src, 100))
    unknown = await newest_to_fetch(first.branch, [nobody], ident, trust, no_lan)  # asked: no answer
    assert (unknown.branch, unknown.extends) == (first.branch, None)


def test_the_command_exits_with_mains_code_after_flushing_what_it_printed() -> None:
    """cli.main.run ends the process with os._exit: buffered output must be out first, through
    a pipe bigger than the pipe's buffer, and the code is main's."""
    script = ("from p2pnode.cli import main as cli\n"
              "cli.main = lambda argv=None: (print('x' * 300_000, end=''), 3)[1]\n"
              "cli.run()\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, len(proc.stdout), proc.stderr) == (3, 300_000, "")
