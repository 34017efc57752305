"""The always-on node: the daemon's composition, its control API and the client of that API."""
