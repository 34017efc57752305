"""Errors of the node's library API.  Each carries the process exit code the CLI uses.

Exit codes (documented in README.md):
  0 ok, 1 unexpected error, 2 usage error, 3 not found, 4 invalid input,
  5 verification failed, 6 no peer reachable / network error, 7 conflict (including a node
  home in use by a running node, and a port another process listens on), 8 refused (untrusted,
  either way round).
The CLI adds 130 (Ctrl-C) and 141 (stdout closed by its reader); it maps the few other
exceptions a command can meet (OSError, the store's StoreLocked and PayloadTooLarge) to these
classes in `cli._as_node_error`, so no message shows a class name or a traceback; the store's
failed state and damage are `from_store`'s, for the CLI and the node alike.
"""
from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

CALLERS_PATH_ERRNOS = frozenset({errno.ENAMETOOLONG, errno.ENOTDIR, errno.EISDIR, errno.ELOOP,
                                 errno.EACCES, errno.EPERM, errno.EINVAL})
"""OSErrors that a path the caller named causes (too long, a file where a directory must be,
a loop of symlinks, one this user may not read or write, a name the file system does not
take): bad input, exit 4 with the path,
from the CLI and the node alike.  A share of a 10,000-character name through the node was a
500 and a traceback; a one-shot fetch into a PI_CODING_AGENT_DIR too deep for the system, exit 1."""


PERMISSION_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
"""A file of the node's own this user may not write (or read), or a read-only file system:
exit 4, naming the file, with what to do (not "make room", as for a full disk)."""


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


def naming(exc: P2PNodeError, subject: str, name: str) -> P2PNodeError:
    """`exc`, its message led by `subject` unless it names `name` already (same class, same exit
    code): a fetch's error says which branch or session the user asked for, whatever part of it
    failed (an ancestor's sidecar, a newer version's line manifest, a session's src)."""
    if name not in str(exc):
        exc.args = (f"{subject}: {exc}", *exc.args[1:])
    return exc


EXIT_INTERRUPTED = 130
"""128 + SIGINT, as a shell reports a command stopped by Ctrl-C."""

KINDS = {1: "error", 3: "not_found", 4: "invalid_input", 5: "verification_failed",
         6: "peer_unavailable", 7: "conflict", 8: "refused", EXIT_INTERRUPTED: "interrupted"}
"""Each exit code's name in the object a command run with --json prints when it fails (an
error the node sent carries only its code, so the name follows the code, not the class)."""


def unwritable(path: str) -> str:
    """What a write refused at `path` is about: a file there, else (a file being made: a temp
    file, a journal's next generation) the directory it was to be made in, which is what the
    user can mend; naming a file that does not exist would tell them nothing."""
    where = Path(path)
    if where.is_dir():
        return f"the directory {where}"
    if not where.exists() and where.parent.is_dir():
        return f"the directory {where.parent}"
    return str(where)


def from_store(exc: BaseException, store: str, then: str) -> P2PNodeError | None:
    """What a store error means to the command that met it (`store`: whose, as the message
    names it; `then`: what to do once there is room), or None for any other exception: a
    failed write (a full disk, an I/O error) leaves nothing recorded; a damaged record is
    refused as bytes that fail their hash are (exit 5)."""
    from store.errors import CorruptRecord, StoreFailed, UnknownBlob

    if isinstance(exc, StoreFailed) and exc.errno in PERMISSION_ERRNOS:
        return InvalidInput(f"{store}: {unwritable(exc.path)} is not writable by this user ({exc.reason}) "
                            f"and nothing of it was recorded: give it back to this user, or mount it "
                            f"read-write, then {then}")
    if isinstance(exc, StoreFailed):
        return P2PNodeError(f"{store} at {exc.path} could not write ({exc.reason}) and recorded nothing "
                            f"of it: make room (or mend the disk), then {then}")
    if isinstance(exc, CorruptRecord | UnknownBlob):
        return VerificationFailed(f"{store} is damaged: {exc} (`p2pnode fsck` lists what; after "
                                  "`fsck --repair`, share the file again, or rm a fetched session and "
                                  "fetch it)")
    return None


def listen_failed(host: str, port: int, exc: OSError) -> P2PNodeError:
    """Why a server could not listen on host:port (the peer server, `serve-peers`, a pairing
    code's listener), naming that address: a port another process holds is a conflict (exit 7),
    an address this machine does not have or a port this user may not use is input (exit 4)."""
    where = f"cannot listen on {host}:{port}"
    if isinstance(exc, socket.gaierror):
        return InvalidInput(f"{where}: {host!r} is not a name or address of this machine ({exc.strerror})")
    why = os.strerror(exc.errno).lower() if exc.errno else str(exc)  # not asyncio's "error while ..."
    if exc.errno == errno.EADDRINUSE:
        return Conflict(f"{where}: port {port} is taken by another process ({why}); stop that process, "
                        "or choose another --port (0: any free port)")
    if exc.errno == errno.EADDRNOTAVAIL:
        return InvalidInput(f"{where}: {host} is not an address of this machine ({why}); "
                            "choose another --host (0.0.0.0: all)")
    if exc.errno in PERMISSION_ERRNOS:
        return InvalidInput(f"{where}: {why} (ports below 1024 need privileges: choose another --port)")
    return P2PNodeError(f"{where}: {why}")
