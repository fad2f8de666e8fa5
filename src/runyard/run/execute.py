"""Executes a run: plan, data, stages (each gated), evaluation, export.

`execute_run` is the spine. Every step writes into the run directory and can be repeated: a stage
whose gates passed is not trained again, a stage with checkpoints continues from the newest good
one, and the data stage reuses its cache. So `runyard resume RUN_DIR` is `execute_run` on the spec
stored in the run directory.

One writer at a time: `execute_run` holds the run directory's lock (runyard.system.rundir) throughout, or,
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

import numpy as np
import torch
from tokenizers import Tokenizer

from runyard.data.chat import directory_template, load_chat_template
from runyard.data.instruct import PreparedInstruct, prepare_instruct, trained_chat_template
from runyard.data.loader import eval_sample
from runyard.data.pipeline import PreparedData, prepare_data, resolve_cache_dir, train_token_counts
from runyard.data.tokenizer import TOKENIZER_FILE, eos_token_beside, read_tokenizer_config
from runyard.errors import EXIT_NOT_FIT, GateFailed, NotFitToShip, SpecError
from runyard.evaluate.heldout import (
    HeldoutMetrics,
    summarise,
    unigram_loss,
)
from runyard.evaluate.report import finetune_verdict, verdict, write_report
from runyard.model.hf.config import CONFIG_FILE, read_json
from runyard.model.hf.export import GENERATION_CONFIG_FILE, export_eos_ids, load_export
from runyard.model.hf.export import export_model as write_export
from runyard.model.stage_model import stage_start, weights_origin
from runyard.plan import sizing
from runyard.plan.datacheck import check_spec_against_data
from runyard.plan.records_in import check_records_in
from runyard.plan.runlife import run_lifetime
from runyard.plan.task_data import check_data_in
from runyard.plan.weights_in import check_weights_in, run_vocab, weights_tokenizer_dir
from runyard.reproduce import manifest as mf
from runyard.run import predictive as run_predictive
from runyard.run.continuation import open_run_dir
from runyard.run.preflight import check_run_disk
from runyard.serve.drift import DRIFT_FILES, DriftReference, build_reference
from runyard.serve.engine import Generator
from runyard.spec.data import DataSpec
from runyard.spec.job import JobSpec, resolved_stage
from runyard.spec.seeds import derive_seed, evaluation_seeds
from runyard.system import rundir
from runyard.system.cpus import ThreadChoice, choose_threads, local_processes
from runyard.system.files import sha256_file
from runyard.system.progress import phase
from runyard.tracking.process import mirrored
from runyard.train import parallel
from runyard.train.finetune_metrics import read_record as read_finetune_record
from runyard.train.gates import (
    evaluate_recorded_gates,
    format_failures,
    read_gates,
    steady_tokens_per_s,
    write_gates,
)
from runyard.train.loop import StageResult, build_model, evaluate_loss, final_stage_model, train_stage
from runyard.train.metrics import MetricsLog
from runyard.train.rejudge import needs_rejudging, rejudge
from runyard.train.signals import StopRequest, stop_on_signals
from runyard.train.stage_result import StageResultMissing, final_checkpoint, stage_dir

log = logging.getLogger(__name__)

@dataclass
class RunSummary:
    run_dir: Path
    stages: list[dict] = field(default_factory=list)
    metrics: HeldoutMetrics | None = None
    fit_to_ship: bool | None = None
    samples: list[dict] = field(default_factory=list)
    evaluated: bool = False
    prediction: dict | None = None  # tabular and image tasks: the test split's metrics beside their baseline
    reasons: list[str] = field(default_factory=list)  # why the verdict is not fit to ship

    def not_fit(self) -> NotFitToShip | None:
        """The error `runyard run` exits with (EXIT_NOT_FIT) when the finished run is not fit to ship."""
        if not self.evaluated or self.fit_to_ship is not False:
            return None
        return NotFitToShip(f"the run finished but is not fit to ship: {'; '.join(self.reasons) or 'see the report'}. "
                            f"The export and {self.run_dir / 'eval' / 'report.md'} are written; exit {EXIT_NOT_FIT} "
                            "tells a script or CI")


def default_run_dir(spec: JobSpec, root: Path | None = None) -> Path:
    return (root or Path(os.environ.get("RUNYARD_RUNS_DIR", "runs"))) / spec.name


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
    manifest.setdefault("init_weights", init_provenance(spec))
    manifest["seeds"] = {
        "spec": spec.seed,
        **{f"{s.name}.init": derive_seed(spec.seed, "init", s.name) for s in spec.stages},
        **{f"{s.name}.data": derive_seed(spec.seed, "data", s.name) for s in spec.stages},
        **evaluation_seeds(spec.seed),
        **{f"{s.name}.lora": derive_seed(spec.seed, "lora", s.name) for s in spec.stages if s.lora is not None},
        **{f"{s.name}.eval.heldout": derive_seed(spec.seed, "eval", "heldout", s.name)
           for s in spec.stages if s.kind != "pretrain"},
        "drift_reference": derive_seed(spec.seed, "drift"),
    }
    mf.write_manifest(run_dir, manifest)


def data_spec_for(spec: JobSpec) -> DataSpec | None:
    """The spec's data section, with the tokenizer of the weights the run starts from (if any stage
    starts from a model directory) in place of a BPE trained on the data; None without top-level data."""
    directory = weights_tokenizer_dir(spec)
    if directory is None or spec.data is None:
        return spec.data
    tokenizer = spec.data.tokenizer.model_copy(update={"path": str(directory / TOKENIZER_FILE)})
    return spec.data.model_copy(update={"tokenizer": tokenizer})


def init_provenance(spec: JobSpec) -> dict[str, dict]:
    """Where each stage's initial weights come from, with the sha256 of every file of a model directory
    (recorded once, at the run's first session: the run's weights descend from exactly these bytes)."""
    out = {}
    for stage in spec.stages:
        start = stage_start(spec, stage.name)
        entry: dict = {"from": start.source}
        if start.from_stage is not None:
            entry["stage"] = start.from_stage
        if start.directory is not None:
            entry["path"] = str(start.directory.resolve())
            entry["sha256"] = {p.name: sha256_file(p) for p in sorted(start.directory.iterdir()) if p.is_file()}
        out[stage.name] = entry
    return out


def tokenizer_only(spec: JobSpec) -> PreparedData:
    """What an sft/dpo-only run without top-level data has of PreparedData: the tokenizer of the weights it
    starts from (JobSpec requires a model directory then), no token store, so no pretraining split."""
    path = weights_tokenizer_dir(spec) / TOKENIZER_FILE
    tokenizer = Tokenizer.from_file(str(path))
    return PreparedData(tokenizer_path=path, vocab_size=tokenizer.get_vocab_size(),
                        eos_id=tokenizer.token_to_id(eos_token_beside(path)), train_index=None, heldout_index=None,
                        fingerprint=sha256_file(path), stats={}, input_fingerprints={})


def prepare(spec: JobSpec, run_dir: Path, ctx: parallel.DistContext, show_progress: bool) -> PreparedData:
    """Rank 0 prepares the data (or finds it cached); the other ranks then read the same cache. Without
    top-level data (every stage sft or dpo), only the initial weights' tokenizer."""
    if spec.data is None:
        prepared = tokenizer_only(spec)
        if ctx.is_main:
            mf.update_manifest(run_dir, data={"top_level": None, "tokenizer": str(prepared.tokenizer_path),
                                              "tokenizer_sha256": prepared.fingerprint,
                                              "tokenizer_vocab": prepared.vocab_size})
        return prepared
    prepared = None
    data_spec = data_spec_for(spec)
    if ctx.is_main:
        prepared = prepare_data(data_spec, seed=spec.seed, report_dir=run_dir / "data", progress=show_progress)
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
        prepared = prepare_data(data_spec, seed=spec.seed, report_dir=None, progress=None)  # rank 0 reports
    return prepared


def prepare_stage_data(spec: JobSpec, stage, prepared: PreparedData, run_dir: Path,
                       ctx: parallel.DistContext) -> PreparedInstruct | None:
    """An sft or dpo stage's records, prepared with the tokenizer the run trains with (rank 0 first,
    the others then read the same cache); None for a pretrain stage."""
    if stage.kind == "pretrain":
        return None
    instruct = stage_records(spec, stage, prepared, run_dir / "data" / stage.name) if ctx.is_main else None
    parallel.barrier(ctx)
    return instruct if instruct is not None else stage_records(spec, stage, prepared, None)


def stage_records(spec: JobSpec, stage, prepared: PreparedData, report: Path | None) -> PreparedInstruct:
    """An sft or dpo stage's prepared records (from the cache once made); `report`: where the data report goes."""
    cache = (Path(stage.data.cache_dir).expanduser() if stage.data.cache_dir
             else resolve_cache_dir(spec.data if spec.data is not None else stage.data))
    # The tokenizer file as it came (a model directory's, or data.tokenizer.path), so that its
    # tokenizer_config.json (eos_token, chat_template) is beside it; else the BPE the data stage trained.
    data_spec = data_spec_for(spec)
    tokenizer_path = Path((data_spec.tokenizer.path if data_spec is not None else None) or prepared.tokenizer_path)
    return prepare_instruct(stage.data, stage.kind, tokenizer_path, stage.model.context_length, spec.seed,
                            cache, report, where=f"stages[{stage.index}].data")


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
        if record is not None and needs_rejudging(record, stage.gates):
            record = _rejudged(stage, sdir, record, ctx)
        if record is not None and not record["passed"]:
            raise GateFailed(f"stage {name} failed its gates earlier: {format_failures(record)}")
        restore = record is not None and not _final_checkpoint_intact(sdir, stage.train.steps, ctx)
        if record is None or restore:
            if only_stage is not None and name != only_stage and not restore:
                raise GateFailed(f"stage {only_stage} needs stage {name} to pass first; it has not run yet")
            instruct = prepare_stage_data(spec, stage, prepared, run_dir, ctx)
            last = train_stage(spec, stage, prepared, sdir, ctx, stop=stop, show_progress=show_progress,
                               instruct=instruct)
            record = {"passed": True}
            if ctx.is_main:
                rows = MetricsLog(sdir / "metrics.jsonl").read()
                before = read_finetune_record(sdir).get("before", {}).get("metrics", {})
                results = evaluate_recorded_gates(stage.gates, rows, last.checkpoint, last.checkpointed_module,
                                                  heldout_start=before.get("heldout_loss"))
                record = write_gates(sdir, name, results, stage.gates)
            record = parallel.broadcast_object(record, ctx)  # every rank stops, or goes on, together
            if not record["passed"]:
                raise GateFailed(f"stage {name} failed its gates: {format_failures(record)}; later stages not started")
        summaries.append(_stage_summary(name, record, MetricsLog(sdir / "metrics.jsonl").read()))
        if name == only_stage:
            break
    return summaries, last


def _rejudged(stage, sdir: Path, record: dict, ctx: parallel.DistContext) -> dict:
    """A finished stage's verdict under the gates of the spec now (edited since it was judged)."""
    if ctx.is_main:
        earlier = record["passed"]
        record = write_gates(sdir, stage.name, rejudge(stage.gates, sdir, stage.train.steps, record), stage.gates)
        if record["passed"] != earlier:
            log.info("stage %s judged again with the spec's gates: %s", stage.name,
                     "passed" if record["passed"] else f"failed ({format_failures(record)})")
    return parallel.broadcast_object(record, ctx)


def load_final_stage(spec: JobSpec, run_dir: Path, prepared: PreparedData, ctx: parallel.DistContext):
    """The last stage's model as its final checkpoint holds it (for a run resumed after training)."""
    stage = resolved_stage(spec, spec.stages[-1].name)
    # A plain model, not build_setup's: this runs on rank 0 alone, where a DDP/FSDP wrapper would wait
    # for the other ranks.
    ref = final_checkpoint(stage_dir(run_dir, stage.name), stage.train.steps)  # never older weights
    return final_stage_model(spec, stage, prepared, ctx, ref.path, run_dir)


def drift_files(reference: DriftReference):
    """The export's writer of the drift reference: saves it into the export being written, returns its files."""
    def write(directory: Path) -> list[str]:
        reference.save(directory)
        return [name for name in DRIFT_FILES if (directory / name).is_file()]
    return write


def export_run_model(model, config, export_dir: Path, prepared: PreparedData, spec: JobSpec, run_dir: Path,
                     extra_files=None) -> Path:
    """The export: a Hugging Face model directory with runyard.json. The tokenizer files are those of
    the weights the run started from (tokenizer.json, tokenizer_config.json, generation_config.json as
    they came), or the BPE the data stage trained. The chat template is the one the last sft/dpo stage
    trained with, else the one the weights came with; it goes into chat_template.jinja, where
    transformers' apply_chat_template and runyard's chat endpoint read it. config.json keeps the
    architecture (and its fields) of the directory the last stage's weights came from."""
    tokenizer_path, tokenizer_config, generation_config = prepared.tokenizer_path, None, None
    template = trained_chat_template([run_dir / "data" / s.name for s in spec.stages if s.kind != "pretrain"])
    directory = weights_tokenizer_dir(spec)
    if directory is not None:
        tokenizer_path, tokenizer_config = directory / TOKENIZER_FILE, read_tokenizer_config(directory)
        tokenizer_config.pop("chat_template", None)
        if template is None:
            template = directory_template(directory)[0]
        if (directory / GENERATION_CONFIG_FILE).is_file():
            generation_config = read_json(directory / GENERATION_CONFIG_FILE)
    origin = weights_origin(spec, spec.stages[-1].name)
    source_config = read_json(origin / CONFIG_FILE) if origin is not None and (origin / CONFIG_FILE).is_file() else None
    return write_export(
        model, config, tokenizer_path, export_dir,
        extra_config={"run_name": spec.name, "spec_sha256": spec.fingerprint()},
        family=resolved_stage(spec, spec.stages[-1].name).model.family,
        tokenizer_config=tokenizer_config,
        generation_config=generation_config,
        chat_template=template,
        source_config=source_config,
        extra_files=extra_files,
    )


def evaluate_and_export(
    spec: JobSpec, run_dir: Path, prepared: PreparedData, model, config, summaries: list[dict], ctx
) -> RunSummary:
    """Held-out metrics, unigram baseline, export, samples (from the initial weights and the export), the report.

    The held-out and train losses are scored on samples of the same size drawn across each whole
    split (seeded from the spec), so their gap measures generalisation; the report says what each
    sample covered. A run without top-level data (every stage sft or dpo) has no pretraining split: no
    held-out/unigram figures, and its drift reference is built from the last stage's training records."""
    device = ctx.device
    metrics, counts = None, None
    if prepared.train_index is not None:
        metrics, counts = _pretraining_figures(spec, prepared, model, ctx)

    export_dir = run_dir / "export"
    # The training token distribution and a sample of its documents, for drift monitoring (serve/drift.py):
    # written into the export before it is renamed into place, and listed in its runyard.json.
    with phase("export", info=str(export_dir)):
        reference, drift_note = _drift_reference(spec, prepared, counts)
        export_run_model(model, config, export_dir, prepared, spec, run_dir,
                         extra_files=drift_files(reference) if reference is not None else None)
    exported, _cfg, tokenizer = load_export(export_dir, device=str(device))
    final = spec.stages[-1]
    with phase("samples", info=f"{len(spec.eval.prompts)} prompts from the export"):
        samples = prompt_samples(spec, exported, tokenizer, export_dir, device)
        if final.kind != "pretrain" and spec.eval.prompts:  # the same prompts from the weights the last stage began with
            # its model.init weights (a model directory, an export, or an earlier stage's final checkpoint)
            initial, _ = build_model(spec, resolved_stage(spec, final.name), prepared, ctx, run_dir)
            for sample, before in zip(samples, prompt_samples(spec, initial, tokenizer, export_dir, device), strict=True):
                sample["before"] = before["completion"]
            del initial

    stage_metrics = {s.name: MetricsLog(stage_dir(run_dir, s.name) / "metrics.jsonl").read() for s in spec.stages}
    finetune = {s.name: read_finetune_record(stage_dir(run_dir, s.name)) for s in spec.stages if s.kind != "pretrain"}
    if final.kind == "pretrain":
        result = verdict(metrics, spec.eval, stage_metrics)
    else:  # a fine-tune is judged on its own held-out figures, not on the pretraining text's baseline
        result = finetune_verdict(final.name, final.kind, finetune[final.name], spec.eval, stage_metrics)
    lifetime = run_lifetime(spec, exported, config, device, prepared.stats, stage_metrics)  # None without traffic
    write_report(run_dir / "eval", spec.name, metrics, result, samples, stage_metrics, summaries, finetune, lifetime,
                 notes=[drift_note] if drift_note else [])
    return RunSummary(run_dir, summaries, metrics, result.fit_to_ship, samples, evaluated=True,
                      reasons=list(result.reasons))


def _pretraining_figures(spec: JobSpec, prepared: PreparedData, model, ctx) -> tuple[HeldoutMetrics, np.ndarray]:
    """Held-out and train loss on the top-level split, with the unigram baseline; and the training token counts."""
    last_stage = resolved_stage(spec, spec.stages[-1].name)
    seq, batch = last_stage.model.context_length, last_stage.train.batch_size
    seeds = evaluation_seeds(spec.seed)
    held = eval_sample(prepared.heldout_index, seq, batch, spec.eval.final_batches * batch, seeds["eval.final_heldout"])
    train_sample = eval_sample(prepared.train_index, seq, batch, held.sequences, seeds["eval.final_train"])
    with phase("final evaluation", info=f"{held.sequences} held-out and {train_sample.sequences} train sequences"):
        heldout_loss = evaluate_loss(model, held.batches, ctx.device, spec.resources.precision)
        train_loss = evaluate_loss(model, train_sample.batches, ctx.device, spec.resources.precision)
    counts = train_token_counts(prepared)  # counted while the data stage tokenized the training split
    unigram = unigram_loss(counts, [y for _, y in held.batches])
    metrics = summarise(heldout_loss, train_loss, unigram, held.tokens,
                        coverage={"held-out": held.coverage(), "train": train_sample.coverage()})
    return metrics, counts


class _StoreDocuments:
    """A sample store's token arrays as a sequence (read on demand), for the drift reference."""

    def __init__(self, store):
        self.store = store

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.store.sample(int(i))[0]


def _drift_reference(spec: JobSpec, prepared: PreparedData, counts) -> tuple[DriftReference | None, str | None]:
    """The drift reference and, when it is not the top-level training split's, a note saying what it is."""
    seed = derive_seed(spec.seed, "drift")
    if prepared.train_index is not None:
        return build_reference(counts, prepared.train_index, seed), None
    # No pretraining text: the prompts a served fine-tune sees look like its own training records, rendered
    # with its template, so those (the chosen side of a dpo stage's pairs) are the reference.
    final = resolved_stage(spec, spec.stages[-1].name)
    store = stage_records(spec, final, prepared, None).stores("train")[0]
    if len(store) == 0:
        return None, (f"no drift reference: stage {final.name}'s training split is empty and the spec has no "
                      "top-level data; the export serves without drift monitoring")
    documents = _StoreDocuments(store)
    token_counts = np.zeros(prepared.vocab_size, dtype=np.int64)
    for i in range(len(documents)):
        tokens = documents[i]
        token_counts += np.bincount(tokens[(tokens >= 0) & (tokens < prepared.vocab_size)], minlength=prepared.vocab_size)
    return (DriftReference.from_documents(token_counts, documents, seed),
            f"drift reference: the {len(store):,} training records of stage {final.name} ({final.kind}) as rendered "
            "for training; the spec has no top-level data")


def prompt_samples(spec: JobSpec, model, tokenizer, export_dir: Path, device) -> list[dict]:
    """eval.prompts completed by `model`: a plain string as it is, a list of messages rendered with the
    export's chat template (the one renderer, data/chat.py) with the generation prompt added."""
    generator = Generator(model, tokenizer, device=str(device), eos_ids=export_eos_ids(export_dir, tokenizer))
    template = None
    samples = []
    for i, prompt in enumerate(spec.eval.prompts):
        if isinstance(prompt, str):
            text = prompt
        else:
            template = template or load_chat_template(export_dir)
            if template is None:
                raise SpecError("eval.prompts", [(f"eval.prompts[{i}]", "(messages)", f"text, or a model with a "
                                                  f"chat template to render messages with; {export_dir} has none")])
            text = template.render([m.model_dump() for m in prompt], add_generation_prompt=True)
        completion = generator.generate(
            text, max_tokens=spec.eval.sample_tokens, temperature=spec.eval.temperature,
            top_k=spec.eval.top_k, seed=derive_seed(spec.seed, "sample", i),
        )
        sample = {"prompt": prompt if isinstance(prompt, str) else [m.model_dump() for m in prompt],
                  "completion": completion}
        if not isinstance(prompt, str):
            sample["rendered"] = text
        samples.append(sample)
    return samples


def execute_run(
    spec: JobSpec,
    run_dir: Path,
    argv: list[str] | None = None,
    only_stage: str | None = None,
    show_progress: bool = True,
    evaluate: bool = True,
    restart_from: str | None = None,
) -> RunSummary:
    """Run (or continue) the whole spine for `spec` in `run_dir`; `evaluate=False` stops after training.
    `restart_from`: train that stage and every later one again (runyard.run.continuation)."""
    names = [s.name for s in spec.stages]
    if only_stage is not None and only_stage not in names:
        raise SpecError("--stage", [("--stage", only_stage, f"one of the spec's stages {names}")])
    check_weights_in(spec)  # exit 2 before any work when the spec cannot run on its initial weights
    check_records_in(spec)  # exit 2 before any work when an sft/dpo record is bad (on_bad_record: error)
    # exit 2 before any work when a table or the images cannot train the spec; the table read here is the one
    # the run trains on (the same reader and split seed), so it is not read a second time
    checked = check_data_in(spec)
    table = checked.table if checked is not None else None
    ctx = parallel.setup(spec.resources.device)
    try:
        with rundir.writing(run_dir, ctx.rank):
            return _execute_locked(spec, run_dir, ctx, argv, only_stage, show_progress, evaluate, restart_from,
                                   table)
    finally:
        parallel.teardown()


def _execute_locked(spec, run_dir, ctx, argv, only_stage, show_progress, evaluate, restart_from,
                    table=None) -> RunSummary:
    threads = _configure_threads(spec)
    if ctx.is_main:
        open_run_dir(spec, run_dir, restart_from)
        record_session(run_dir, spec, argv)
        mf.update_manifest(run_dir, threads=threads.to_dict())
        mf.record_environment(run_dir, spec)  # env/ lock + data file digests, for `runyard reproduce`
        if spec.task == "language_model":
            mf.update_manifest(run_dir, plan=sizing.plan_run(spec, run_vocab(spec)))
            check_run_disk(spec, run_dir)  # checkpoints and export; the data stage checks its cache
    parallel.barrier(ctx)
    with mirrored(spec, run_dir, ctx.is_main):  # MLflow/TensorBoard, from a process of its own (runyard.tracking)
        return _execute_work(spec, run_dir, ctx, threads, only_stage, show_progress, evaluate, table)


def _execute_work(spec, run_dir, ctx, threads, only_stage, show_progress, evaluate, table=None) -> RunSummary:
    if spec.task != "language_model":
        return _execute_task(spec, run_dir, ctx, threads.threads, only_stage, show_progress, evaluate, table)
    stop = StopRequest()
    with stop_on_signals(stop):
        prepared = prepare(spec, run_dir, ctx, show_progress)
        if spec.data is not None:
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


def _execute_task(spec, run_dir, ctx, threads, only_stage, show_progress, evaluate, table=None) -> RunSummary:
    """A tabular or image run (runyard.run.predictive; its libraries, the extra runyard[predict], load there)."""
    stop = StopRequest()
    with stop_on_signals(stop):
        result = run_predictive.execute_task_run(spec, run_dir, ctx, stop, threads, only_stage, show_progress, evaluate,
                                                 table)
    return RunSummary(run_dir, result.stages, fit_to_ship=result.fit_to_ship, evaluated=result.evaluated,
                      prediction=result.prediction, reasons=result.reasons)


def _configure_threads(spec: JobSpec) -> ThreadChoice:
    """torch's threads per the one rule (runyard/system/cpus.py); LightGBM is given the same number."""
    threads = choose_threads(spec.resources.threads, local_processes())
    torch.set_num_threads(threads.threads)
    if spec.resources.deterministic and spec.resources.compile:
        torch.use_deterministic_algorithms(True, warn_only=True)  # also tells inductor, which compile runs
    elif spec.resources.deterministic:
        # torch's public setter imports inductor's config (sympy with it: about two seconds of every run's
        # start) only to set inductor's flag, which nothing reads without torch.compile.
        torch._C._set_deterministic_algorithms(True, warn_only=True)
    return threads
