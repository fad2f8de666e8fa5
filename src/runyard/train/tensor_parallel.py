"""Tensor parallelism applied from outside the model, through PyTorch's own DTensor API
(`parallelize_module` with `ColwiseParallel` / `RowwiseParallel`) and the family's plan
(`ModelFamily.tensor_parallel_plan`).

A fused projection (the decoder's Q/K/V in one matrix, SwiGLU's gate and up in another) cannot be split
by contiguous rows as it is: rank 0 would get all of Q. Its rows are first reordered so that each rank's
contiguous chunk holds its share of every part ([q_r | k_r | v_r]); the model's forward then sees the
local heads (`local_attributes`). `whole_state_dict` undoes the order, so a consolidated model (gates,
evaluation, the export) is exactly the model's own layout.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from runyard.model.registry import TensorParallelPlan
from runyard.train import parallel

STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def tp_mesh(ctx: parallel.DistContext) -> DeviceMesh:
    return init_device_mesh(ctx.device.type, (ctx.tp,), mesh_dim_names=("tp",))


def rank_major_rows(parts: tuple[int, ...], tp: int) -> torch.Tensor:
    """The row order that puts each rank's share of every part in one contiguous chunk."""
    starts = [sum(parts[:i]) for i in range(len(parts))]
    chunks = [torch.arange(lo, lo + n).chunk(tp) for lo, n in zip(starts, parts, strict=True)]
    return torch.cat([c[r] for r in range(tp) for c in chunks])


@torch.no_grad()
def apply_tensor_parallel(model: torch.nn.Module, plan: TensorParallelPlan, mesh: DeviceMesh) -> None:
    """Split `model` over `mesh` by `plan`, in place (before activation checkpointing, compile and FSDP)."""
    tp = mesh.size()
    for path, parts in plan.fused_rows.items():
        param = model.get_parameter(path)
        param.copy_(param[rank_major_rows(parts, tp)])
    for path, value in plan.local_attributes.items():
        owner, attr = path.rsplit(".", 1)
        setattr(model.get_submodule(owner), attr, value)
    parallelize_module(model, mesh, {path: STYLES[style]() for path, style in plan.styles.items()})


def whole_state_dict(model: torch.nn.Module, plan: TensorParallelPlan, tp: int) -> dict[str, torch.Tensor]:
    """The model's state as one process holds it: every split tensor gathered (a collective: every rank
    calls it), fused rows back in the model's own order."""
    state = {}
    for name, value in model.state_dict().items():
        value = value.full_tensor() if isinstance(value, DTensor) else value
        if name in plan.fused_rows:
            value = value[torch.argsort(rank_major_rows(plan.fused_rows[name], tp))]
        state[name] = value.detach().cpu()
    return state


def consolidated_model(model: torch.nn.Module, plan: TensorParallelPlan, build: Callable[[], torch.nn.Module],
                       ctx: parallel.DistContext) -> torch.nn.Module:
    """A whole copy of the model on rank 0 (other ranks get `model` back). Collective."""
    state = whole_state_dict(model, plan, ctx.tp)
    if not ctx.is_main:
        return model
    with torch.random.fork_rng(devices=[]):
        whole = build()
    whole.load_state_dict(state)
    return whole.to(ctx.device)
