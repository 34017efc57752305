"""Named sessions of the pi 0.73.1 corpus (tests/data/pi-corpus-0.73.1), as paths relative to
an agent dir, for the tests that copy the corpus into a node's agent dir and pick files."""
from __future__ import annotations

ALPHA = "sessions/--tmp-pi-harness-work-alpha--"
A1 = f"{ALPHA}/2026-11-21T19-26-27-092Z_01a1ff93-0313-7475-8d45-88a780e9fa37.jsonl"
"""The alpha root."""
A3 = f"{ALPHA}/2026-11-21T19-26-32-251Z_01a1ff93-173a-7744-89ad-bbc16c12cc22.jsonl"
A6 = f"{ALPHA}/2026-11-21T19-26-31-001Z_01a1ff93-1258-73ae-a9a4-6ce4a586df6a.jsonl"
BETA = "sessions/--tmp-pi-harness-work-beta--"
B1 = f"{BETA}/2026-11-21T19-26-46-592Z_01a1ff93-4f3f-74a0-8c1a-0b533764bed8.jsonl"
"""The beta root; B5's lineage is B5 -> B3 -> B2 -> B1."""
B2 = f"{BETA}/2026-11-21T19-26-52-475Z_01a1ff93-663b-7434-a15c-ca966db56817.jsonl"
B3 = f"{BETA}/2026-11-21T19-26-52-785Z_01a1ff93-6771-72be-be7a-758d028dc479.jsonl"
B5 = f"{BETA}/2026-11-21T19-26-53-423Z_01a1ff93-69ef-76bb-aaf0-d291c98d9fe0.jsonl"
