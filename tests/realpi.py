"""The real `pi` from npm for tests (tests/pi/test_real_pi.py, tests/node/test_lan_real_pi.py):
where `.ci/install-real-pi` put each version, and running it in print mode against the scripted
stand-in for the model (tests/pimodel.py).

The tests never install anything themselves (they talk only to loopback).  A version that is
not installed fails the test, saying how to install it; a version that npm could not install
because the registry does not have its packages (npm's E404/ETARGET, recorded by the script
in INSTALL-FAILED) is an expected failure with npm's own words as the reason.
"""
from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest
from pimodel import MODEL, PROVIDER

VERSIONS = ("0.73.1", "1.5.2")
PI_TIMEOUT = 120


def real_pi_dir() -> Path:
    """$P2PNODE_REAL_PI_DIR, else ~/.cache/p2pnode/real-pi (the script's default too)."""
    env = os.environ.get("P2PNODE_REAL_PI_DIR")
    return Path(env) if env else Path.home() / ".cache" / "p2pnode" / "real-pi"


def installed_pi(version: str) -> Path:
    """The `pi` executable of this version, as .ci/install-real-pi installed it."""
    prefix = real_pi_dir() / version
    binary = prefix / "node_modules" / ".bin" / "pi"
    if binary.exists():
        return binary
    failed = prefix / "INSTALL-FAILED"
    if failed.exists() and any(code in failed.read_text() for code in ("E404", "ETARGET")):
        pytest.xfail(f"pi {version}: the npm registry does not have its packages: {failed.read_text()}")
    pytest.fail(f"the real pi {version} is not installed in {prefix}: run .ci/install-real-pi "
                f"{real_pi_dir()} (it needs node and npm)", pytrace=False)


def run_pi(binary: Path, *args: str, cwd: Path, env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    """The real pi in print mode (`-p`) against the stand-in (its models.json in the agent dir
    that `env` names), with no tools; it must succeed."""
    env = dict(env, PI_OFFLINE="1", PI_SKIP_VERSION_CHECK="1")
    node = binary.parents[2] / "node" / "node_modules" / ".bin"  # installed when this node is too old
    if node.is_dir():
        env["PATH"] = f"{node}{os.pathsep}{env.get('PATH', '')}"
    argv = [str(binary), "-p", "--provider", PROVIDER, "--model", MODEL, "--no-tools", *args]
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=PI_TIMEOUT)
    assert proc.returncode == 0, f"pi {' '.join(args)} exited {proc.returncode}: {proc.stderr}"
    return proc
