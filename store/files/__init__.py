"""One module per file kind of a store directory; each owns its file's reading, appending and repair."""
