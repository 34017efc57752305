"""`p2pnode status` of a node whose store refuses writes (a write met a full disk): said, with
what to do (the node keeps its store open; only a restart reopens it)."""
from __future__ import annotations

import pytest

from p2pnode.cli.render import print_status
from p2pnode.library.api import Catalog
from p2pnode.node.status import build_status


@pytest.mark.parametrize("failure", [None, "No space left on device"])
def test_status_says_when_the_store_refuses_writes(capsys: pytest.CaptureFixture[str],
                                                   failure: str | None) -> None:
    status = build_status(node_id="N", running=True, home="/h", catalog=Catalog(1, []), branches=[], peers=[],
                          space={"store_bytes": 10, "reclaimable_bytes": 0}, store_failure=failure)
    assert status["store_failure"] == failure
    print_status(status)
    out = capsys.readouterr().out
    assert ("REFUSES WRITES" in out) == (failure is not None)
    if failure:
        assert failure in out and "restart the node" in out
