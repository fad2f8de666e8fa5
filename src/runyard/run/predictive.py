"""A tabular or image run: data, stages (each gated), evaluation against a baseline, export.

run.py hands these tasks here once the run directory is open and locked. The spine is the language
model's: the data stage writes its report into `data/`, each stage writes `stages/<stage>/` (metrics,
its result, gates.json) and is skipped once passed, the evaluation writes `eval/`, the export `export/`.
What differs is the data (a table, images), the family (trees or a linear model fit by their library;
a CNN trained by runyard's loop, with its checkpoints and exact resume) and the metrics.

A spec that leaves `model.family` out gets the family `runyard.plan.families.recommend_family` picks from the
prepared data (runyard.model.choice's rule, the one `runyard plan` recommends by); the choice and its
reason are recorded in the manifest and the report.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runyard.data.image_prep import PreparedImages, prepare_images
from runyard.data.pipeline import resolve_cache_dir
from runyard.data.tabular import PreparedTable, prepare_table
from runyard.data.task_report import write_image_report, write_table_report
from runyard.errors import GateFailed
from runyard.evaluate.prediction import (
    PredictionMetrics,
    evaluate_classification,
    evaluate_regression,
    prediction_verdict,
)
from runyard.evaluate.prediction_report import write_prediction_report
from runyard.model.registry import get_family
from runyard.model.tabular import loss_name
from runyard.plan.families import DataSummary, Recommendation, recommend_family, table_summary
from runyard.reproduce import manifest as mf
from runyard.serve.feature_drift import FeatureReference
from runyard.serve.predict_export import KIND_IMAGE, KIND_TABLE, export_predictor, image_drift_features
from runyard.spec.checks import IMAGE_TASK
from runyard.spec.job import JobSpec, ResolvedStage, resolved_stage, with_family
from runyard.spec.predictive import PredictionEvalSpec
from runyard.spec.seeds import derive_seed
from runyard.system.progress import phase
from runyard.train import batches, checkpoint, parallel
from runyard.train.gates import (
    evaluate_recorded_gates,
    format_failures,
    read_gates,
    steady_tokens_per_s,
    write_gates,
)
from runyard.train.loop import train_stage
from runyard.train.metrics import MetricsLog
from runyard.train.signals import StopRequest
from runyard.train.tabular_stage import (
    StageModelMissing,
    TabularStageResult,
    fit_stage,
    load_stage_model,
    stage_gates,
    table_facts,
)

log = logging.getLogger(__name__)


@dataclass
class TaskRunResult:
    stages: list[dict] = field(default_factory=list)
    prediction: dict[str, Any] | None = None
    fit_to_ship: bool | None = None
    reasons: list[str] = field(default_factory=list)  # the bounds the verdict found failing
    evaluated: bool = False
    family: str | None = None


def run_family(spec: JobSpec, summary: DataSummary) -> tuple[str, str]:
    """(family, how it was chosen): the spec's, or the data's recommendation."""
    if spec.model.family is not None:
        return spec.model.family, "named by the spec (model.family)"
    rec: Recommendation = recommend_family(spec.task, summary)
    return rec.family, f"recommended from the data: {rec.reason}"


def _seeds(spec: JobSpec) -> dict[str, int]:
    return {"split": derive_seed(spec.seed, "split"), "drift": derive_seed(spec.seed, "drift")}


def _thresholds(spec: JobSpec) -> PredictionEvalSpec:
    return spec.eval.prediction or PredictionEvalSpec()


def _evaluate(task_is_classification: bool, y: np.ndarray, output: np.ndarray, train_y: np.ndarray,
              classes: list[str] | None, thresholds: PredictionEvalSpec) -> PredictionMetrics:
    if task_is_classification:
        return evaluate_classification(y, output, train_y, classes, thresholds)
    return evaluate_regression(y, output, train_y)


def execute_task_run(spec: JobSpec, run_dir: Path, ctx: parallel.DistContext, stop: StopRequest, threads: int,
                     only_stage: str | None = None, show_progress: bool = True, evaluate: bool = True,
                     table: PreparedTable | None = None) -> TaskRunResult:
    """Run (or continue) a tabular or image spec in the locked `run_dir` (see the module's docstring);
    `threads`: each process's CPU threads (runyard/system/cpus.py), torch's already, given to LightGBM here;
    `table`: the table as the pre-flight prepared it (runyard.plan.task_data), else it is read here."""
    if spec.task == IMAGE_TASK:
        return _image_run(spec, run_dir, ctx, stop, only_stage, show_progress, evaluate)
    return _table_run(spec, run_dir, threads, only_stage, evaluate, table)


def _record_task(run_dir: Path, spec: JobSpec, family: str, chosen: str, summary: DataSummary,
                 prepared: PreparedTable | PreparedImages, seeds: dict[str, int]) -> None:
    """The manifest's task (its family and how it was chosen, the data's summary), the prepared data's
    fingerprints and split, and the data stage's seeds beside the run's."""
    mf.update_manifest(run_dir, task={"task": spec.task, "family": family, "chosen": chosen, "data": summary.to_dict()},
                       data={"fingerprint": prepared.fingerprint, "inputs": prepared.input_fingerprints,
                             "split": prepared.stats["split"]},
                       seeds={**mf.read_manifest(run_dir).get("seeds", {}), **{f"data.{k}": v for k, v in seeds.items()}})


def _settle_family(spec: JobSpec, summary: DataSummary) -> tuple[JobSpec, str, str]:
    """The spec with its family filled in, the family, and how it was chosen."""
    family, chosen = run_family(spec, summary)
    return with_family(spec, family), family, chosen


def _stages(spec: JobSpec, run_dir: Path) -> Iterator[tuple[ResolvedStage, Path, dict | None]]:
    """Each stage in order: resolved, its directory, and the gates it recorded on an earlier attempt
    (None: it has not finished one). GateFailed when those failed: a failed stage is not trained again."""
    for s in spec.stages:
        sdir = run_dir / "stages" / s.name
        record = read_gates(sdir)
        if record is not None and not record["passed"]:
            raise GateFailed(f"stage {s.name} failed its gates earlier: {format_failures(record)}")
        yield resolved_stage(spec, s.name), sdir, record


def _check_may_train(name: str, only_stage: str | None) -> None:
    """A run limited to `only_stage` trains no other stage: the earlier ones must have passed already."""
    if only_stage is not None and name != only_stage:
        raise GateFailed(f"stage {only_stage} needs stage {name} to pass first; it has not run yet")


def _passed(record: dict) -> dict:
    """A stage's gates just recorded; GateFailed when they failed (later stages do not start)."""
    if not record["passed"]:
        raise GateFailed(f"stage {record['stage']} failed its gates: {format_failures(record)}; later stages not started")
    return record


def _stage_metrics(spec: JobSpec, run_dir: Path) -> dict[str, list[dict]]:
    return {s.name: MetricsLog(run_dir / "stages" / s.name / "metrics.jsonl").read() for s in spec.stages}


# -- tables ----------------------------------------------------------------------------------------------
def _table_run(spec: JobSpec, run_dir: Path, threads: int, only_stage: str | None, evaluate: bool,
               table: PreparedTable | None = None) -> TaskRunResult:
    seeds = _seeds(spec)
    prepared = table if table is not None else prepare_table(spec.data, spec.task, seeds["split"])
    kinds = {f.name: f.kind for f in prepared.schema.features}
    write_table_report(run_dir / "data", prepared.stats, prepared.train_columns, kinds)
    summary = table_summary(spec.task, prepared)
    spec, family, chosen = _settle_family(spec, summary)
    _record_task(run_dir, spec, family, chosen, summary, prepared, seeds)
    summaries, last = [], None
    for stage, sdir, record in _stages(spec, run_dir):
        result = None
        if record is not None:
            try:
                model, config, stage_record = load_stage_model(sdir)
                result = _loaded_result(stage.name, stage_record, model, config, sdir)
            except StageModelMissing as exc:
                log.warning("%s", exc)
                record = None
        if record is None:
            _check_may_train(stage.name, only_stage)
            result = fit_stage(stage, prepared, sdir, derive_seed(spec.seed, "init", stage.name), threads)
            record = _passed(write_gates(sdir, stage.name, stage_gates(stage, result, sdir, prepared)))
        summaries.append(_table_stage_summary(stage.name, result, record))
        last = result
        if stage.name == only_stage:
            break
    out = TaskRunResult(summaries, family=family)
    if not evaluate or (only_stage is not None and only_stage != spec.stages[-1].name):
        return out
    return _table_evaluate(spec, run_dir, prepared, last, summaries, chosen, out, seeds, threads)


def _loaded_result(name: str, record: dict, model: Any, config: Any, sdir: Path) -> TabularStageResult:
    return TabularStageResult(name, record["family"], config, model, record["best_step"],
                              MetricsLog(sdir / "metrics.jsonl").read(), record.get("details", {}))


def _table_stage_summary(name: str, result: Any, record: dict) -> dict:
    rows = result.history
    kept = next((r for r in rows if r["step"] == result.best_step), rows[-1])
    return {"name": name, "family": result.family, "steps": rows[-1]["step"], "best_step": result.best_step,
            "final_loss": kept["loss"], "heldout_loss": kept["heldout_loss"], "tokens_per_s": 0.0,
            "rows_per_s": rows[-1].get("rows_per_s"), "gates_passed": record["passed"]}


def _table_evaluate(spec: JobSpec, run_dir: Path, prepared: PreparedTable, last: Any, summaries: list[dict],
                    chosen: str, out: TaskRunResult, seeds: dict[str, int], threads: int) -> TaskRunResult:
    thresholds = _thresholds(spec)
    classification = prepared.is_classification
    output = last.model.predict(prepared.test.x)
    result = _evaluate(classification, prepared.test.y, output, prepared.train.y, prepared.schema.classes, thresholds)
    if last.family != "linear":  # the linear model beside the trees, fit on the same rows
        linear = get_family("linear")
        lin_cfg = linear.config_from_spec(resolved_stage(spec, spec.stages[-1].name).model, table=table_facts(prepared))
        fitted = linear.fit(lin_cfg, prepared.train.x, prepared.train.y, prepared.valid.x, prepared.valid.y,
                            derive_seed(spec.seed, "init", "linear-baseline"), threads)
        other = _evaluate(classification, prepared.test.y, fitted.model.predict(prepared.test.x), prepared.train.y,
                          prepared.schema.classes, thresholds)
        result.others["linear"] = other.metrics
    verdict = prediction_verdict(result, thresholds)
    stage_metrics = _stage_metrics(spec, run_dir)
    write_prediction_report(run_dir / "eval", spec.name, result, verdict, summaries, stage_metrics,
                            {"family": last.family, "chosen": chosen}, prepared.test.y, output,
                            loss_name(len(prepared.schema.classes) if classification else None))
    kinds = [f.kind for f in prepared.schema.features]
    reference = FeatureReference.build(prepared.train.x, prepared.schema.names, kinds,
                                       [len(f.categories) for f in prepared.schema.features], seeds["drift"])
    with phase("export", info="model, feature schema and ONNX"):
        export_predictor(last.model, last.config, last.family, run_dir / "export", kind=KIND_TABLE, task=spec.task,
                         schema=prepared.schema.to_dict(), reference=reference, check_x=prepared.test.x,
                         expected=output,
                         extra={"run_name": spec.name, "spec_sha256": spec.fingerprint(), "metrics": result.metrics})
    mf.update_manifest(run_dir, finished_at=mf.now_iso(), fit_to_ship=verdict.fit_to_ship)
    out.prediction, out.fit_to_ship, out.evaluated = result.to_dict(), verdict.fit_to_ship, True
    out.reasons = list(verdict.reasons)
    return out


# -- images ----------------------------------------------------------------------------------------------
def _prepare_images(spec: JobSpec, run_dir: Path, ctx: parallel.DistContext, seed: int) -> PreparedImages:
    """Rank 0 prepares (or finds) the arrays and writes the report; the other ranks then read the cache."""
    cache = resolve_cache_dir(spec.data)
    prepared = None
    if ctx.is_main:
        prepared = prepare_images(spec.data, seed, cache)
        x, y = prepared.arrays("train")
        write_image_report(run_dir / "data", prepared.stats, x, y)
    parallel.barrier(ctx)
    return prepared if prepared is not None else prepare_images(spec.data, seed, cache, write=False)


def _final_intact(sdir: Path, steps: int, ctx: parallel.DistContext) -> bool:
    """Rank 0 checks the stage's checkpoint at its final step verifies; every rank gets the answer."""
    ok = None
    if ctx.is_main:
        ref = checkpoint.latest_good(sdir / "checkpoints")
        ok = ref is not None and ref.step == steps
        if not ok:
            log.warning("stage %s: its final checkpoint (step %d) is missing or damaged; training again from the "
                        "last good one", sdir.name, steps)
    return bool(parallel.broadcast_object(ok, ctx))


def _image_run(spec: JobSpec, run_dir: Path, ctx: parallel.DistContext, stop: StopRequest, only_stage: str | None,
               show_progress: bool, evaluate: bool) -> TaskRunResult:
    seeds = _seeds(spec)
    prepared = _prepare_images(spec, run_dir, ctx, seeds["split"])
    c, h, w = prepared.shape
    counts = prepared.stats["split"]["counts"]
    summary = DataSummary(spec.task, "images", sum(counts.values()), c * h * w, prepared.n_classes, image_shape=(c, h, w))
    spec, family, chosen = _settle_family(spec, summary)
    if ctx.is_main:
        _record_task(run_dir, spec, family, chosen, summary, prepared, seeds)
    summaries, last = [], None
    for stage, sdir, record in _stages(spec, run_dir):
        restore = record is not None and not _final_intact(sdir, stage.train.steps, ctx)
        if record is None or restore:
            if not restore:
                _check_may_train(stage.name, only_stage)
            last = train_stage(spec, stage, prepared, sdir, ctx, stop=stop, show_progress=show_progress)
            record = {"passed": True}
            if ctx.is_main:
                rows = MetricsLog(sdir / "metrics.jsonl").read()
                record = write_gates(sdir, stage.name, evaluate_recorded_gates(stage.gates, rows, last.checkpoint, last.model))
            record = _passed(parallel.broadcast_object(record, ctx))
        rows = MetricsLog(sdir / "metrics.jsonl").read()
        held = [r["heldout_loss"] for r in rows if r.get("heldout_loss") is not None]
        summaries.append({"name": stage.name, "family": family, "steps": rows[-1]["step"] if rows else 0,
                          "final_loss": rows[-1]["loss"] if rows else None, "heldout_loss": held[-1] if held else None,
                          "tokens_per_s": 0.0, "samples_per_s": steady_tokens_per_s(rows, "samples_per_s"),
                          "gates_passed": record["passed"]})
        if stage.name == only_stage:
            break
    out = TaskRunResult(summaries, family=family)
    if not evaluate or not ctx.is_main or (only_stage is not None and only_stage != spec.stages[-1].name):
        return out
    model, config = _final_image_model(spec, run_dir, prepared, last, ctx)
    return _image_evaluate(spec, run_dir, prepared, model, config, summaries, chosen, out, seeds)


def _final_image_model(spec: JobSpec, run_dir: Path, prepared: PreparedImages, last: Any, ctx: parallel.DistContext):
    stage = resolved_stage(spec, spec.stages[-1].name)
    if last is not None and last.name == stage.name:
        return last.model, last.config
    family = get_family(stage.model.family)
    config = family.config_from_spec(stage.model, **batches.data_facts(prepared))
    model = family.build(config).to(ctx.device)
    ref = checkpoint.latest_good(run_dir / "stages" / stage.name / "checkpoints")
    if ref is None or ref.step != stage.train.steps:
        raise GateFailed(f"stage {stage.name}: its final checkpoint (step {stage.train.steps}) is missing or damaged")
    model.load_state_dict(checkpoint.read_model_weights(ref.path))
    return model, config


@torch.no_grad()
def _predict_images(model: torch.nn.Module, x: np.ndarray, device: torch.device, batch: int = 512) -> np.ndarray:
    model.eval()
    out = []
    for i in range(0, len(x), batch):
        logits = model(torch.from_numpy(np.array(x[i:i + batch], dtype=np.float32)).to(device))  # a copy: x is read-only
        out.append(torch.softmax(logits.double(), dim=-1).cpu().numpy())
    return np.concatenate(out)


def _image_evaluate(spec: JobSpec, run_dir: Path, prepared: PreparedImages, model: torch.nn.Module, config: Any,
                    summaries: list[dict], chosen: str, out: TaskRunResult, seeds: dict[str, int]) -> TaskRunResult:
    thresholds = _thresholds(spec)
    model = model.to("cpu")
    test_x, test_y = prepared.arrays("test")
    train_x, train_y = prepared.arrays("train")
    output = _predict_images(model, test_x, torch.device("cpu"))
    result = evaluate_classification(test_y, output, train_y, prepared.class_names, thresholds)
    verdict = prediction_verdict(result, thresholds)
    stage_metrics = _stage_metrics(spec, run_dir)
    write_prediction_report(run_dir / "eval", spec.name, result, verdict, summaries, stage_metrics,
                            {"family": out.family, "chosen": chosen}, test_y, output,
                            "cross-entropy (nats per image)")
    features, names = image_drift_features(np.asarray(train_x))
    reference = FeatureReference.build(features, names, ["numeric"] * len(names), [0] * len(names), seeds["drift"])
    images = spec.data.images
    schema = {"kind": KIND_IMAGE, "shape": list(prepared.shape), "classes": prepared.class_names,
              "resize": images.resize if images else None, "pixel_range": [0.0, 1.0]}
    with phase("export", info="model, image schema and ONNX"):
        export_predictor(model, config, out.family, run_dir / "export", kind=KIND_IMAGE, task=spec.task,
                         schema=schema, reference=reference, check_x=np.asarray(test_x), expected=output,
                         extra={"run_name": spec.name, "spec_sha256": spec.fingerprint(), "metrics": result.metrics})
    mf.update_manifest(run_dir, finished_at=mf.now_iso(), fit_to_ship=verdict.fit_to_ship)
    out.prediction, out.fit_to_ship, out.evaluated = result.to_dict(), verdict.fit_to_ship, True
    out.reasons = list(verdict.reasons)
    return out
