"""Sizing a run from its spec alone: parameters, training FLOPs, memory per device, time and the
requirement a market or scheduler can act on.

The model's own numbers (parameters, FLOPs per token, activation memory) come from its family in the
model registry (for the decoder: counted on the meta device from the model's definition, with the usual
6 FLOPs per matmul weight per training token plus attention, see `Transformer.flops_per_token`).
Memory adds fp32 weights, gradients and AdamW's two moments (16 bytes/parameter; divided over ranks
under FSDP) to the family's activation estimate for the micro-batch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from runyard.market.requirement import Requirement
from runyard.model.registry import DEFAULT_FAMILY, get_family
from runyard.plan.weights_in import stage_config
from runyard.spec import JobSpec, resolved_stage

BYTES_PER_PARAM_TRAINING = 16  # fp32 weights 4 + grads 4 + AdamW m 4 + v 4


@dataclass(frozen=True)
class StagePlan:
    stage: str
    family: str
    parameters: int
    non_embedding_parameters: int
    tokens: int
    flops_per_token: float
    training_flops: float
    memory_per_device_bytes: int
    estimated_seconds: float | None


def count_parameters(cfg: Any, family: str = DEFAULT_FAMILY) -> tuple[int, int]:
    """(total, non-embedding) parameters of a model of config `cfg`, from its shape alone."""
    size = get_family(family).sizing(cfg)
    return size.parameters, size.non_embedding_parameters


def flops_per_token(cfg: Any, family: str = DEFAULT_FAMILY) -> float:
    """Training FLOPs (forward and backward) per token of a model of config `cfg`."""
    return get_family(family).sizing(cfg).flops_per_unit


def plan_stage(spec: JobSpec, stage_name: str, vocab_size: int, tokens_per_s: float | None = None) -> StagePlan:
    stage = resolved_stage(spec, stage_name)
    family = get_family(stage.model.family)
    cfg = stage_config(spec, stage_name, vocab_size)  # the spec's shape, or its initial weights'
    size = family.sizing(cfg, micro_batch=stage.train.batch_size)
    world = spec.resources.nproc
    tokens = stage.train.steps * stage.train.batch_size * stage.train.grad_accum * world * stage.model.context_length
    states = size.parameters * BYTES_PER_PARAM_TRAINING
    if spec.resources.parallel == "fsdp":
        states //= world
    memory = states + size.activation_bytes
    seconds = tokens / tokens_per_s if tokens_per_s else None
    return StagePlan(stage_name, family.name, size.parameters, size.non_embedding_parameters, tokens,
                     size.flops_per_unit, size.flops_per_unit * tokens, memory, seconds)


def plan_run(spec: JobSpec, vocab_size: int, tokens_per_s: float | None = None) -> dict:
    """The plan of every stage and the run's requirement (the spec's, with its duration raised to the
    estimate when the estimate is longer)."""
    stages = [plan_stage(spec, s.name, vocab_size, tokens_per_s) for s in spec.stages]
    requirement: Requirement = spec.resources.requirement
    estimate = sum(s.estimated_seconds or 0 for s in stages)
    if estimate > requirement.duration_s:
        requirement = requirement.model_copy(update={"duration_s": int(estimate * 1.2) + 60})
    return {
        "stages": [asdict(s) for s in stages],
        "training_flops": sum(s.training_flops for s in stages),
        "requirement": requirement.model_dump(mode="json"),
    }


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"
