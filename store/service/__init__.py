"""The store's local frame-protocol service (docs/PROTOCOL.md): codecs, server, client."""
