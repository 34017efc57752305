"""The pairing protocol's sans-IO core (p2pnode/peer/pairing.py): the code, both state machines,
and every way an exchange must fail (wrong code, replay, expiry, tampering, out of turn)."""
from __future__ import annotations

import base64
import json
import os

import pytest

from p2pnode.peer.nodeid import format_node_id
from p2pnode.peer.pairing import (
    CODE_TTL,
    BadCode,
    Code,
    CodeExpired,
    CodeUsed,
    Joiner,
    PairingProtocolError,
    Party,
    PeerReported,
    SelfPairing,
    State,
    Waiter,
    WrongCode,
    encode,
    encode_error,
)
from p2pnode.peer.pgpwords import EVEN, ODD

CODE = Code.parse("7-crossover-clockwork")
BOB = Party(format_node_id(bytes([0x11]) * 32), "bob")      # joins
ALICE = Party(format_node_id(bytes([0x22]) * 32), "alice")  # waits


def run(joiner: Joiner, waiter: Waiter, now: float = 1.0) -> tuple[Party | None, Party | None]:
    """The five messages in turn; (whom the joiner paired with, whom the waiter paired with)."""
    to_joiner = waiter.receive(joiner.start(), now)
    to_waiter = joiner.receive(to_joiner.send or b"")
    to_joiner = waiter.receive(to_waiter.send or b"", now)
    done = joiner.receive(to_joiner.send or b"")
    final = waiter.receive(done.send or b"", now)
    return done.peer, final.peer


def tamper(line: bytes, **changes: object) -> bytes:
    msg = json.loads(line)
    msg.update(changes)
    return encode(msg)


# --- the code --------------------------------------------------------------------------------------


def test_codes_are_a_channel_and_two_pgp_words_and_parse_back_loosely():
    for _ in range(50):
        code = Code.generate()
        assert 1 <= code.channel <= 999 and code.words[0] in ODD and code.words[1] in EVEN
        assert Code.parse(str(code)) == code
        assert Code.parse("  " + str(code).upper().replace("-", " ") + " ") == code
    assert len(set(ODD)) == len(set(EVEN)) == 256 and not set(ODD) & set(EVEN)  # 16 bits of secret


@pytest.mark.parametrize("text", ["", "7", "7-crossover", "crossover-clockwork-7", "0-crossover-clockwork",
                                  "1000-crossover-clockwork", "7-clockwork-crossover", "7-crosover-clockwork",
                                  "7-crossover-clockwork-extra", "\u00b2-crossover-clockwork"])
def test_a_malformed_code_is_refused_before_anything_is_sent(text: str):
    with pytest.raises(BadCode) as err:
        Code.parse(text)
    assert err.value.exit_code == 4


# --- the exchange ----------------------------------------------------------------------------------


def test_right_code_both_sides_learn_each_other_id_and_name():
    joiner, waiter = Joiner(CODE, BOB), Waiter(CODE, ALICE, now=0.0)
    assert run(joiner, waiter) == (ALICE, BOB)
    assert joiner.state is waiter.state is State.DONE


def test_wrong_code_fails_on_both_sides_and_burns_the_code():
    wrong = Code(CODE.channel, ("crossover", "cobra"))
    joiner, waiter = Joiner(wrong, BOB), Waiter(CODE, ALICE, now=0.0)
    reply = waiter.receive(joiner.start(), 1.0)
    confirm = joiner.receive(reply.send or b"")
    with pytest.raises(WrongCode) as err:
        waiter.receive(confirm.send or b"", 1.0)
    assert err.value.exit_code == 8 and "burned" in str(err.value)
    assert waiter.state is State.BURNED
    # the joiner hears why and is done too
    with pytest.raises(PeerReported):
        joiner.receive(encode_error(str(err.value)))
    assert joiner.state is State.BURNED
    # the right code cannot be tried afterwards: one attempt per code
    with pytest.raises(CodeUsed):
        waiter.receive(Joiner(CODE, BOB).start(), 1.0)


def test_a_waiter_that_answered_once_takes_no_second_spake2_message():
    waiter = Waiter(CODE, ALICE, now=0.0)
    waiter.receive(Joiner(CODE, BOB).start(), 1.0)
    with pytest.raises(PairingProtocolError):  # out of turn: it burns the code
        waiter.receive(Joiner(CODE, BOB).start(), 1.0)
    assert waiter.state is State.BURNED


def test_garbage_before_any_spake2_message_does_not_burn_the_code():
    waiter = Waiter(CODE, ALICE, now=0.0)
    for junk in (b"GET / HTTP/1.1\r\n", b"{}\n", b"[1]\n", encode({"type": "confirm"}),
                 tamper(Joiner(CODE, BOB).start(), channel=8), tamper(Joiner(CODE, BOB).start(), msg="AAAA")):
        with pytest.raises(PairingProtocolError):
            waiter.receive(junk, 1.0)
    assert not waiter.attempted and waiter.state is State.WAITING
    assert run(Joiner(CODE, BOB), waiter) == (ALICE, BOB)


def test_a_mistyped_code_number_or_another_version_is_said_plainly():
    """It said 'expected version 1 on channel N' for both."""
    waiter = Waiter(CODE, ALICE, now=0.0)
    with pytest.raises(PairingProtocolError, match=f"waits with a code numbered {CODE.channel}, not 8"):
        waiter.receive(tamper(Joiner(CODE, BOB).start(), channel=8), 1.0)
    with pytest.raises(PairingProtocolError, match="speaks pairing version 9, this one 1: update p2pnode"):
        waiter.receive(tamper(Joiner(CODE, BOB).start(), version=9), 1.0)
    assert waiter.state is State.WAITING


def test_a_replayed_exchange_fails():
    """Every message of a successful exchange, replayed to a new waiter with the same code (the
    worst case: the user made the same code again), fails at the first MAC and burns it."""
    joiner, waiter = Joiner(CODE, BOB), Waiter(CODE, ALICE, now=0.0)
    first = joiner.start()
    second = waiter.receive(first, 1.0)
    confirm = joiner.receive(second.send or b"")
    answer = waiter.receive(confirm.send or b"", 1.0)
    again = Waiter(CODE, ALICE, now=0.0)
    again.receive(first, 1.0)  # a fresh SPAKE2 run on the waiter's side: another K
    with pytest.raises(WrongCode):
        again.receive(confirm.send or b"", 1.0)
    assert again.state is State.BURNED and again.peer is None
    # and the waiter's own answers replayed to a new joiner do not confirm either
    fresh = Joiner(CODE, BOB)
    fresh.start()
    fresh.receive(second.send or b"")
    with pytest.raises(WrongCode):
        fresh.receive(answer.send or b"")
    assert fresh.state is State.BURNED and fresh.peer is None


def test_an_expired_code_refuses_even_the_right_joiner():
    waiter = Waiter(CODE, ALICE, now=100.0)
    with pytest.raises(CodeExpired) as err:
        waiter.receive(Joiner(CODE, BOB).start(), 100.0 + CODE_TTL)
    assert err.value.exit_code == 6 and waiter.state is State.BURNED
    assert Waiter(CODE, ALICE, now=100.0).expired(100.0 + CODE_TTL)
    assert not Waiter(CODE, ALICE, now=100.0).expired(100.0 + CODE_TTL - 1)


@pytest.mark.parametrize("field", ["mac", "id", "name"])
def test_a_tampered_joiner_confirm_is_refused(field: str):
    joiner, waiter = Joiner(CODE, BOB), Waiter(CODE, ALICE, now=0.0)
    confirm = joiner.receive(waiter.receive(joiner.start(), 1.0).send or b"").send or b""
    changes = {"mac": base64.b64encode(os.urandom(32)).decode(), "id": format_node_id(bytes([0x33]) * 32),
               "name": "mallory"}
    with pytest.raises(WrongCode):
        waiter.receive(tamper(confirm, **{field: changes[field]}), 1.0)
    assert waiter.state is State.BURNED and waiter.peer is None


@pytest.mark.parametrize("field", ["mac", "id", "name"])
def test_a_tampered_waiter_confirm_is_refused(field: str):
    joiner, waiter = Joiner(CODE, BOB), Waiter(CODE, ALICE, now=0.0)
    confirm = joiner.receive(waiter.receive(joiner.start(), 1.0).send or b"").send or b""
    answer = waiter.receive(confirm, 1.0).send or b""
    changes = {"mac": base64.b64encode(os.urandom(32)).decode(), "id": format_node_id(bytes([0x33]) * 32),
               "name": "mallory"}
    with pytest.raises(WrongCode):
        joiner.receive(tamper(answer, **{field: changes[field]}))
    assert joiner.state is State.BURNED and joiner.peer is None


def test_a_tampered_ok_leaves_the_waiter_untrusting():
    joiner, waiter = Joiner(CODE, BOB), Waiter(CODE, ALICE, now=0.0)
    confirm = joiner.receive(waiter.receive(joiner.start(), 1.0).send or b"").send or b""
    ok = joiner.receive(waiter.receive(confirm, 1.0).send or b"").send or b""
    with pytest.raises(WrongCode):
        waiter.receive(tamper(ok, mac=base64.b64encode(bytes(32)).decode()), 1.0)
    assert waiter.state is State.BURNED


def test_a_node_cannot_pair_with_itself():
    """The waiter confirms all the same, so that the joiner tells it from an authenticated
    message (SelfPairing, exit 4, not the waiter's unauthenticated error); the waiter then
    ends with SelfPairing whatever comes next, an `ok` included, trusting nobody."""
    joiner, waiter = Joiner(CODE, ALICE), Waiter(CODE, ALICE, now=0.0)
    confirm = joiner.receive(waiter.receive(joiner.start(), 1.0).send or b"").send or b""
    theirs = waiter.receive(confirm, 1.0).send or b""
    with pytest.raises(SelfPairing) as err:
        joiner.receive(theirs)
    assert err.value.exit_code == 4 and joiner.peer is None
    assert joiner._keys is not None  # a joiner that lies: it sends the ok all the same
    ok = encode({"type": "ok", "mac": base64.b64encode(joiner._keys.joiner_ok(ALICE, ALICE)).decode()})
    with pytest.raises(SelfPairing):
        waiter.receive(ok, 1.0)
    assert waiter.state is State.BURNED


@pytest.mark.parametrize("line", [b"x" * 3000 + b"\n", b'{"type":"pake"}', b"\xff\n", b'"pake"\n',
                                  b"[" * 5000 + b"\n"])
def test_malformed_lines_are_protocol_errors(line: bytes):
    with pytest.raises(PairingProtocolError) as err:
        Waiter(CODE, ALICE, now=0.0).receive(line, 1.0)
    assert err.value.exit_code == 5


def test_a_bad_peer_name_is_refused():
    joiner, waiter = Joiner(CODE, Party(BOB.node_id, "bob\x1b[31m"), ), Waiter(CODE, ALICE, now=0.0)
    confirm = joiner.receive(waiter.receive(joiner.start(), 1.0).send or b"").send or b""
    with pytest.raises(PairingProtocolError):
        waiter.receive(confirm, 1.0)


# --- the test vector of docs/PROTOCOL.md, "Pairing" ----------------------------------------------------

VECTOR = [
    b'{"type":"pake","version":1,"channel":7,"msg":"Qc1ox0XCcPsslGmic+DtkOhrynjsou69nVBi2TJYEPJS"}\n',
    b'{"type":"pake","msg":"Qpq17DlYW3eL1AFynVmexYPNllwiVYz/CEIykz41SQmo"}\n',
    b'{"type":"confirm","id":"CEIRCEI-RCEIRC7-EIRCEIR-CEIRCEB-IRCEIRC-EIRCEIZ-RCEIRCE-IRCEIQV",'
    b'"name":"bob","mac":"pnafgsf2ogk2NYxvtSWdlqNMPfMdcs+FpfnN3eLL+SI="}\n',
    b'{"type":"confirm","id":"EIRCEIR-CEIRCEB-IRCEIRC-EIRCEIZ-RCEIRCE-IRCEIRU-CEIRCEI-RCEIRAB",'
    b'"name":"alice","mac":"w4AmbCX/i0fsPDP7laSwRI+2MHf6vr5dgaxnjdO8I1c="}\n',
    b'{"type":"ok","mac":"fBRir4LFkEx1qRwlpyud+9sca6eMAHa4o3kSq++FONI="}\n',
]


def test_the_documented_test_vector():
    joiner = Joiner(CODE, BOB, entropy=lambda n: b"\x01" * n)
    waiter = Waiter(CODE, ALICE, now=0.0, entropy=lambda n: b"\x02" * n)
    sent = [joiner.start()]
    sent.append(waiter.receive(sent[-1], 1.0).send or b"")
    sent.append(joiner.receive(sent[-1]).send or b"")
    sent.append(waiter.receive(sent[-1], 1.0).send or b"")
    sent.append(joiner.receive(sent[-1]).send or b"")
    assert waiter.receive(sent[-1], 1.0).peer == BOB
    assert sent == VECTOR
    keys = joiner._keys
    assert keys is not None
    assert keys.transcript == "9a29a55dc83f2df044b2bd72999fa7d95012b1821f25c65e2c19dcd07ba1d447"
    assert keys.joiner.hex() == "f784517bc48bb6d5a126095cf221be2ca110453edd242f57144c37089ec50c59"
    assert keys.waiter.hex() == "60b074ea5a3ff2372b4bfe4b97adf03ad15f114eae7c1088d511490c8fe95bb8"
