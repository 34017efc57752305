"""Errors of the node's library API.  Each carries the process exit code the CLI uses.

Exit codes (documented in README.md):
  0 ok, 1 unexpected error, 2 usage error, 3 not found, 4 invalid input,
  5 verification failed, 6 no peer reachable / network error, 7 conflict (including a node
  home in use by a running node), 8 refused (untrusted, either way round).
The CLI adds 130 (Ctrl-C) and 141 (stdout closed by its reader); it maps the few other
exceptions a command can meet (OSError, the store's StoreLocked and PayloadTooLarge) to these
classes in `cli._as_node_error`, so no message shows a class name or a traceback.
"""
from __future__ import annotations


class P2PNodeError(Exception):
    exit_code = 1


class NotFound(P2PNodeError):
    exit_code = 3


class InvalidInput(P2PNodeError):
    exit_code = 4


class VerificationFailed(P2PNodeError):
    exit_code = 5


class PeerUnavailable(P2PNodeError):
    exit_code = 6


class Conflict(P2PNodeError):
    exit_code = 7


class Refused(P2PNodeError):
    exit_code = 8
