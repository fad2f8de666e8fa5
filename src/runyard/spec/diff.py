"""What changed between the spec a run directory was made by and an edited one, and what each change
would make the run compute again.

A run directory keeps its spec (spec.yaml). Running it again with an edited spec may continue when no
work already done depends on what changed:
- judgement: a language model stage's gates (judged again from its records), the final verdict's bounds,
  prompts and sampling (the final evaluation runs again in every session), retention, costs, traffic; and
  the layout (resources.parallel, resources.nproc: a stage resumes its checkpoint under any layout);
- a stage's own settings (its resolved model, optimizer, schedule, training, data, kind, LoRA): that
  stage and every later one, since each starts from its predecessor's weights;
- the layout (processes, the device mesh, threads, compile): nothing already computed changes; a stage in
  progress continues from its last checkpoint under the new layout (equal within fp32 tolerance, not bitwise,
  to an uninterrupted run); the requirement only plans and prices;
- anything else (the data, the seed, the task, device, precision, in-training evaluation): every stage, and
  the data.
Stages are matched by position; a stage renamed or inserted at position i changes stage i.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from runyard.spec.job import JobSpec, resolved_stage

ABSENT = "(absent)"

# Paths (dotted, `stages[i]` for list items; prefixes match) that judge work but never change it.
JUDGEMENT_PATHS = (
    "name", "costs", "traffic", "checkpoint.keep_last", "checkpoint.keep_best", "checkpoint.interval",
    "eval.final_batches", "eval.max_heldout_perplexity", "eval.max_gap", "eval.must_beat_unigram",
    "eval.unigram_margin", "eval.min_response_loss_drop", "eval.min_task_score", "eval.min_reward_accuracy",
    "eval.min_reward_margin", "eval.stall_fraction", "eval.prompts", "eval.sample_tokens", "eval.temperature",
    "eval.top_k", "eval.prediction", "tracking",
)
# The layout a run trains under: a checkpoint reshards across layouts (runyard.train.checkpoint), so a
# change continues from the last one; recorded, never refused.
LAYOUT_PATHS = ("resources.nproc", "resources.parallel", "resources.threads", "resources.compile")
# What only plans and prices the run.
PRICING_PATHS = ("resources.requirement",)
# Top-level sections that stages inherit (and may override): a change to one matters only where a
# stage's resolved value changed.
INHERITED = ("model", "optim", "schedule", "train")


@dataclass(frozen=True)
class FieldChange:
    path: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.path}: {_short(self.old)} -> {_short(self.new)}"


@dataclass
class SpecChange:
    """The edited spec against the stored one."""

    changes: list[FieldChange] = field(default_factory=list)
    # Index (in the edited spec) of the first stage whose inputs changed; None when no stage's did.
    first_changed_stage: int | None = None
    # The data, the seed, the task, resources or in-training evaluation: inputs of every stage.
    every_stage: bool = False
    # Changes that do not alter work (gates judged again, the final evaluation's settings).
    judgement: list[FieldChange] = field(default_factory=list)
    # Changes of the layout (processes, mesh, threads, compile): a stage in progress continues under it.
    layout: list[FieldChange] = field(default_factory=list)
    # Each change that alters work, with the stage index (edited spec) it first alters.
    altering: list[tuple[FieldChange, int]] = field(default_factory=list)

    @property
    def none(self) -> bool:
        return not self.changes


def field_changes(old: JobSpec, new: JobSpec) -> list[FieldChange]:
    """Every leaf that differs between the two resolved specs, as a dotted path with both values."""
    return list(_walk("", old.model_dump(mode="json"), new.model_dump(mode="json")))


def compare(old: JobSpec, new: JobSpec) -> SpecChange:
    """Classify each change between the stored spec `old` and the edited `new`."""
    result = SpecChange(changes=field_changes(old, new))
    stage_changed = _changed_stages(old, new)
    for change in result.changes:
        if _under(change.path, LAYOUT_PATHS):
            result.layout.append(change)
            continue
        if _is_judgement(change.path, rejudged_gates=new.task == "language_model"):
            result.judgement.append(change)
            continue
        index = _stage_index(change.path)
        if index is not None:
            if index >= len(new.stages):  # a stage removed from the end: later than every kept one
                result.judgement.append(change)
                continue
            result.altering.append((change, index))
        elif change.path.split(".")[0] in INHERITED:
            altered = [i for i in stage_changed if _inherits(old, new, i, change.path.split(".")[0])]
            if altered:
                result.altering.append((change, min(altered)))
            else:  # every stage overrides it: nothing trains differently
                result.judgement.append(change)
        else:
            result.altering.append((change, 0))
            result.every_stage = True
    if result.altering:
        result.first_changed_stage = min(i for _, i in result.altering)
    return result


def _walk(path: str, a: Any, b: Any):
    if isinstance(a, dict) and isinstance(b, dict):
        for key in [*a, *(k for k in b if k not in a)]:
            yield from _walk(f"{path}.{key}" if path else key, a.get(key, ABSENT), b.get(key, ABSENT))
    elif isinstance(a, list) and isinstance(b, list) and any(isinstance(x, dict) for x in [*a, *b]):
        for i in range(max(len(a), len(b))):
            yield from _walk(f"{path}[{i}]", a[i] if i < len(a) else ABSENT, b[i] if i < len(b) else ABSENT)
    elif a != b:
        yield FieldChange(path, a, b)


def _under(path: str, prefixes: tuple[str, ...]) -> bool:
    return any(path == p or path.startswith(p + ".") or path.startswith(p + "[") for p in prefixes)


def _is_judgement(path: str, rejudged_gates: bool) -> bool:
    """`rejudged_gates`: a language model's stage gates are judged again from its records (a table's
    or an image model's stage is trained again to judge other gates)."""
    if _under(path, JUDGEMENT_PATHS + PRICING_PATHS):
        return True
    index = _stage_index(path)
    return rejudged_gates and index is not None and path.startswith(f"stages[{index}].gates")


def _stage_index(path: str) -> int | None:
    if not path.startswith("stages["):
        return None
    return int(path[len("stages["):path.index("]")])


def _changed_stages(old: JobSpec, new: JobSpec) -> list[int]:
    """Stages (edited spec's indices) whose resolved settings differ, gates aside."""
    return [i for i, stage in enumerate(new.stages)
            if i >= len(old.stages) or old.stages[i].name != stage.name
            or _resolved(old, stage.name) != _resolved(new, stage.name)]


def _inherits(old: JobSpec, new: JobSpec, index: int, section: str) -> bool:
    """Whether stage `index`'s resolved `section` differs between the specs."""
    name = new.stages[index].name
    if index >= len(old.stages) or old.stages[index].name != name:
        return False  # a new stage: its own change, not the inherited section's
    return _resolved(old, name).get(section) != _resolved(new, name).get(section)


def _resolved(spec: JobSpec, name: str) -> dict:
    return resolved_stage(spec, name).model_dump(mode="json", exclude={"gates", "index"})


def _short(value: Any) -> str:
    text = json.dumps(value) if value is not ABSENT else ABSENT
    return text if len(text) <= 60 else text[:57] + "..."
