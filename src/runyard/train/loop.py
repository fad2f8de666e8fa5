"""The training loop for one stage: a plain `while` a person can follow, nanoGPT-style.

Each optimizer step: set the learning rate, run `grad_accum` micro-batches (loss summed over every
token of the accumulated batch and divided by their count, so accumulation equals one large batch),
clip, AdamW step, log. Held-out evaluation (on a sample drawn across the whole held-out split, fixed
for the run) and checkpoints happen at their intervals. A stop request (SIGTERM/SIGINT) writes a
checkpoint at the next step boundary and raises `Preempted`.

The model comes from its family in the model registry; the loop never names a model. A stage starts
from random weights or from its `model.init` weights (train/init_weights.py). Resume is exact:
the checkpoint holds model, optimizer, step, loader position and every RNG state (train/checkpoint/),
so on CPU a resumed stage ends bitwise identical to one that never stopped.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from runyard.data.loader import TokenLoader, eval_sample
from runyard.data.pipeline import PreparedData
from runyard.errors import Preempted
from runyard.evaluate.heldout import evaluation_seeds
from runyard.model.registry import get_family
from runyard.plan.weights_in import stage_config
from runyard.spec import JobSpec, ResolvedStage
from runyard.train import checkpoint, parallel
from runyard.train.init_weights import load_initial_weights
from runyard.train.metrics import MetricsLog, device_peak_flops, mfu
from runyard.train.progress import StepProgress
from runyard.train.recovery import RecoveryTracker
from runyard.train.rng import derive_seed, seed_everything
from runyard.train.schedule import lr_at
from runyard.train.signals import StopRequest

log = logging.getLogger(__name__)


@dataclass
class StageResult:
    name: str
    steps: int
    losses: list[float]
    heldout_loss: float | None
    tokens_per_s: float
    resumed_from: int | None
    checkpoint: Path
    model: torch.nn.Module
    config: Any
    extra: dict = field(default_factory=dict)


@dataclass
class TrainSetup:
    """Everything a stage's loop works on, built the same way for a fresh start and a resume."""

    model: torch.nn.Module
    module: torch.nn.Module  # what forward runs on: the model, or its DDP/FSDP wrapper
    config: Any  # the model family's config
    optimizer: torch.optim.Optimizer
    loader: TokenLoader

    @property
    def state(self) -> checkpoint.TrainingState:
        """What a checkpoint saves and restores: model, optimizer, loader position and RNG."""
        return checkpoint.TrainingState(self.model, self.optimizer, self.loader)


def autocast_for(device: torch.device, precision: str):
    """bf16 autocast on CUDA when asked (or 'auto'); fp32 everywhere else."""
    if device.type == "cuda" and precision in ("bf16", "auto"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def build_setup(spec: JobSpec, stage: ResolvedStage, prepared: PreparedData, ctx: parallel.DistContext,
                run_dir: Path | None = None) -> TrainSetup:
    """The stage's model, optimizer and loader. With `run_dir` (a fresh start), the model starts from
    the stage's `model.init` weights, loaded before it is wrapped (DDP then broadcasts them, FSDP shards
    them); without, from its seeded random initialisation (a resume restores its checkpoint over it)."""
    family = get_family(stage.model.family)
    seed_everything(derive_seed(spec.seed, "init", stage.name))
    config = stage_config(spec, stage.name, prepared.vocab_size)  # the spec's shape, or its init weights'
    model = family.build(config)
    if run_dir is not None:
        load_initial_weights(model, spec, stage.name, run_dir)
    model = model.to(ctx.device)
    module = parallel.wrap_model(model, ctx, spec.resources, shard_units=family.shard_units(model))
    if spec.resources.compile and ctx.device.type == "cuda":
        module = torch.compile(module)
    o = stage.optim
    optimizer = torch.optim.AdamW(family.optimizer_groups(model, o), lr=o.lr, betas=o.betas, eps=o.eps)
    loader = TokenLoader(
        prepared.train_index,
        seq_len=stage.model.context_length,  # the training length; a model from weights may attend further
        batch_size=stage.train.batch_size,
        seed=derive_seed(spec.seed, "data", stage.name),
        rank=ctx.rank,
        world_size=ctx.world_size,
    )
    return TrainSetup(model, module, config, optimizer, loader)


def forward_backward(
    module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, loss_scale: float, device: torch.device, precision: str
) -> torch.Tensor:
    """One micro-batch: the loss summed over its tokens times `loss_scale` (1 / tokens in the whole
    accumulated batch), so gradients accumulated over micro-batches equal one large batch's."""
    with autocast_for(device, precision):
        logits = module(x)
    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum") * loss_scale
    loss.backward()
    return loss.detach()


@torch.no_grad()
def evaluate_loss(module: torch.nn.Module, batches, device: torch.device, precision: str) -> float:
    """Mean token cross-entropy over fixed batches (dropout off)."""
    was_training = module.training
    module.eval()
    total, count = 0.0, 0
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with autocast_for(device, precision):
            logits = module(x)
        total += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").item()
        count += y.numel()
    module.train(was_training)
    return total / max(count, 1)


def train_stage(
    spec: JobSpec,
    stage: ResolvedStage,
    prepared: PreparedData,
    stage_dir: Path,
    ctx: parallel.DistContext,
    stop: StopRequest | None = None,
    show_progress: bool = True,
) -> StageResult:
    """Train one stage from scratch, or continue it from its newest good checkpoint. A checkpoint
    still being written when training fails is waited for (its own failure only logged)."""
    try:
        return _train_stage(spec, stage, prepared, stage_dir, ctx, stop or StopRequest(), show_progress)
    finally:
        checkpoint.wait_pending(raise_errors=False)


def _train_stage(spec: JobSpec, stage: ResolvedStage, prepared: PreparedData, stage_dir: Path,
                 ctx: parallel.DistContext, stop: StopRequest, show_progress: bool) -> StageResult:
    family = get_family(stage.model.family)
    ckpt_dir = stage_dir / "checkpoints"
    fresh = checkpoint.agreed_latest_good(ckpt_dir, ctx) is None  # a resume restores its own weights
    setup = build_setup(spec, stage, prepared, ctx, run_dir=stage_dir.parent.parent if fresh else None)
    device, precision = ctx.device, spec.resources.precision
    metrics = MetricsLog(stage_dir / "metrics.jsonl")
    train_cfg = stage.train
    total_steps = train_cfg.steps
    seq_len = stage.model.context_length
    # Drawn across the whole held-out split, the same sample at every evaluation and after a resume.
    heldout = eval_sample(prepared.heldout_index, seq_len, train_cfg.batch_size,
                          spec.eval.batches * train_cfg.batch_size, evaluation_seeds(spec.seed)["eval.heldout"])

    step, best_loss, best_step, resumed_from, last_heldout = 0, math.inf, None, None, None
    restored = checkpoint.load(setup.state, ckpt_dir, ctx)
    recovery = RecoveryTracker(stage_dir.parent.parent, stage.name, enabled=ctx.is_main)
    if restored is not None:
        saved = restored.values
        step = resumed_from = restored.step
        best_loss = saved.get("best_heldout_loss") or math.inf
        best_step = saved.get("best_step")
        last_heldout = saved.get("last_heldout_loss")
        log.info("stage %s: resuming from %s (step %d)", stage.name, restored.ref.path, step)
    if ctx.is_main:
        recovery.on_resume(metrics.read(), step, ctx.world_size)  # also a restart before the first checkpoint
        metrics.truncate_after(step)
    losses = [row["loss"] for row in metrics.read() if "loss" in row] if ctx.is_main else []

    tokens_per_micro = train_cfg.batch_size * seq_len
    # Resumed onto another world size, accumulation keeps the checkpoint's global batch when it divides.
    grad_accum = parallel.grad_accum_for(train_cfg.grad_accum, train_cfg.batch_size, ctx,
                                         restored.values if restored else None)
    tokens_per_step = tokens_per_micro * grad_accum * ctx.world_size
    # Each rank divides its summed loss by its own share of the step's tokens; DDP's mean over ranks
    # then makes the gradient that of the whole global batch.
    loss_scale = ctx.world_size / tokens_per_step
    flops_per_token = family.sizing(setup.config).flops_per_unit
    peak = device_peak_flops(device)
    params = [p for p in setup.model.parameters() if p.requires_grad]
    clip = stage.optim.grad_clip
    throughput: list[float] = []
    last_path = restored.ref.path if restored else None
    retention_keep_best = spec.checkpoint.keep_best

    def checkpoint_now(at_step: int) -> Path:
        nonlocal last_path
        values = {
            "stage": stage.name,
            "best_heldout_loss": None if math.isinf(best_loss) else best_loss,
            "best_step": best_step,
            "last_heldout_loss": last_heldout,
            "world_size": ctx.world_size,
            "grad_accum": grad_accum,
        }
        retention = checkpoint.Retention(spec.checkpoint.keep_last, best_step if retention_keep_best else None)
        last_path = checkpoint.save(setup.state, ckpt_dir, at_step, values, ctx, retention=retention,
                                    wait=at_step >= total_steps or stop.requested)
        return last_path

    setup.module.train()
    with StepProgress(f"stage {stage.name}", total_steps, start=step, enabled=show_progress and ctx.is_main) as bar:
        while step < total_steps:
            t0 = time.perf_counter()
            lr = lr_at(step, stage.optim.lr, stage.schedule, total_steps)
            for group in setup.optimizer.param_groups:
                group["lr"] = lr
            step_loss = torch.zeros((), device=device)
            for micro in range(grad_accum):
                x, y = setup.loader.next_batch()
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                last_micro = micro == grad_accum - 1
                with parallel.grad_sync(setup.module, ctx, last_micro):
                    step_loss += forward_backward(setup.module, x, y, loss_scale, device, precision)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, clip if clip else math.inf)
            setup.optimizer.step()
            setup.optimizer.zero_grad(set_to_none=True)
            step += 1

            loss_value = parallel.all_reduce_mean(step_loss.item(), ctx)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            tok_s = tokens_per_step / dt
            throughput.append(tok_s)
            row = {
                "step": step,
                "loss": loss_value,
                "lr": lr,
                "grad_norm": float(grad_norm),
                "tokens_per_s": tok_s,
                "tokens": step * tokens_per_step,
                "time": time.time(),
            }
            step_mfu = mfu(flops_per_token, tok_s, peak, ctx.world_size)
            if step_mfu is not None:
                row["mfu"] = step_mfu
            if step % spec.eval.interval == 0 or step == total_steps:
                last_heldout = parallel.all_reduce_mean(
                    evaluate_loss(setup.module, heldout.batches, device, precision), ctx
                )
                row.update(heldout_loss=last_heldout, heldout_tokens=heldout.tokens,
                           heldout_documents=heldout.documents)
                if last_heldout < best_loss:
                    best_loss, best_step = last_heldout, step
            losses.append(loss_value)
            if ctx.is_main:
                metrics.write(row)
                recovery.after_step(step)
            bar.update(step, loss=loss_value, tok_s=tok_s, heldout=last_heldout)

            if parallel.agree_stop(stop, ctx):
                path = checkpoint_now(step)
                raise Preempted(
                    f"stage {stage.name} stopped by {stop.signal_name} at step {step}; checkpoint {path}. "
                    f"Continue with `runyard resume {stage_dir.parent.parent}`."
                )
            if step % spec.checkpoint.interval == 0 or step == total_steps:
                checkpoint_now(step)

    # Throughput over the steady state: the first steps carry warm-up costs (allocation, compile).
    steady = throughput[len(throughput) // 5 :] or throughput
    return StageResult(
        name=stage.name,
        steps=step,
        losses=losses,
        heldout_loss=last_heldout,
        tokens_per_s=sum(steady) / len(steady) if steady else 0.0,
        resumed_from=resumed_from,
        checkpoint=last_path,
        model=parallel.consolidated_model(setup.model, lambda: family.build(setup.config), ctx),
        config=setup.config,
    )
