"""The announced name in a node's TXT record and the records of a waiting pairing code
(discovery/records.py, sans-IO)."""
from __future__ import annotations

import os

import pytest

from p2pnode.discovery.records import (
    TXT_LIMIT,
    Announcement,
    BadAnnouncement,
    instance_name,
    pair_instance_name,
    pair_subtype,
    pair_txt,
    parse_pair_txt,
    parse_txt,
    txt_size,
)
from p2pnode.peer.nodeid import format_node_id

NODE = format_node_id(os.urandom(32))


def test_a_name_travels_in_the_txt_record_and_stays_within_its_limit():
    ann = Announcement(NODE, 47470, 3, tuple(os.urandom(32).hex() for _ in range(40)), name="alice")
    props = ann.txt()
    assert props["name"] == "alice" and txt_size(props) <= TXT_LIMIT
    back = parse_txt(dict(props), instance_name(NODE))
    assert back.name == "alice" and back.branches == ann.branches[:len(back.branches)]
    assert parse_txt(Announcement(NODE, 1, 0).txt(), instance_name(NODE)).name is None  # older nodes


@pytest.mark.parametrize("name", ["", "x" * 101, "bob\x1b[31m", "a\nb"])
def test_a_bad_announced_name_rejects_the_record(name: str):
    props = dict(Announcement(NODE, 47470, 0).txt(), name=name)
    with pytest.raises(BadAnnouncement):
        parse_txt(props, instance_name(NODE))


def test_pairing_records_name_the_channel_only():
    assert pair_subtype(7) == "_c7._sub._p2pnode-pair._tcp.local."
    instance = pair_instance_name(7, "0a1b2c3d")
    assert instance == "pair7-0a1b2c3d._p2pnode-pair._tcp.local."
    assert pair_txt(7) == {"v": "1", "ch": "7"}  # no node id, no name, nothing of the words
    parse_pair_txt(pair_txt(7), instance, 7)
    for props, name in ((pair_txt(8), instance), (pair_txt(7), pair_instance_name(70, "0a1b2c3d")),
                        ({"v": "1"}, instance)):
        with pytest.raises(BadAnnouncement):
            parse_pair_txt(props, name, 7)
