"""OS-facing helpers shared by store/ and p2pnode/: one place for each thing the OS must get right.

- files: atomic whole-file writes, private (0600/0700) files and directories
- locks: flock-based inter-process locks, with and without a timeout
- flush: the portable flushes (fdatasync, F_FULLFSYNC, directory fsync) and `write_at`
- eventloop: the event-loop choice (uvloop unless P2PNODE_EVENT_LOOP=asyncio)
- sockets: whether a process listens on a Unix socket file (stale-socket probing)
"""
