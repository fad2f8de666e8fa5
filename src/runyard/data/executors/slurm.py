"""The Slurm executor: each step's tasks run as a Slurm job array, submitted with sbatch.

Why sbatch and not submitit: a task is already plain JSON run by `python -m runyard.data.work_units` (no
pickled closures to ship), sbatch is what every Slurm site has, and runyard's other Slurm code (the
control plane's backend, `reproduce`) speaks it too; submitit would add a dependency and pickle the
task functions onto shared storage for nothing.

- One array per step, one CPU and `--mem` = data.memory_limit per array task. With data.workers W set,
  the array has at most W tasks (`--array=0-N%W`) and each drains the step's task list (work_units.py
  `--drain`: a task is claimed by an exclusive create on shared storage): one interpreter start per
  array task rather than per task, and whichever array task is free takes the next task. Without W,
  one array task per task (as many at once as the cluster gives). Arrays larger than the cluster's
  MaxArraySize are submitted in pieces.
- The data cache must be on storage every node sees (data.cache_dir on a shared filesystem): the tasks
  write their outputs there, and the preparing process reads them.
- A task is done when its output exists (written atomically and last); the step is over as soon as
  every output exists (the array tasks then only exit). Polling starts at POLL_MIN_S and backs off to
  POLL_MAX_S while nothing finishes; one squeue call a poll, for every array of the step.
- When the arrays end, the tasks without output (failed, killed, lost with their node) are submitted
  again, alone, up to `retries` times; then the step fails naming each task and the end of its log. A
  later `runyard prepare` skips every task whose output exists, so it too reruns only the failed ones.
- The array is cancelled (scancel) if the preparing process stops on an error, Ctrl-C or SIGTERM.
  If it is SIGKILLed the array runs on; its outputs are the same ones a rerun would write (atomic
  renames of identical content), so they are used, never mixed.

State comes from `squeue` (no accounting needed: the CI cluster has none); runyard.system.slurm runs
every Slurm command, and a failed one raises its SlurmError.
"""

from __future__ import annotations

import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from runyard.data.errors import TaskFailed
from runyard.data.work_units import Task, write_task_list
from runyard.system import slurm

POLL_MIN_S = 0.1
POLL_MAX_S = 2.0
LOG_TAIL = 1500


class SlurmExecutor:
    name = "slurm"

    def __init__(self, log_dir: Path, workers: int | None, memory_limit: int, partition: str | None = None,
                 sbatch_args: list[str] | None = None, retries: int = 2):
        self.log_dir = Path(log_dir)
        self.workers, self.memory_limit = workers, memory_limit
        self.partition, self.sbatch_args, self.retries = partition, list(sbatch_args or []), retries
        self.submissions: list[dict] = []  # (job id, label, attempt, task indices): what was submitted
        self._max_array: int | None = None
        self.task_cpu_s: dict[str, float] = {}  # not known here: the tasks ran elsewhere

    def array_tasks(self, count: int) -> int:
        """Array tasks for a list of `count` tasks: one each, or at most data.workers draining the list."""
        return min(count, self.workers) if self.workers else count

    def script(self, label: str, tasks_file: Path, count: int) -> str:
        """The batch script of one array over the `count` tasks listed in `tasks_file`."""
        elements = self.array_tasks(count)
        array = f"0-{elements - 1}" + (f"%{self.workers}" if self.workers else "")
        lines = [
            "#!/bin/bash",
            f"#SBATCH --job-name=runyard-data-{label}",
            f"#SBATCH --array={array}",
            "#SBATCH --cpus-per-task=1",
            f"#SBATCH --mem={max(1, self.memory_limit >> 20)}M",
            f"#SBATCH --output={self.log_dir}/{tasks_file.stem}-%a.log",
            "#SBATCH --export=ALL",
            f"#SBATCH --chdir={Path.cwd()}",
        ]
        if self.partition:
            lines.append(f"#SBATCH --partition={self.partition}")
        command = [sys.executable, "-m", "runyard.data.work_units", str(tasks_file)]
        if elements < count:
            command += ["--drain", str(self.claims_dir(tasks_file))]
        else:
            command += ["$SLURM_ARRAY_TASK_ID"]
        run = shlex.join(command).replace("'$SLURM_ARRAY_TASK_ID'", '"$SLURM_ARRAY_TASK_ID"')
        lines += ["export TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1", f"exec {run}", ""]
        return "\n".join(lines)

    @staticmethod
    def claims_dir(tasks_file: Path) -> Path:
        return tasks_file.with_suffix(".claims")

    def task_log(self, tasks_file: Path, position: int, count: int) -> Path:
        """Where the output of the task at `position` of a list of `count` goes."""
        if self.array_tasks(count) < count:
            return self.claims_dir(tasks_file) / f"{position}.log"
        return self.log_dir / f"{tasks_file.stem}-{position}.log"

    def max_array_size(self) -> int:
        if self._max_array is None:
            self._max_array = slurm.max_array_size()
        return self._max_array

    def _submit(self, label: str, tasks: list[Task], attempt: int, piece: int) -> tuple[str, Path]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        stem = f"{label}-a{attempt}-{piece:03d}"
        tasks_file = self.log_dir / f"{stem}.json"
        if self.array_tasks(len(tasks)) < len(tasks):
            self.claims_dir(tasks_file).mkdir(exist_ok=True)
        write_task_list(tasks_file, tasks)
        script = self.log_dir / f"{stem}.sbatch"
        script.write_text(self.script(label, tasks_file, len(tasks)))
        job_id = slurm.submit(script, self.sbatch_args)
        self.submissions.append({"job": job_id, "label": label, "attempt": attempt,
                                 "tasks": [t.index for t in tasks]})
        return job_id, tasks_file

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def run(self, label: str, tasks: list[Task], on_done: Callable[[Task], None]) -> None:
        """Run the tasks not yet done as arrays; resubmit the failed ones alone (see the module doc)."""
        todo = [t for t in tasks if not t.done()]
        attempt = 0
        logs: dict[int, Path] = {}
        jobs: list[str] = []
        stop = _CancelOnSignal()
        try:
            with stop:
                while todo:
                    attempt += 1
                    size = max(1, self.max_array_size() - 1)
                    jobs = []
                    for piece, start in enumerate(range(0, len(todo), size)):
                        batch = todo[start : start + size]
                        job_id, tasks_file = self._submit(label, batch, attempt, piece)
                        jobs.append(job_id)
                        for k, t in enumerate(batch):
                            logs[t.index] = self.task_log(tasks_file, k, len(batch))
                    todo = self._wait(jobs, todo, on_done)
                    jobs = []
                    if todo and attempt > self.retries:
                        raise TaskFailed(self._failure(label, todo, logs, attempt))
        finally:
            for job_id in jobs:
                slurm.cancel(job_id)

    def _wait(self, jobs: list[str], waiting: list[Task], on_done: Callable[[Task], None]) -> list[Task]:
        """Poll until every task has its output or every job has ended; returns the tasks without output."""
        delay = POLL_MIN_S
        while True:
            time.sleep(delay)
            before = len(waiting)
            waiting = self._report(waiting, on_done)
            if not waiting:
                return waiting
            jobs = slurm.live_jobs(jobs)
            if not jobs:
                return self._report(waiting, on_done)
            delay = POLL_MIN_S if len(waiting) < before else min(POLL_MAX_S, delay * 1.5)

    def _report(self, waiting: list[Task], on_done: Callable[[Task], None]) -> list[Task]:
        still = []
        for task in waiting:
            if task.done():
                on_done(task)
            else:
                still.append(task)
        return still

    def _failure(self, label: str, failed: list[Task], logs: dict[int, Path], attempts: int) -> str:
        lines = [f"{len(failed)} {label} task(s) failed on Slurm after {attempts} attempt(s):"]
        for task in failed[:5]:
            log = logs.get(task.index)
            tail = ""
            if log is not None and log.exists():
                tail = log.read_text(errors="replace")[-LOG_TAIL:].strip()
            lines.append(f"  task {task.index} ({task.output}); log {log}:")
            lines += [f"    {line}" for line in tail.splitlines()[-12:]]
        return "\n".join(lines)


class _CancelOnSignal:
    """While active, SIGTERM raises KeyboardInterrupt in the main thread, so the array is cancelled on
    the way out."""

    def __enter__(self) -> _CancelOnSignal:
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_term)
        return self

    def _on_term(self, signum, frame) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
