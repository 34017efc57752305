"""The node's state: sessions as turn chains in the store, the manifest of shares and
placed files, and the porcelain API (share, unshare, ls, show, cat, add_fetched)."""
