"""Node ids (no I/O, no cryptography): a key's SPKI SHA-256 shown as grouped base32 with Luhn
check characters, exactly like a Syncthing device id (56 characters in 8 groups of 7), and
read back from what a user typed.  Apart from identity.py so that the commands that only
name peers (a fetch handed to the running node) do not load the TLS and X.509 stack."""
from __future__ import annotations

import base64
import re

from p2pnode.errors import InvalidInput

_B32 = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"


class InvalidNodeId(InvalidInput):
    def __init__(self, text: str, reason: str) -> None:
        super().__init__(f"invalid node id {text!r}: {reason}")


def _luhn32(chars: str) -> str:
    factor, total = 1, 0
    for c in chars:
        addend = factor * _B32.index(c)
        factor = 1 if factor == 2 else 2
        total += addend // 32 + addend % 32
    return _B32[(32 - total % 32) % 32]


def format_node_id(fingerprint: bytes) -> str:
    """32-byte SPKI SHA-256 → `XXXXXXX-XXXXXXX-...` (Syncthing's device id layout)."""
    if len(fingerprint) != 32:
        raise ValueError("a node fingerprint is 32 bytes")
    b32 = base64.b32encode(fingerprint).decode().rstrip("=")  # 52 characters
    chunks = [b32[i : i + 13] for i in range(0, 52, 13)]
    full = "".join(chunk + _luhn32(chunk) for chunk in chunks)
    return "-".join(full[i : i + 7] for i in range(0, 56, 7))


def parse_node_id(text: str) -> bytes:
    """A user-typed node id → its 32-byte fingerprint.

    Accepts any case, dashes or spaces anywhere, the 52-character form without check
    characters, and Syncthing's usual typo fixes (0→O, 1→I, 8→B).  Check characters are
    verified, so a mistyped id is refused rather than silently trusting the wrong key.
    """
    s = re.sub(r"[\s-]", "", text).upper().translate(str.maketrans("018", "OIB"))
    if not s or any(c not in _B32 for c in s):
        raise InvalidNodeId(text, "only base32 letters A-Z and digits 2-7 are allowed")
    if len(s) == 56:
        chunks = [s[i : i + 14] for i in range(0, 56, 14)]
        for n, chunk in enumerate(chunks, 1):
            if _luhn32(chunk[:13]) != chunk[13]:
                raise InvalidNodeId(text, f"check character of group {n} does not match (typo?)")
        s = "".join(chunk[:13] for chunk in chunks)
    elif len(s) != 52:
        raise InvalidNodeId(text, f"expected 56 characters (52 without checks), got {len(s)}")
    raw = base64.b32decode(s + "====")
    if base64.b32encode(raw).decode().rstrip("=") != s:  # the last character's 4 spare bits
        raise InvalidNodeId(text, "not a canonical encoding")
    return raw


def normalise_node_id(text: str) -> str:
    return format_node_id(parse_node_id(text))
