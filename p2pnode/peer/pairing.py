"""Pairing two nodes by a short one-time code, sans-IO: the code, the messages, the key schedule
and the two state machines (the asyncio layer is pairlink.py; docs/PROTOCOL.md "Pairing" has
the messages and a test vector, docs/SECURITY.md "Pairing" the threat model).

The waiting side (`p2pnode pair`) shows a code `<channel>-<odd word>-<even word>` (PGP words,
16 bits of secret); the joining side (`p2pnode pair <code>`) finds the waiter by the channel
number and runs SPAKE2 (the `spake2` package) with the whole code as the password.  Each side
then sends its node id (the SHA-256 of its TLS key: what the other side will pin) and its
name, with an HMAC under a key derived from SPAKE2's K over the transcript: only someone who
knows the code can make the other side trust a key, and a passive listener learns nothing that
lets it pose as either node.  One SPAKE2 run per code: the waiter counts the attempt as soon
as it answers a SPAKE2 message (the code is burned whatever follows), so an attacker gets one
guess in 65,536 per code the user makes; codes expire after CODE_TTL seconds.
"""
from __future__ import annotations

import base64
import binascii
import enum
import hashlib
import hmac
import json
import os
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from spake2 import SPAKE2_A, SPAKE2_B
from spake2.spake2 import SPAKEError

from p2pnode.errors import InvalidInput, PeerUnavailable, Refused, VerificationFailed
from p2pnode.peer.nodeid import InvalidNodeId, normalise_node_id
from p2pnode.peer.pgpwords import EVEN, ODD
from p2pnode.peer.trust import MAX_NAME_LEN

PROTOCOL = "p2pnode-pair/1"
VERSION = 1
CODE_TTL = 300.0
"""Seconds a code waits for its one attempt."""
MAX_MESSAGE = 2048
"""Bytes in one message line, newline included (real ones are under 400)."""
MAX_REASON = 200
CHANNELS = 999
"""Channel numbers are 1..CHANNELS: public (announced over mDNS), they only find the waiter."""
ID_JOINER = b"p2pnode-pair/1 joiner"
ID_WAITER = b"p2pnode-pair/1 waiter"
_ODD_INDEX = {w: i for i, w in enumerate(ODD)}
_EVEN_INDEX = {w: i for i, w in enumerate(EVEN)}

Entropy = Callable[[int], bytes]


# --- errors ----------------------------------------------------------------------------------


class BadCode(InvalidInput):
    """A code that is not well-formed (a typo): nothing was sent, the code is not burned."""


class WrongCode(Refused):
    """The other side's key confirmation failed: a wrong code (or someone else answered)."""


class CodeUsed(Refused):
    """The code had its one attempt already."""


class CodeExpired(PeerUnavailable):
    """Nobody paired within CODE_TTL seconds."""


class PairingProtocolError(VerificationFailed):
    """A message that is malformed or comes out of turn."""


class SelfPairing(InvalidInput):
    def __init__(self) -> None:
        super().__init__("this is the node's own code: run `p2pnode pair <code>` on the other machine")


class PeerReported(Refused):
    """The other side stopped the exchange and said why."""


# --- the code ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Code:
    """`7-crossover-clockwork`: a channel number and two PGP words (odd list, then even list)."""

    channel: int
    words: tuple[str, str]

    def __str__(self) -> str:
        return f"{self.channel}-{self.words[0]}-{self.words[1]}"

    @property
    def password(self) -> bytes:
        return str(self).encode()

    @classmethod
    def generate(cls, entropy: Entropy = os.urandom) -> Code:
        raw = entropy(2)
        return cls(1 + secrets.randbelow(CHANNELS), (ODD[raw[0]], EVEN[raw[1]]))

    @classmethod
    def parse(cls, text: str) -> Code:
        """Any case, dashes or spaces between the parts; a typo is refused here, before anything is
        sent, so it does not burn the code."""
        parts = [p for p in re.split(r"[\s-]+", text.strip().lower()) if p]
        number = parts[0] if len(parts) == 3 else ""
        if not (number.isascii() and number.isdigit()) or not 1 <= int(number) <= CHANNELS:  # not "²"
            raise BadCode(f"pairing code {text[:60]!r}: expected <number>-<word>-<word>, "
                          "e.g. 7-crossover-clockwork")
        for word, table in ((parts[1], _ODD_INDEX), (parts[2], _EVEN_INDEX)):
            if word not in table:
                where = "first" if table is _ODD_INDEX else "second"
                raise BadCode(f"pairing code {text[:60]!r}: {word[:30]!r} is not a {where} code word (typo?)")
        return cls(int(parts[0]), (parts[1], parts[2]))


@dataclass(frozen=True)
class Party:
    """What one side claims about itself: its node id (its TLS key) and the name to show for it."""

    node_id: str
    name: str | None

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.node_id, "name": self.name}


def check_name(name: Any) -> str | None:
    if name is None:
        return None
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_LEN or not name.isprintable():
        raise PairingProtocolError(f"pairing: a name must be 1..{MAX_NAME_LEN} printable characters")
    return name


# --- messages ----------------------------------------------------------------------------------


def encode(msg: dict[str, Any]) -> bytes:
    line = json.dumps(msg, separators=(",", ":"), ensure_ascii=True).encode() + b"\n"
    assert len(line) <= MAX_MESSAGE, "pairing messages are small by construction"
    return line


def encode_error(reason: str) -> bytes:
    return encode({"type": "error", "reason": reason[:MAX_REASON]})


def decode(line: bytes) -> dict[str, Any]:
    """One message line → its object; anything else is a PairingProtocolError."""
    if len(line) > MAX_MESSAGE or not line.endswith(b"\n"):
        raise PairingProtocolError(f"pairing: a message must be one line of at most {MAX_MESSAGE} bytes")
    try:
        msg = json.loads(line)
    except (ValueError, RecursionError):
        raise PairingProtocolError("pairing: a message is not JSON") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise PairingProtocolError("pairing: a message must be an object with a type")
    if msg["type"] == "error":
        reason = msg.get("reason")
        text = reason[:MAX_REASON] if isinstance(reason, str) else "no reason given"
        raise PeerReported(f"the other node stopped the pairing: {text}")
    return msg


def _b64(msg: dict[str, Any], key: str, size: int | None = None) -> bytes:
    value = msg.get(key)
    try:
        raw = base64.b64decode(value, validate=True) if isinstance(value, str) else None
    except binascii.Error:
        raw = None
    if raw is None or (size is not None and len(raw) != size):
        raise PairingProtocolError(f"pairing: {msg['type']}.{key} is not valid base64"
                                   + (f" of {size} bytes" if size else ""))
    return raw


def _expect(msg: dict[str, Any], kind: str) -> dict[str, Any]:
    if msg["type"] != kind:
        raise PairingProtocolError(f"pairing: expected a {kind} message, got {msg['type'][:20]!r}")
    return msg


def _party(msg: dict[str, Any]) -> Party:
    node_id = msg.get("id")
    if not isinstance(node_id, str):
        raise PairingProtocolError("pairing: confirm.id must be a node id")
    try:
        node_id = normalise_node_id(node_id)
    except InvalidNodeId as exc:
        raise PairingProtocolError(f"pairing: {exc}") from None
    return Party(node_id, check_name(msg.get("name")))


# --- key schedule ------------------------------------------------------------------------------


def _canon(items: list[Any]) -> bytes:
    return json.dumps(items, separators=(",", ":"), ensure_ascii=True).encode()


@dataclass(frozen=True)
class Keys:
    """What both sides derive from SPAKE2's K and the transcript of the two SPAKE2 messages."""

    transcript: str   # hex SHA-256 of [PROTOCOL, channel, joiner's message, waiter's message]
    joiner: bytes     # HMAC key of the joiner's confirm and ok
    waiter: bytes     # HMAC key of the waiter's confirm

    @classmethod
    def derive(cls, k: bytes, channel: int, joiner_msg: bytes, waiter_msg: bytes) -> Keys:
        transcript = hashlib.sha256(_canon([PROTOCOL, channel, base64.b64encode(joiner_msg).decode(),
                                            base64.b64encode(waiter_msg).decode()])).hexdigest()

        def sub(label: bytes) -> bytes:
            return HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                        info=b"p2pnode-pair/1 " + label + b" " + transcript.encode()).derive(k)

        return cls(transcript, sub(b"joiner"), sub(b"waiter"))

    def mac(self, key: bytes, items: list[Any]) -> bytes:
        return hmac.new(key, _canon([self.transcript, *items]), hashlib.sha256).digest()

    def joiner_confirm(self, joiner: Party) -> bytes:
        return self.mac(self.joiner, ["confirm", joiner.node_id, joiner.name])

    def waiter_confirm(self, joiner: Party, waiter: Party) -> bytes:
        return self.mac(self.waiter, ["confirm", joiner.node_id, joiner.name, waiter.node_id, waiter.name])

    def joiner_ok(self, joiner: Party, waiter: Party) -> bytes:
        return self.mac(self.joiner, ["ok", joiner.node_id, waiter.node_id])


def _verify(msg: dict[str, Any], expected: bytes) -> None:
    if not hmac.compare_digest(_b64(msg, "mac", 32), expected):
        raise WrongCode("the pairing code did not match (mistyped, or another node answered): it is burned "
                        "on both sides; run `p2pnode pair` again for a new code")


def _finish(spake: Any, msg: bytes) -> bytes:
    try:
        return bytes(spake.finish(msg))
    except (SPAKEError, ValueError, AssertionError) as exc:
        raise PairingProtocolError(f"pairing: the SPAKE2 message is invalid ({type(exc).__name__})") from None


# --- the state machines ------------------------------------------------------------------------


class State(enum.Enum):
    WAITING = "waiting"        # waiter: for a SPAKE2 message; joiner: for the waiter's SPAKE2 message
    CONFIRMING = "confirming"  # for the other side's key confirmation
    FINISHING = "finishing"    # waiter: for the joiner's ok
    DONE = "done"
    BURNED = "burned"          # failed after the attempt counted: the code is spent


@dataclass(frozen=True)
class Step:
    """What to do after a message: send `send` (if any); `peer` is set once paired."""

    send: bytes | None = None
    peer: Party | None = None


class Waiter:
    """The side that showed the code.  Feed it each message line with the current time."""

    def __init__(self, code: Code, me: Party, now: float, ttl: float = CODE_TTL,
                 entropy: Entropy = os.urandom) -> None:
        self.code, self.me = code, me
        self.expires_at = now + ttl
        self.state = State.WAITING
        self.attempted = False
        """True once a SPAKE2 run began: the code is spent whatever happens next."""
        self.peer: Party | None = None
        self._entropy = entropy
        self._keys: Keys | None = None

    def expired(self, now: float) -> bool:
        return self.state is not State.DONE and now >= self.expires_at

    def receive(self, line: bytes, now: float) -> Step:
        if self.state is State.DONE or self.attempted and self.state is State.WAITING:
            raise CodeUsed("this pairing code was used already: run `p2pnode pair` again for a new one")
        if self.state is State.BURNED:
            raise CodeUsed("this pairing code failed once and is burned: run `p2pnode pair` again")
        if self.expired(now):
            self.state = State.BURNED
            raise CodeExpired(f"the pairing code expired ({CODE_TTL:g} s without a pairing): "
                              "run `p2pnode pair` again")
        try:
            if self.state is State.FINISHING and self.peer and self.peer.node_id == self.me.node_id:
                raise SelfPairing()  # whatever the joiner says now: it refused our confirm, or it lies
            return self._receive(decode(line))
        except BaseException:
            if self.attempted:
                self.state = State.BURNED
            raise

    def _receive(self, msg: dict[str, Any]) -> Step:
        if self.state is State.WAITING:
            _expect(msg, "pake")
            theirs_v, theirs_c = str(msg.get("version"))[:20], str(msg.get("channel"))[:20]
            if msg.get("version") != VERSION:
                raise PairingProtocolError(f"pairing: the joining node speaks pairing version {theirs_v}, "
                                           f"this one {VERSION}: update p2pnode")
            if msg.get("channel") != self.code.channel:  # a mistyped number; the code is not spent
                raise PairingProtocolError(f"pairing: this node waits with a code numbered "
                                           f"{self.code.channel}, not {theirs_c}: check the code's number")
            theirs = _b64(msg, "msg", 33)
            self.attempted = True  # from here on the code is spent
            spake = SPAKE2_B(self.code.password, idA=ID_JOINER, idB=ID_WAITER, entropy_f=self._entropy)
            mine = spake.start()
            self._keys = Keys.derive(_finish(spake, theirs), self.code.channel, theirs, mine)
            self.state = State.CONFIRMING
            return Step(send=encode({"type": "pake", "msg": base64.b64encode(mine).decode()}))
        assert self._keys is not None
        if self.state is State.CONFIRMING:
            _expect(msg, "confirm")
            joiner = _party(msg)
            _verify(msg, self._keys.joiner_confirm(joiner))
            # this node's own id (its own code typed here): confirmed all the same, so that the
            # joiner learns it from an authenticated message 4 and says so itself (exit 4, not a
            # refusal); the next message then ends the exchange here, never trusting itself
            self.peer = joiner
            self.state = State.FINISHING
            mac = self._keys.waiter_confirm(joiner, self.me)
            return Step(send=encode({"type": "confirm", "id": self.me.node_id, "name": self.me.name,
                                     "mac": base64.b64encode(mac).decode()}))
        assert self.peer is not None
        _expect(msg, "ok")
        _verify(msg, self._keys.joiner_ok(self.peer, self.me))
        self.state = State.DONE
        return Step(peer=self.peer)


class Joiner:
    """The side that typed the code: `start()` gives the first message, then feed it the replies."""

    def __init__(self, code: Code, me: Party, entropy: Entropy = os.urandom) -> None:
        self.code, self.me = code, me
        self.state = State.WAITING
        self.peer: Party | None = None
        self._spake = SPAKE2_A(code.password, idA=ID_JOINER, idB=ID_WAITER, entropy_f=entropy)
        self._mine = b""
        self._keys: Keys | None = None

    def start(self) -> bytes:
        self._mine = self._spake.start()
        return encode({"type": "pake", "version": VERSION, "channel": self.code.channel,
                       "msg": base64.b64encode(self._mine).decode()})

    def receive(self, line: bytes) -> Step:
        if self.state in (State.DONE, State.BURNED) or not self._mine:
            raise PairingProtocolError(f"pairing: no message expected now (state {self.state.value})")
        try:
            return self._receive(decode(line))
        except BaseException:
            self.state = State.BURNED
            raise

    def _receive(self, msg: dict[str, Any]) -> Step:
        if self.state is State.WAITING:
            _expect(msg, "pake")
            theirs = _b64(msg, "msg", 33)
            self._keys = Keys.derive(_finish(self._spake, theirs), self.code.channel, self._mine, theirs)
            self.state = State.CONFIRMING
            mac = self._keys.joiner_confirm(self.me)
            return Step(send=encode({"type": "confirm", "id": self.me.node_id, "name": self.me.name,
                                     "mac": base64.b64encode(mac).decode()}))
        assert self._keys is not None and self.state is State.CONFIRMING
        _expect(msg, "confirm")
        waiter = _party(msg)
        _verify(msg, self._keys.waiter_confirm(self.me, waiter))
        if waiter.node_id == self.me.node_id:
            raise SelfPairing()
        self.peer = waiter
        self.state = State.DONE
        mac = self._keys.joiner_ok(self.me, waiter)
        return Step(send=encode({"type": "ok", "mac": base64.b64encode(mac).decode()}), peer=waiter)
