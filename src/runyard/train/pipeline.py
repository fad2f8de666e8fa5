"""Pipeline parallelism through PyTorch's own `torch.distributed.pipelining`, torchtitan's way: the model
family cuts the model into consecutive stages (`ModelFamily.pipeline_stage`: for the decoder, embeddings
with the first blocks, final norm and head with the last), each process wraps its stage in a
`PipelineStage`, and a `Schedule1F1B` or `ScheduleGPipe` runs each batch as `pp_microbatches` chunks split
along the batch. Nothing here schedules sends and receives itself.

Exactness: the schedule's loss function is the summed token loss of a chunk (positions labelled with the
ignore index left out: an sft stage's prompts and padding) times the step's loss scale (1 / the step's global
count of tokens, or of supervised tokens for sft, as the one-process loop uses), and the schedule does not
rescale gradients (`scale_grads=False`), so the chunks' gradients add up to the one-process step's whatever
the chunks' supervised counts.

The stages exchange activations of one shape, fixed at the first step, so every batch is padded to
`train.batch_size` rows of the stage's context length (padded inputs are a valid token, padded labels the
ignore index): causal attention never lets a padded position change an earlier one, and the loss and the
counts skip them. An sft batch, padded to its longest sample elsewhere, costs the whole context here. The loss
lives on the last stage only: the step's figures are summed over the ranks when the loop logs
(train/step_log.py), the gradient norm is reduced over the stages before clipping (one small collective
on the device), and the held-out loss is broadcast from the last stage at an evaluation.

Each stage keeps the whole model's parameter names, so checkpoints (torch.distributed.checkpoint, each
rank writing its stage's tensors) hold the same keys whatever the layout: a pp 2 run resumes on one
process. For gates and the export, `consolidated_model` gathers every stage's weights to rank 0.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from runyard.data.samples import IGNORE_INDEX
from runyard.model.compute import token_loss_sum
from runyard.model.registry import ModelFamily
from runyard.train import parallel

log = logging.getLogger(__name__)

SCHEDULES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe"}  # torch.distributed.pipelining's names
Autocast = Callable[[], AbstractContextManager]


def refuse_unsupported(stage, resources, layout: parallel.Layout) -> None:
    """What pipeline parallelism does not train yet, refused by the field that asks for it."""
    where = f"stage {stage.name}: pipeline parallel (resources.parallel.pp {layout.pp})"
    if stage.kind not in ("pretrain", "sft"):  # dpo: a pair's two rows and its reference scores would split
        raise parallel.LayoutError(f"{where} trains pretrain and sft stages, not {stage.kind} (its chosen and "
                                   "rejected rows would fall into different micro-batches); set "
                                   "resources.parallel: ddp or fsdp")
    if stage.lora is not None:
        raise parallel.LayoutError(f"{where} does not train LoRA adapters (lora); set resources.parallel: ddp")
    if getattr(stage.train, "activation_checkpointing", "none") != "none":
        raise parallel.LayoutError(f"{where} is not yet combined with train.activation_checkpointing "
                                   f"({stage.train.activation_checkpointing}); set it to none")
    if getattr(resources, "compile", False):
        raise parallel.LayoutError(f"{where} is not yet combined with resources.compile; set it to false")
    chunks = microbatches(layout)
    if stage.train.batch_size % chunks:
        raise parallel.LayoutError(f"{where}: resources.parallel.pp_microbatches ({chunks}) must divide "
                                   f"train.batch_size ({stage.train.batch_size})")
    if layout.pp_schedule == "1f1b" and chunks < layout.pp:
        raise parallel.LayoutError(f"{where}: resources.parallel.pp_microbatches ({chunks}) must be at least pp "
                                   f"({layout.pp}) under pp_schedule 1f1b")


def microbatches(layout: parallel.Layout) -> int:
    return layout.pp_microbatches or layout.pp


def stage_index(ctx: parallel.DistContext) -> int:
    """Consecutive ranks hold consecutive stages."""
    return ctx.rank % ctx.pp


def fixed_shape(x: torch.Tensor, y: torch.Tensor, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` and `y` padded to `rows` x `width` (inputs with token 0, labels with the ignore index), the one
    shape the stages exchange."""
    if x.shape[0] > rows or x.shape[1] > width:
        raise ValueError(f"a batch of {tuple(x.shape)} does not fit the pipeline's {rows} x {width}")
    if tuple(x.shape) == (rows, width):
        return x, y
    padded_x = x.new_zeros((rows, width))
    padded_y = y.new_full((rows, width), IGNORE_INDEX)
    padded_x[: x.shape[0], : x.shape[1]] = x
    padded_y[: y.shape[0], : y.shape[1]] = y
    return padded_x, padded_y


def split_model(model: torch.nn.Module, family: ModelFamily, ctx: parallel.DistContext) -> torch.nn.Module:
    """This rank's stage of `model` (the rest of the model is left to be freed)."""
    stage = family.pipeline_stage(model, stage_index(ctx), ctx.pp)
    log.info("pipeline stage %d of %d: %d parameters", stage_index(ctx), ctx.pp,
             sum(p.numel() for p in stage.parameters()))
    return stage


class Pipeline:
    """This rank's stage under its schedule: a training step, a held-out loss, the gradient norm over
    every stage, and the whole model gathered to rank 0."""

    def __init__(self, module: torch.nn.Module, ctx: parallel.DistContext, layout: parallel.Layout, rows: int,
                 width: int):
        self.module, self.ctx = module, ctx
        self.rows, self.width = rows, width  # every batch's shape (fixed_shape)
        self.mesh = init_device_mesh(ctx.device.type, (ctx.pp,), mesh_dim_names=("pp",))
        self.group = self.mesh.get_group("pp")
        self.index = stage_index(ctx)
        self.first, self.last = self.index == 0, self.index == ctx.pp - 1
        self.last_rank = dist.get_global_rank(self.group, ctx.pp - 1)
        self.scale: float | torch.Tensor = 1.0
        # Imported when a pipeline is built: torch.distributed.pipelining loads torch._dynamo, about a
        # second that every run without a pipeline (this module is imported by the loop) would pay.
        from torch.distributed import pipelining

        stage = pipelining.PipelineStage(module, self.index, ctx.pp, ctx.device, group=self.group)
        schedule = getattr(pipelining, SCHEDULES[layout.pp_schedule])
        self.schedule = schedule(stage, n_microbatches=microbatches(layout), loss_fn=self._loss, scale_grads=False)

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return token_loss_sum(output, target) * self.scale

    def _run(self, run: Callable, x: torch.Tensor, y: torch.Tensor, losses: list, **kwargs) -> None:
        device = self.ctx.device
        x, y = fixed_shape(x, y, self.rows, self.width)
        args = (x.to(device, non_blocking=True),) if self.first else ()
        if self.last:
            kwargs.update(target=y.to(device, non_blocking=True), losses=losses)
        run(*args, **kwargs)

    def step(self, batches: list, loss_scale: float | torch.Tensor, autocast: Autocast) -> torch.Tensor:
        """Forward and backward of the step's batches ((inputs, labels) of the loop's accumulation
        micro-batches, each run by the schedule in chunks); gradients accumulate in the stage's parameters. The step's scaled loss on
        the last stage (zero elsewhere), on the device."""
        self.scale = loss_scale
        total = torch.zeros((), device=self.ctx.device)
        for x, y in batches:
            losses: list[torch.Tensor] = []
            with autocast():
                self._run(self.schedule.step, x, y, losses, return_outputs=False)
            for loss in losses:
                total += loss.detach()
        return total

    @torch.no_grad()
    def heldout_loss(self, batches, autocast: Autocast) -> float:
        """Mean cross-entropy per supervised target (labels other than the ignore index) over fixed
        (inputs, labels) batches (dropout off), the same on every rank."""
        was_training = self.module.training
        self.module.eval()
        self.scale = 1.0
        total, count = 0.0, 0
        try:
            for x, y in batches:
                losses: list[torch.Tensor] = []
                with autocast():
                    self._run(self.schedule.eval, x, y, losses)
                total += sum(float(loss) for loss in losses)
                count += int((y != IGNORE_INDEX).sum())
        finally:
            self.module.train(was_training)
        value = parallel.device_values([total], self.ctx)
        dist.broadcast(value, src=self.last_rank, group=self.group)  # the loss lives on the last stage
        return float(value[0]) / max(count, 1)

    def clip_grad_norm(self, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """The gradient norm over every stage's parameters (each stage's squared norm summed over the
        pipeline, on the device), and the gradients clipped by it, as one process clips the whole model."""
        grads = [p.grad for p in params if p.grad is not None]
        local = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=self.ctx.device)
        squared = local.double().square().reshape(1)
        if self.ctx.device.type != "cuda":
            squared = squared.cpu()
        dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=self.group)
        total = squared.sqrt().to(local.device, torch.float32).reshape(())
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def consolidated_model(self, build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
        """The whole model on rank 0, every stage's weights gathered under their own names (for gates,
        evaluation and the export); other ranks get their stage back. Collective."""
        state = {name: t.detach().cpu() for name, t in self.module.state_dict().items()}
        parts: list | None = [None] * self.ctx.pp if self.ctx.is_main else None
        dist.gather_object(state, parts, dst=0, group=self.group)
        if not self.ctx.is_main:
            return self.module
        whole_state = {name: t for part in parts for name, t in part.items()}
        with torch.random.fork_rng(devices=[]):  # building the copy must not move the training RNG
            whole = build()
        whole.load_state_dict(whole_state)
        return whole.to(self.ctx.device)
