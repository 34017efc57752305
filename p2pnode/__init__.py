"""p2pnode: share Pi coding-agent sessions with their fork lineage, by one hash, over the LAN."""

__version__ = "0.1.0"
