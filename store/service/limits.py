"""What one connection may cost the store service (`ServiceLimits`), announced in HELLO."""
from __future__ import annotations

from dataclasses import dataclass

from store.service import messages as m

MiB = 1 << 20


@dataclass(frozen=True)
class ServiceLimits:
    """What one connection may cost the server; all but write_buffer are announced in HELLO."""

    max_payload: int = 256 * MiB
    """Largest turn payload or blob (the engine's own default limit)."""
    max_frame: int = 256 * MiB + 64 * 1024
    """Largest frame payload in either direction: one max_payload plus room for the headers."""
    max_in_flight: int = 128
    """Requests one connection may have unanswered; more get TOO_MANY_IN_FLIGHT."""
    max_turns: int = 65536
    """Largest `limit` of GET_LAST, GET_BEFORE and GET_RANGE_BY_DEPTH."""
    idle_timeout: float = 300.0
    """Seconds without a byte received and with nothing in flight before the server hangs up."""
    read_timeout: float = 30.0
    """Seconds a started frame may take to arrive completely."""
    write_buffer: int = 1 * MiB
    """Queued reply bytes above which the server stops reading from that connection."""
    drain_timeout: float = 30.0
    """Seconds a connection that is being ended waits for the replies of its requests still
    running before it closes without them (not announced)."""

    def __post_init__(self) -> None:
        announced = {
            "max_frame": self.max_frame, "max_payload": self.max_payload, "max_in_flight": self.max_in_flight,
            "max_turns": self.max_turns, "idle_timeout (ms)": self.idle_timeout * 1000,
            "read_timeout (ms)": self.read_timeout * 1000,
        }  # fmt: skip
        for name, value in announced.items():
            if not 0 < value <= 0xFFFF_FFFF:
                raise ValueError(
                    f"ServiceLimits.{name} = {value} is outside 1..{0xFFFF_FFFF} (a u32 in HELLO)"
                )
        for name, value in (("write_buffer", self.write_buffer), ("drain_timeout", self.drain_timeout)):
            if value <= 0:
                raise ValueError(f"ServiceLimits.{name} = {value} must be positive")

    def hello(self, version: int) -> m.HelloReply:
        return m.HelloReply(
            version, self.max_frame, self.max_payload, self.max_in_flight, self.max_turns,
            round(self.idle_timeout * 1000), round(self.read_timeout * 1000),
        )  # fmt: skip
