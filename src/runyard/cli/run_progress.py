"""How far a run got, for the reading verbs: each stage's state (`show`), and the refusal `generate`
and `serve` give a run directory whose export is not finished, naming the stage and step it stopped at.
Reads only what is on disk; writes nothing and verifies no checkpoint (that is the writer's job)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runyard.cli.readers import export_dir_of
from runyard.errors import RunyardError
from runyard.model.hf.export import PROVENANCE_FILE
from runyard.run.continuation import SPEC_FILE
from runyard.spec.job import JobSpec, load_spec, resolved_stage
from runyard.train.checkpoint.store import list_checkpoints
from runyard.train.gates import read_gates
from runyard.train.metrics import MetricsLog
from runyard.train.stage_result import stage_dir


class UnfinishedRun(RunyardError):
    """A run directory read for its export before the run finished it."""


def finished_export(path: Path) -> Path:
    """A run directory's export/, or `path` itself when it is an export directory. A run directory
    whose export is not finished (no export/, or none with its runyard.json, which the rename brings
    last) is refused saying how far the run got, rather than read as a directory that is not an export."""
    path = Path(path)
    if (path / SPEC_FILE).is_file() and not (path / "export" / PROVENANCE_FILE).is_file():
        raise UnfinishedRun(unfinished_message(path))
    return export_dir_of(path)


def stage_progress(run_dir: Path, spec: JobSpec) -> list[dict[str, Any]]:
    """Each stage's state, from what is on disk: `passed` / `failed` (its gates were judged),
    `interrupted` (it trained some steps: the last logged one, and its newest checkpoint), or `not run`."""
    out = []
    for s in spec.stages:
        sdir = stage_dir(run_dir, s.name)
        record = read_gates(sdir)
        try:
            train = getattr(resolved_stage(spec, s.name), "train", None)
        except Exception:  # a stage without a training loop's settings (a table model's)
            train = None
        rows = MetricsLog(sdir / "metrics.jsonl").read()
        logged = [r["step"] for r in rows if isinstance(r.get("step"), int)]
        checkpoints = list_checkpoints(sdir / "checkpoints")
        last = checkpoints[-1] if checkpoints else None
        step = max([*logged, *([last.step] if last else [])], default=None)
        if record is not None:
            state = "passed" if record["passed"] else "failed"
        else:
            state = "interrupted" if step is not None else "not run"
        out.append({
            "name": s.name, "gates": None if record is None else state, "state": state,
            "step": step, "steps": getattr(train, "steps", None),
            "last_checkpoint_step": last.step if last else None,
            "last_checkpoint": str(last.path) if last else None,
        })
    return out


def describe_stage(stage: dict[str, Any]) -> str:
    """One stage's line for `show`: `passed`, `not run`, or `interrupted at step 40 of 100 (last checkpoint: step 30, PATH)`."""
    if stage["state"] != "interrupted":
        return stage["state"]
    of = f" of {stage['steps']}" if stage["steps"] else ""
    if stage["last_checkpoint_step"] is None:
        kept = "no checkpoint yet: it restarts from step 0"
    else:
        kept = f"last checkpoint: step {stage['last_checkpoint_step']}, {stage['last_checkpoint']}"
    return f"interrupted at step {stage['step']}{of} ({kept})"


def unfinished_message(run_dir: Path) -> str:
    """Why a run directory has no finished export: the stage it stopped in and at which step."""
    try:
        stages = stage_progress(run_dir, load_spec(run_dir / SPEC_FILE))
    except Exception as exc:  # a spec this runyard cannot read: say what is known
        return f"the run {run_dir} is unfinished: it has no finished export ({run_dir / 'export' / PROVENANCE_FILE}); {exc}"
    started = [s for s in stages if s["state"] != "not run"]
    if not started:
        where = "no stage has started"
    else:
        last = started[-1]
        if last["state"] == "failed":
            where = f"stage {last['name']} failed its gates, so the run stopped before its export"
        elif last["state"] == "passed":
            where = (f"every stage up to {last['name']} passed; the final evaluation and export did not finish"
                     if last is stages[-1] else f"stage {last['name']} passed and the next has not started")
        else:
            where = f"stage {last['name']} was {describe_stage(last)}"
    return (f"the run {run_dir} is unfinished: it has no finished export yet ({where}); "
            f"`runyard resume {run_dir}` continues it")
