"""The plan picks the parallel layout: from a stage's memory per device under each layout (sizing.ReplicaMemory)
and the hardware's memory and links (devices.Cluster), in torchtitan's order:

1. plain data parallel (DDP; one process on one device) while a whole replica fits a device;
2. else FSDP2 (`dp_shard` over every device): weights, gradients and optimizer state sharded;
3. then activation checkpointing on top (`selective`, then `full`), the stage's own setting first;
4. then tensor parallel inside a node, over NVLink-class links (the requirement then asks for NVLink);
5. else pipeline parallel across nodes would be needed, which runyard does not train yet: the plan names
   the figures and chooses nothing.

Only layouts runyard's trainer runs today are chosen (train/parallel.py, train/loop.py refuse the others):
tensor parallel is chosen as one axis equal to the world size, for pretrain and sft stages without LoRA (the
trainer also runs dp_shard x tp on a 2-D mesh when a spec names it; the plan checks, not chooses, that);
replicas of FSDP shards (HSDP) are not laid out; LoRA stages train with ddp.

A layout the spec names in `resources.parallel` is checked, not chosen: when its per-device need exceeds the
device's usable memory the plan is a SpecError naming both figures (`check_explicit`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from runyard.errors import SpecError
from runyard.market.requirement import Interconnect
from runyard.model.registry import NoTensorParallelPlan, get_family
from runyard.plan.devices import Cluster, cluster_of, device, usable_memory
from runyard.plan.recommend import Hardware
from runyard.plan.sizing import (
    DeviceMemory,
    ReplicaMemory,
    human_bytes,
    plan_stage,
    recommended_training,
    replica_memory,
    stage_config,
)
from runyard.plan.weights_in import run_vocab
from runyard.spec.job import JobSpec, resolved_stage

AC_ORDER = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    """A layout on the device mesh (the spec's `resources.parallel` axes, and `pp` which runyard does not
    train yet) with the stage's activation checkpointing."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    activation_checkpointing: str = "none"
    every: int = 2  # for `selective`: every k-th block

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def parallel(self) -> str | dict:
        """What `resources.parallel` reads for it."""
        if self.tp == 1 and self.pp == 1:
            return "fsdp" if self.dp_shard > 1 else "ddp"
        axes = {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp, "pp": self.pp}
        return {k: v for k, v in axes.items() if v > 1}

    def describe(self) -> str:
        if self.world == 1:
            shape = "one process (no data parallelism)"
        elif self.tp == 1 and self.pp == 1:
            shape = f"FSDP over {self.dp_shard}" if self.dp_shard > 1 else f"DDP over {self.dp_replicate}"
        else:
            shape = " x ".join(f"{k} {v}" for k, v in (("pp", self.pp), ("dp_shard", self.dp_shard),
                                                          ("dp_replicate", self.dp_replicate), ("tp", self.tp))
                               if v > 1)
        ac = self.activation_checkpointing
        if ac == "selective":
            ac = f"selective (every {self.every})"
        return f"{shape}, activation checkpointing {ac}"


@dataclass(frozen=True)
class LayoutStep:
    """One layout the chooser weighed: its memory per device against the device's usable memory, or why
    runyard cannot train it (`refused`)."""

    layout: Layout
    memory: DeviceMemory | None
    available: int
    refused: str | None = None

    @property
    def fits(self) -> bool:
        return self.refused is None and self.memory is not None and self.memory.total <= self.available

    def reason(self) -> str:
        head = self.layout.describe()
        if self.refused is not None and self.memory is None:
            return f"{head}: {self.refused}"
        holds = self.memory.total <= self.available
        figures = (f"{human_bytes(self.memory.total)} per device of {human_bytes(self.available)} usable "
                   f"({'fits' if holds else 'too big'}; {self.memory.describe()})")
        if self.refused is not None:
            return f"{head}: {figures}; {'but ' if holds else 'and '}{self.refused}"
        return f"{head}: {figures}"

    def to_dict(self) -> dict:
        return {"layout": self.layout.describe(), "parallel": self.layout.parallel,
                "activation_checkpointing": self.layout.activation_checkpointing,
                "per_device_bytes": self.memory.total if self.memory else None, "available_bytes": self.available,
                "fits": self.fits, "refused": self.refused}


@dataclass(frozen=True)
class LayoutChoice:
    """A stage's layout on `cluster`, the steps that led to it, and the link it needs (None: what the
    hardware's recommendation already says)."""

    stage: str
    cluster: Cluster
    chosen: Layout | None
    steps: tuple[LayoutStep, ...]
    interconnect: str | None
    explicit: bool = False
    fsdp_devices: int | None = None  # when nothing fits: the devices FSDP with full recomputation would need

    def reasons(self) -> list[str]:
        out = [step.reason() for step in self.steps]
        if self.chosen is None:
            best = min((s for s in self.steps if s.memory is not None and s.layout.pp == 1),
                       key=lambda s: s.memory.total, default=None)
            smallest = (f"; the smallest runyard trains, {best.layout.describe()}, needs "
                        f"{human_bytes(best.memory.total)} per device of {human_bytes(best.available)}") if best else ""
            nodes = cluster_of(self.cluster.kind, self.fsdp_devices).nodes if self.fsdp_devices else 0
            more = (f"; FSDP with full activation checkpointing would fit on {self.fsdp_devices} devices"
                    + (f" ({nodes} nodes)" if nodes > 1 else "")) if self.fsdp_devices else ""
            out.append(f"no layout runyard trains holds stage {self.stage} on {self.cluster.describe()}{smallest}"
                       f"{more}; use devices with more memory, more of them, or a smaller micro-batch or context")
        elif self.chosen.tp > 1:
            out.append(f"tensor parallel needs {Interconnect.NVLINK.value} within the node: written into the requirement")
        return out

    def describe(self) -> str:
        if self.chosen is None:
            return f"stage {self.stage}: no layout fits {self.cluster.describe()}"
        how = "as resources.parallel names it" if self.explicit else "chosen"
        return f"stage {self.stage}: {self.chosen.describe()} on {self.cluster.describe()} ({how})"

    def to_dict(self) -> dict:
        return {"stage": self.stage, "hardware": self.cluster.describe(), "explicit": self.explicit,
                "chosen": None if self.chosen is None else {
                    "parallel": self.chosen.parallel, "activation_checkpointing": self.chosen.activation_checkpointing,
                    "activation_checkpointing_every": self.chosen.every, "describe": self.chosen.describe()},
                "interconnect": self.interconnect, "steps": [s.to_dict() for s in self.steps],
                "reasons": self.reasons()}


@dataclass(frozen=True)
class StageFacts:
    """What the chooser needs of a stage beyond its memory: what runyard's trainer allows it."""

    name: str
    kind: str  # pretrain, sft, dpo
    lora: bool
    activation_checkpointing: str
    every: int
    tp_refusal: Any  # callable tp -> None, or why the family cannot split this model over tp ranks


def choose_layout(memory: ReplicaMemory, cluster: Cluster, stage: StageFacts) -> LayoutChoice:
    """The first layout in the module doc's order whose per-device need fits the device's usable memory."""
    world, available = cluster.devices, usable_memory(device(cluster.kind))
    acs = AC_ORDER[AC_ORDER.index(stage.activation_checkpointing):]
    if stage.activation_checkpointing == "none" and stage.every == 1:
        acs = ("none", "full")  # selective every 1 block is full
    steps: list[LayoutStep] = []

    def weigh(layout: Layout, refused: str | None = None) -> Layout | None:
        mem = memory.per_device(layout.dp_shard * layout.pp, layout.tp, layout.activation_checkpointing, layout.every)
        step = LayoutStep(layout, mem, available, refused)
        steps.append(step)
        return layout if step.fits else None

    def at(ac: str, **axes: int) -> Layout:
        return Layout(activation_checkpointing=ac, every=stage.every, **axes)

    found = weigh(at(acs[0], dp_replicate=world))
    sharded = world > 1 and not stage.lora
    if found is None and world > 1:
        found = weigh(at(acs[0], dp_shard=world), None if sharded else "LoRA stages train with ddp only")
    for ac in acs[1:]:
        if found is None:
            found = weigh(at(ac, dp_shard=world) if sharded else at(ac, dp_replicate=world))
    if found is None and world > 1:
        refused = tensor_parallel_refusal(cluster, stage)
        for ac in acs if refused is None else acs[-1:]:
            if found is None:
                found = weigh(at(ac, tp=world), refused)
    if found is None and cluster.nodes > 1:
        inner = dict(tp=cluster.devices_per_node) if cluster.within_node == Interconnect.NVLINK.value \
            else dict(dp_shard=cluster.devices_per_node)
        weigh(at("full", pp=cluster.nodes, **inner), "runyard does not train pipeline parallel yet")
    interconnect = Interconnect.NVLINK.value if found is not None and found.tp > 1 else None
    devices = None if found is not None or stage.lora else fsdp_devices_needed(memory, cluster, stage.every)
    return LayoutChoice(stage.name, cluster, found, tuple(steps), interconnect, fsdp_devices=devices)


def fsdp_devices_needed(memory: ReplicaMemory, cluster: Cluster, every: int, most: int = 1 << 16) -> int | None:
    """The fewest devices of the cluster's kind over which FSDP with full activation
    checkpointing holds the stage; None when its activations alone exceed a device, or past `most`."""
    available = usable_memory(device(cluster.kind))
    if memory.per_device(most, 1, "full", every).total > available:
        return None
    n = cluster.devices + 1
    while n <= most:
        if memory.per_device(n, 1, "full", every).total <= available:
            return n
        n += 1
    return None


def tensor_parallel_refusal(cluster: Cluster, stage: StageFacts) -> str | None:
    """Why runyard cannot train the stage with tensor parallel over every device of `cluster`, or None."""
    if cluster.nodes > 1:
        return (f"tensor parallel would span {cluster.nodes} nodes, and the plan does not yet choose FSDP over "
                "tensor-parallel groups (a spec can name dp_shard x tp)")
    if cluster.within_node != Interconnect.NVLINK.value:
        return f"tensor parallel needs NVLink-class links within the node; {cluster.kind} has {cluster.within_node} only"
    if stage.lora:
        return "LoRA stages train with ddp only"
    if stage.kind not in ("pretrain", "sft"):
        return f"tensor parallel trains pretrain and sft stages only (this is {stage.kind})"
    return stage.tp_refusal(cluster.devices)


def stage_facts(spec: JobSpec, stage_name: str, data_facts: dict[str, Any] | None = None) -> StageFacts:
    stage = resolved_stage(spec, stage_name)
    family, cfg = stage_config(spec, stage, dict(data_facts or {}))

    def tp_refusal(tp: int) -> str | None:
        with torch.device("meta"):
            model = family.build(cfg)
        try:
            family.tensor_parallel_plan(model, tp)
        except NoTensorParallelPlan as e:
            return str(e)
        return None

    return StageFacts(stage.name, stage.kind, stage.lora is not None, stage.train.activation_checkpointing,
                      stage.train.activation_checkpointing_every, tp_refusal)


def explicit_layout(spec: JobSpec, world: int) -> Layout | None:
    """The layout `resources.parallel` names when the spec sets it (ddp and fsdp over `world` devices), or None."""
    if "parallel" not in spec.resources.model_fields_set:
        return None
    p = spec.resources.parallel
    if p == "ddp":
        return Layout(dp_replicate=world)
    if p == "fsdp":
        return Layout(dp_shard=world)
    return Layout(dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, tp=p.tp)


def check_explicit(memory: ReplicaMemory, cluster: Cluster, stage: StageFacts, layout: Layout) -> LayoutChoice:
    """The spec's own layout weighed on `cluster`; SpecError naming the per-device need and the device's usable
    memory when the hardware cannot hold it."""
    layout = Layout(layout.dp_replicate, layout.dp_shard, layout.tp, layout.pp, stage.activation_checkpointing,
                    stage.every)
    mem = memory.per_device(layout.dp_shard, layout.tp, layout.activation_checkpointing, layout.every)
    step = LayoutStep(layout, mem, usable_memory(device(cluster.kind)))
    if not step.fits:
        raise SpecError("resources.parallel", [(
            "resources.parallel", layout.parallel,
            f"stage {stage.name} needs {human_bytes(mem.total)} per device ({mem.total:,} bytes: {mem.describe()}) "
            f"under {layout.describe()}, and a {cluster.kind} has {human_bytes(step.available)} usable "
            f"({step.available:,} bytes); leave resources.parallel out for the plan to choose, or use more devices "
            "or activation checkpointing")])
    interconnect = Interconnect.NVLINK.value if layout.tp > 1 else None
    return LayoutChoice(stage.name, cluster, layout, (step,), interconnect, explicit=True)


def target_hardware(spec: JobSpec, recommended: Hardware) -> Hardware:
    """The devices the run will get: the requirement's where the spec sets them (of several kinds, the one
    with the least memory, since any may be given), else the recommendation."""
    given = spec.resources.requirement.model_fields_set if "requirement" in spec.resources.model_fields_set else set()
    kind, count = recommended.kind, recommended.devices
    if "accelerator_kinds" in given:
        kind = min(spec.resources.requirement.accelerator_kinds, key=lambda k: usable_memory(device(k)))
    if "device_count" in given:
        count = spec.resources.requirement.device_count
    if (kind, count) == (recommended.kind, recommended.devices):
        return recommended
    return Hardware(kind, count, "the spec's requirement")


def stage_layout(spec: JobSpec, stage_name: str, hardware: Hardware,
                 data_facts: dict[str, Any] | None = None) -> LayoutChoice | None:
    """The stage's layout on `hardware` (the requirement's or the recommended devices): the spec's own when
    it names one (checked), else chosen. None for a family the loop does not train (trees)."""
    stage = resolved_stage(spec, stage_name)
    if not get_family(stage.model.family).trains_with_loop:
        return None
    memory = replica_memory(spec, stage_name, data_facts)
    facts = stage_facts(spec, stage_name, data_facts)
    explicit = explicit_layout(spec, hardware.devices)
    if explicit is not None:
        return check_explicit(memory, cluster_of(hardware.kind, explicit.world), facts, explicit)
    return choose_layout(memory, cluster_of(hardware.kind, hardware.devices), facts)


def check_named_layout(spec: JobSpec) -> None:
    """What `runyard run` checks before any work, as `runyard plan` does: the layout `resources.parallel`
    names, weighed for each stage on the hardware the run will get (the requirement's devices, else the
    recommended ones, from the spec alone); a SpecError naming the per-device need and the device's usable
    memory when a stage does not fit. A spec naming no layout passes (the plan chooses one), and so does a
    task other than language modelling (its sizes need the prepared data)."""
    if "parallel" not in spec.resources.model_fields_set or spec.task != "language_model":
        return
    facts = {"vocab_size": run_vocab(spec)}
    plans = [plan_stage(spec, s.name, data_facts=facts) for s in spec.stages]
    target = target_hardware(spec, recommended_training(spec, plans))
    for s in spec.stages:
        stage_layout(spec, s.name, target, facts)


def run_interconnect(choices: list[LayoutChoice | None]) -> str | None:
    """The strongest link any stage's layout needs (None: none beyond the hardware's recommendation)."""
    needed = [Interconnect(c.interconnect) for c in choices if c is not None and c.interconnect]
    return max(needed, key=lambda i: i.rank).value if needed else None
