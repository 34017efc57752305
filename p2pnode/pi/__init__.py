"""Pi's own files, read and written as Pi does: the session header and layout, the line
splitter, the sidecar, incremental hashing and placement. No store, no network."""
