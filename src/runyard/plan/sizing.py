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

`ReplicaMemory` is the same model state and activations before a parallel layout divides them, and
`ReplicaMemory.per_device` what one device holds under a layout (FSDP shards, tensor parallel, activation
checkpointing): the figures plan/layout_choice.py chooses a layout by.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from runyard.market.requirement import Interconnect, Requirement
from runyard.model import stage_model
from runyard.model.compute import checkpointed_indices
from runyard.model.registry import DEFAULT_FAMILY, ModelFamily, Sizing, get_family
from runyard.plan.devices import GPU_RESERVED_BYTES, UTILISATION, device
from runyard.plan.recommend import DATA_KINDS, Hardware, training_hardware, training_seconds
from runyard.spec.job import JobSpec, ResolvedStage, resolved_stage

BYTES_PER_PARAM_TRAINING = 16  # fp32 weights 4 + grads 4 + AdamW m 4 + v 4
BYTES_PER_PARAM_STATE_NO_GRAD = 12  # weights and moments: what stays while evaluating (grads set to None)
FRAMEWORK_CPU_BYTES = 400 << 20  # python + torch + runyard as a run imports them, stated (measured by plan)
BYTES_PER_WEIGHT = 4  # fp32 weights (autocast computes in bf16; the weights and their gradients stay fp32)
BYTES_PER_GRADIENT = 4
BYTES_PER_OPTIMIZER_STATE = 8  # AdamW's two fp32 moments
# Tensor parallel without sequence parallel (runyard's plan): of the ~34 values a block keeps per token and
# channel, the 24 inside attention and the MLP split over the tp ranks; the 10 of the norms' inputs and the
# residual stay whole on every rank (Korthikanti et al. 2022, table 2).
TP_SPLIT_ACTIVATION_FRACTION = 24 / 34
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
    # The least a device holds besides model state under a layout runyard trains (layout_choice's figures:
    # every block recomputed, or the evaluation's forward, whichever is larger).
    least_activation_bytes: int = 0


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


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes one device holds under a layout, by what holds them. Training holds weights, gradients, the
    optimizer's moments and one micro-batch's activations; a periodic evaluation holds the weights and moments
    (gradients set to None) and a forward pass's outputs: the peak is the larger."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    evaluation: int

    @property
    def total(self) -> int:
        return max(self.weights + self.gradients + self.optimizer + self.activations,
                   self.weights + self.optimizer + self.evaluation)

    def describe(self) -> str:
        return (f"weights {human_bytes(self.weights)} + gradients {human_bytes(self.gradients)} + optimizer "
                f"{human_bytes(self.optimizer)} + activations {human_bytes(self.activations)}")


@dataclass(frozen=True)
class ReplicaMemory:
    """A stage's model as one replica holds it, before a layout divides it: fp32 weights of every parameter;
    gradients and AdamW's moments of the trainable ones (all, or LoRA's adapters, which are fp32 too); the
    family's activations at the stage's micro-batch and context. `block_parameters` are those of the
    family's shard units (the blocks), which tensor parallel splits; the rest (embedding, final norm, head)
    stays whole on every tensor-parallel rank."""

    parameters: int
    trainable: int
    block_parameters: int
    lora: bool
    size: Sizing
    every: int  # train.activation_checkpointing_every, for `selective`

    def recomputed(self, activation_checkpointing: str, every: int | None = None) -> int:
        return len(checkpointed_indices(self.size.recomputable_units, activation_checkpointing,
                                        self.every if every is None else every))

    def per_device(self, dp_shard: int = 1, tp: int = 1, activation_checkpointing: str = "none",
                   every: int | None = None) -> DeviceMemory:
        """What one device holds with the model state sharded over `dp_shard` FSDP ranks and the blocks split
        over `tp` tensor-parallel ranks, with `activation_checkpointing` (the stage's `every` unless given)."""
        adapters = self.trainable if self.lora else 0

        def split(n: int) -> int:  # parameters on one tp rank: its share of the blocks', the rest whole
            blocks = n * self.block_parameters // self.parameters if self.parameters else 0
            return (n - blocks) + blocks // tp

        weights = split(self.parameters) * BYTES_PER_WEIGHT + split(adapters) * BYTES_PER_WEIGHT
        return DeviceMemory(
            weights=weights // dp_shard,
            gradients=split(self.trainable) * BYTES_PER_GRADIENT // dp_shard,
            optimizer=split(self.trainable) * BYTES_PER_OPTIMIZER_STATE // dp_shard,
            activations=activation_bytes_on(self.size, self.recomputed(activation_checkpointing, every), tp),
            evaluation=evaluation_bytes(self.size),
        )


def evaluation_bytes(size: Sizing) -> int:
    """A forward pass without gradients keeps nothing for backward: what lies outside the blocks (the logits
    and the loss's softmax) and one block's activations at a time. A family without blocks: a third of the
    training batch's activations, as memory_estimate states it."""
    if not size.recomputable_units:
        return size.activation_bytes // 3
    outside = size.activation_bytes - size.recomputable_units * size.unit_activation_bytes
    return outside + size.unit_activation_bytes


def activation_bytes_on(size: Sizing, recomputed: int, tp: int = 1) -> int:
    """`Sizing.activation_bytes_with(recomputed)` on one of `tp` tensor-parallel ranks: each block's own
    activations shrink by TP_SPLIT_ACTIVATION_FRACTION x (1 - 1/tp); its input (the residual stream), and
    what lies outside the blocks (the logits: the head stays whole), do not."""
    if tp == 1 or not size.recomputable_units:
        return size.activation_bytes_with(recomputed)
    n = max(0, min(recomputed, size.recomputable_units))
    unit = int(size.unit_activation_bytes * (1 - TP_SPLIT_ACTIVATION_FRACTION * (1 - 1 / tp)))
    outside = size.activation_bytes - size.recomputable_units * size.unit_activation_bytes
    kept = (size.recomputable_units - n) * unit + n * size.unit_input_bytes + (unit if n else 0)
    return outside + kept


def replica_memory(spec: JobSpec, stage_name: str, data_facts: dict[str, Any] | None = None) -> ReplicaMemory:
    """The stage's `ReplicaMemory` from the spec (and what the data tells, as plan_stage)."""
    stage = resolved_stage(spec, stage_name)
    family, cfg = stage_config(spec, stage, dict(data_facts or {}))
    size = family.sizing(cfg, micro_batch=stage.train.batch_size)
    blocks = block_parameters(family, cfg)
    trainable = size.parameters
    if stage.lora is not None:
        trainable = lora_parameters(cfg, stage.lora.rank, stage.lora.targets)
    return ReplicaMemory(size.parameters, trainable, blocks, stage.lora is not None, size,
                         stage.train.activation_checkpointing_every)


def block_parameters(family: ModelFamily, cfg: Any) -> int:
    """Parameters in the family's shard units (its blocks), counted on the meta device (no memory)."""
    if not family.trains_with_loop:
        return 0
    with torch.device("meta"):
        model = family.build(cfg)
    return sum(p.numel() for unit in family.shard_units(model) for p in unit.parameters())


# LoRA targets by their Hugging Face names: (input, output) features as multiples of (d_model, head_dim x
# heads, head_dim x kv heads, ffn_hidden), read from the decoder's config.
def lora_parameters(cfg: Any, rank: int, targets: list[str]) -> int:
    """Adapter parameters LoRA of `rank` adds on `targets` in every block: rank x (in + out) each."""
    d, q, kv, ffn = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_hidden
    shapes = {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
              "gate_proj": (d, ffn), "up_proj": (d, ffn), "down_proj": (ffn, d)}
    return cfg.n_layers * sum(rank * sum(shapes[t]) for t in targets)


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
                     size.forward_flops_per_unit * evaluation_units(spec, stage, family, cfg),
                     max(activation_bytes_on(size, size.recomputable_units), evaluation_bytes(size)))


def recommended_training(spec: JobSpec, stages: list[StagePlan]) -> Hardware:
    """The training hardware the stages' sizes call for, every kind weighed (recommend.training_hardware)."""
    biggest = max(stages, key=lambda s: s.memory["states"] + s.memory["activations"])
    per_replica = biggest.memory["states"] * state_sharding(spec)
    need = per_replica + max(biggest.memory["activations"], biggest.memory["evaluation"]) + GPU_RESERVED_BYTES
    kind = DATA_KINDS[spec.task]
    util = UTILISATION["train_transformer" if kind == "text" else "train_other"]
    return training_hardware(spec.task, need, per_replica, sum(s.training_flops + s.evaluation_flops for s in stages),
                             util, spec.resources.threads, micro_steps=micro_steps(spec, stages), costs=spec.costs,
                             on_device=any(get_family(s.family).trains_with_loop for s in stages),
                             parameters=biggest.parameters,
                             least_unsharded=biggest.least_activation_bytes + GPU_RESERVED_BYTES)


def micro_steps(spec: JobSpec, stages: list[StagePlan]) -> int:
    """Forward-backward passes the stages the loop trains take (steps x gradient accumulation)."""
    out = 0
    for s in stages:
        if get_family(s.family).trains_with_loop:
            t = resolved_stage(spec, s.stage).train
            out += t.steps * t.grad_accum
    return out


def device_table_seconds(stages: list[StagePlan], hardware: Hardware, task: str, spec: JobSpec | None = None) -> float:
    """Training and periodic evaluation on `hardware`, by the device table: FLOPs / (peak x utilisation), and
    on a GPU at least recommend.GPU_TRAIN_STEP_FLOOR_S per micro-batch (given the spec)."""
    kind = DATA_KINDS[task]
    flops = sum(s.training_flops + s.evaluation_flops for s in stages)
    return training_seconds(device(hardware.kind), flops, UTILISATION["train_transformer" if kind == "text" else "train_other"],
                            hardware.devices, micro_steps(spec, stages) if spec is not None else 0)


def requirement_for(spec: JobSpec, hardware: Hardware, seconds: float, interconnect: str | None = None) -> Requirement:
    """The spec's requirement with the recommended hardware written in where the spec left it to runyard
    (accelerator kinds, device count, interconnect not set explicitly; the interconnect the stronger of the
    hardware's and `interconnect`, the one the chosen layout needs: NVLink for tensor parallel), and its
    duration raised to the estimate (times REQUIREMENT_MARGIN, plus REQUIREMENT_SLACK_S) when the estimate is
    longer."""
    requirement: Requirement = spec.resources.requirement
    given = requirement.model_fields_set if "requirement" in spec.resources.model_fields_set else set()
    update: dict[str, Any] = {}
    if "accelerator_kinds" not in given:
        update["accelerator_kinds"] = [hardware.kind]
    if "device_count" not in given:
        update["device_count"] = hardware.devices
    if "min_interconnect" not in given:
        links = [Interconnect(hardware.interconnect)] + ([Interconnect(interconnect)] if interconnect else [])
        update["min_interconnect"] = max(links, key=lambda i: i.rank)
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
        estimate = device_table_seconds(stages, hardware, spec.task, spec)
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
