"""A one-line progress bar on stderr (no dependency): `label 12/32 [####......] 3.1s`."""

from __future__ import annotations

import sys
import time


class ProgressBar:
    WIDTH = 30

    def __init__(self, total: int, label: str = "", enabled: bool = True, interval: float = 0.2):
        self.total = total
        self.label = label
        self.enabled = enabled
        self.interval = interval  # seconds between redraws
        self.num_done = 0
        self.started = time.perf_counter()
        self._drawn_at = 0.0

    def update(self, num: int = 1) -> None:
        self.num_done += num
        if time.perf_counter() - self._drawn_at >= self.interval:
            self._draw()

    def close(self) -> None:
        self._draw()
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()

    def _draw(self) -> None:
        if not self.enabled:
            return
        self._drawn_at = now = time.perf_counter()
        filled = self.WIDTH * self.num_done // max(self.total, 1)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        elapsed = now - self.started
        sys.stderr.write(f"\r{self.label} {self.num_done}/{self.total} [{bar}] {elapsed:.1f}s")
        sys.stderr.flush()
