"""The job spec: one YAML file that states everything a run depends on.

`load_spec(path)` parses and validates it up front; any problem is raised as a `SpecError` naming
the field path, the bad value and what was expected, before any work starts. Stages inherit the
top-level `model`, `optim`, `schedule` and `train` settings and override them field by field;
`resolved_stage(spec, stage)` gives the settings a stage really trains with.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from runyard.data.config import DataSpec
from runyard.errors import SpecError
from runyard.market.requirement import Requirement


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSpec(_Strict):
    """A Llama-style decoder. `vocab_size: null` takes the tokenizer's vocabulary size."""

    family: Literal["decoder"] = Field(
        default="decoder", description="the model family (runyard.model.registry); the fields below are the decoder's"
    )
    vocab_size: int | None = Field(default=None, ge=2)
    d_model: int = Field(default=256, ge=8)
    n_layers: int = Field(default=4, ge=1)
    n_heads: int = Field(default=4, ge=1)
    n_kv_heads: int | None = Field(default=None, ge=1, description="grouped-query heads; default n_heads")
    ffn_hidden: int | None = Field(default=None, ge=1, description="SwiGLU width; default ~8/3 d_model")
    context_length: int = Field(default=256, ge=2)
    tie_embeddings: bool = True
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    rope_theta: float = Field(default=10000.0, gt=0)
    norm_eps: float = Field(default=1e-5, gt=0)

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelSpec:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("head dimension d_model/n_heads must be even for rotary embeddings")
        kv = self.n_kv_heads or self.n_heads
        if self.n_heads % kv:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({kv})")
        return self


class OptimSpec(_Strict):
    """AdamW. Norm weights, biases and embeddings are not decayed unless the flags say so."""

    lr: float = Field(default=3e-3, gt=0, le=10)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.1, ge=0)
    decay_norms_and_biases: bool = False
    decay_embeddings: bool = False
    grad_clip: float | None = Field(default=1.0, gt=0)

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError("each beta must be in [0, 1)")
        return v


class ScheduleSpec(_Strict):
    warmup_steps: int = Field(default=20, ge=0)
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = Field(default=0.1, ge=0.0, le=1.0)


class TrainSpec(_Strict):
    """How long and how wide a stage trains. Global batch = batch_size x grad_accum x world size."""

    steps: int = Field(default=200, ge=1)
    batch_size: int = Field(default=16, ge=1, description="sequences per micro-batch per process")
    grad_accum: int = Field(default=1, ge=1)


class GateSpec(_Strict):
    """A stage passes only if every set gate passes."""

    min_loss_drop: float | None = Field(
        default=0.1, ge=0, lt=1, description="fraction by which the training loss must fall"
    )
    require_finite: bool = True
    max_heldout_loss: float | None = Field(default=None, gt=0)
    checkpoint_roundtrip: bool = True
    min_tokens_per_s: float | None = Field(default=None, gt=0)


class StageSpec(_Strict):
    """One stage. Unset sections inherit the top level; set fields override it one by one."""

    name: str
    model: dict[str, Any] = Field(default_factory=dict)
    optim: dict[str, Any] = Field(default_factory=dict)
    schedule: dict[str, Any] = Field(default_factory=dict)
    train: dict[str, Any] = Field(default_factory=dict)
    gates: GateSpec = Field(default_factory=GateSpec)

    @field_validator("name")
    @classmethod
    def _slug(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", v):
            raise ValueError("a stage name is 1-64 letters, digits, '_', '.' or '-'")
        return v


class EvalSpec(_Strict):
    interval: int = Field(default=50, ge=1, description="steps between held-out evaluations")
    batches: int = Field(default=8, ge=1, description="held-out batches per evaluation during training")
    final_batches: int = Field(default=32, ge=1, description="held-out batches scored by the final evaluation")
    max_heldout_perplexity: float | None = Field(default=None, gt=1, description="fit-to-ship bound")
    max_gap: float | None = Field(default=None, gt=0, description="held-out minus train loss bound")
    must_beat_unigram: bool = True
    prompts: list[str] = Field(default_factory=lambda: ["def ", "import ", "class "])
    sample_tokens: int = Field(default=48, ge=1)
    temperature: float = Field(default=0.8, ge=0)
    top_k: int | None = Field(default=40, ge=1)


class CheckpointSpec(_Strict):
    interval: int = Field(default=50, ge=1, description="steps between checkpoints")
    keep_last: int = Field(default=2, ge=1)
    keep_best: bool = True


class ResourcesSpec(_Strict):
    device: Literal["cpu", "cuda", "auto"] = "auto"
    precision: Literal["fp32", "bf16", "auto"] = "auto"
    compile: bool = False
    nproc: int = Field(default=1, ge=1)
    parallel: Literal["ddp", "fsdp"] = "ddp"
    deterministic: bool = True
    threads: int | None = Field(default=None, ge=1, description="CPU threads per process")
    requirement: Requirement = Field(default_factory=Requirement)


class JobSpec(_Strict):
    name: str
    seed: int = Field(default=0, ge=0, lt=2**63)
    data: DataSpec
    model: ModelSpec = Field(default_factory=ModelSpec)
    optim: OptimSpec = Field(default_factory=OptimSpec)
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    stages: list[StageSpec] = Field(default_factory=lambda: [StageSpec(name="main")], min_length=1)
    eval: EvalSpec = Field(default_factory=EvalSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)

    @field_validator("name")
    @classmethod
    def _slug(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}", v):
            raise ValueError("a run name is 1-100 letters, digits, '_', '.' or '-' (it names a directory)")
        return v

    @model_validator(mode="after")
    def _stages_resolve(self) -> JobSpec:
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names must be unique, got {names}")
        for i, stage in enumerate(self.stages):
            for section in ("model", "optim", "schedule", "train"):
                try:
                    _merge(self, stage, section)
                except ValidationError as exc:
                    raise _StageOverrideError(i, section, exc) from None
        return self

    def fingerprint(self) -> str:
        """sha256 of the resolved spec: two runs with equal fingerprints ask for the same work."""
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
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


_SECTION_TYPES: dict[str, type[BaseModel]] = {
    "model": ModelSpec,
    "optim": OptimSpec,
    "schedule": ScheduleSpec,
    "train": TrainSpec,
}


class _StageOverrideError(ValueError):
    def __init__(self, index: int, section: str, exc: ValidationError):
        self.index, self.section, self.exc = index, section, exc
        super().__init__(str(exc))


def _merge(spec: JobSpec, stage: StageSpec, section: str) -> BaseModel:
    base = getattr(spec, section).model_dump()
    base.update(getattr(stage, section))
    return _SECTION_TYPES[section].model_validate(base)


def resolved_stage(spec: JobSpec, name: str) -> ResolvedStage:
    for i, stage in enumerate(spec.stages):
        if stage.name == name:
            return ResolvedStage(
                name=stage.name,
                index=i,
                gates=stage.gates,
                **{section: _merge(spec, stage, section) for section in _SECTION_TYPES},
            )
    raise KeyError(f"no stage named {name!r}; stages are {[s.name for s in spec.stages]}")


def _loc_to_path(loc: tuple[Any, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += ("." if path else "") + str(part)
    return path or "(top level)"


def _lookup(raw: Any, loc: tuple[Any, ...]) -> tuple[bool, Any]:
    """The user's own value at `loc`, so messages quote what they wrote rather than a merged default."""
    node = raw
    for part in loc:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return False, None
    return True, node


def _problems(exc: ValidationError, raw: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[str, object, str]]:
    problems = []
    for err in exc.errors():
        loc = prefix + tuple(err["loc"])
        ctx_exc = (err.get("ctx") or {}).get("error")
        if isinstance(ctx_exc, _StageOverrideError):
            # An override that makes a stage invalid: report it under stages[i].<section>.<field>.
            problems += _problems(ctx_exc.exc, raw, ("stages", ctx_exc.index, ctx_exc.section))
            continue
        found, value = _lookup(raw, loc)
        if not found:
            value = err.get("input")
        if err["type"] == "missing":
            value = "(missing)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key; check its spelling against the spec reference"
        problems.append((_loc_to_path(loc), value, msg.removeprefix("Value error, ")))
    return problems


def parse_spec(raw: Any, source: str = "<spec>") -> JobSpec:
    """Validate an already-parsed mapping."""
    if not isinstance(raw, dict):
        raise SpecError(source, [("(top level)", type(raw).__name__, "expected a mapping of spec sections")])
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as exc:
        raise SpecError(source, _problems(exc, raw)) from None


def load_spec(path: str | Path) -> JobSpec:
    """Read and validate a YAML job spec."""
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
    return parse_spec(raw, str(path))


def dump_spec(spec: JobSpec) -> str:
    """The spec as resolved (defaults filled in), as YAML."""
    return yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False)
