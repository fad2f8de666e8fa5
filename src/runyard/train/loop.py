"""The training loop for one stage: a plain `while` a person can follow, nanoGPT-style.

Each optimizer step: set the learning rate, run `grad_accum` micro-batches (loss summed over every
token of the accumulated batch and divided by their count, so accumulation equals one large batch),
clip, AdamW step, log. Held-out evaluation and checkpoints happen at their intervals. A stop request
(SIGTERM/SIGINT) writes a checkpoint at the next step boundary and raises `Preempted`.

Resume is exact: the checkpoint holds model, optimizer, step, loader position and every RNG state,
so on CPU a resumed stage ends bitwise identical to one that never stopped.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from runyard.data.loader import TokenLoader, heldout_batches
from runyard.data.pipeline import PreparedData
from runyard.errors import Preempted
from runyard.model.transformer import ModelConfig, Transformer
from runyard.spec import JobSpec, ResolvedStage
from runyard.train import checkpoint as ckpt
from runyard.train import parallel
from runyard.train.metrics import MetricsLog, device_peak_flops, mfu
from runyard.train.progress import StepProgress
from runyard.train.recovery import RecoveryTracker
from runyard.train.rng import capture_rng, derive_seed, restore_rng, seed_everything
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
    model: Transformer
    config: ModelConfig
    extra: dict = field(default_factory=dict)


@dataclass
class TrainSetup:
    """Everything a stage's loop works on, built the same way for a fresh start and a resume."""

    model: Transformer
    module: torch.nn.Module  # what forward runs on: the model, or its DDP/FSDP wrapper
    config: ModelConfig
    optimizer: torch.optim.Optimizer
    loader: TokenLoader


def autocast_for(device: torch.device, precision: str):
    """bf16 autocast on CUDA when asked (or 'auto'); fp32 everywhere else."""
    if device.type == "cuda" and precision in ("bf16", "auto"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def build_setup(spec: JobSpec, stage: ResolvedStage, prepared: PreparedData, ctx: parallel.DistContext) -> TrainSetup:
    seed_everything(derive_seed(spec.seed, "init", stage.name))
    config = ModelConfig.from_spec(stage.model, prepared.vocab_size)
    model = Transformer(config).to(ctx.device)
    module = parallel.wrap_model(model, ctx, spec.resources)
    if spec.resources.compile and ctx.device.type == "cuda":
        module = torch.compile(module)
    o = stage.optim
    optimizer = torch.optim.AdamW(
        model.param_groups(o.weight_decay, o.decay_norms_and_biases, o.decay_embeddings),
        lr=o.lr,
        betas=o.betas,
        eps=o.eps,
    )
    loader = TokenLoader(
        prepared.train_index,
        seq_len=config.context_length,
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


def save_state(setup: TrainSetup, ckpt_dir: Path, step: int, extra_state: dict) -> Path:
    rng_tensors, rng_json = capture_rng()
    return ckpt.write_checkpoint(
        ckpt_dir,
        step,
        tensors={
            "model": setup.model.state_dict(),
            "optimizer": setup.optimizer.state_dict(),
            "rng": rng_tensors,
        },
        state={"loader": setup.loader.state_dict(), "rng": rng_json, **extra_state},
    )


def load_state(setup: TrainSetup, ref: ckpt.CheckpointRef, device: torch.device) -> dict:
    tensors, state = ckpt.read_checkpoint(ref.path, map_location=device)
    setup.model.load_state_dict(tensors["model"])
    setup.optimizer.load_state_dict(tensors["optimizer"])
    setup.loader.load_state_dict(state["loader"])
    restore_rng(tensors["rng"], state["rng"])
    return state


def train_stage(
    spec: JobSpec,
    stage: ResolvedStage,
    prepared: PreparedData,
    stage_dir: Path,
    ctx: parallel.DistContext,
    stop: StopRequest | None = None,
    show_progress: bool = True,
) -> StageResult:
    """Train one stage from scratch, or continue it from its newest good checkpoint."""
    stop = stop or StopRequest()
    setup = build_setup(spec, stage, prepared, ctx)
    device, precision = ctx.device, spec.resources.precision
    ckpt_dir = stage_dir / "checkpoints"
    metrics = MetricsLog(stage_dir / "metrics.jsonl")
    train_cfg = stage.train
    total_steps = train_cfg.steps
    heldout = heldout_batches(
        prepared.heldout_index, setup.config.context_length, train_cfg.batch_size, spec.eval.batches
    )

    step, best_loss, best_step, resumed_from, last_heldout = 0, math.inf, None, None, None
    ref = parallel.latest_good(ckpt_dir, ctx)
    recovery = RecoveryTracker(stage_dir.parent.parent, stage.name, enabled=ctx.is_main)
    if ref is not None:
        state = parallel.load_checkpoint(load_state, setup, ref, ctx)
        step = resumed_from = state["step"]
        best_loss = state.get("best_heldout_loss") or math.inf
        best_step = state.get("best_step")
        last_heldout = state.get("last_heldout_loss")
        log.info("stage %s: resuming from %s (step %d)", stage.name, ref.path, step)
    if ctx.is_main:
        recovery.on_resume(metrics.read(), step, ctx.world_size)  # also a restart before the first checkpoint
        metrics.truncate_after(step)
    losses = [row["loss"] for row in metrics.read() if "loss" in row] if ctx.is_main else []

    tokens_per_micro = train_cfg.batch_size * setup.config.context_length
    # Resumed onto another world size, accumulation keeps the checkpoint's global batch when it divides.
    grad_accum = parallel.grad_accum_for(train_cfg.grad_accum, train_cfg.batch_size, ctx, state if ref else None)
    tokens_per_step = tokens_per_micro * grad_accum * ctx.world_size
    # Each rank divides its summed loss by its own share of the step's tokens; DDP's mean over ranks
    # then makes the gradient that of the whole global batch.
    loss_scale = ctx.world_size / tokens_per_step
    flops_per_token = setup.model.flops_per_token()
    peak = device_peak_flops(device)
    params = [p for p in setup.model.parameters() if p.requires_grad]
    clip = stage.optim.grad_clip
    throughput: list[float] = []
    last_path = ref.path if ref else None

    def checkpoint_now(at_step: int) -> Path:
        nonlocal last_path
        extra = {
            "stage": stage.name,
            "best_heldout_loss": None if math.isinf(best_loss) else best_loss,
            "best_step": best_step,
            "last_heldout_loss": last_heldout,
            "world_size": ctx.world_size,
            "grad_accum": grad_accum,
        }
        keep_best = best_step if spec.checkpoint.keep_best else None
        last_path = parallel.save_checkpoint(
            save_state, setup, ckpt_dir, at_step, extra, ctx,
            retain=lambda: ckpt.apply_retention(ckpt_dir, spec.checkpoint.keep_last, keep_best),
            wait=at_step >= total_steps or stop.requested,
        )
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
                last_heldout = parallel.all_reduce_mean(evaluate_loss(setup.module, heldout, device, precision), ctx)
                row["heldout_loss"] = last_heldout
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
        model=parallel.consolidated_model(setup.model, setup.config, ctx),
        config=setup.config,
    )
