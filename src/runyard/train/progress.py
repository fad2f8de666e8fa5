"""A rich progress bar for training steps, with loss, throughput and ETA."""

from __future__ import annotations

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class StepProgress:
    def __init__(self, description: str, total: int, start: int = 0, enabled: bool = True):
        self.enabled = enabled
        self._progress = (
            Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
            )
            if enabled
            else None
        )
        self._task = None
        self._description, self._total, self._start = description, total, start

    def __enter__(self) -> StepProgress:
        if self._progress is not None:
            self._progress.__enter__()
            self._task = self._progress.add_task(
                self._description, total=self._total, completed=self._start, info=""
            )
        return self

    def update(self, step: int, loss: float, tok_s: float, heldout: float | None = None) -> None:
        if self._progress is None:
            return
        info = f"loss {loss:.3f}  {tok_s:,.0f} tok/s"
        if heldout is not None:
            info += f"  held-out {heldout:.3f}"
        self._progress.update(self._task, completed=step, info=info)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)
