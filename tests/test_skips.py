"""The strict-skip rule of `.ci/run` (tests/skips.py), on a small suite of its own."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from skips import NEEDS_ROOT, STRICT_SKIPS_ENV

SUITE = '''
import pytest

def test_runs():
    pass

@pytest.mark.root
def test_needs_root():
    import os
    assert os.geteuid() == 0

def test_kernel():
    pytest.skip("kernel limitation: this kernel has no dm-error target")

def test_other():
    pytest.skip("curl is not installed")
'''


def run_suite(tmp_path: Path, strict: bool) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_small.py").write_text(SUITE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    root: needs root\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    env.pop(STRICT_SKIPS_ENV, None)
    if strict:
        env[STRICT_SKIPS_ENV] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "skips", "-p", "no:cacheprovider", "-rs",
                           str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_skip_for_another_reason_fails_a_strict_run(tmp_path: Path) -> None:
    proc = run_suite(tmp_path, strict=True)
    assert proc.returncode == 1, proc.stdout
    refused = proc.stdout.split("skips not allowed", 1)[1]
    assert "test_other: curl is not installed" in refused
    assert "test_kernel" not in refused and "test_needs_root" not in refused  # allowed, or ran as root
    if os.geteuid() != 0:
        assert NEEDS_ROOT in proc.stdout  # the root-only test is skipped, with the reason


def test_a_developers_run_is_not_failed_by_skips(tmp_path: Path) -> None:
    proc = run_suite(tmp_path, strict=False)
    assert proc.returncode == 0 and "skips not allowed" not in proc.stdout, proc.stdout
