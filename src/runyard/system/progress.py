"""Progress on long work: rich bars on a terminal, one-line log records at a bounded rate everywhere else.

Rich draws a live bar only on a terminal; with output going to a file (a job log, CI, `nohup`) it writes
the bar once, when the work ends, so an 11-minute stage showed nothing until it finished. Every long
phase reports here instead: a line when it starts, a line at most every `log_interval()` seconds while
it runs (count, rate and ETA where the total is known; elapsed time where it is not), and a line when
it ends. `--no-progress` turns the bars off, never the lines.

The `progress` argument the long steps take is one of three values: True, bars on a terminal (lines
otherwise); False, lines only; None, nothing at all (a rank other than 0, a calibration run).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
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

log = logging.getLogger("runyard.progress")

DEFAULT_INTERVAL_S = 30.0
INTERVAL_ENV = "RUNYARD_PROGRESS_INTERVAL"
NO_PROGRESS_HELP = ("no progress bars: each long phase (data steps, stages, final evaluation, samples, export) "
                    "still logs a line when it starts and ends and one every 30 s (RUNYARD_PROGRESS_INTERVAL) "
                    "with its count, rate and ETA, as it does whenever output is not a terminal")


def log_interval() -> float:
    """Seconds between two progress lines of one task (RUNYARD_PROGRESS_INTERVAL, default 30)."""
    raw = os.environ.get(INTERVAL_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_INTERVAL_S
    except ValueError:
        value = DEFAULT_INTERVAL_S
    return max(value, 0.05)


def on_terminal() -> bool:
    """Whether rich can draw live bars here (its console is a terminal)."""
    return Console().is_terminal


def duration(seconds: float) -> str:
    """`42s`, `3m05s`, `1h02m`: short enough for a log line."""
    s = int(round(max(seconds, 0.0)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _amount(value: float, bytes_mode: bool) -> str:
    if bytes_mode:
        return f"{value / 1e6:,.1f} MB"
    return f"{value:,.0f}"


class _Task:
    def __init__(self, description: str, total: float | None, completed: float, info: str):
        self.description, self.total, self.completed, self.info = description, total, completed, info
        self.start_completed = completed
        self.started = self.last_line = time.monotonic()
        self.finished = False


class ProgressLines:
    """rich.Progress's add_task/advance/update, written as log lines: one when a task starts, at most one
    per interval while it runs (from the caller's updates, or from a heartbeat thread when the caller has
    nothing to report, e.g. a tokenizer training for minutes), and one when it completes."""

    def __init__(self, bytes_mode: bool = False, interval: float | None = None):
        self.bytes_mode = bytes_mode
        self.interval = log_interval() if interval is None else interval
        self._tasks: list[_Task] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="progress-lines", daemon=True)

    def __enter__(self) -> ProgressLines:
        self._heartbeat.start()
        return self

    def __exit__(self, *exc) -> None:
        # A task still open when the work ends without an error is done (its count may fall short of
        # the total when part of the work was found done already).
        self._closed.set()
        self._heartbeat.join()
        with self._lock:
            for task in self._tasks:
                if not task.finished and exc[0] is None:
                    self._finish(task)

    def add_task(self, description: str, total: float | None = None, completed: float = 0, info: str = "",
                 **_fields: Any) -> int:
        with self._lock:
            task = _Task(description, total, completed, info)
            self._tasks.append(task)
            of = f" of {_amount(total, self.bytes_mode)}" if total is not None else ""
            log.info("%s: started%s%s", description, of, f" ({info})" if info else "")
            return len(self._tasks) - 1

    def advance(self, task_id: int, advance: float = 1) -> None:
        with self._lock:
            task = self._tasks[task_id]
            task.completed += advance
            self._after_change(task)

    def update(self, task_id: int, completed: float | None = None, info: str | None = None, **_fields: Any) -> None:
        with self._lock:
            task = self._tasks[task_id]
            if completed is not None:
                task.completed = completed
            if info is not None:
                task.info = info
            self._after_change(task)

    def _after_change(self, task: _Task) -> None:
        if task.total is not None and task.completed >= task.total and not task.finished:
            self._finish(task)
        elif time.monotonic() - task.last_line >= self.interval:
            self._line(task)

    def _beat(self) -> None:
        # A task whose caller has had nothing to report for two intervals still gets a line, so that a
        # log never goes quiet for long; the caller's own updates speak first.
        while not self._closed.wait(min(self.interval, 1.0)):
            with self._lock:
                for task in self._tasks:
                    if not task.finished and time.monotonic() - task.last_line >= 2 * self.interval:
                        self._line(task)

    def _line(self, task: _Task) -> None:
        now = time.monotonic()
        task.last_line = now
        elapsed = now - task.started
        done = task.completed - task.start_completed
        if task.total:
            head = (f"{task.description}: {_amount(task.completed, self.bytes_mode)}/"
                    f"{_amount(task.total, self.bytes_mode)} ({100 * task.completed / task.total:.0f}%)")
        else:
            head = f"{task.description}: running"
        parts = [head] + ([task.info] if task.info else []) + [f"elapsed {duration(elapsed)}"]
        if task.total and done > 0 and elapsed > 0:
            parts.append(f"eta {duration((task.total - task.completed) * elapsed / done)}")
        log.info(", ".join(parts))

    def _finish(self, task: _Task) -> None:
        task.finished = True
        of = f" {_amount(task.completed, self.bytes_mode)}" if task.total is not None else ""
        log.info("%s: done%s in %s", task.description, of, duration(time.monotonic() - task.started))


class _Silent:
    def add_task(self, *args, **kwargs) -> int:
        return 0

    def update(self, *args, **kwargs) -> None:
        pass

    def advance(self, *args, **kwargs) -> None:
        pass


@contextmanager
def progress_bars(progress: bool | None, bytes_mode: bool = False) -> Iterator[Any]:
    """An object with rich.Progress's add_task/advance/update for the steps of a long job: live bars
    (progress True, on a terminal), log lines (progress False, or True without a terminal), or nothing
    (None). In bytes mode amounts are bytes (MB/s on a bar)."""
    if progress is None:
        yield _Silent()
        return
    if not (progress and on_terminal()):
        with ProgressLines(bytes_mode) as lines:
            yield lines
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


@contextmanager
def phase(description: str, progress: bool | None = False, info: str = "") -> Iterator[None]:
    """A long step without a count (final evaluation, samples, export, ONNX): a log line when it starts,
    one per interval while it runs, one when it ends (nothing when progress is None)."""
    if progress is None:
        yield
        return
    with ProgressLines() as lines:
        lines.add_task(description, total=None, info=info)
        yield
