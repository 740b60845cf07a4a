"""Progress of long transfers: a bar on a terminal, log lines otherwise.

Quiet for transfers that finish within ``after`` seconds, which is most of them.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import TextIO

__all__ = ["Progress"]

log = logging.getLogger("rallypoint.trainer")

_MiB = 1 << 20


class Progress:
    """Counts bytes moved; thread-safe (parallel blocks report from several threads).

    Args:
        label: What moves, e.g. ``"save step 1200 (rank 3)"``.
        total: Bytes expected.
        enabled: False silences it.
        stream: Where the bar goes; a bar only if it is a terminal, else log lines.
        after: Seconds before anything is shown.
    """

    def __init__(
        self,
        label: str,
        total: int,
        *,
        enabled: bool = True,
        stream: TextIO | None = None,
        after: float = 1.0,
    ) -> None:
        self.label = label
        self.total = total
        self.done = 0
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.after = after
        self._start = time.monotonic()
        self._shown = 0.0
        self._lock = threading.Lock()

    def update(self, n: int) -> None:
        with self._lock:
            self.done += n
            if not self.enabled:
                return
            now = time.monotonic()
            # A bar redraws ten times a second; log lines every ten seconds.
            if now - self._start >= self.after and now - self._shown >= (0.1 if self.tty else 10):
                self._shown = now
                self._show(now, final=False)

    def close(self) -> None:
        with self._lock:
            if self.enabled and self._shown:
                self._show(time.monotonic(), final=True)

    def _show(self, now: float, *, final: bool) -> None:
        elapsed = max(now - self._start, 1e-9)
        fraction = self.done / self.total if self.total else 1.0
        rate = self.done / _MiB / elapsed
        figures = f"{self.done / _MiB:,.0f}/{self.total / _MiB:,.0f} MiB, {rate:,.0f} MiB/s"
        if self.tty:
            bar = "#" * int(fraction * 30)
            end = "\n" if final else ""
            self.stream.write(f"\r{self.label} [{bar:<30}] {fraction:4.0%} {figures}{end}")
            self.stream.flush()
        else:
            log.info(
                "%s: %.0f%% (%s)%s", self.label, 100 * fraction, figures, " done" if final else ""
            )
