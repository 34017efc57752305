"""aiohttp's client comes without the system's CA certificates, and the environment is left as
it was (p2pnode/peer/aiohttp_client.py).  Each case runs in a fresh interpreter: the import
is what is tested."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, os
before = {k: os.environ.get(k) for k in ("SSL_CERT_FILE", "SSL_CERT_DIR")}
import p2pnode.peer.link  # the fetch's first user of aiohttp
import aiohttp.connector
after = {k: os.environ.get(k) for k in ("SSL_CERT_FILE", "SSL_CERT_DIR")}
print(json.dumps({"cas": aiohttp.connector._SSL_CONTEXT_VERIFIED.cert_store_stats()["x509_ca"],
                  "before": before, "after": after}))
"""


@pytest.mark.parametrize("cert_env", [{}, {"SSL_CERT_FILE": "/nonexistent/ca.pem", "SSL_CERT_DIR": "/etc"}])
def test_the_client_loads_no_system_cas_and_restores_the_environment(cert_env: dict[str, str]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("SSL_CERT_FILE", "SSL_CERT_DIR")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**env, **cert_env}, capture_output=True,
                         text=True, check=True).stdout
    got = json.loads(out)
    assert got["cas"] == 0
    expected = {k: cert_env.get(k) for k in ("SSL_CERT_FILE", "SSL_CERT_DIR")}
    assert got["before"] == got["after"] == expected
