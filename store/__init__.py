"""The turn and blob store: an append-dominant, crash-safe store of immutable turns
(a parent-pointer DAG), context heads and a deduplicated, zstd-compressed blob pack.

This package knows nothing of Pi sessions, peers or the command line.
"""
