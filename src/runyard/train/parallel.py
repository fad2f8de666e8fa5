"""Process layout: which rank this is, which device it drives, data parallelism and collective helpers.

A single process is world size 1 and every collective is the identity, so the loop has one code path.
Under torchrun (RANK/WORLD_SIZE/LOCAL_RANK in the environment) the process group is set up with gloo
on CPU and nccl on CUDA (plus gloo beside nccl, which async checkpointing needs for its CPU tensors).

The model never knows it is parallelised: `wrap_model` applies DDP or FSDP2 from outside
(torchtitan's `parallelize.py` idea). This module knows processes and collectives only; checkpoints
(train/checkpoint/) use its collectives, never the other way round.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from runyard.errors import RunyardError
from runyard.model.compute import resolve_device
from runyard.spec.seeds import derive_seed

log = logging.getLogger(__name__)

# How long a collective may wait for a peer before failing; a dead peer usually fails faster (gloo sees
# the closed connection), this bounds the rest.
COLLECTIVE_TIMEOUT = timedelta(seconds=float(os.environ.get("RUNYARD_DIST_TIMEOUT_S", "600")))


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    # A second gloo group for checkpoint traffic, so an async save's collectives (run from a background
    # thread) never interleave with the training loop's on the default group.
    ckpt_group: Any = None
    tp: int = 1  # tensor-parallel degree: consecutive ranks form one tensor-parallel group
    pp: int = 1  # pipeline-parallel degree: consecutive ranks hold consecutive stages (train/pipeline.py)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def data(self) -> DistContext:
        """The data-parallel view: the rank and world size that read data and normalise the loss. Under
        tensor or pipeline parallelism every rank of a group reads the same batch (so pure tp or pure pp is one
        data rank)."""
        group = self.tp * self.pp
        if group == 1:
            return self
        return dataclasses.replace(self, rank=self.rank // group, world_size=self.world_size // group,
                                   ckpt_group=None, tp=1, pp=1)


class LayoutError(RunyardError):
    """`resources.parallel` asks for a layout that this world size or this runyard cannot lay out."""


@dataclass(frozen=True)
class Layout:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int = 1
    pp_microbatches: int | None = None  # null: pp
    pp_schedule: str = "1f1b"


def layout_of(setting: Any, world_size: int) -> Layout:
    """`resources.parallel` as mesh sizes: `ddp` replicates over every process, `fsdp` shards over them,
    a `{dp_replicate, dp_shard, tp, pp}` layout must multiply to the world size."""
    if setting == "ddp" or setting is None:
        return Layout(world_size, 1, 1)
    if setting == "fsdp":
        return Layout(1, world_size, 1)
    pp = getattr(setting, "pp", 1)
    layout = Layout(setting.dp_replicate, setting.dp_shard, setting.tp, pp, getattr(setting, "pp_microbatches", None),
                    getattr(setting, "pp_schedule", "1f1b"))
    if layout.dp_replicate * layout.dp_shard * layout.tp * layout.pp != world_size:
        raise LayoutError(f"resources.parallel {layout.dp_replicate} x {layout.dp_shard} x {layout.tp} x {layout.pp} "
                          f"(dp_replicate x dp_shard x tp x pp) does not equal the {world_size} processes")
    if layout.pp > 1 and layout.pp != world_size:
        raise LayoutError(f"resources.parallel: pipeline parallel (pp {layout.pp}) is not yet combined with data or "
                          f"tensor parallelism; use pp equal to the processes ({world_size}) with dp_replicate, "
                          "dp_shard and tp 1")
    if layout.tp > 1 and layout.dp_replicate > 1:
        raise LayoutError(f"resources.parallel: tensor parallel (tp {layout.tp}) is combined with FSDP (dp_shard) "
                          f"only, not yet with replicas (dp_replicate {layout.dp_replicate}); use dp_shard x tp equal "
                          f"to the processes ({world_size})")
    if layout.dp_replicate > 1 and layout.dp_shard > 1:
        raise LayoutError("resources.parallel: replicas of FSDP shards (HSDP) are not yet laid out; use ddp or fsdp")
    return layout


def with_layout(ctx: DistContext, resources) -> DistContext:
    """`ctx` knowing its tensor- and pipeline-parallel degrees (from `resources.parallel`)."""
    layout = layout_of(getattr(resources, "parallel", "ddp"), ctx.world_size)
    if (layout.tp, layout.pp) == (ctx.tp, ctx.pp):
        return ctx
    return dataclasses.replace(ctx, tp=layout.tp, pp=layout.pp)


def _attempt_store(rank: int, world_size: int) -> dict:
    """Under torchrun, the workers share the agent's key-value store across restarts; the addresses the
    dead attempt's ranks published there would be read again by the new attempt (gloo then dials dead
    ports). A prefix per attempt keeps each attempt's keys apart."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                         is_master=False, timeout=COLLECTIVE_TIMEOUT)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"runyard/attempt_{attempt}", base), "rank": rank, "world_size": world_size}


def setup(requested_device: str) -> DistContext:
    """Join the process group if launched under torchrun, else describe a single process."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    # torchrun counts its own restarts; record them as runyard's unless a supervisor set its own count.
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        os.environ.setdefault("RUNYARD_RESTART_COUNT", os.environ["TORCHELASTIC_RESTART_COUNT"])
    if rank != 0:  # one rank narrates; the others speak up only for warnings and errors
        logging.getLogger("runyard").setLevel(logging.WARNING)
    device = resolve_device(requested_device)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    ckpt_group = None
    if world_size > 1:
        if not dist.is_initialized():
            backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend=backend, timeout=COLLECTIVE_TIMEOUT, **_attempt_store(rank, world_size))
        ckpt_group = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    return DistContext(rank=rank, world_size=world_size, local_rank=local_rank, device=device, ckpt_group=ckpt_group)


def teardown() -> None:
    """Leave the process group (a no-op for one process). A checkpoint save still in flight must have
    been waited for first (the training loop does so, even when it fails)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# -- collectives ---------------------------------------------------------------------------------------
def _scalar(value: float, ctx: DistContext) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float64, device=ctx.device if ctx.device.type == "cuda" else "cpu")


def all_reduce_mean(value: float, ctx: DistContext) -> float:
    if not ctx.distributed:
        return value
    t = _scalar(value, ctx)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t.item()) / ctx.world_size


def all_reduce_sum(values: list[float], ctx: DistContext) -> list[float]:
    """The element-wise sum of `values` over all ranks (one collective for the whole list)."""
    if not ctx.distributed:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device if ctx.device.type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return [float(v) for v in t.tolist()]


def device_values(values: Sequence[float], ctx: DistContext) -> torch.Tensor:
    """`values` as a float64 vector where this rank's collectives run (the GPU, or the CPU under gloo)."""
    dev = ctx.device if ctx.device.type == "cuda" else torch.device("cpu")
    return torch.tensor(list(values), dtype=torch.float64).to(dev, non_blocking=True)


def all_reduce_sum_tensor(t: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """`t` summed over all ranks, in place, without reading it back: under nccl the host queues the
    reduction and goes on."""
    if ctx.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


# FSDP2 and DTensor (torch.distributed.fsdp, torch.distributed.tensor) are imported where a model is
# sharded: every run imports this module, and their import costs about a second. A tensor or module can
# only be one of theirs once their module is loaded, which is what the two checks below rely on.
def is_dtensor(t: Any) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def is_fsdp(module: torch.nn.Module) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2's gradient norm, replicated on every rank) as the plain tensor it holds."""
    return t.full_tensor() if is_dtensor(t) else t


def all_reduce_max(value: float, ctx: DistContext) -> float:
    if not ctx.distributed:
        return value
    t = _scalar(value, ctx)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def any_rank(flag: bool, ctx: DistContext) -> bool:
    """True on every rank when it is true on any: decisions such as stopping are taken together."""
    return all_reduce_max(1.0 if flag else 0.0, ctx) > 0.5


def agree_stop(stop, ctx: DistContext) -> bool:
    """Whether the job stops at this step boundary: a signal seen by any rank stops every rank, so they
    all write the same checkpoint and exit together (one all-reduce of a flag per step)."""
    if not any_rank(stop.requested, ctx):
        return False
    if not stop.requested:
        stop.request("a signal on another rank")
    return True


def broadcast_object(obj: Any, ctx: DistContext) -> Any:
    """Rank 0's `obj` on every rank (e.g. gate results, so all ranks stop or continue together)."""
    if not ctx.distributed:
        return obj
    box = [obj if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()


# -- data parallelism ----------------------------------------------------------------------------------
def seed_rank_stream(ctx: DistContext) -> None:
    """After every rank built the identical initial model, give each rank its own torch RNG stream, so
    dropout differs between the ranks' micro-batches (as it does between rows of one large batch)."""
    if ctx.distributed:  # the ranks of a tensor-parallel group hold one batch: they drop out alike
        torch.manual_seed(derive_seed(torch.initial_seed(), "rank", ctx.data.rank))


def wrap_model(model: torch.nn.Module, ctx: DistContext, resources,
               shard_units: Sequence[torch.nn.Module] = (), mesh: DeviceMesh | None = None) -> torch.nn.Module:
    """Apply data parallelism from outside the model (the model never knows it is parallelised).

    ddp: the model replicated, gradients all-reduced in buckets during backward.
    fsdp: FSDP2 `fully_shard` on each of `shard_units` (the model family names them: a decoder's
    blocks), then on the root (for a decoder: embedding, final norm, head): parameters, gradients and
    optimizer state are sharded; with bf16 on CUDA, parameters are gathered in bf16 and gradients
    reduced in fp32. Under tensor parallel (dp_shard x tp) FSDP shards over `mesh`, the device mesh's
    dp_shard dimension, each rank's tensor-parallel shards.
    """
    if not ctx.distributed:
        return model
    layout = layout_of(getattr(resources, "parallel", "ddp"), ctx.world_size)
    if layout.pp > 1 or layout.dp_replicate * layout.dp_shard == 1:  # over every process: no data parallelism
        return model
    seed_rank_stream(ctx)
    if layout.dp_shard > 1:
        return shard_model(model, ctx, resources, shard_units, mesh)
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def shard_model(model: torch.nn.Module, ctx: DistContext, resources,
                shard_units: Sequence[torch.nn.Module] = (), mesh: DeviceMesh | None = None) -> torch.nn.Module:
    """FSDP2 `fully_shard` on each of `shard_units`, then on the root, in place: each rank keeps its share
    of every parameter and gathers a unit's whole weights only while it runs (over `mesh`; None: every
    process)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {"mesh": mesh} if mesh is not None else {}
    if ctx.device.type == "cuda" and resources.precision in ("bf16", "auto"):
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for unit in shard_units:
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    return model


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_`, also over gradients on several meshes, which torch's own refuses:
    tensor-parallel DTensors with plain (replicated) tensors, or under dp_shard x tp FSDP's shards of the
    split blocks (the 2-D mesh) with those of the whole embedding, norms and head (its dp_shard dimension).
    The norm of each mesh's gradients is reduced over that mesh. The total stays on the device."""
    grads = [p.grad for p in params if p.grad is not None]
    by_mesh: dict[Any, list[torch.Tensor]] = {}  # in the parameters' order: every rank reduces the meshes alike
    for g in grads:
        by_mesh.setdefault(g.device_mesh if is_dtensor(g) else None, []).append(g)
    if len(by_mesh) <= 1:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    norms = [torch.nn.utils.get_total_norm(group) for group in by_mesh.values()]
    total = torch.linalg.vector_norm(torch.stack([plain_tensor(n) for n in norms]))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        (g.to_local() if is_dtensor(g) else g).mul_(coef)
    return total


def local_numel(t: torch.Tensor) -> int:
    """The elements of `t` this rank holds: its shard of a DTensor, all of a plain tensor."""
    return t.to_local().numel() if is_dtensor(t) else t.numel()


@contextlib.contextmanager
def _fsdp_sync(module, sync: bool):
    module.set_requires_gradient_sync(sync)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def grad_sync(module: torch.nn.Module, ctx: DistContext, last_micro: bool):
    """Skip the gradient reduction on all but the last micro-batch of an accumulated step."""
    if not ctx.distributed or last_micro:
        return contextlib.nullcontext()
    if hasattr(module, "no_sync"):  # DDP
        return module.no_sync()
    if is_fsdp(module):
        return _fsdp_sync(module, False)
    return contextlib.nullcontext()


def consolidated_model(model: torch.nn.Module, build: Callable[[], torch.nn.Module], ctx: DistContext) -> torch.nn.Module:
    """A whole (unsharded) copy of the model on rank 0, for gates, evaluation and export; other ranks
    get the model back unchanged. `build()` makes an empty model of the same shape. Collective under
    FSDP: every rank must call it."""
    if not ctx.distributed or not is_fsdp(model):
        return model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not ctx.is_main:
        return model
    with torch.random.fork_rng(devices=[]):  # building the copy must not move the training RNG
        whole = build()
    whole.load_state_dict(full)
    return whole.to(ctx.device)


def grad_accum_for(spec_accum: int, batch_size: int, ctx: DistContext, saved: dict | None) -> int:
    """Micro-batches per step. A fresh stage uses the spec's. A stage resumed onto another world size
    keeps the checkpoint's global batch (batch_size x grad_accum x world_size) when the new world size
    divides it, so every step still reads the same sequences and the loss curve continues; otherwise
    the spec's accumulation is used and the change of global batch is logged."""
    if not saved or "world_size" not in saved:
        return spec_accum
    saved_global = batch_size * int(saved.get("grad_accum", spec_accum)) * int(saved["world_size"])
    if saved_global % (batch_size * ctx.world_size) == 0:
        accum = saved_global // (batch_size * ctx.world_size)
        if accum != spec_accum:
            log.info("world size %d -> %d: %d micro-batches per step keep the global batch of %d sequences",
                     saved["world_size"], ctx.world_size, accum, saved_global)
        return accum
    log.warning("world size %d -> %d cannot keep the global batch of %d sequences with batch_size %d; "
                "it becomes %d", saved["world_size"], ctx.world_size, saved_global, batch_size,
                batch_size * spec_accum * ctx.world_size)
    return spec_accum
