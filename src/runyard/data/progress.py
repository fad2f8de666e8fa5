"""Rich progress bars for the long data steps (counts and throughput); silent when disabled."""

from __future__ import annotations

from contextlib import contextmanager

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)


class _Silent:
    def add_task(self, *args, **kwargs) -> int:
        return 0

    def update(self, *args, **kwargs) -> None:
        pass

    def advance(self, *args, **kwargs) -> None:
        pass


@contextmanager
def progress_bars(enabled: bool, bytes_mode: bool = False):
    """Yield an object with rich.Progress's add_task/advance/update; a no-op one when not enabled.
    In bytes mode the rate column shows MB/s instead of counts."""
    if not enabled:
        yield _Silent()
        return
    rate = TransferSpeedColumn() if bytes_mode else MofNCompleteColumn()
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        rate,
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        transient=False,
    ) as bars:
        yield bars
