"""Sizing a run from its spec alone: parameters, training FLOPs, memory per device, and the requirement a
market or scheduler can act on, with the time it asks for on the recommended hardware (device table).

The model's own numbers (parameters, FLOPs per unit, activation memory) come from its family in the
model registry (for the decoder: counted on the meta device from the model's definition, with the usual
6 FLOPs per matmul weight per training token plus attention, see `Transformer.flops_per_token`).

Memory per device (`MemoryEstimate`) counts:
- the framework: the interpreter, torch and runyard as a run imports them (measured by `runyard plan`;
  stated here), plus a CUDA context on a GPU;
- model state: fp32 weights, gradients and AdamW's two moments, 16 bytes a parameter (divided over ranks
  under FSDP);
- activations one micro-batch keeps for backward (the family's estimate, with the blocks that
  `train.activation_checkpointing` recomputes keeping only their input; or measured by a calibration);
- the evaluation's batch (a forward pass without gradients: its outputs and the loss's softmax);
- the loader: the token shards it maps, resident once read.
This module never measures; `runyard.plan.planner` replaces stated figures with measured ones.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from runyard.market.requirement import Interconnect, Requirement
from runyard.model import stage_model
from runyard.model.compute import checkpointed_indices
from runyard.model.registry import DEFAULT_FAMILY, ModelFamily, Sizing, get_family
from runyard.plan.devices import GPU_RESERVED_BYTES, UTILISATION, device
from runyard.plan.recommend import DATA_KINDS, Hardware, training_hardware
from runyard.spec.job import JobSpec, ResolvedStage, resolved_stage

BYTES_PER_PARAM_TRAINING = 16  # fp32 weights 4 + grads 4 + AdamW m 4 + v 4
BYTES_PER_PARAM_STATE_NO_GRAD = 12  # weights and moments: what stays while evaluating (grads set to None)
FRAMEWORK_CPU_BYTES = 400 << 20  # python + torch + runyard as a run imports them, stated (measured by plan)
REQUIREMENT_MARGIN = 1.2  # the requirement's duration over the estimate, plus REQUIREMENT_SLACK_S
REQUIREMENT_SLACK_S = 60


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one device (one process on a CPU) holds at its peak during a stage, by what holds them."""

    framework: int
    states: int
    activations: int
    evaluation: int
    loader: int
    how: str

    @property
    def total(self) -> int:
        training = self.states + self.activations
        evaluating = self.states * BYTES_PER_PARAM_STATE_NO_GRAD // BYTES_PER_PARAM_TRAINING + self.evaluation
        return self.framework + self.loader + max(training, evaluating)

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


@dataclass(frozen=True)
class StagePlan:
    stage: str
    family: str
    parameters: int
    non_embedding_parameters: int
    tokens: int  # units of training data (tokens for a language model, samples or rows otherwise)
    unit: str
    flops_per_token: float  # training FLOPs per unit
    training_flops: float
    memory_per_device_bytes: int
    estimated_seconds: float | None
    memory: dict
    evaluation_flops: float = 0.0


def count_parameters(cfg: Any, family: str = DEFAULT_FAMILY) -> tuple[int, int]:
    """(total, non-embedding) parameters of a model of config `cfg`, from its shape alone."""
    size = get_family(family).sizing(cfg)
    return size.parameters, size.non_embedding_parameters


def flops_per_token(cfg: Any, family: str = DEFAULT_FAMILY) -> float:
    """Training FLOPs (forward and backward) per token of a model of config `cfg`."""
    return get_family(family).sizing(cfg).flops_per_unit


def stage_config(spec: JobSpec, stage: ResolvedStage, data_facts: dict[str, Any]) -> tuple[ModelFamily, Any]:
    """The stage's family and resolved config: its model section with what the data tells, or the shape of
    the weights it starts from (`model.init`, model/stage_model.py)."""
    return get_family(stage.model.family), stage_model.stage_config(spec, stage.name, **data_facts)


def training_units(spec: JobSpec, stage: ResolvedStage, family: ModelFamily, config: Any,
                   train_rows: int | None = None) -> int:
    """Units of data a stage trains on: steps x micro-batch x accumulation x processes x units per example
    for the loop; the training rows once for a family fit by its own library."""
    if not family.trains_with_loop:
        return int(train_rows or 0)
    t = stage.train
    return t.steps * t.batch_size * t.grad_accum * spec.resources.nproc * family.units_per_example(config)


def evaluation_units(spec: JobSpec, stage: ResolvedStage, family: ModelFamily, config: Any) -> int:
    """Units of held-out data the stage's periodic evaluations score (every eval.interval steps and at the end)."""
    if not family.trains_with_loop:
        return 0
    steps = stage.train.steps
    evaluations = steps // spec.eval.interval + (1 if steps % spec.eval.interval else 0)
    return evaluations * spec.eval.batches * stage.train.batch_size * family.units_per_example(config)


def state_bytes(parameters: int, spec: JobSpec) -> int:
    return parameters * BYTES_PER_PARAM_TRAINING // state_sharding(spec)


def state_sharding(spec: JobSpec) -> int:
    """Over how many processes a replica's model state is split: FSDP's shards times tensor parallel's."""
    parallel = spec.resources.parallel
    if parallel == "fsdp":
        return spec.resources.nproc
    if parallel == "ddp":
        return 1
    return parallel.dp_shard * parallel.tp


def recomputed_units(stage: ResolvedStage, size: Sizing) -> int:
    """How many of the family's blocks the stage's `train.activation_checkpointing` recomputes."""
    t = stage.train
    return len(checkpointed_indices(size.recomputable_units, t.activation_checkpointing,
                                    t.activation_checkpointing_every))


def memory_estimate(spec: JobSpec, size: Sizing, framework: int, loader: int, gpu: bool,
                    recomputed: int = 0) -> MemoryEstimate:
    """The stated memory of a stage (see the module doc), with `recomputed` blocks keeping only their
    input for backward. On a GPU the framework is the CUDA context."""
    how = "stated: the family's activation estimate, 16 bytes a parameter, the framework as a run imports it"
    if recomputed:
        how += f"; {recomputed} of {size.recomputable_units} blocks recomputed in backward"
    return MemoryEstimate(
        framework=GPU_RESERVED_BYTES if gpu else framework,
        states=state_bytes(size.parameters, spec),
        activations=size.activation_bytes_with(recomputed),
        # A forward pass without gradients keeps no activations; its outputs and softmax are about the
        # last layers' share, taken as a third of the training batch's activations.
        evaluation=size.activation_bytes // 3,
        loader=0 if gpu else loader,
        how=how,
    )


def plan_stage(spec: JobSpec, stage_name: str, vocab_size: int | None = None, tokens_per_s: float | None = None,
               data_facts: dict[str, Any] | None = None, framework: int = FRAMEWORK_CPU_BYTES,
               loader: int = 0, train_rows: int | None = None) -> StagePlan:
    """A stage's size from the spec (and what the data tells: `vocab_size` for a language model, or
    `data_facts` for any family). `tokens_per_s` given, the time is units / it."""
    stage = resolved_stage(spec, stage_name)
    facts = dict(data_facts or {})
    if vocab_size is not None:
        facts.setdefault("vocab_size", vocab_size)
    family, cfg = stage_config(spec, stage, facts)
    size = family.sizing(cfg, micro_batch=stage.train.batch_size)
    units = training_units(spec, stage, family, cfg, train_rows)
    memory = memory_estimate(spec, size, framework, loader, gpu=False, recomputed=recomputed_units(stage, size))
    seconds = units / tokens_per_s if tokens_per_s else None
    return StagePlan(stage_name, family.name, size.parameters, size.non_embedding_parameters, units, size.unit,
                     size.flops_per_unit, size.flops_per_unit * units, memory.total, seconds, memory.to_dict(),
                     size.forward_flops_per_unit * evaluation_units(spec, stage, family, cfg))


def recommended_training(spec: JobSpec, stages: list[StagePlan]) -> Hardware:
    """The training hardware the seed's table and the stages' sizes call for (recommend.training_hardware)."""
    biggest = max(stages, key=lambda s: s.memory["states"] + s.memory["activations"])
    per_replica = biggest.memory["states"] * state_sharding(spec)
    need = per_replica + max(biggest.memory["activations"], biggest.memory["evaluation"]) + GPU_RESERVED_BYTES
    kind = DATA_KINDS[spec.task]
    util = UTILISATION["train_transformer" if kind == "text" else "train_other"]
    return training_hardware(spec.task, need, per_replica, sum(s.training_flops + s.evaluation_flops for s in stages),
                             util, spec.resources.threads)


def device_table_seconds(stages: list[StagePlan], hardware: Hardware, task: str) -> float:
    """Training and periodic evaluation on `hardware`, by the device table: FLOPs / (peak x utilisation)."""
    d = device(hardware.kind)
    kind = DATA_KINDS[task]
    util = UTILISATION["train_transformer" if kind == "text" else "train_other"] if d.gpu else UTILISATION["cpu_of_matmul_peak"]
    flops = sum(s.training_flops + s.evaluation_flops for s in stages)
    return flops / (d.peak_flops * util * hardware.devices)


def requirement_for(spec: JobSpec, hardware: Hardware, seconds: float) -> Requirement:
    """The spec's requirement with the recommended hardware written in where the spec left it to runyard
    (accelerator kinds, device count, interconnect not set explicitly), and its duration raised to the
    estimate (times REQUIREMENT_MARGIN, plus REQUIREMENT_SLACK_S) when the estimate is longer."""
    requirement: Requirement = spec.resources.requirement
    given = requirement.model_fields_set if "requirement" in spec.resources.model_fields_set else set()
    update: dict[str, Any] = {}
    if "accelerator_kinds" not in given:
        update["accelerator_kinds"] = [hardware.kind]
    if "device_count" not in given:
        update["device_count"] = hardware.devices
    if "min_interconnect" not in given:
        update["min_interconnect"] = Interconnect(hardware.interconnect)
    if seconds > requirement.duration_s:
        update["duration_s"] = int(seconds * REQUIREMENT_MARGIN) + REQUIREMENT_SLACK_S
    return requirement.model_copy(update=update)


def plan_run(spec: JobSpec, vocab_size: int | None = None, tokens_per_s: float | None = None,
             data_facts: dict[str, Any] | None = None) -> dict:
    """The plan of every stage from the spec alone, the recommended training hardware and the run's
    requirement: the spec's, with the recommended hardware written in where the spec left it open and the
    duration raised to the estimate (at `tokens_per_s` when given, else the device table's on the
    recommended hardware) when that is longer. No measurement: `runyard plan` calibrates (planner.py)."""
    stages = [plan_stage(spec, s.name, vocab_size, tokens_per_s, data_facts) for s in spec.stages]
    hardware = recommended_training(spec, stages)
    if tokens_per_s:
        estimate = sum(s.estimated_seconds or 0 for s in stages)
    else:
        estimate = device_table_seconds(stages, hardware, spec.task)
    return {
        "stages": [asdict(s) for s in stages],
        "training_flops": sum(s.training_flops for s in stages),
        "recommended_training": hardware.to_dict(),
        "requirement": requirement_for(spec, hardware, estimate).model_dump(mode="json"),
    }


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"
