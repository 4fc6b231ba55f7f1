"""The progress display: tqdm on a terminal, else a plain line, else nothing."""

from __future__ import annotations

import importlib.util
import sys
import time
from typing import Any


class Progress:
    """tqdm on stderr when it is installed and stderr is a terminal; else a plain line."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.enabled = enabled
        self.total = total
        self.done = 0
        self.bar: Any = None
        self._last = 0.0
        self._start = time.monotonic()
        if enabled and importlib.util.find_spec("tqdm") is not None:
            import tqdm  # type: ignore[import-untyped,unused-ignore]  # optional; no stubs

            tqdm.tqdm.monitor_interval = 0  # no monitor thread next to timed loops
            self.bar = tqdm.tqdm(
                total=total,
                file=sys.stderr,
                unit="step",
                delay=2.0,
                leave=False,
                dynamic_ncols=True,
            )

    def step(self, what: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_description_str(what, refresh=False)
            self.bar.update(1)
            return
        now = time.monotonic()
        if now - self._start > 2.0 and now - self._last > 0.5:
            self._last = now
            sys.stderr.write(f"\r[{self.done}/{self.total}] {what[:60]:<60}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and time.monotonic() - self._start > 2.0:
            sys.stderr.write("\r" + " " * 80 + "\r")
            sys.stderr.flush()
