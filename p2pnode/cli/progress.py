"""The live progress line of `p2pnode fetch` and `share` (rich, on stderr): bytes, rate, ETA, peers
and lines verified, the same for a one-shot fetch or share (fed by a progress callback through a
ProgressMeter) and for one the running node does (fed by its streamed events).  Nothing is
drawn when stderr is not a terminal, nor for a transfer under MIN_BYTES that ends before
anything would be worth seeing; stdout (the result, `--json`) is never touched.  rich is
imported only when stderr may be a terminal: a scripted fetch does not pay for it."""
from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from p2pnode.cli.render import transfer_detail
from p2pnode.peer.progress import ProgressInfo, ProgressMeter, TransferProgress

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID

MIN_BYTES = 1 << 20


class TransferBar:
    """A context manager: `view(done, total[, info])` as a fetch's or share's progress callback,
    or `view.event(node's event)`; the bar (labelled `label`) is removed at the end."""

    def __init__(self, peers: list[str] | None = None, console: Console | None = None,
                 label: str = "fetch") -> None:
        self.label = label
        if console is None and _may_be_terminal():
            from rich.console import Console

            console = Console(stderr=True)
        self.console = console
        self.enabled = console is not None and console.is_terminal
        self.meter = ProgressMeter(peers, on_change=self.show)
        self._bar: Progress | None = None
        self._task: TaskID | None = None

    def __enter__(self) -> TransferBar:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def __call__(self, done: int, total: int, info: ProgressInfo | None = None) -> None:
        self.meter(done, total, info)

    def event(self, event: dict[str, Any]) -> None:
        """One event the node streamed (node/transfers.py): progress is shown, the rest ignored."""
        if event.get("event") == "progress":
            self.show(TransferProgress.from_dict(event))

    def show(self, p: TransferProgress) -> None:
        if not self.enabled or not p.bytes_total or p.bytes_total < MIN_BYTES:
            return
        if self._bar is None:
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

            self._bar = Progress(TextColumn(self.label), BarColumn(), DownloadColumn(),
                                 TextColumn("{task.fields[detail]}"), console=self.console, transient=True,
                                 auto_refresh=False)  # drawn at each report: the node sends 5 a second
            self._task = self._bar.add_task(self.label, total=p.bytes_total, detail="")
            self._bar.start()
        assert self._task is not None
        self._bar.update(self._task, completed=p.bytes_done, total=p.bytes_total,
                         detail=transfer_detail(p.as_dict()))
        self._bar.refresh()


def _may_be_terminal() -> bool:
    """False when rich's Console(stderr=True).is_terminal would be False for sure (stderr not a
    tty, and neither FORCE_COLOR nor TTY_COMPATIBLE=1 says otherwise); True: ask rich."""
    return sys.stderr.isatty() or "FORCE_COLOR" in os.environ or os.environ.get("TTY_COMPATIBLE") == "1"
