"""The suite's rules on root and on skips (hooks in conftest.py; `.ci/run` sets the env var).

A skip is a test that did not run.  With P2PNODE_STRICT_SKIPS=1 a run fails on any skip but
these two, which a fresh CI machine cannot avoid:
- NEEDS_ROOT: a test marked `lab` or `root`, run by an ordinary user; `.ci/run` runs those
  again, as root, in its second part.
- a reason starting with KERNEL_LIMITATION: this machine's kernel lacks what the test needs
  (a device-mapper target, mount namespaces in a container); no test can supply a kernel.
"""
from __future__ import annotations

NEEDS_ROOT = "needs root: runs in the root part of .ci/run"
KERNEL_LIMITATION = "kernel limitation: "
ROOT_MARKERS = ("lab", "root")
STRICT_SKIPS_ENV = "P2PNODE_STRICT_SKIPS"


def skip_allowed(reason: str) -> bool:
    return reason == NEEDS_ROOT or reason.startswith(KERNEL_LIMITATION)
