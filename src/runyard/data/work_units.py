"""A step's unit of work, the same wherever it runs: a local worker, a Slurm array task, a Ray task.

A `Task` is plain JSON: which step, the arguments of its step function, and the output whose existence
says it is done. Step functions write their output atomically and last, so "done" never means half
done, and an executor may rerun any task whose output is missing (after a kill, a failed array task, a
node lost) without touching the others.

Run tasks of a list from the command line, as a Slurm array task does:

    python -m runyard.data.work_units TASKS.json INDEX             one task
    python -m runyard.data.work_units TASKS.json --drain CLAIMS    every task no one has claimed yet

`--drain` lets a few array tasks share a long list (one interpreter start per array task instead of per
task, and the load balanced as tasks finish): a task is claimed by creating `CLAIMS/<i>` exclusively
(it names the claimant), it writes its output to `CLAIMS/<i>.log`, and one that fails is reported there
while the others go on; the exit status is 1 if any failed. A claim is no promise: a claimant killed
mid-task leaves a claim and no output, and the executor reruns every task without output.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from runyard.data.budget import MemoryBudget, release_freed_memory
from runyard.data.clean import clean_part
from runyard.data.sources import InputFile
from runyard.data.tokenize import tokenize_part
from runyard.data.tokenizer import EOS_TOKEN
from runyard.errors import RunyardError
from runyard.spec.data import DataSpec


@dataclass(frozen=True)
class Task:
    """One task of a step: `args` are its step function's arguments (JSON), `output` marks it done."""

    step: str  # "clean" or "tokenize"
    index: int
    output: str
    args: dict[str, Any]
    budget: tuple[int, int]  # (memory limit, worker processes) the task's buffers are sized from

    def done(self) -> bool:
        return Path(self.output).exists()

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Task:
        return cls(data["step"], int(data["index"]), data["output"], data["args"], tuple(data["budget"]))


def run_task(task: Task) -> float:
    """Run one task in this process (and give back what it freed: the process runs more afterwards);
    returns the CPU seconds it took (this process's, all its threads)."""
    started = time.process_time()
    try:
        _run(task)
    finally:
        release_freed_memory()
    return time.process_time() - started


def _run(task: Task) -> None:
    budget = MemoryBudget(*task.budget)
    a = task.args
    if task.step == "clean":
        spec = DataSpec.model_validate(a["spec"])
        files = [InputFile(**f) for f in a["files"]]
        clean_part(files, spec, Path(task.output), budget, temp_dir=a.get("temp_dir"))
    elif task.step == "tokenize":
        tokenize_part(
            Path(a["part_dir"]), Path(a["flags"]), int(a["first_doc"]), Path(a["tokenizer"]),
            Path(a["work_dir"]), int(a["part_index"]), int(a["chunk_bytes"]), budget, Path(task.output),
            eos_token=a.get("eos_token", EOS_TOKEN),
        )
    else:
        raise ValueError(f"unknown data step {task.step!r}")


def write_task_list(path: Path, tasks: list[Task]) -> None:
    path.write_text(json.dumps([t.to_json() for t in tasks]))


def read_task_list(path: Path) -> list[Task]:
    return [Task.from_json(t) for t in json.loads(Path(path).read_text())]


def claim(claims: Path, position: int, claimant: str) -> bool:
    """Take the task at `position` of a list for `claimant`: True if no one had (an exclusive create)."""
    try:
        fd = os.open(claims / str(position), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(claimant)
    return True


@contextlib.contextmanager
def _output_to(path: Path):
    """Output goes to `path`: Python's (sys.stdout, sys.stderr) and this process's file descriptors 1 and
    2 (native libraries', children's)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(path, "a", buffering=1) as log:
        try:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def _run_reported(task: Task) -> bool:
    """Run `task`, printing what it is and how it ended; False if it failed."""
    print(f"runyard data task: {task.step} {task.index} -> {task.output}", flush=True)
    try:
        run_task(task)
    except RunyardError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return False
    print("done", flush=True)
    return True


def drain(tasks: list[Task], claims: Path, first: int = 0) -> int:
    """Run every task of the list not done and not claimed, starting at position `first` and going round;
    returns how many failed (each reported in its own log beside its claim)."""
    claimant = f"{os.environ.get('SLURM_ARRAY_TASK_ID', '-')} {os.uname().nodename} {os.getpid()}"
    failed = 0
    for k in range(len(tasks)):
        position = (first + k) % len(tasks)
        task = tasks[position]
        if task.done() or not claim(claims, position, claimant):
            continue
        print(f"task {position}: {task.step} {task.index} (log {claims / f'{position}.log'})", flush=True)
        with _output_to(claims / f"{position}.log"):
            try:
                ok = _run_reported(task)
            except Exception:  # a bug or an unexpected error in one task: report it, run the others
                traceback.print_exc()
                ok = False
        failed += not ok
        print(f"task {position}: {'done' if ok else 'FAILED'}", flush=True)
    return failed


_USAGE = ("usage: python -m runyard.data.work_units TASKS.json INDEX        (runs one task of the list)\n"
          "       python -m runyard.data.work_units TASKS.json --drain DIR  (runs every task not yet claimed in DIR)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(_USAGE)
        return 0
    if len(argv) == 3 and argv[1] == "--drain":
        first = int(os.environ.get("SLURM_ARRAY_TASK_ID", "0"))
        return 1 if drain(read_task_list(Path(argv[0])), Path(argv[2]), first) else 0
    if len(argv) != 2:
        print(_USAGE)
        return 2
    return 0 if _run_reported(read_task_list(Path(argv[0]))[int(argv[1])]) else 1


if __name__ == "__main__":
    sys.exit(main())
