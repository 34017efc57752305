"""The suite's rules on root and on skips: pytest hooks, used by conftest.py (or `-p skips`).

A skip is a test that did not run.  With P2PNODE_STRICT_SKIPS=1 a run fails on any skip but
these two, which a fresh CI machine cannot avoid:
- NEEDS_ROOT: a test marked `lab` or `root`, run by an ordinary user; `.ci/run` runs those
  again, as root, in its second part.
- a reason starting with KERNEL_LIMITATION: this machine's kernel lacks what the test needs
  (a device-mapper target, mount namespaces in a container); no test can supply a kernel.
"""
from __future__ import annotations

import os

import pytest

NEEDS_ROOT = "needs root: runs in the root part of .ci/run"
KERNEL_LIMITATION = "kernel limitation: "
ROOT_MARKERS = ("lab", "root")
STRICT_SKIPS_ENV = "P2PNODE_STRICT_SKIPS"


def skip_allowed(reason: str) -> bool:
    return reason == NEEDS_ROOT or reason.startswith(KERNEL_LIMITATION)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.geteuid() == 0:
        return
    for item in items:
        if any(item.get_closest_marker(m) for m in ROOT_MARKERS):
            item.add_marker(pytest.mark.skip(reason=NEEDS_ROOT))


_refused_skips: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if os.environ.get(STRICT_SKIPS_ENV) != "1" or not report.skipped or hasattr(report, "wasxfail"):
        return
    assert isinstance(report.longrepr, tuple)  # (file, line, "Skipped: <reason>")
    reason = report.longrepr[2].removeprefix("Skipped: ")
    if not skip_allowed(reason):
        _refused_skips.append(f"{report.nodeid}: {reason}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _refused_skips:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _refused_skips:
        terminalreporter.section(f"skips not allowed with {STRICT_SKIPS_ENV}=1 (the run fails)", red=True)
        for line in _refused_skips:
            terminalreporter.line(line)
