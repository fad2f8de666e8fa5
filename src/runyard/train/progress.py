"""A stage's progress: a rich bar with loss, throughput and ETA on a terminal, one-line log records at a
bounded rate otherwise (runyard.system.progress says why)."""

from __future__ import annotations

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from runyard.system.progress import ProgressLines, on_terminal


class StepProgress:
    """`progress`: True a bar on a terminal (log lines otherwise), False log lines, None nothing (ranks
    other than 0)."""

    def __init__(self, description: str, total: int, start: int = 0, progress: bool | None = True):
        self._bars: Progress | None = None
        self._lines: ProgressLines | None = None
        if progress and on_terminal():
            self._bars = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
            )
        elif progress is not None:
            self._lines = ProgressLines()
        self._task = None
        self._description, self._total, self._start = description, total, start

    def __enter__(self) -> StepProgress:
        reporter = self._bars or self._lines
        if reporter is not None:
            reporter.__enter__()
            info = f"from step {self._start}" if self._start and self._lines is not None else ""
            self._task = reporter.add_task(self._description, total=self._total, completed=self._start, info=info)
        return self

    def update(self, step: int, loss: float, tok_s: float, heldout: float | None = None) -> None:
        reporter = self._bars or self._lines
        if reporter is None:
            return
        info = f"loss {loss:.3f}  {tok_s:,.0f} tok/s" if self._bars else f"loss {loss:.3f}, {tok_s:,.0f} tok/s"
        if heldout is not None:
            info += f"  held-out {heldout:.3f}" if self._bars else f", held-out {heldout:.3f}"
        reporter.update(self._task, completed=step, info=info)

    def __exit__(self, *exc) -> None:
        reporter = self._bars or self._lines
        if reporter is not None:
            reporter.__exit__(*exc)
