"""sessions.json made anew from the store, for `p2pnode fsck --repair` when the file is lost or
unreadable: every branch sidecar the store holds, and the version below it, read back from
their turns (each line re-hashed by the store, the whole re-hashed to the sidecar's `src`).

What only the file knew is not in the store and comes back as the safe default: each branch
is not offered (the user shares it again to offer it, with the --to and --expires it wants),
`shared_at` is the time of the rebuild, and the links between versions are found again at
the next open (`versions.unlinked_growths`).  The titles and the header are read from the
lines as an import reads them.
"""
from __future__ import annotations

import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass

from p2pnode.errors import P2PNodeError, VerificationFailed
from p2pnode.library.sessions import TAG_HEADER, TAG_SIDECAR, BranchRecord, Version
from p2pnode.pi.hashing import new_hasher
from p2pnode.pi.session import HEADER_SCAN_BYTES, is_header_candidate, parse_header, titles_after
from p2pnode.pi.sidecar import blake3_hex, parse_sidecar
from store.api import Store
from store.errors import StoreError
from store.types import Turn

LINES_READ = 256
"""Lines read from the store at once (a version is never whole in memory)."""


@dataclass(frozen=True)
class Rebuilt:
    """What the store gave back, and what it could not: (the branch, if its sidecar could be
    read; why) of each."""

    versions: list[Version]
    branches: list[BranchRecord]
    lost: list[tuple[str | None, str]]
    left_out: list[str]
    """Branches the store still holds that were forgotten before (`forgotten`)."""


def rebuild(store: Store, forgotten: Collection[str] = ()) -> Rebuilt:
    """The version and branch records of every sidecar the store's contexts end with, but
    those of `forgotten` branches: a branch removed (`rm`, `gc`) whose version another branch
    keeps leaves its sidecar heading the version's context, and must not come back."""
    headers: dict[int, int] = {}  # header turn -> the context it heads (a version's own)
    sidecars: list[tuple[int, Turn]] = []
    lost: list[tuple[str | None, str]] = []
    for head in store.list_contexts():
        if not head.head_turn_id:
            continue
        try:
            turn = store.get_turn(head.head_turn_id)
        except StoreError as exc:
            lost.append((None, f"context {head.context_id}: {exc}"))
            continue
        if turn.type_tag == TAG_HEADER:
            headers[turn.turn_id] = head.context_id
        elif turn.type_tag == TAG_SIDECAR:
            sidecars.append((head.context_id, turn))
    versions: dict[str, Version] = {}
    branches: list[BranchRecord] = []
    left_out: list[str] = []
    now = int(time.time() * 1000)
    for context, turn in sidecars:
        branch = None
        try:
            sidecar = store.get_blob(turn.payload_hash, verify=True)
            branch = blake3_hex(sidecar)
            if branch in forgotten:
                left_out.append(branch)
                continue
            parsed = parse_sidecar(sidecar, branch)
            if parsed.src not in versions:
                versions[parsed.src] = _version(store, parsed.src, turn.parent_turn_id,
                                                headers.get(turn.parent_turn_id, context))
        except (StoreError, P2PNodeError) as exc:
            lost.append((branch, f"context {context} (sidecar turn {turn.turn_id}): {exc}"))
            continue
        branches.append(BranchRecord(branch, parsed.src, parsed.parent, context, turn.turn_id,
                                     offered=False, shared_at=now))
    return Rebuilt(list(versions.values()), branches, lost, left_out)


def _version(store: Store, src: str, header_turn: int, context: int) -> Version:
    """The version whose chain ends with `header_turn`, read back and hashed to `src`."""
    top = store.get_turn(header_turn)
    if top.type_tag != TAG_HEADER:
        raise VerificationFailed(f"turn {header_turn} below the sidecar is not a session's header")
    hasher = new_hasher()
    size = lines = last_start = 0
    header_line: bytes | None = None
    name: str | None = None
    first_user: str | None = None
    ended = True
    for line in _file_lines(store, top):
        if header_line is None and size < HEADER_SCAN_BYTES and is_header_candidate(line):
            header_line = line
        name, first_user = titles_after(line, name, first_user)
        hasher.update(line)
        last_start = size
        size += len(line)
        lines += 1
        ended = line.endswith(b"\n")
    if (actual := hasher.hexdigest()) != src:
        raise VerificationFailed(f"session {src} read back from the store hashes to {actual}")
    if header_line is None:
        raise VerificationFailed(f"session {src} has no header in its first {HEADER_SCAN_BYTES} bytes")
    header = parse_header(header_line.rstrip(b"\n"), f"session {src}")
    return Version(src=src, session_id=header.id, header=header.as_dict(), size=size, lines=lines,
                   last_line_start=size if ended else last_start, context=context,
                   head=header_turn, name=name, first_user=first_user)


def _file_lines(store: Store, top: Turn) -> Iterator[bytes]:
    """The file's lines in order: the header (the chain's top), then the body (the rest)."""
    yield store.payloads([top])[0]
    body = store.chain(top.turn_id)[:-1]
    for at in range(0, len(body), LINES_READ):
        yield from store.payloads(body[at:at + LINES_READ])
