"""Executes a run: plan, data, stages (each gated), evaluation, export.

`execute_run` is the spine. Every step writes into the run directory and can be repeated: a stage
whose gates passed is not trained again, a stage with checkpoints continues from the newest good
one, and the data stage reuses its cache. So `runyard resume RUN_DIR` is `execute_run` on the spec
stored in the run directory.

One writer at a time: `execute_run` holds the run directory's lock (runyard.rundir) throughout, or,
in a worker under the launcher, checks that the launcher holds it. A stage's result is the verified
checkpoint at its final step: a passed stage whose final checkpoint is damaged or missing is trained
again from its last good checkpoint to the final step before anything uses it, so an export never
holds older weights.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runyard import manifest as mf
from runyard import rundir
from runyard.data.loader import eval_sample
from runyard.data.pipeline import PreparedData, prepare_data, train_token_counts
from runyard.errors import GateFailed, RunyardError, SpecError
from runyard.evaluate.heldout import (
    HeldoutMetrics,
    evaluation_seeds,
    summarise,
    unigram_loss,
)
from runyard.evaluate.report import verdict, write_report
from runyard.fsutil import atomic_write_text
from runyard.model.registry import get_family
from runyard.plan import sizing
from runyard.plan.datacheck import check_spec_against_data
from runyard.plan.preflight import check_run_disk
from runyard.plan.stages import (
    evaluate_recorded_gates,
    format_failures,
    read_gates,
    steady_tokens_per_s,
    write_gates,
)
from runyard.serve.drift import build_reference
from runyard.serve.engine import Generator
from runyard.serve.export import export_model, load_export
from runyard.spec import JobSpec, dump_spec, load_spec, resolved_stage
from runyard.train import checkpoint, parallel
from runyard.train.loop import StageResult, evaluate_loss, train_stage
from runyard.train.metrics import MetricsLog
from runyard.train.rng import derive_seed
from runyard.train.signals import StopRequest, stop_on_signals

log = logging.getLogger(__name__)

SPEC_FILE = "spec.yaml"


@dataclass
class RunSummary:
    run_dir: Path
    stages: list[dict] = field(default_factory=list)
    metrics: HeldoutMetrics | None = None
    fit_to_ship: bool | None = None
    samples: list[dict] = field(default_factory=list)
    evaluated: bool = False


def default_run_dir(spec: JobSpec, root: Path | None = None) -> Path:
    return (root or Path(os.environ.get("RUNYARD_RUNS_DIR", "runs"))) / spec.name


def stage_dir(run_dir: Path, stage: str) -> Path:
    return run_dir / "stages" / stage


class StageResultMissing(RunyardError):
    """A stage passed its gates, but the checkpoint at its final step is not there or not intact."""


def final_checkpoint(sdir: Path, steps: int) -> checkpoint.CheckpointRef:
    """The stage's result: its checkpoint at the final step `steps`, verified against its checksums.
    Raises StageResultMissing when the newest good checkpoint is an earlier one (or there is none)."""
    ref = checkpoint.latest_good(sdir / "checkpoints")
    if ref is None or ref.step != steps:
        found = "no intact checkpoint" if ref is None else f"the newest intact checkpoint is step {ref.step}"
        raise StageResultMissing(f"stage {sdir.name}: its final checkpoint (step {steps}) is missing or damaged; "
                                 f"{found}")
    return ref


def _final_checkpoint_intact(sdir: Path, steps: int, ctx: parallel.DistContext) -> bool:
    """Rank 0 verifies the final checkpoint; every rank gets the answer (they retrain together)."""
    problem = None
    if ctx.is_main:
        try:
            final_checkpoint(sdir, steps)
        except StageResultMissing as exc:
            problem = str(exc)
            log.warning("%s: retraining the stage from its last good checkpoint to step %d, so that what "
                        "comes after it starts from its real result", problem, steps)
    return parallel.broadcast_object(problem, ctx) is None


def open_run_dir(spec: JobSpec, run_dir: Path) -> None:
    """Create the run directory, or check that an existing one belongs to this very spec."""
    spec_path = run_dir / SPEC_FILE
    if spec_path.is_file():
        existing = load_spec(spec_path)
        if existing.fingerprint() != spec.fingerprint():
            raise SpecError(
                str(spec_path),
                [("(whole spec)", spec.name, f"the spec stored in {run_dir}; this run directory was made by a "
                  "different spec: pick another --run-dir or remove it")],
            )
        return
    atomic_write_text(spec_path, dump_spec(spec))


def record_session(run_dir: Path, spec: JobSpec, argv: list[str] | None) -> None:
    manifest = mf.read_manifest(run_dir) or mf.new_manifest(spec.fingerprint(), spec.seed, argv)
    manifest["sessions"].append(
        {
            "started_at": mf.now_iso(),
            "command_line": list(argv) if argv is not None else None,
            "restart_count": int(os.environ.get("RUNYARD_RESTART_COUNT", "0")),
            "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        }
    )
    manifest["seeds"] = {
        "spec": spec.seed,
        **{f"{s.name}.init": derive_seed(spec.seed, "init", s.name) for s in spec.stages},
        **{f"{s.name}.data": derive_seed(spec.seed, "data", s.name) for s in spec.stages},
        **evaluation_seeds(spec.seed),
        "drift_reference": derive_seed(spec.seed, "drift"),
    }
    mf.write_manifest(run_dir, manifest)


def prepare(spec: JobSpec, run_dir: Path, ctx: parallel.DistContext, show_progress: bool) -> PreparedData:
    """Rank 0 prepares the data (or finds it cached); the other ranks then read the same cache."""
    prepared = None
    if ctx.is_main:
        prepared = prepare_data(spec.data, seed=spec.seed, report_dir=run_dir / "data", progress=show_progress)
        mf.update_manifest(
            run_dir,
            data={
                "fingerprint": prepared.fingerprint,
                "inputs": prepared.input_fingerprints,
                "stats": prepared.stats,
                "tokenizer_vocab": prepared.vocab_size,
            },
        )
    parallel.barrier(ctx)
    if prepared is None:
        prepared = prepare_data(spec.data, seed=spec.seed, report_dir=None, progress=False)
    return prepared


def _stage_summary(name: str, record: dict, metrics_rows: list[dict]) -> dict:
    losses = [r["loss"] for r in metrics_rows if "loss" in r]
    held = [r["heldout_loss"] for r in metrics_rows if r.get("heldout_loss") is not None]
    return {
        "name": name,
        "steps": metrics_rows[-1]["step"] if metrics_rows else 0,
        "final_loss": losses[-1] if losses else float("nan"),
        "heldout_loss": held[-1] if held else None,
        "tokens_per_s": steady_tokens_per_s(metrics_rows),
        "gates_passed": record["passed"],
    }


def run_stages(
    spec: JobSpec,
    run_dir: Path,
    prepared: PreparedData,
    ctx: parallel.DistContext,
    stop: StopRequest,
    only_stage: str | None,
    show_progress: bool,
) -> tuple[list[dict], StageResult | None]:
    """Train each stage in order; a stage whose gates passed before is skipped (once its final checkpoint
    is verified: a damaged one is retrained first), a failed one stops all."""
    names = [s.name for s in spec.stages]
    summaries, last = [], None
    for name in names:
        sdir = stage_dir(run_dir, name)
        stage = resolved_stage(spec, name)
        record = read_gates(sdir)
        if record is not None and not record["passed"]:
            raise GateFailed(f"stage {name} failed its gates earlier: {format_failures(record)}")
        restore = record is not None and not _final_checkpoint_intact(sdir, stage.train.steps, ctx)
        if record is None or restore:
            if only_stage is not None and name != only_stage and not restore:
                raise GateFailed(f"stage {only_stage} needs stage {name} to pass first; it has not run yet")
            last = train_stage(spec, stage, prepared, sdir, ctx, stop=stop, show_progress=show_progress)
            record = {"passed": True}
            if ctx.is_main:
                rows = MetricsLog(sdir / "metrics.jsonl").read()
                results = evaluate_recorded_gates(stage.gates, rows, last.checkpoint, last.model)
                record = write_gates(sdir, name, results)
            record = parallel.broadcast_object(record, ctx)  # every rank stops, or goes on, together
            if not record["passed"]:
                raise GateFailed(f"stage {name} failed its gates: {format_failures(record)}; later stages not started")
        summaries.append(_stage_summary(name, record, MetricsLog(sdir / "metrics.jsonl").read()))
        if name == only_stage:
            break
    return summaries, last


def load_final_stage(spec: JobSpec, run_dir: Path, prepared: PreparedData, ctx: parallel.DistContext):
    """The last stage's model as its final checkpoint holds it (for a run resumed after training)."""
    stage = resolved_stage(spec, spec.stages[-1].name)
    family = get_family(stage.model.family)
    # A plain model, not build_setup's: this runs on rank 0 alone, where a DDP/FSDP wrapper would wait
    # for the other ranks.
    config = family.config_from_spec(stage.model, vocab_size=prepared.vocab_size)
    model = family.build(config).to(ctx.device)
    ref = final_checkpoint(stage_dir(run_dir, stage.name), stage.train.steps)  # never older weights
    model.load_state_dict(checkpoint.read_model_weights(ref.path))
    return model, config


def evaluate_and_export(
    spec: JobSpec, run_dir: Path, prepared: PreparedData, model, config, summaries: list[dict], ctx
) -> RunSummary:
    """Held-out metrics, unigram baseline, export, samples from the export, the report.

    The held-out and train losses are scored on samples of the same size drawn across each whole
    split (seeded from the spec), so their gap measures generalisation; the report says what each
    sample covered."""
    device, precision = ctx.device, spec.resources.precision
    last_stage = resolved_stage(spec, spec.stages[-1].name)
    seq, batch = config.context_length, last_stage.train.batch_size
    seeds = evaluation_seeds(spec.seed)
    held = eval_sample(prepared.heldout_index, seq, batch, spec.eval.final_batches * batch, seeds["eval.final_heldout"])
    train_sample = eval_sample(prepared.train_index, seq, batch, held.sequences, seeds["eval.final_train"])
    heldout_loss = evaluate_loss(model, held.batches, device, precision)
    train_loss = evaluate_loss(model, train_sample.batches, device, precision)
    counts = train_token_counts(prepared)  # counted while the data stage tokenized the training split
    unigram = unigram_loss(counts, [y for _, y in held.batches])
    metrics = summarise(heldout_loss, train_loss, unigram, held.tokens,
                        coverage={"held-out": held.coverage(), "train": train_sample.coverage()})

    export_dir = run_dir / "export"
    export_model(model, config, prepared.tokenizer_path, export_dir,
                 extra_config={"run_name": spec.name, "spec_sha256": spec.fingerprint()},
                 family=last_stage.model.family)
    # The training token distribution and a sample of its documents, for drift monitoring (serve/drift.py).
    build_reference(counts, prepared.train_index, derive_seed(spec.seed, "drift")).save(export_dir)
    exported, _cfg, tokenizer = load_export(export_dir, device=str(device))
    generator = Generator(exported, tokenizer, device=str(device))
    samples = []
    for i, prompt in enumerate(spec.eval.prompts):
        completion = generator.generate(
            prompt, max_tokens=spec.eval.sample_tokens, temperature=spec.eval.temperature,
            top_k=spec.eval.top_k, seed=derive_seed(spec.seed, "sample", i),
        )
        samples.append({"prompt": prompt, "completion": completion})

    stage_metrics = {s.name: MetricsLog(stage_dir(run_dir, s.name) / "metrics.jsonl").read() for s in spec.stages}
    result = verdict(metrics, spec.eval, stage_metrics)
    write_report(run_dir / "eval", spec.name, metrics, result, samples, stage_metrics, summaries)
    return RunSummary(run_dir, summaries, metrics, result.fit_to_ship, samples, evaluated=True)


def execute_run(
    spec: JobSpec,
    run_dir: Path,
    argv: list[str] | None = None,
    only_stage: str | None = None,
    show_progress: bool = True,
    evaluate: bool = True,
) -> RunSummary:
    """Run (or continue) the whole spine for `spec` in `run_dir`; `evaluate=False` stops after training."""
    names = [s.name for s in spec.stages]
    if only_stage is not None and only_stage not in names:
        raise SpecError("--stage", [("--stage", only_stage, f"one of the spec's stages {names}")])
    ctx = parallel.setup(spec.resources.device)
    try:
        with rundir.writing(run_dir, ctx.rank):
            return _execute_locked(spec, run_dir, ctx, argv, only_stage, show_progress, evaluate)
    finally:
        parallel.teardown()


def _execute_locked(spec, run_dir, ctx, argv, only_stage, show_progress, evaluate) -> RunSummary:
    _configure_threads(spec)
    if ctx.is_main:
        open_run_dir(spec, run_dir)
        record_session(run_dir, spec, argv)
        mf.record_environment(run_dir, spec)  # env/ lock + data file digests, for `runyard reproduce`
        mf.update_manifest(run_dir, plan=sizing.plan_run(spec, spec.model.vocab_size or spec.data.tokenizer.vocab_size))
        check_run_disk(spec, run_dir)  # checkpoints and export; the data stage checks its cache
    parallel.barrier(ctx)
    stop = StopRequest()
    with stop_on_signals(stop):
        prepared = prepare(spec, run_dir, ctx, show_progress)
        check_spec_against_data(spec, prepared)
        summaries, last = run_stages(spec, run_dir, prepared, ctx, stop, only_stage, show_progress)
    is_last = only_stage is None or only_stage == spec.stages[-1].name
    if not is_last or not ctx.is_main or not evaluate:
        return RunSummary(run_dir, summaries)
    if last is not None and last.name == spec.stages[-1].name:
        model, config = last.model, last.config
    else:
        model, config = load_final_stage(spec, run_dir, prepared, ctx)
    summary = evaluate_and_export(spec, run_dir, prepared, model, config, summaries, ctx)
    mf.update_manifest(run_dir, finished_at=mf.now_iso(), fit_to_ship=summary.fit_to_ship)
    return summary


def _configure_threads(spec: JobSpec) -> None:
    if spec.resources.threads:
        torch.set_num_threads(spec.resources.threads)
    if spec.resources.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
