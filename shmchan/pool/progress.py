"""The progress bar of KeyedExecutor.map(progress=True), drawn with rich on stderr.

On a terminal the bar is redrawn in place a few times a second; elsewhere (a log file,
a captured stream) rich draws it once, as it ends. rich is imported when a bar is first
drawn, not with the executor."""

from __future__ import annotations

__all__ = ["ProgressBar"]


class ProgressBar:
    """Items done out of `total`, elapsed and remaining time, and the executor's retries
    (tasks run again after their worker died)."""

    def __init__(self, total: int, what: str = "tasks") -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("retries {task.fields[retries]}"),
            console=Console(stderr=True),
        )
        self._task = self._progress.add_task(what, total=total, retries=0)
        self._progress.start()

    def advance(self, retries: int) -> None:
        """One more item done; `retries` so far."""
        self._progress.update(self._task, advance=1, retries=retries)

    def close(self) -> None:
        """Draw the bar a last time and stop redrawing it (idempotent)."""
        self._progress.stop()
