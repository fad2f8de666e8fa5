"""The local executor: tasks in worker processes on this machine (in this process when there is one
worker or one task, so a small preparation starts no process at all).

Workers are forked (no re-import of the caller's __main__, no interpreter start-up per worker) and die
with this process however it dies (a parent-death signal): left alone they would wait for work forever
and keep the data cache busy. Each encodes on one thread (TOKENIZERS_PARALLELISM=false), since the
workers themselves are the parallelism.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from multiprocessing import get_context

from runyard.data.work_units import Task, run_task
from runyard.system.processes import die_with_parent


def _worker_context():
    return get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")


def _init_worker(parent: int) -> None:
    die_with_parent(signal.SIGKILL, parent)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


class LocalExecutor:
    """Used as a context manager, it keeps one pool for every step: forked at the start of a preparation,
    before the main process has grown (a forked worker's resident size starts as its parent's)."""

    name = "local"

    def __init__(self, workers: int):
        self.workers = max(1, workers)
        self._pool: ProcessPoolExecutor | None = None
        self.task_cpu_s: dict[str, float] = {}  # step -> CPU seconds its tasks took, summed

    def __enter__(self) -> LocalExecutor:
        if self.workers > 1:
            self._pool = ProcessPoolExecutor(self.workers, mp_context=_worker_context(),
                                             initializer=_init_worker, initargs=(os.getpid(),))
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    def run(self, label: str, tasks: list[Task], on_done: Callable[[Task], None]) -> None:
        """Run the tasks not yet done, up to `workers` at once; the first failure is raised as it was."""
        todo = [t for t in tasks if not t.done()]
        if self.workers == 1 or len(todo) <= 1:
            for task in todo:
                self._count(label, run_task(task))
                on_done(task)
            return
        with contextlib.ExitStack() as stack:
            pool = self._pool
            if pool is None:  # used outside a `with`: a pool for this step alone
                pool = stack.enter_context(self)._pool
            futures = {pool.submit(run_task, t): t for t in todo}
            try:
                pending = set(futures)
                while pending:
                    done, pending = wait(pending, return_when=FIRST_EXCEPTION)
                    for future in done:
                        self._count(label, future.result())  # a task's error, as the task raised it
                        on_done(futures[future])
            except BaseException:
                for future in futures:
                    future.cancel()
                raise

    def _count(self, label: str, cpu_s: float) -> None:
        self.task_cpu_s[label] = self.task_cpu_s.get(label, 0.0) + cpu_s
