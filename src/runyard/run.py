"""Executes a run: plan, data, stages (each gated), evaluation, export.

`execute_run` is the spine. Every step writes into the run directory and can be repeated: a stage
whose gates passed is not trained again, a stage with checkpoints continues from the newest good
one, and the data stage reuses its cache. So `runyard resume RUN_DIR` is `execute_run` on the spec
stored in the run directory.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from runyard import manifest as mf
from runyard.data.loader import TokenLoader, heldout_batches
from runyard.data.pipeline import PreparedData, prepare_data
from runyard.errors import GateFailed, RunyardError, SpecError
from runyard.evaluate.heldout import HeldoutMetrics, summarise, train_token_counts, unigram_loss
from runyard.evaluate.report import verdict, write_report
from runyard.fsutil import atomic_write_text
from runyard.plan import sizing
from runyard.plan.stages import evaluate_gates, format_failures, read_gates, write_gates
from runyard.serve.drift import build_reference
from runyard.serve.engine import Generator
from runyard.serve.export import export_model, load_export
from runyard.spec import JobSpec, dump_spec, load_spec, resolved_stage
from runyard.train import checkpoint as ckpt
from runyard.train import parallel
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


def check_spec_against_data(spec: JobSpec, prepared: PreparedData) -> None:
    """Problems only the prepared data can reveal, reported like any spec error (field path, value,
    what was expected) before a stage starts."""
    from runyard.data.loader import TokenStream

    problems = []
    split_tokens = {
        "train": TokenStream(prepared.train_index).total,
        "held-out": TokenStream(prepared.heldout_index).total,
    }
    for stage in spec.stages:
        resolved = resolved_stage(spec, stage.name)
        where = f"stages[{resolved.index}].model" if stage.model else "model"
        vocab = resolved.model.vocab_size
        if vocab is not None and vocab < prepared.vocab_size:
            problems.append((f"{where}.vocab_size", vocab, f"at least the tokenizer's vocabulary, {prepared.vocab_size}"))
        need = resolved.model.context_length + 1
        for split, total in split_tokens.items():
            if total < need:
                problems.append((f"{where}.context_length", resolved.model.context_length,
                                 f"a sequence the {split} split can fill: it has {total} tokens"))
    if problems:
        raise SpecError("(spec checked against its prepared data)", problems)


def _stage_summary(name: str, result: StageResult | None, record: dict, metrics_rows: list[dict]) -> dict:
    losses = [r["loss"] for r in metrics_rows if "loss" in r]
    held = [r["heldout_loss"] for r in metrics_rows if r.get("heldout_loss") is not None]
    tok = [r["tokens_per_s"] for r in metrics_rows if "tokens_per_s" in r]
    return {
        "name": name,
        "steps": metrics_rows[-1]["step"] if metrics_rows else 0,
        "final_loss": losses[-1] if losses else float("nan"),
        "heldout_loss": held[-1] if held else None,
        "tokens_per_s": result.tokens_per_s if result else (sum(tok) / len(tok) if tok else 0.0),
        "gates_passed": record["passed"],
        "resumed_from": result.resumed_from if result else None,
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
    """Train each stage in order; a stage whose gates passed before is skipped, a failed one stops all."""
    names = [s.name for s in spec.stages]
    summaries, last = [], None
    for name in names:
        sdir = stage_dir(run_dir, name)
        record = read_gates(sdir)
        if record is not None and not record["passed"]:
            raise GateFailed(f"stage {name} failed its gates earlier: {format_failures(record)}")
        if record is None:
            if only_stage is not None and name != only_stage:
                raise GateFailed(f"stage {only_stage} needs stage {name} to pass first; it has not run yet")
            stage = resolved_stage(spec, name)
            last = train_stage(spec, stage, prepared, sdir, ctx, stop=stop, show_progress=show_progress)
            record = {"passed": True}
            if ctx.is_main:
                results = evaluate_gates(
                    stage.gates, last.losses, last.heldout_loss, last.tokens_per_s, last.checkpoint, last.model
                )
                record = write_gates(sdir, name, results)
            record = parallel.broadcast_object(record, ctx)  # every rank stops, or goes on, together
            if not record["passed"]:
                raise GateFailed(f"stage {name} failed its gates: {format_failures(record)}; later stages not started")
        trained_now = last if last is not None and last.name == name else None
        summaries.append(_stage_summary(name, trained_now, record, MetricsLog(sdir / "metrics.jsonl").read()))
        if name == only_stage:
            break
    return summaries, last


def load_final_stage(spec: JobSpec, run_dir: Path, prepared: PreparedData, ctx: parallel.DistContext):
    """The last stage's model as its final checkpoint holds it (for a run resumed after training)."""
    from runyard.model.transformer import ModelConfig, Transformer

    stage = resolved_stage(spec, spec.stages[-1].name)
    # A plain model, not build_setup's: this runs on rank 0 alone, where a DDP/FSDP wrapper would wait
    # for the other ranks.
    config = ModelConfig.from_spec(stage.model, prepared.vocab_size)
    model = Transformer(config).to(ctx.device)
    ref = ckpt.latest_good(stage_dir(run_dir, stage.name) / "checkpoints")
    if ref is None:
        raise RunyardError(f"stage {stage.name} passed but has no readable checkpoint in {run_dir}")
    tensors, _ = ckpt.read_checkpoint(ref.path)
    model.load_state_dict(tensors["model"])
    return model, config


def evaluate_and_export(
    spec: JobSpec, run_dir: Path, prepared: PreparedData, model, config, summaries: list[dict], ctx
) -> RunSummary:
    """Held-out metrics, unigram baseline, export, samples from the export, the report."""
    device, precision = ctx.device, spec.resources.precision
    seq, batch = config.context_length, resolved_stage(spec, spec.stages[-1].name).train.batch_size
    held = heldout_batches(prepared.heldout_index, seq, batch, spec.eval.final_batches)
    train_sample = heldout_batches(prepared.train_index, seq, batch, spec.eval.final_batches)
    heldout_loss = evaluate_loss(model, held, device, precision)
    train_loss = evaluate_loss(model, train_sample, device, precision)
    counts = train_token_counts(
        TokenLoader(prepared.train_index, seq_len=seq, batch_size=batch, seed=0, shuffle=False), prepared.vocab_size
    )
    unigram = unigram_loss(counts, [y for _, y in held])
    metrics = summarise(heldout_loss, train_loss, unigram, sum(y.numel() for _, y in held))

    export_dir = run_dir / "export"
    export_model(model, config, prepared.tokenizer_path, export_dir,
                 extra_config={"run_name": spec.name, "spec_sha256": spec.fingerprint()})
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

    result = verdict(metrics, spec.eval)
    stage_metrics = {s.name: MetricsLog(stage_dir(run_dir, s.name) / "metrics.jsonl").read() for s in spec.stages}
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
        _configure_threads(spec)
        if ctx.is_main:
            open_run_dir(spec, run_dir)
            record_session(run_dir, spec, argv)
            mf.update_manifest(run_dir, plan=sizing.plan_run(spec, spec.model.vocab_size or spec.data.tokenizer.vocab_size))
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
    finally:
        parallel.teardown()


def _configure_threads(spec: JobSpec) -> None:
    import torch

    if spec.resources.threads:
        torch.set_num_threads(spec.resources.threads)
    if spec.resources.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
