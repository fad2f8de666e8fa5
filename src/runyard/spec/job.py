"""The job spec: one YAML file that states everything a run depends on.

`load_spec(path)` parses and validates it up front; any problem is raised as a `SpecError` naming
the field path, the bad value, what was expected and the field's entry in the spec reference
(docs/spec.md, generated from these models by `runyard spec reference`), before any work starts.
Stages inherit the top-level `model`, `optim`, `schedule` and `train` settings and override them field
by field; `resolved_stage(spec, stage)` gives the settings a stage really trains with.

Every field carries a description (what it means, its unit): the reference and the JSON Schema are
built from them, and a test fails when one is missing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from runyard.errors import SpecError
from runyard.spec import paths as spec_paths
from runyard.spec.checks import task_problems
from runyard.spec.data import DataSpec
from runyard.spec.data_instruct import InstructDataSpec
from runyard.spec.finetune import DPOSpec, LoRASpec, SFTSpec
from runyard.spec.sections import (
    CheckpointSpec,
    CostsSpec,
    EvalSpec,
    GateSpec,
    ModelSpec,
    OptimSpec,
    ResourcesSpec,
    ScheduleSpec,
    StageSpec,
    TrafficSpec,
    TrainSpec,
    _Strict,
)
from runyard.spec.tracking import TrackingSpec

__all__ = [
    "CheckpointSpec",
    "CostsSpec",
    "DataSpec",
    "EvalSpec",
    "GateSpec",
    "JobSpec",
    "ModelSpec",
    "OptimSpec",
    "ResolvedStage",
    "ResourcesSpec",
    "ScheduleSpec",
    "StageSpec",
    "TASKS",
    "TrafficSpec",
    "TrainSpec",
    "dump_spec",
    "load_spec",
    "parse_spec",
    "reference_anchor",
    "resolved_stage",
    "spec_warnings",
]

log = logging.getLogger(__name__)

# Where spec errors send the reader: docs/spec.md, whose anchors are field paths (reference_anchor).
REFERENCE_DOC = "docs/spec.md"

# The tasks a spec may name; runyard.spec.templates has a starting spec for each, runyard.plan.families what each
# reads, trains and serves.
Task = Literal["language_model", "tabular_classification", "tabular_regression", "image_classification"]
TASKS: tuple[str, ...] = get_args(Task)


class JobSpec(_Strict):
    """A run's whole job spec: what to train on, what to train, how, and what counts as done."""

    task: Task = Field(
        default="language_model",
        description="what the run trains: `language_model` (a decoder on text), `tabular_classification` or "
        "`tabular_regression` (a table's target column from its other columns: gradient-boosted trees or a linear "
        "model), `image_classification` (a small CNN). `runyard spec init --task` writes a starting spec for a task",
    )
    name: str = Field(
        description="the run's name (1-100 letters, digits, '_', '.' or '-'); the run directory is "
        "runs/<name> unless --run-dir says otherwise"
    )
    seed: int = Field(
        default=0,
        ge=0,
        lt=2**63,
        description="the seed every random source derives from (split, initialisation, data order, dropout, "
        "samples); recorded in the manifest",
    )
    data: DataSpec | None = Field(
        default=None,
        description="the data: sources, cleaning, deduplication, split, tokenizer, shards. Required when any stage "
        "pretrains (kind `pretrain`, the default) and for the tabular and image tasks; a spec whose every stage is "
        "sft or dpo, starting from `model.init` weights, may leave it out: the stages train on their own `data`, "
        "the tokenizer is the weights', and the verdict is the last stage's own held-out figures",
    )
    model: ModelSpec = Field(default_factory=ModelSpec, description="the model's shape (stages may override fields)")
    optim: OptimSpec = Field(default_factory=OptimSpec, description="the optimizer (stages may override fields)")
    schedule: ScheduleSpec = Field(
        default_factory=ScheduleSpec, description="the learning-rate schedule (stages may override fields)"
    )
    train: TrainSpec = Field(default_factory=TrainSpec, description="steps and batch sizes (stages may override fields)")
    stages: list[StageSpec] = Field(
        default_factory=lambda: [StageSpec(name="main")],
        min_length=1,
        description="the stages, trained in order; the default is one stage named `main`",
    )
    eval: EvalSpec = Field(default_factory=EvalSpec, description="evaluation, the fit-to-ship verdict and samples")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="checkpoint interval and retention")
    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec, description="devices, precision, processes and the hardware requirement"
    )
    costs: CostsSpec = Field(
        default_factory=CostsSpec, description="prices per device-hour and power overhead, for the plan's costs"
    )
    traffic: TrafficSpec | None = Field(
        default=None,
        description="expected serving traffic; when given, the plan and the evaluation report weigh training "
        "against the cumulative cost of inference",
    )
    tracking: TrackingSpec = Field(default_factory=TrackingSpec, description="MLflow and TensorBoard mirrors of the run")

    @field_validator("name")
    @classmethod
    def _slug(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}", v):
            raise ValueError("a run name is 1-100 letters, digits, '_', '.' or '-' (it names a directory)")
        return v

    @model_validator(mode="after")
    def _task_fits(self) -> JobSpec:
        problems = task_problems(self)
        if problems:
            raise _FieldErrors(problems)
        if self.model.family is None and self.task == "language_model":
            self.model.family = "decoder"  # the one language-model family; other tasks' come from the data
        return self

    @model_validator(mode="after")
    def _data_when_needed(self) -> JobSpec:
        if self.data is None:
            problems = _missing_data_problems(self)
            if problems:
                raise _FieldErrors(problems)
        return self

    @model_validator(mode="after")
    def _stages_resolve(self) -> JobSpec:
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names must be unique, got {names}")
        for i, stage in enumerate(self.stages):
            for section in _SECTION_TYPES:
                try:
                    _merge(self, stage, section)
                except ValidationError as exc:
                    raise _StageOverrideError(i, section, exc) from None
        return self

    def fingerprint(self) -> str:
        """sha256 of the resolved spec: two runs with equal fingerprints ask for the same work."""
        # Tracking changes where the run is watched, never the work: left out.
        canonical = json.dumps(self.model_dump(mode="json", exclude={"tracking"}), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


class ResolvedStage(BaseModel):
    """A stage's own settings with the top level's filled in."""

    name: str
    index: int
    model: ModelSpec
    optim: OptimSpec
    schedule: ScheduleSpec
    train: TrainSpec
    gates: GateSpec
    kind: str = "pretrain"
    data: InstructDataSpec | None = None
    sft: SFTSpec = SFTSpec()
    dpo: DPOSpec = DPOSpec()
    lora: LoRASpec | None = None


_SECTION_TYPES: dict[str, type[BaseModel]] = {
    "model": ModelSpec,
    "optim": OptimSpec,
    "schedule": ScheduleSpec,
    "train": TrainSpec,
}


class _FieldErrors(ValueError):
    """Problems found by a whole-spec check, each at its own field path (not the spec's top level)."""

    def __init__(self, problems: list[tuple[tuple[Any, ...], Any, str]]):
        self.problems = problems
        super().__init__("; ".join(message for _loc, _value, message in problems))


class _StageOverrideError(ValueError):
    def __init__(self, index: int, section: str, exc: ValidationError):
        self.index, self.section, self.exc = index, section, exc
        super().__init__(str(exc))


def _missing_data_problems(spec: JobSpec) -> list[tuple[tuple[Any, ...], Any, str]]:
    """Why a spec without top-level `data` cannot run, if it cannot: a task other than the language model, a
    stage that pretrains (it trains on that data), or a stage from random weights (no tokenizer without it)."""
    if spec.task != "language_model":
        return [(("data",), "(missing)", f"task {spec.task} reads its table or images from data.sources")]
    pretraining = [s.name for s in spec.stages if s.kind == "pretrain"]
    if pretraining:
        return [(("data",), "(missing)",
                 f"stage {pretraining[0]!r} has kind pretrain, which trains on the top-level data: give `data` "
                 "(sources, tokenizer), or make every stage sft or dpo on its own data")]
    problems = []
    for i, stage in enumerate(spec.stages):
        init = stage.model.get("init", spec.model.init)
        if init is None:
            problems.append((("stages", i, "model", "init"), None,
                             f"stage {stage.name!r} starts from random weights, and without top-level `data` there "
                             "is no tokenizer for it: start it from a model directory (model.init: {from: hf, path: "
                             "...}) or an earlier stage, or give `data`"))
    return problems


REPLACED_WHOLE = {"init"}  # a stage's `model.init` is another source, not a tweak of the top level's


def _merge(spec: JobSpec, stage: StageSpec, section: str) -> BaseModel:
    """The top-level section with the stage's overrides: field by field, and inside a sub-section
    (`model.cnn`) field by field too, except `model.init`, which names one source and is replaced whole."""
    base = getattr(spec, section).model_dump()
    for key, value in getattr(stage, section).items():
        if isinstance(value, dict) and isinstance(base.get(key), dict) and key not in REPLACED_WHOLE:
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return _SECTION_TYPES[section].model_validate(base)


def _stage_warmup(spec: JobSpec, index: int) -> tuple[int, int, tuple[Any, ...]]:
    """(warmup steps, steps, where the warmup is set) for stage `index`."""
    stage = spec.stages[index]
    warmup = stage.schedule.get("warmup_steps", spec.schedule.warmup_steps)
    steps = stage.train.get("steps", spec.train.steps)
    if "warmup_steps" in stage.schedule:
        return warmup, steps, ("stages", index, "schedule", "warmup_steps")
    return warmup, steps, ("schedule", "warmup_steps")


def resolved_stage(spec: JobSpec, name: str) -> ResolvedStage:
    for i, stage in enumerate(spec.stages):
        if stage.name == name:
            return ResolvedStage(
                name=stage.name,
                index=i,
                gates=stage.gates,
                kind=stage.kind,
                data=stage.data,
                sft=stage.sft,
                dpo=stage.dpo,
                lora=stage.lora,
                **{section: _merge(spec, stage, section) for section in _SECTION_TYPES},
            )
    raise KeyError(f"no stage named {name!r}; stages are {[s.name for s in spec.stages]}")


def with_family(spec: JobSpec, family: str) -> JobSpec:
    """The spec with `model.family` filled in (stages that name their own keep it)."""
    if spec.model.family == family:
        return spec
    return spec.model_copy(update={"model": spec.model.model_copy(update={"family": family})})


def spec_warnings(spec: JobSpec) -> list[tuple[str, object, str]]:
    """Values the run will not use as written, though the spec is valid: (field path, value, what
    happens). Errors are raised by validation; these are logged when a spec is loaded."""
    out = []
    for i, stage in enumerate(spec.stages):
        warmup, steps, where = _stage_warmup(spec, i)
        if warmup > steps:
            # A warning, not an error: a run directory's stored spec states every default explicitly, so
            # "the user set it" cannot be told apart on resume.
            out.append((
                _loc_to_path(where),
                warmup,
                f"longer than stage {stage.name!r} ({steps} steps): its learning rate peaks at "
                f"{steps / warmup:.0%} of optim.lr and never decays; set it below {steps}, e.g. "
                f"{max(1, steps // 10)}",
            ))
    return out


# A stage's free-form overrides are the top-level sections' fields.
_STAGE_ALIASES = {f"stages.{section}": (section,) for section in _SECTION_TYPES}


def reference_anchor(loc: tuple[Any, ...] | str) -> str:
    """The anchor of a field's entry in docs/spec.md: its dotted path without list indices
    (`data.sources[0].path` -> `data.sources.path`; `stages[1].train.steps` -> `train.steps`); an unknown
    key points at its section."""
    if isinstance(loc, str):
        loc = spec_paths.path_to_loc(loc)
    return spec_paths.anchor(JobSpec, loc, _STAGE_ALIASES)


def reference_hint(loc: tuple[Any, ...] | str) -> str:
    """Where the reference describes the field at `loc`, for the end of an error message."""
    return f"(see {REFERENCE_DOC}#{reference_anchor(loc)})"


_loc_to_path = spec_paths.loc_to_path


def _problems(exc: ValidationError, raw: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[str, object, str]]:
    problems = []
    for err in exc.errors():
        loc = prefix + tuple(err["loc"])
        ctx_exc = (err.get("ctx") or {}).get("error")
        if isinstance(ctx_exc, _FieldErrors):
            for field_loc, value, message in ctx_exc.problems:
                found, written = spec_paths.lookup(raw, prefix + field_loc)
                problems.append((_loc_to_path(prefix + field_loc), written if found else value,
                                 f"{message} {reference_hint(prefix + field_loc)}"))
            continue
        if isinstance(ctx_exc, _StageOverrideError):
            # An override that makes a stage invalid: report it under stages[i].<section>.<field>.
            problems += _problems(ctx_exc.exc, raw, ("stages", ctx_exc.index, ctx_exc.section))
            continue
        found, value = spec_paths.lookup(raw, loc)
        if not found:
            value = err.get("input")
        if err["type"] == "missing":
            value = "(missing)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = spec_paths.unknown_key_message(JobSpec, loc, _STAGE_ALIASES)
        problems.append((_loc_to_path(loc), value, f"{msg} {reference_hint(loc)}"))
    return problems


def parse_spec(raw: Any, source: str = "<spec>") -> JobSpec:
    """Validate an already-parsed mapping."""
    if not isinstance(raw, dict):
        raise SpecError(source, [("(top level)", type(raw).__name__, "expected a mapping of spec sections")])
    try:
        spec = JobSpec.model_validate(raw)
    except ValidationError as exc:
        raise SpecError(source, _problems(exc, raw)) from None
    problems = _init_problems(spec)
    if problems:
        raise SpecError(source, problems)
    return spec


def _init_problems(spec: JobSpec) -> list[tuple[str, object, str]]:
    """A stage may start only from a stage before it (`model.init: {from: stage}`)."""
    problems = []
    names = [s.name for s in spec.stages]
    for i, stage in enumerate(spec.stages):
        init = _merge(spec, stage, "model").init
        if init is None or init.source != "stage" or init.name in names[:i]:
            continue
        where = f"stages[{i}].model.init.name" if "init" in stage.model else "model.init.name"
        if init.name in names:
            why = f"a stage before {stage.name!r}: a stage starts from the final weights of one trained before it"
        else:
            why = f"one of the spec's stages before {stage.name!r} ({names[:i] or 'there are none'})"
        problems.append((where, init.name, f"{why} {reference_hint('model.init.name')}"))
    return problems


def load_spec(path: str | Path) -> JobSpec:
    """Read and validate a YAML job spec; values the run will not use as written are logged as warnings."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(str(path), [("(file)", str(path), f"a readable YAML file ({exc.strerror})")]) from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(file)"
        raise SpecError(str(path), [(where, getattr(exc, "problem", str(exc)), "valid YAML")]) from None
    spec = parse_spec(raw, str(path))
    for field_path, value, message in spec_warnings(spec):
        log.warning("spec %s: %s = %r: %s", path, field_path, value, message)
    return spec


def dump_spec(spec: JobSpec) -> str:
    """The spec as resolved (defaults filled in), as YAML."""
    return yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False)
