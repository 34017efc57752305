"""How writes become durable: group commit of the append-only files (fails closed)."""
