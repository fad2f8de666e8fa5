"""Where a step's tasks run: `local` (worker processes on this machine), `slurm` (a job array per step,
through sbatch) or `ray` (tasks on a Ray cluster: the one at an address, else a local one).

Every executor has one method, `run(label, tasks, on_done)`: run each task whose output is missing,
call `on_done(task)` as each finishes, and raise `TaskFailed` (naming the task and where its log is)
for one that still fails after its retries. The tasks, their outputs and therefore the dataset are the
same whichever executor ran them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from runyard.data.executors.local import LocalExecutor
from runyard.data.executors.ray import RayExecutor
from runyard.data.executors.slurm import SlurmExecutor
from runyard.data.work_units import Task
from runyard.errors import DataError

EXECUTORS = ("local", "slurm", "ray")


class Executor(Protocol):
    """Runs tasks; used as a context manager around a whole preparation (the local one keeps its worker
    pool for every step)."""

    name: str
    task_cpu_s: dict[str, float]  # step -> CPU seconds of its tasks, where the executor can know them

    def __enter__(self) -> Executor: ...

    def __exit__(self, *exc) -> None: ...

    def run(self, label: str, tasks: list[Task], on_done: Callable[[Task], None]) -> None: ...


@dataclass(frozen=True)
class ExecutorChoice:
    """What `runyard prepare --executor ...` asked for."""

    kind: str = "local"
    partition: str | None = None  # slurm
    sbatch_args: list[str] = field(default_factory=list)  # slurm
    ray_address: str | None = None  # ray
    retries: int = 2  # reruns of a failed task (slurm, ray)


def make_executor(choice: ExecutorChoice | None, workers: int | None, memory_limit: int, log_dir) -> Executor:
    """The executor `choice` names, for `workers` parallel tasks of at most `memory_limit` bytes each
    (slurm, ray) or in all (local)."""
    choice = choice or ExecutorChoice()
    if choice.kind == "local":
        return LocalExecutor(workers or 1)
    if choice.kind == "slurm":
        return SlurmExecutor(log_dir, workers, memory_limit, choice.partition, choice.sbatch_args, choice.retries)
    if choice.kind == "ray":  # no address: $RAY_ADDRESS, else a local Ray (executors/ray.py)
        return RayExecutor(choice.ray_address, memory_limit, choice.retries, workers)
    raise DataError(f"unknown executor {choice.kind!r}; choose one of {', '.join(EXECUTORS)}")
