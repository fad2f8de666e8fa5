"""Tensor parallelism applied from outside the model, through PyTorch's own DTensor API
(`parallelize_module` with `ColwiseParallel` / `RowwiseParallel`) and the family's plan
(`ModelFamily.tensor_parallel_plan`).

A fused projection (the decoder's Q/K/V in one matrix, SwiGLU's gate and up in another) cannot be split
by contiguous rows as it is: rank 0 would get all of Q. Its rows are first reordered so that each rank's
contiguous chunk holds its share of every part ([q_r | k_r | v_r]); the model's forward then sees the
local heads (`local_attributes`). `whole_state_dict` undoes the order, so a consolidated model (gates,
evaluation, the export) is exactly the model's own layout.

Checkpoints never hold the rank-by-rank order: `FusedRows` turns a laid-out model's state (its weights and
the optimizer's moments) into the model's own order before a save and back after a load, so a checkpoint
holds the same global tensors under the same names whatever tp wrote it, and any layout resumes it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from runyard.model.registry import TensorParallelPlan
from runyard.train import parallel
from runyard.train.parallel import is_dtensor

# torch.distributed.tensor is imported where a model is split or a split tensor is rebuilt: the
# checkpoint code imports this module on every run, and DTensor's import alone costs about a second.
STYLES = {"colwise": "ColwiseParallel", "rowwise": "RowwiseParallel"}  # torch.distributed.tensor.parallel's


def refuse_unsupported(stage, layout: parallel.Layout) -> None:
    """What tensor parallelism does not train, refused by the field that asks for it. Pretrain and sft
    train (every rank reads the same batch, so sft's masks and supervised count are the one process's);
    dpo's frozen reference would be a whole copy on every rank."""
    if stage.kind == "dpo":
        raise parallel.LayoutError(f"stage {stage.name}: tensor parallel (resources.parallel.tp {layout.tp}) trains "
                                   "pretrain and sft stages, not dpo (its frozen reference would not be split); "
                                   "set resources.parallel: ddp or fsdp")
    if stage.kind == "sft" and layout.dp_shard > 1:  # its supervised count is summed over the data ranks only
        raise parallel.LayoutError(f"stage {stage.name}: tensor parallel with FSDP (resources.parallel.dp_shard "
                                   f"{layout.dp_shard} x tp {layout.tp}) trains pretrain stages only, not sft; use tp "
                                   "alone or fsdp")


def layout_mesh(ctx: parallel.DistContext) -> DeviceMesh:
    """The device mesh tensor parallel splits over: (dp_shard, tp) when FSDP shards over the tensor-parallel
    groups too (consecutive ranks form one group, as ctx.data reads), else (tp) alone."""
    if ctx.world_size > ctx.tp:
        return init_device_mesh(ctx.device.type, (ctx.world_size // ctx.tp, ctx.tp), mesh_dim_names=("dp_shard", "tp"))
    return init_device_mesh(ctx.device.type, (ctx.tp,), mesh_dim_names=("tp",))


def rank_major_rows(parts: tuple[int, ...], tp: int) -> torch.Tensor:
    """The row order that puts each rank's share of every part in one contiguous chunk."""
    starts = [sum(parts[:i]) for i in range(len(parts))]
    chunks = [torch.arange(lo, lo + n).chunk(tp) for lo, n in zip(starts, parts, strict=True)]
    return torch.cat([c[r] for r in range(tp) for c in chunks])


@dataclass(frozen=True)
class FusedRows:
    """Which parameters of a model hold fused rows (path -> sizes of the parts) and the tp they are
    ordered for: 1 is the model's own order."""

    parts: dict[str, tuple[int, ...]]
    tp: int

    def rows_from(self, name: str, stored: FusedRows | None) -> torch.Tensor | None:
        """The row index that turns `name` held in `stored`'s order (None: the model's own) into this
        order; None when nothing moves."""
        parts = self.parts.get(name) or (stored.parts.get(name) if stored else None)
        if parts is None:
            return None
        src = stored.tp if stored is not None and name in stored.parts else 1
        if src == self.tp:
            return None
        # stored S = M[rm(src)], so M = S[argsort(rm(src))] and M[rm(tp)] = S[argsort(rm(src))[rm(tp)]]
        return torch.argsort(rank_major_rows(tuple(parts), src))[rank_major_rows(tuple(parts), self.tp)]

    def reorder(self, model_sd: dict[str, Any], optim_sd: dict[str, Any] | None,
                stored: FusedRows | None = None) -> None:
        """Reorder, in the dicts (values replaced, never written into), every fused parameter and its
        optimizer moments from `stored`'s order into this one. Collective when the values are DTensors
        (every rank of the tensor-parallel group calls it)."""
        for name in sorted({*self.parts, *(stored.parts if stored else ())}):
            rows = self.rows_from(name, stored)
            if rows is None:
                continue
            if name in model_sd:
                model_sd[name] = reorder_rows(model_sd[name], rows)
            state = (optim_sd or {}).get("state", {})
            if name in state:  # a new dict: the optimizer's state_dict shares its per-parameter dicts with it
                state[name] = {k: reorder_rows(v, rows) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                               for k, v in state[name].items()}
            # the flat form (torch.distributed.checkpoint.state_dict's flatten_optimizer_state_dict):
            # `state.<name>.<moment>` keys
            for key in [k for k in (optim_sd or {}) if k.startswith(f"state.{name}.")]:
                value = optim_sd[key]
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    optim_sd[key] = reorder_rows(value, rows)


def reorder_rows(value: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`value[rows]`; for a DTensor (tensor-parallel rows, and FSDP's shards of them under dp_shard x tp) the
    whole tensor is gathered, reordered and each rank keeps its own shard of it again, under the same
    placements (a save or load moment: one whole matrix at a time)."""
    if not is_dtensor(value):
        return value[rows.to(value.device)]
    from torch.distributed.tensor import distribute_tensor

    whole = value.full_tensor().detach()[rows.to(value.device)]
    # every rank holds the same whole: each cuts its own shard, nothing is sent
    return distribute_tensor(whole, value.device_mesh, value.placements, src_data_rank=None)


# The models `apply_tensor_parallel` laid out, with their fused rows' order (read by the checkpoint code,
# which sees only the model); weak, so a model dropped is forgotten.
_LAID_OUT: weakref.WeakKeyDictionary[torch.nn.Module, FusedRows] = weakref.WeakKeyDictionary()


def fused_rows_of(model: torch.nn.Module) -> FusedRows | None:
    """The fused rows' order of a model split by `apply_tensor_parallel`; None for any other model."""
    return _LAID_OUT.get(model)


@torch.no_grad()
def apply_tensor_parallel(model: torch.nn.Module, plan: TensorParallelPlan, mesh: DeviceMesh) -> None:
    """Split `model` over `mesh` by `plan`, in place (before activation checkpointing, compile and FSDP)."""
    from torch.distributed.tensor import parallel as tensor_parallel_styles

    tp = mesh.size()
    _LAID_OUT[model] = FusedRows(dict(plan.fused_rows), tp)
    for path, parts in plan.fused_rows.items():
        param = model.get_parameter(path)
        param.copy_(param[rank_major_rows(parts, tp)])
    for path, value in plan.local_attributes.items():
        owner, attr = path.rsplit(".", 1)
        setattr(model.get_submodule(owner), attr, value)
    styles = {path: getattr(tensor_parallel_styles, STYLES[style])() for path, style in plan.styles.items()}
    tensor_parallel_styles.parallelize_module(model, mesh, styles)


def whole_state_dict(model: torch.nn.Module, plan: TensorParallelPlan, tp: int) -> dict[str, torch.Tensor]:
    """The model's state as one process holds it: every split tensor gathered (a collective: every rank
    calls it), fused rows back in the model's own order."""
    state = {}
    for name, value in model.state_dict().items():
        value = value.full_tensor() if is_dtensor(value) else value
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
