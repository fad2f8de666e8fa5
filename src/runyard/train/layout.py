"""How a stage's model is laid out for training, applied from outside it in torchtitan's order
(`parallelize.py`): tensor parallelism by the family's plan (train/tensor_parallel.py), activation
checkpointing of the family's blocks, then `torch.compile` of each block
(`resources.compile`, on CUDA), then data parallelism (DDP, or FSDP2 over the family's shard units;
train/parallel.py). Compiling before wrapping keeps FSDP2's hooks and DDP's buckets outside the compiled
graphs, so FSDP2 reduce-scatters once per step rather than inside a compiled whole; blocks are compiled in
place (`nn.Module.compile`), so no parameter name moves. The model never knows; the loop receives a model
already laid out and only calls it."""

from __future__ import annotations

import copy
import logging

import torch

from runyard.model.compute import apply_activation_checkpointing
from runyard.model.registry import ModelFamily
from runyard.train import parallel, tensor_parallel

log = logging.getLogger(__name__)


def lay_out(model: torch.nn.Module, family: ModelFamily, ctx: parallel.DistContext, resources,
            train_cfg) -> torch.nn.Module:
    """The module the loop's forward runs on: `model` split over its tensor-parallel group (ctx.tp), with
    its recomputed blocks (`train.activation_checkpointing`) and compiled blocks, wrapped for data
    parallelism. `model` itself keeps its names and is what checkpoints and the optimizer see."""
    dp_mesh = None
    if ctx.tp > 1:  # first, as torchtitan does: the blocks are split before anything wraps them
        mesh = tensor_parallel.layout_mesh(ctx)
        tp_mesh = mesh["tp"] if mesh.ndim > 1 else mesh
        tensor_parallel.apply_tensor_parallel(model, family.tensor_parallel_plan(model, ctx.tp), tp_mesh)
        dp_mesh = mesh["dp_shard"] if mesh.ndim > 1 else None  # FSDP then shards each rank's split blocks
    mode = getattr(train_cfg, "activation_checkpointing", "none")
    if mode != "none":
        chosen = apply_activation_checkpointing(family.checkpoint_units(model), mode,
                                                train_cfg.activation_checkpointing_every)
        log.info("activation checkpointing (%s): %d of %d blocks recomputed in backward", mode, len(chosen),
                 len(family.checkpoint_units(model)))
    if getattr(resources, "compile", False) and ctx.device.type == "cuda":
        compile_blocks(model, family)
    return parallel.wrap_model(model, ctx, resources, shard_units=family.shard_units(model), mesh=dp_mesh)


def frozen_copy(model: torch.nn.Module, family: ModelFamily, ctx: parallel.DistContext, resources) -> torch.nn.Module:
    """A frozen copy of `model` as it is now (no gradients, eval mode), for a dpo stage's reference: sharded
    over the same units as the policy under FSDP, so each rank holds its share of the reference rather than
    a whole copy; whole otherwise (DDP replicates the policy too). Made before the policy is laid out."""
    reference = copy.deepcopy(model).requires_grad_(False).eval()
    shape = parallel.layout_of(getattr(resources, "parallel", "ddp"), ctx.world_size)
    if ctx.distributed and shape.dp_shard > 1:
        parallel.shard_model(reference, ctx, resources, family.shard_units(reference))
    held = sum(parallel.local_numel(p) for p in reference.parameters())
    log.info("dpo reference: %d of its %d parameters on this rank", held, sum(p.numel() for p in reference.parameters()))
    return reference


def compile_blocks(model: torch.nn.Module, family: ModelFamily) -> None:
    """`torch.compile` each of the family's blocks in place (the whole model when it names none)."""
    units = family.checkpoint_units(model)
    for unit in units or [model]:
        unit.compile()
