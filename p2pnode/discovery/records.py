"""The DNS-SD scheme of p2pnode nodes (docs/PROTOCOL.md, "LAN discovery"): instance and
subtype names, the TXT record a node announces and its validation, and the records of a waiting
pairing code (docs/PROTOCOL.md, "Pairing").  No I/O: mdns.py sends and receives these over zeroconf."""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from p2pnode.errors import InvalidInput
from p2pnode.pi.sidecar import is_hash_hex

SERVICE_TYPE = "_p2pnode._tcp.local."
RECORD_VERSION = 1
"""TXT `v`: the version of this announcement scheme (the peer protocol has its own,
peer/wire.py's PROTOCOL_VERSION)."""
TXT_LIMIT = 1300          # bytes on the wire: one unfragmented packet with the other records
LABEL_CHARS = 26          # node-id characters in an instance label (130 bits)
SUBTYPE_HEX = 16          # branch-hash hex characters in a subtype label (64 bits, a hint)
MAX_SUBTYPES = 16         # branch subtypes one node announces (most recent first)
MAX_NAME_CHARS = 100     # a node's announced name (trust.MAX_NAME_LEN)
MAIN_INSTANCE = re.compile(rf"^p2p-[0-9a-z]{{{LABEL_CHARS}}}\.", re.IGNORECASE)


class BadAnnouncement(InvalidInput):
    """A TXT record that is not a valid p2pnode announcement."""


def instance_label(node_id: str) -> str:
    """DNS label for a node: `p2p-` + the first LABEL_CHARS alphanumerics of its id, lower case."""
    chars = re.sub(r"[^0-9a-z]", "", node_id.lower())
    if len(chars) < LABEL_CHARS:
        raise BadAnnouncement(f"node id {node_id!r} is too short for an instance label")
    return "p2p-" + chars[:LABEL_CHARS]


def instance_name(node_id: str) -> str:
    return f"{instance_label(node_id)}.{SERVICE_TYPE}"


def subtype_name(branch_hex: str) -> str:
    return f"_{branch_hex[:SUBTYPE_HEX]}._sub.{SERVICE_TYPE}"


def branch_instance_name(node_id: str, branch_hex: str) -> str:
    return f"{instance_label(node_id)}-{branch_hex[:SUBTYPE_HEX]}.{SERVICE_TYPE}"


def txt_size(props: dict[str, str]) -> int:
    """Wire size of a TXT record: one length byte plus `key=value` per string."""
    return sum(1 + len(k.encode()) + 1 + len(v.encode()) for k, v in props.items())


@dataclass(frozen=True)
class Announcement:
    """What a node claims about itself in its main instance's TXT record."""

    node_id: str
    port: int
    generation: int
    branches: tuple[str, ...] = ()   # most recently shared first
    version: int = RECORD_VERSION
    name: str | None = None          # the name its user gave it (`pair --name`): a claim, shown as such

    def txt(self) -> dict[str, str]:
        """TXT properties; branches are cut so the record stays within TXT_LIMIT bytes."""
        props = {"v": str(self.version), "id": self.node_id, "port": str(self.port),
                 "gen": str(self.generation)}
        if self.name is not None:
            props["name"] = self.name
        for i, branch in enumerate(self.branches):
            key = f"b{i}"
            if txt_size(props) + 1 + len(key) + 1 + len(branch) > TXT_LIMIT:
                break
            props[key] = branch
        return props


def parse_txt(props: Mapping[str, str | None], instance: str) -> Announcement:
    """Validate a received TXT record; the id must match the instance label it came under."""
    def need(key: str) -> str:
        value = props.get(key)
        if value is None:
            raise BadAnnouncement(f"{instance}: TXT has no {key!r}")
        return value

    def integer(key: str, lo: int, hi: int) -> int:
        raw = need(key)
        if not (raw.isascii() and raw.isdigit()) or not lo <= int(raw) <= hi:  # int() refuses "²"
            raise BadAnnouncement(f"{instance}: TXT {key}={raw!r} is not an integer in {lo}..{hi}")
        return int(raw)

    version = integer("v", 1, 65535)
    node_id = need("id")
    label = instance.split(".")[0].lower()
    mine = instance_label(node_id)
    if label != mine and not label.startswith(mine + "-"):  # main or per-branch instance
        raise BadAnnouncement(f"{instance}: TXT id {node_id!r} does not match the instance name")
    branches = []
    for i in range(len(props)):
        branch = props.get(f"b{i}")
        if branch is None:
            break
        if not is_hash_hex(branch):
            raise BadAnnouncement(f"{instance}: TXT b{i}={branch!r} is not a 64-hex branch hash")
        branches.append(branch)
    name = props.get("name")
    if name is not None and not valid_name(name):
        raise BadAnnouncement(f"{instance}: TXT name is not 1..{MAX_NAME_CHARS} printable characters")
    return Announcement(node_id, integer("port", 1, 65535), integer("gen", 0, 2**63),
                        tuple(branches), version, name)


def valid_name(name: str) -> bool:
    return 0 < len(name) <= MAX_NAME_CHARS and name.isprintable()


# --- pairing (`p2pnode pair`): a waiting code announced by its channel number ------------------

PAIR_SERVICE_TYPE = "_p2pnode-pair._tcp.local."


def pair_subtype(channel: int) -> str:
    """The subtype a waiter announces, so that `pair <code>` asks only for its channel."""
    return f"_c{channel}._sub.{PAIR_SERVICE_TYPE}"


def pair_instance_name(channel: int, token: str) -> str:
    """`pair<channel>-<random token>`: unique without naming the node."""
    return f"pair{channel}-{token}.{PAIR_SERVICE_TYPE}"


def pair_txt(channel: int) -> dict[str, str]:
    return {"v": str(RECORD_VERSION), "ch": str(channel)}


def parse_pair_txt(props: Mapping[str, str | None], instance: str, channel: int) -> None:
    """A waiter's TXT must name the channel that was asked for (and its instance must too)."""
    if props.get("ch") != str(channel) or not instance.startswith(f"pair{channel}-"):
        raise BadAnnouncement(f"{instance}: not a pairing announcement for channel {channel}")
