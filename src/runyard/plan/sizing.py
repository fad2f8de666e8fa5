"""Sizing a run from its spec alone: parameters, training FLOPs, memory per device, time and the
requirement a market or scheduler can act on.

FLOPs follow the usual accounting (Kaplan et al. 2020; PaLM appendix B; see
`Transformer.flops_per_token`): 6 FLOPs per matmul weight per training token plus attention's
12 * layers * d_model * context.
Memory counts fp32 weights, gradients and AdamW's two moments (16 bytes/parameter; divided over ranks
under FSDP) plus activations estimated per layer for the micro-batch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from runyard.market.requirement import Requirement
from runyard.model.config import ModelConfig
from runyard.spec import JobSpec, resolved_stage

BYTES_PER_PARAM_TRAINING = 16  # fp32 weights 4 + grads 4 + AdamW m 4 + v 4


@dataclass(frozen=True)
class StagePlan:
    stage: str
    parameters: int
    non_embedding_parameters: int
    tokens: int
    flops_per_token: float
    training_flops: float
    memory_per_device_bytes: int
    estimated_seconds: float | None


def _shape_only(cfg: ModelConfig):
    """The model built on the meta device: shapes without memory, so counts come from the model's own
    definition rather than a second copy of its arithmetic."""
    import torch

    from runyard.model.transformer import Transformer

    with torch.device("meta"):
        return Transformer(cfg)


def count_parameters(cfg: ModelConfig) -> tuple[int, int]:
    """(total, non-embedding) parameters of the decoder, from its shape alone."""
    model = _shape_only(cfg)
    return model.num_parameters(), model.num_parameters(non_embedding=True)


def flops_per_token(cfg: ModelConfig) -> float:
    return _shape_only(cfg).flops_per_token()


def activation_bytes(cfg: ModelConfig, micro_batch: int, bytes_per_value: int = 4) -> int:
    """A coarse estimate of saved activations for one micro-batch: ~34*d per token per layer plus the
    logits (Korthikanti et al. 2022, without recomputation, SDPA's memory-efficient attention)."""
    tokens = micro_batch * cfg.context_length
    per_layer = 34 * cfg.d_model * tokens * bytes_per_value // 2
    logits = tokens * cfg.vocab_size * bytes_per_value * 2
    return cfg.n_layers * per_layer + logits


def plan_stage(spec: JobSpec, stage_name: str, vocab_size: int, tokens_per_s: float | None = None) -> StagePlan:
    stage = resolved_stage(spec, stage_name)
    cfg = ModelConfig.from_spec(stage.model, vocab_size)
    total, non_embedding = count_parameters(cfg)
    world = spec.resources.nproc
    tokens = stage.train.steps * stage.train.batch_size * stage.train.grad_accum * world * cfg.context_length
    fpt = flops_per_token(cfg)
    states = total * BYTES_PER_PARAM_TRAINING
    if spec.resources.parallel == "fsdp":
        states //= world
    memory = states + activation_bytes(cfg, stage.train.batch_size)
    seconds = tokens / tokens_per_s if tokens_per_s else None
    return StagePlan(stage_name, total, non_embedding, tokens, fpt, fpt * tokens, memory, seconds)


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
