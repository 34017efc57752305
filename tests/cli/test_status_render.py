"""How `p2pnode status` (and `peers`) render: a node whose store refuses writes (a write met
a full disk) is said, with what to do (only a restart reopens the store); the nodes seen on
the LAN are listed within a bound."""
from __future__ import annotations

import pytest

from p2pnode.cli.render import print_status
from p2pnode.library.api import Catalog
from p2pnode.node.status import build_status


@pytest.mark.parametrize("failure", [None, "No space left on device"])
def test_status_says_when_the_store_refuses_writes(capsys: pytest.CaptureFixture[str],
                                                   failure: str | None) -> None:
    status = build_status(node_id="N", running=True, home="/h", catalog=Catalog(1, []), branches=[], peers=[],
                          space={"store_bytes": 10, "reclaimable_bytes": 0, "store_damage": None},
                          store_failure=failure)
    assert status["store_failure"] == failure
    print_status(status)
    out = capsys.readouterr().out
    assert ("REFUSES WRITES" in out) == (failure is not None)
    if failure:
        assert failure in out and "restart the node" in out


def test_status_and_peers_list_a_few_untrusted_nodes_and_every_trusted_one(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Any host on the LAN can announce thousands of nodes (a flood printed 3,530 lines)."""
    from p2pnode.cli.render import SHOWN_UNTRUSTED, print_peers

    def peer(i: int, trusted: bool) -> dict:
        return {"node_id": f"N{i}", "id": f"N{i}", "name": None, "trusted": trusted, "online": None,
                "addresses": ["10.0.0.1"], "port": 1}

    peers = [peer(i, False) for i in range(500)] + [peer(i, True) for i in range(500, 503)]
    status = build_status(node_id="N", running=True, home="/h", catalog=Catalog(1, []), branches=[],
                          peers=peers, space=None, store_failure=None)
    for show in (lambda: print_status(status), lambda: print_peers(peers)):
        show()
        out = capsys.readouterr().out
        assert all(f"N{i} " in out for i in range(500, 503))  # every trusted one
        assert sum(f"N{i} " in out for i in range(500)) == SHOWN_UNTRUSTED
        assert f"and {500 - SHOWN_UNTRUSTED} more untrusted" in out


def test_unshare_names_each_withheld_fork_by_its_title_if_any(capsys: pytest.CaptureFixture[str]) -> None:
    from p2pnode.cli.render import print_unshared

    print_unshared({"branch": "a" * 64, "versions": [], "withheld": [
        {"branch": "b" * 64, "title": "fix the parser"}, {"branch": "c" * 64, "title": None}]})
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"p2pnode: warning: {'b' * 16} (fix the parser) descends from it")
    assert err[1].startswith(f"p2pnode: warning: {'c' * 16} descends from it")
