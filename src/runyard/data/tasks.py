"""A step's unit of work, the same wherever it runs: a local worker, a Slurm array task, a Ray task.

A `Task` is plain JSON: which step, the arguments of its step function, and the output whose existence
says it is done. Step functions write their output atomically and last, so "done" never means half
done, and an executor may rerun any task whose output is missing (after a kill, a failed array task, a
node lost) without touching the others.

Run one task of a list from the command line, as a Slurm array task does:

    python -m runyard.data.tasks TASKS.json INDEX
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from runyard.data.budget import MemoryBudget, release_freed_memory
from runyard.data.clean import clean_part
from runyard.data.config import DataSpec
from runyard.data.sources import InputFile
from runyard.data.tokenize import tokenize_part
from runyard.data.tokenizer import EOS_TOKEN
from runyard.errors import RunyardError


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


def run_task(task: Task) -> None:
    """Run one task in this process (and give back what it freed: the process runs more afterwards)."""
    try:
        _run(task)
    finally:
        release_freed_memory()


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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] in ("-h", "--help"):
        print("usage: python -m runyard.data.tasks TASKS.json INDEX  (runs one task of the list)")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    tasks = [Task.from_json(t) for t in json.loads(Path(argv[0]).read_text())]
    task = tasks[int(argv[1])]
    print(f"runyard data task: {task.step} {task.index} -> {task.output}", flush=True)
    try:
        run_task(task)
    except RunyardError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
