"""Process layout: which rank this is, which device it drives, and collective helpers.

A single process is world size 1 and every collective is the identity, so the loop has one code path.
Under torchrun (RANK/WORLD_SIZE/LOCAL_RANK in the environment) the process group is set up with gloo
on CPU and nccl on CUDA.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def resolve_device(requested: str) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        from runyard.errors import RunyardError

        raise RunyardError("resources.device is 'cuda' but torch sees no CUDA device on this machine")
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(requested)


def setup(requested_device: str) -> DistContext:
    """Join the process group if launched under torchrun, else describe a single process."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(requested_device)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return DistContext(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_mean(value: float, ctx: DistContext) -> float:
    if not ctx.distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=ctx.device if ctx.device.type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t.item()) / ctx.world_size


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()


def wrap_model(model: torch.nn.Module, ctx: DistContext, resources) -> torch.nn.Module:
    """Apply data parallelism from outside the model (the model never knows it is parallelised)."""
    if not ctx.distributed:
        return model
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def grad_sync(module: torch.nn.Module, ctx: DistContext, last_micro: bool):
    """Skip the gradient all-reduce on all but the last micro-batch of an accumulated step."""
    import contextlib

    if ctx.distributed and not last_micro and hasattr(module, "no_sync"):
        return module.no_sync()
    return contextlib.nullcontext()


def save_checkpoint(save_fn, setup, ckpt_dir, step: int, extra: dict, ctx: DistContext):
    """Rank 0 writes the (replicated) state; every rank waits until it is committed."""
    from runyard.train.checkpoint import step_dir_name

    path = save_fn(setup, ckpt_dir, step, extra) if ctx.is_main else ckpt_dir / step_dir_name(step)
    barrier(ctx)
    return path
