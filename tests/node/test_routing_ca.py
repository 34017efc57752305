"""The one-shot fetch imports its peer side (aiohttp) with the system's CA store pointed at
nothing (node/routing.py): aiohttp's import-time default contexts read no certificates, and
the environment is as it was afterwards."""
from __future__ import annotations

import os
import ssl

import pytest

from p2pnode.node.routing import _no_system_ca_store


def test_default_contexts_made_meanwhile_trust_nothing_and_the_environment_is_put_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", "/somewhere/cas.pem")
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    with _no_system_ca_store():
        assert ssl.create_default_context().cert_store_stats()["x509_ca"] == 0
    assert os.environ["SSL_CERT_FILE"] == "/somewhere/cas.pem"
    assert "SSL_CERT_DIR" not in os.environ
