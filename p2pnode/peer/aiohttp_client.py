"""aiohttp, imported without reading the system's CA certificates.

aiohttp builds its two default TLS contexts when `aiohttp.connector` is imported, and each loads
the system's trust store (~150 certificates: 0.08-0.15 s of every command that talks to a peer
on these machines).  p2pnode never uses them: every connection to a peer carries its own
context, pinned to the peer's key (tls.py).  So the import points OpenSSL's default paths at
nothing for its duration, and puts the environment back as it was; an aiohttp imported earlier
by someone else is used as it is.  The modules that use aiohttp's client import it from here."""
from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

_CA_PATHS = ("SSL_CERT_FILE", "SSL_CERT_DIR")


@contextmanager
def _no_system_cas() -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in _CA_PATHS}
    os.environ.update(dict.fromkeys(_CA_PATHS, os.devnull))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


if "aiohttp.connector" in sys.modules:
    import aiohttp
else:
    with _no_system_cas():
        import aiohttp

__all__ = ["aiohttp"]
