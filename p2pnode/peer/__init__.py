"""Talking to other nodes: identity, trust and mutual TLS, the peer protocol's messages, the
fetch and its multi-peer policy, and serving (the provider)."""
