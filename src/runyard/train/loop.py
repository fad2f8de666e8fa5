"""The training loop for one stage: a plain `while` a person can follow, nanoGPT-style.

Each optimizer step: set the learning rate, take `grad_accum` micro-batches from the stage's objective
(train/stage_kinds.py: pretrain, sft or dpo), sum each one's loss and divide by the step's global count
(tokens, supervised tokens or pairs over every micro-batch and process, so accumulation and several
processes equal one large batch), clip, check the loss and gradient norm are finite (train/nonfinite.py:
stop before the optimizer step, or skip it), AdamW step, log. Held-out evaluation (on a sample fixed for the
run) and checkpoints happen at their intervals. A stop request (SIGTERM/SIGINT) writes a checkpoint at the
next step boundary and raises `Preempted`. A LoRA stage (train/lora.py) trains and checkpoints its
adapters alone; its result is the merged model.

The model comes from its family in the model registry; the loop never names a model. A stage starts
from random weights or from its `model.init` weights (train/init_weights.py), loaded on a fresh start
and on a resume alike (a LoRA stage's checkpoint holds only adapters, and a dpo stage's reference is
its initial weights, a frozen copy sharded like the policy under FSDP). Resume is exact: the checkpoint
holds model (or adapters), optimizer, step, loader position and every RNG state (train/checkpoint/), so on
CPU a resumed stage ends bitwise identical to one that never stopped.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from runyard.data.image_prep import PreparedImages
from runyard.data.instruct import PreparedInstruct
from runyard.data.pipeline import PreparedData
from runyard.data.samples import IGNORE_INDEX
from runyard.errors import Preempted, RunyardError
from runyard.model.compute import autocast_for, token_loss_sum
from runyard.model.registry import ModelFamily, get_family
from runyard.model.stage_model import stage_config
from runyard.spec.job import JobSpec, ResolvedStage
from runyard.spec.seeds import derive_seed, evaluation_seeds
from runyard.train import batches, checkpoint, finetune_eval, layout, parallel, pipeline, tensor_parallel
from runyard.train.init_weights import load_initial_weights, load_state_checked
from runyard.train.lora import AdapterSet, LoRAError, apply_lora, attach_trained_adapters, merged_state_dict
from runyard.train.metrics import MetricsLog, device_peak_flops, mfu
from runyard.train.nonfinite import NonFiniteGuard, device_assert_as_nonfinite
from runyard.train.progress import StepProgress
from runyard.train.recovery import RecoveryTracker
from runyard.train.rng import seed_everything
from runyard.train.schedule import lr_at
from runyard.train.signals import StopRequest
from runyard.train.stage_kinds import PretrainObjective, dpo_reference, instruct_objective
from runyard.train.step_log import PendingSteps

log = logging.getLogger(__name__)

DEVICE_LOG_INTERVAL = 10  # steps between readbacks on a GPU when train.log_interval is null


@dataclass
class StageResult:
    name: str
    steps: int
    losses: list[float]
    heldout_loss: float | None
    tokens_per_s: float
    resumed_from: int | None
    checkpoint: Path
    model: torch.nn.Module  # the whole model as trained (LoRA merged into it)
    config: Any
    extra: dict = field(default_factory=dict)
    checkpointed: torch.nn.Module | None = None  # what the checkpoint holds when not `model` (LoRA adapters)

    @property
    def checkpointed_module(self) -> torch.nn.Module:
        return self.checkpointed if self.checkpointed is not None else self.model


@dataclass
class TrainSetup:
    """Everything a stage's loop works on, built the same way for a fresh start and a resume."""

    model: torch.nn.Module
    module: torch.nn.Module  # what forward runs on: the model, or its DDP/FSDP wrapper
    config: Any  # the model family's config
    optimizer: torch.optim.Optimizer
    loader: Any  # the objective's loader (a TokenLoader or ImageLoader, a SampleLoader for sft and dpo)
    objective: Any = None  # PretrainObjective, SFTObjective or DPOObjective (train/stage_kinds.py)
    adapters: AdapterSet | None = None  # LoRA: the only parameters that train and are checkpointed
    pipeline: pipeline.Pipeline | None = None  # pipeline parallel: `model` is this rank's stage (train/pipeline.py)

    @property
    def trained(self) -> torch.nn.Module:
        """The parameters the optimizer steps and checkpoints hold: the adapters, or the whole model."""
        return self.adapters if self.adapters is not None else self.model

    @property
    def state(self) -> checkpoint.TrainingState:
        """What a checkpoint saves and restores: model (or adapters), optimizer, loader position and RNG."""
        return checkpoint.TrainingState(self.trained, self.optimizer, self.loader)


def build_model(spec: JobSpec, stage: ResolvedStage, prepared: PreparedData | PreparedImages,
                ctx: parallel.DistContext, run_dir: Path | None):
    """The stage's model at its start, on the device: built from the stage's seed, then (with `run_dir`)
    loaded with its `model.init` weights before anything wraps it (DDP then broadcasts them, FSDP shards
    them). The one place a stage's model is built. Returns (model, config); the config is the spec's
    shape, or that of the weights the stage starts from. `run_dir=None` leaves the seeded random
    initialisation (what the stage would be without `init`)."""
    family = get_family(stage.model.family)
    seed_everything(derive_seed(spec.seed, "init", stage.name))
    facts = batches.data_facts(prepared)
    config = stage_config(spec, stage.name, **facts)
    model = family.build(config)
    if run_dir is not None:
        load_initial_weights(model, spec, stage.name, run_dir, facts.get("vocab_size"))
    return model.to(ctx.device), config


def build_setup(spec: JobSpec, stage: ResolvedStage, prepared: PreparedData | PreparedImages,
                ctx: parallel.DistContext, run_dir: Path | None = None,
                instruct: PreparedInstruct | None = None) -> TrainSetup:
    """The stage's model (from build_model), its adapters, optimizer and objective. The same for a fresh
    start and a resume: a resume then restores its checkpoint over it."""
    family = get_family(stage.model.family)
    shape = parallel.layout_of(spec.resources.parallel, ctx.world_size)
    if ctx.pp > 1:  # refused before any work
        pipeline.refuse_unsupported(stage, spec.resources, shape)
    if ctx.tp > 1:
        tensor_parallel.refuse_unsupported(stage, shape)
    model, config = build_model(spec, stage, prepared, ctx, run_dir)
    pipe = None
    if ctx.pp > 1:  # from here on the model is this rank's stage, under the whole model's names
        model = pipeline.split_model(model, family, ctx)
        pipe = pipeline.Pipeline(model, ctx, shape, rows=stage.train.batch_size, width=stage.model.context_length)
    reference = None
    if stage.kind == "dpo":  # the stage's initial weights, before anything trains them
        frozen = model if stage.lora is not None else layout.frozen_copy(model, family, ctx, spec.resources)
        reference = dpo_reference(frozen, uses_lora=stage.lora is not None)
    adapters = None
    if stage.lora is not None:
        if ctx.distributed and (shape.dp_shard > 1 or shape.tp > 1):
            raise LoRAError("LoRA stages train with ddp (the adapters are small); set resources.parallel: ddp")
        adapters = apply_lora(model, stage.lora, derive_seed(spec.seed, "lora", stage.name))
    module = layout.lay_out(model, family, ctx, spec.resources, stage.train)  # recompute, compile, wrap
    o = stage.optim
    if adapters is not None:
        groups = [{"name": "lora", "params": list(adapters.parameters()), "weight_decay": o.weight_decay}]
    else:
        groups = family.optimizer_groups(model, o)
    # fused: one kernel over every parameter instead of the multi-tensor path's several passes, on CPU as on
    # CUDA. Deterministic; its update rounds in another order, so it differs from foreach's in the last bits
    # (a checkpoint keeps the path it was saved with).
    optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, fused=True)
    data_seed = derive_seed(spec.seed, "data", stage.name)
    if stage.kind == "pretrain":
        # Text: windows of the spec's training length (a model from weights may attend further,
        # config.context_length); images: pixel batches. Held out: drawn across the whole held-out split,
        # the same sample at every evaluation and after a resume.
        loader = batches.train_loader(prepared, stage.model, stage.train.batch_size, data_seed, ctx.data)
        heldout = batches.heldout_sample(prepared, stage.model, stage.train.batch_size,
                                         spec.eval.batches * stage.train.batch_size,
                                         evaluation_seeds(spec.seed)["eval.heldout"])
        objective = PretrainObjective(loader, heldout, unit=family.sizing(config).unit,
                                      label_smoothing=batches.label_smoothing(prepared, stage.model))
    else:
        if instruct is None:
            raise RunyardError(f"stage {stage.name} ({stage.kind}) has no prepared instruction data")
        objective = instruct_objective(  # ctx.data: every rank of a tensor or pipeline group reads one batch
            stage.kind, instruct, stage.train.batch_size, spec.eval.batches * stage.train.batch_size, data_seed,
            derive_seed(spec.seed, "eval", "heldout", stage.name), stage.data.length_grouping, ctx.data,
            stage.dpo.beta, reference)
    return TrainSetup(model, module, config, optimizer, objective.loader, objective, adapters, pipe)


def whole_model(setup: TrainSetup, family: ModelFamily, ctx: parallel.DistContext) -> torch.nn.Module:
    """The whole model as one process holds it, on rank 0 (gathered from the pipeline's stages, the
    tensor-parallel shards or FSDP's; other ranks get their part back), for gates, evaluation and the
    export. Collective: every rank calls it."""
    def build():
        return family.build(setup.config)

    if setup.pipeline is not None:
        return setup.pipeline.consolidated_model(build)
    if ctx.tp > 1:
        return tensor_parallel.consolidated_model(setup.model, family.tensor_parallel_plan(setup.model, ctx.tp),
                                                  build, ctx)
    return parallel.consolidated_model(setup.model, build, ctx)


@torch.no_grad()
def evaluate_loss(module: torch.nn.Module, batches, device: torch.device, precision: str) -> float:
    """Mean cross-entropy per supervised target (a token, an image's label; not a position labelled with
    the ignore index) over fixed batches (dropout off)."""
    was_training = module.training
    module.eval()
    total, count = 0.0, 0
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with autocast_for(device, precision):
            logits = module(x)
        total += token_loss_sum(logits, y).item()
        count += int((y != IGNORE_INDEX).sum())
    module.train(was_training)
    return total / max(count, 1)


def train_stage(
    spec: JobSpec,
    stage: ResolvedStage,
    prepared: PreparedData | PreparedImages,
    stage_dir: Path,
    ctx: parallel.DistContext,
    stop: StopRequest | None = None,
    show_progress: bool = True,
    instruct: PreparedInstruct | None = None,
) -> StageResult:
    """Train one stage from scratch, or continue it from its newest good checkpoint. A checkpoint
    still being written when training fails is waited for (its own failure only logged). sft and dpo
    stages train on `instruct`, their prepared records."""
    try:
        return _train_stage(spec, stage, prepared, stage_dir, ctx, stop or StopRequest(), show_progress, instruct)
    finally:
        checkpoint.wait_pending(raise_errors=False)


def _train_stage(spec: JobSpec, stage: ResolvedStage, prepared: PreparedData | PreparedImages, stage_dir: Path,
                 ctx: parallel.DistContext, stop: StopRequest, show_progress: bool,
                 instruct: PreparedInstruct | None) -> StageResult:
    family = get_family(stage.model.family)
    # Built the same way on a fresh start and a resume (its init weights loaded either way); a resume
    # then restores its checkpoint over them.
    ctx = parallel.with_layout(ctx, spec.resources)  # its tensor-parallel degree; ctx.data reads the data
    setup = build_setup(spec, stage, prepared, ctx, run_dir=stage_dir.parent.parent, instruct=instruct)
    objective = setup.objective
    device, precision = ctx.device, spec.resources.precision

    def autocast():
        return autocast_for(device, precision)

    def heldout_loss_of(module, batches):
        if setup.pipeline is not None:
            return setup.pipeline.heldout_loss(batches, autocast)
        return evaluate_loss(module, batches, device, precision)

    ckpt_dir = stage_dir / "checkpoints"
    metrics = MetricsLog(stage_dir / "metrics.jsonl")
    train_cfg = stage.train
    total_steps = train_cfg.steps
    if stage.kind == "dpo":  # by every rank together (a sharded reference gathers its units)
        objective.heldout_reference(device, autocast)
    # The initial weights' held-out figures, before any step, taken once (rank 0 decides for every rank:
    # gathering the whole model is collective).
    if instruct is not None and parallel.broadcast_object(ctx.is_main and not finetune_eval.has_before(stage_dir), ctx):
        initial = whole_model(setup, family, ctx)
        if ctx.is_main:
            finetune_eval.record_before(setup, initial, stage, instruct, stage_dir, device, autocast)
    base_hash = setup.adapters.base_sha256 if setup.adapters is not None else None

    step, best_loss, best_step, resumed_from, last_heldout = 0, math.inf, None, None, None
    restored = checkpoint.load(setup.state, ckpt_dir, ctx)
    if restored is not None and restored.values.get("lora_base_sha256") != base_hash:
        raise LoRAError(f"stage {stage.name}: the checkpoint's adapters were trained on a base with sha256 "
                        f"{restored.values.get('lora_base_sha256')}, this stage's base is {base_hash}")
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

    # A "token" here is one target of the loss: a token of text, or an image's label (unit "sample").
    unit = family.sizing(setup.config).unit
    seen_key = f"{unit}s"
    tokens_seen = next((r[seen_key] for r in reversed(metrics.read()) if seen_key in r), 0) if ctx.is_main and step else 0
    # Resumed onto another world size, accumulation keeps the checkpoint's global batch when it divides.
    grad_accum = parallel.grad_accum_for(train_cfg.grad_accum, train_cfg.batch_size, ctx.data,
                                         restored.values if restored else None)
    flops_per_token = family.sizing(setup.config).flops_per_unit
    peak = device_peak_flops(device)
    params = [p for p in setup.model.parameters() if p.requires_grad]
    clip = stage.optim.grad_clip
    throughput: list[float] = []
    last_path = restored.ref.path if restored else None
    retention_keep_best = spec.checkpoint.keep_best
    guard = NonFiniteGuard(stage.name, train_cfg.nonfinite, train_cfg.nonfinite_budget,
                           int(restored.values.get("nonfinite_skipped") or 0) if restored else 0)

    def checkpoint_now(at_step: int) -> Path:
        nonlocal last_path
        values = {
            "stage": stage.name,
            "best_heldout_loss": None if math.isinf(best_loss) else best_loss,
            "best_step": best_step,
            "last_heldout_loss": last_heldout,
            "world_size": ctx.data.world_size,  # the processes that read data: the global batch's factor
            "tp": ctx.tp,  # the layout that wrote it; any layout resumes it (train/checkpoint/sharded.py)
            "pp": ctx.pp,  # stages keep the model's names: any layout resumes it
            "grad_accum": grad_accum,
            "kind": stage.kind,
            "lora_base_sha256": base_hash,
            "nonfinite_skipped": guard.skipped,
        }
        retention = checkpoint.Retention(spec.checkpoint.keep_last, best_step if retention_keep_best else None)
        last_path = checkpoint.save(setup.state, ckpt_dir, at_step, values, ctx, retention=retention,
                                    wait=at_step >= total_steps or stop.requested)
        return last_path

    # Nothing in a step reads a tensor back to the host: its figures wait on the device (train/step_log.py)
    # until the log interval, an evaluation, a checkpoint or the last step; then one all-reduce (which also
    # carries the stop agreement) and one readback turn them into a metrics row per step.
    log_every = train_cfg.log_interval or (DEVICE_LOG_INTERVAL if device.type == "cuda" else 1)
    pending = PendingSteps(device)

    def log_pending() -> bool:
        """Write the pending steps' rows (and the held-out evaluation at an evaluation step); whether any
        rank has been asked to stop."""
        nonlocal tokens_seen, last_heldout, best_loss, best_step
        with device_assert_as_nonfinite(stage.name, pending.first_step, step):
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the interval's time includes its queued work
        dt = time.perf_counter() - interval_start
        with device_assert_as_nonfinite(stage.name, pending.first_step, step):
            logged, any_stop = pending.read_back(ctx, stop.requested)
        tok_s = sum(s.tokens for s in logged) / dt if dt > 0 else math.inf
        rows = []
        for s in logged:
            tokens_seen += int(s.tokens)
            row = {"step": s.step, "loss": s.loss, "lr": s.lr, "grad_norm": s.grad_norm, f"{unit}s_per_s": tok_s,
                   f"{unit}s": tokens_seen, "time": s.time, **objective.step_metrics(s.stats)}
            if train_cfg.nonfinite == "skip_step":
                row["nonfinite_skipped"] = s.skipped
                if not s.stepped:  # not a loss the model trained on: kept out of the curve and the gates
                    row["skipped_loss"] = repr(row.pop("loss"))
            step_mfu = mfu(flops_per_token, tok_s, peak, ctx.world_size)
            if step_mfu is not None:
                row["mfu"] = step_mfu
            throughput.append(tok_s)
            if s.stepped:
                losses.append(s.loss)
            rows.append(row)
        last = rows[-1]
        if last["step"] % spec.eval.interval == 0 or last["step"] == total_steps:
            evaluation = objective.evaluate(setup.module, device, autocast, heldout_loss_of)
            last_heldout = parallel.all_reduce_mean(evaluation["heldout_loss"], ctx)
            last.update(evaluation, heldout_loss=last_heldout)
            if last_heldout < best_loss:
                best_loss, best_step = last_heldout, last["step"]
        if ctx.is_main:
            for row in rows:
                metrics.write(row)
            recovery.after_step(rows[0]["step"])
        bar.update(last["step"], loss=logged[-1].loss, tok_s=tok_s, heldout=last_heldout)
        if not ctx.distributed:
            return stop.requested
        if any_stop and not stop.requested:
            stop.request("a signal on another rank")
        return any_stop

    setup.module.train()
    with StepProgress(f"stage {stage.name}", total_steps, start=step, progress=show_progress if ctx.is_main else None) as bar:
        interval_start = time.perf_counter()
        while step < total_steps:
            lr = lr_at(step, stage.optim.lr, stage.schedule, total_steps)
            for group in setup.optimizer.param_groups:
                group["lr"] = lr
            step_loss = torch.zeros((), device=device)
            micro_batches = [objective.next_batch() for _ in range(grad_accum)]
            # The step's loss is normalised by its global count (tokens, supervised tokens or pairs over
            # every micro-batch and process; a host number, or a tensor summed on the device). Each rank
            # scales its sum by world_size / count; DDP's mean over ranks then gives the gradient of the
            # whole global batch.
            count, tokens_per_step = objective.global_counts(micro_batches, ctx.data)
            loss_scale = ctx.data.world_size / count
            if isinstance(loss_scale, torch.Tensor):  # computed in float64, applied as a Python scale would be
                loss_scale = loss_scale.float()
            if setup.pipeline is not None:  # the schedule runs forward and backward of every stage
                step_loss = setup.pipeline.step([objective.inputs_targets(b) for b in micro_batches], loss_scale,
                                                autocast)
                grad_norm = setup.pipeline.clip_grad_norm(params, clip if clip else math.inf)
            else:
                for micro, batch in enumerate(micro_batches):
                    with parallel.grad_sync(setup.module, ctx, micro == grad_accum - 1):
                        loss = objective.loss_sum(setup.module, batch, device, autocast) * loss_scale
                        loss.backward()
                    step_loss += loss.detach()
                grad_norm = parallel.plain_tensor(parallel.clip_grad_norm(params, clip if clip else math.inf))
            stepped = guard.should_step(step + 1, step_loss, grad_norm, ctx)  # before the optimizer step
            if stepped:
                setup.optimizer.step()
            setup.optimizer.zero_grad(set_to_none=True)
            step += 1
            pending.add(step, lr, step_loss, grad_norm, tokens_per_step, objective.step_stats(device), stepped,
                        guard.skipped, time.time())

            evaluates = step % spec.eval.interval == 0 or step == total_steps
            checkpoints = step % spec.checkpoint.interval == 0 or step == total_steps
            if not (step % log_every == 0 or evaluates or checkpoints):
                continue
            if log_pending():  # a stop request on any rank, agreed in the log's reduction
                path = checkpoint_now(step)
                raise Preempted(
                    f"stage {stage.name} stopped by {stop.signal_name} at step {step}; checkpoint {path}. "
                    f"Continue with `runyard resume {stage_dir.parent.parent}`."
                )
            if checkpoints:
                checkpoint_now(step)
            interval_start = time.perf_counter()  # evaluation and checkpoint time are not the steps'

    # Throughput over the steady state: the first steps carry warm-up costs (allocation, compile).
    steady = throughput[len(throughput) // 5 :] or throughput
    model = whole_model(setup, family, ctx)
    if setup.adapters is not None:
        model = merged_model(family, setup.config, setup.model, device)
    if instruct is not None and ctx.is_main:
        finetune_eval.record_after(setup, model, stage, instruct, stage_dir, device, autocast)
    return StageResult(
        name=stage.name,
        steps=step,
        losses=losses,
        heldout_loss=last_heldout,
        tokens_per_s=sum(steady) / len(steady) if steady else 0.0,
        resumed_from=resumed_from,
        checkpoint=last_path,
        model=model,
        config=setup.config,
        checkpointed=setup.adapters,
    )


def merged_model(family, config, adapted: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """A plain model of `config` holding `adapted`'s weights with its LoRA adapters merged in."""
    with torch.random.fork_rng(devices=[]):  # building the copy must not move the training RNG
        plain = family.build(config)
    plain.load_state_dict(merged_state_dict(adapted))
    return plain.to(device)


def final_stage_model(spec: JobSpec, stage: ResolvedStage, prepared: PreparedData, ctx: parallel.DistContext,
                      checkpoint_path: Path, run_dir: Path | None) -> tuple[torch.nn.Module, Any]:
    """A finished stage's model from its final checkpoint (no collectives): the weights it holds, or for
    a LoRA stage its base (its `model.init` weights, from `run_dir`) with the checkpoint's adapters merged
    in (the base is verified by its hash)."""
    family = get_family(stage.model.family)
    model, config = build_model(spec, stage, prepared, ctx, run_dir)
    weights = checkpoint.read_model_weights(checkpoint_path)
    if stage.lora is None:
        load_state_checked(model, weights, str(checkpoint_path))
        return model, config
    trained_on = checkpoint.read_checkpoint(checkpoint_path)[1].get("lora_base_sha256")
    attach_trained_adapters(model, stage.lora, derive_seed(spec.seed, "lora", stage.name), weights, trained_on,
                            str(checkpoint_path))
    return merged_model(family, config, model, ctx.device), config
