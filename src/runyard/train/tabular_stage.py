"""One stage of a tabular run: fit the family (LightGBM trees or the linear model) on the training rows,
early-stopping on the validation rows, and record it the way a loop stage is recorded.

- `stages/<stage>/metrics.jsonl`: one row per boosting round (the linear model: the intercept-only model
  at step 0, the fit at step 1) with the training `loss` and the validation `heldout_loss`, plus
  `rows_per_s`: what the gates, the report and a person read.
- `stages/<stage>/model/`: the fitted model's files (no pickle) and `stage.json` (family, config, best
  round, each file's sha256), written under a temporary name and renamed into place: the stage's result.
- gates as for a loop stage (stages/<stage>/gates.json): finite losses, loss drop, the validation loss
  at the kept round, and the round trip: the model reloaded from its files predicts the validation rows
  bitwise as the fitted one does.

A fit is deterministic (seeded; LightGBM's deterministic mode), so a stage stopped mid-fit is fit again
from the start: there is nothing to resume inside a fit that takes seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runyard.data.tabular import PreparedTable
from runyard.errors import RunyardError
from runyard.model.registry import get_family
from runyard.model.tabular import TableFacts
from runyard.spec.job import ResolvedStage
from runyard.system.files import atomic_write_text, fsync_dir, fsync_file, make_temp_dir, sha256_file
from runyard.train.gates import GateResult, evaluate_gates

MODEL_DIR = "model"
METRICS_FILE = "metrics.jsonl"
STAGE_FILE = "stage.json"


class StageModelMissing(RunyardError):
    """A tabular stage passed its gates, but its model files are missing or fail their checksums."""


@dataclass
class TabularStageResult:
    name: str
    family: str
    config: Any
    model: Any
    best_step: int
    history: list[dict]
    details: dict[str, Any]


def table_facts(prepared: PreparedTable) -> TableFacts:
    schema = prepared.schema
    return TableFacts(len(schema.features), tuple(schema.categorical_indices),
                      len(schema.classes) if schema.classes else None, tuple(schema.names))


def _write_model_dir(sdir: Path, family_name: str, model: Any, config: Any, best_step: int, details: dict) -> Path:
    family = get_family(family_name)
    final = sdir / MODEL_DIR
    tmp = make_temp_dir(sdir, f".{MODEL_DIR}.tmp-")
    try:
        names = family.export_files(model, config, tmp)
        record = {"family": family_name, "config": family.config_to_dict(config), "best_step": best_step,
                  "details": details, "files": {n: sha256_file(tmp / n) for n in names}}
        (tmp / STAGE_FILE).write_text(json.dumps(record, indent=1, default=str) + "\n", encoding="utf-8")
        for name in (*names, STAGE_FILE):
            fsync_file(tmp / name)
        fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(sdir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def load_stage_model(sdir: Path) -> tuple[Any, Any, dict]:
    """(model, config, stage record) from a stage's model directory, every file checked."""
    directory = sdir / MODEL_DIR
    path = directory / STAGE_FILE
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise StageModelMissing(f"stage {sdir.name}: {path} cannot be read ({exc}); the stage is fit again") from None
    for name, digest in record["files"].items():
        if not (directory / name).is_file() or sha256_file(directory / name) != digest:
            raise StageModelMissing(f"stage {sdir.name}: {directory / name} is missing or fails its checksum")
    family = get_family(record["family"])
    config = family.config_from_dict(record["config"])
    return family.load_files(directory, config), config, record


def fit_stage(stage: ResolvedStage, prepared: PreparedTable, sdir: Path, seed: int, threads: int | None) -> TabularStageResult:
    """Fit the stage's family and write its metrics and model directory (see the module's docstring)."""
    family = get_family(stage.model.family)
    config = family.config_from_spec(stage.model, table=table_facts(prepared))
    sdir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    fitted = family.fit(config, prepared.train.x, prepared.train.y, prepared.valid.x, prepared.valid.y, seed, threads)
    elapsed = time.perf_counter() - start
    # Rows visited per second: each round (or the linear solve) reads every training row once.
    passes = sum(1 for row in fitted.history if row["step"] > 0)
    rows_per_s = prepared.train.rows * passes / max(elapsed, 1e-9)
    now = time.time()
    # Written whole (a fit starts over, so no row of an earlier, unfinished fit survives).
    atomic_write_text(sdir / METRICS_FILE, "".join(
        json.dumps({**row, "rows_per_s": rows_per_s, "fit_seconds": elapsed, "time": now}) + "\n" for row in fitted.history))
    _write_model_dir(sdir, family.name, fitted.model, config, fitted.best_step, fitted.details)
    return TabularStageResult(stage.name, family.name, config, fitted.model, fitted.best_step, fitted.history,
                              {**fitted.details, "fit_seconds": elapsed})


def roundtrip_gate(sdir: Path, model: Any, x: np.ndarray) -> GateResult:
    """The stage's model reloaded from its files predicts `x` bitwise as the fitted model does."""
    try:
        loaded, _config, _record = load_stage_model(sdir)
    except StageModelMissing as exc:
        return GateResult("checkpoint_roundtrip", False, False, True, str(exc))
    same = bool(np.array_equal(loaded.predict(x), model.predict(x)))
    detail = (f"{len(x)} validation rows predicted identically after reloading {MODEL_DIR}/" if same
              else "predictions differ after reloading the model files")
    return GateResult("checkpoint_roundtrip", same, same, True, detail)


def stage_gates(stage: ResolvedStage, result: TabularStageResult, sdir: Path, prepared: PreparedTable) -> list[GateResult]:
    """The loop's gates on the fit's history (the validation loss at the kept round), then the round trip."""
    rows = result.history
    losses = [r["loss"] for r in rows]
    kept = next((r["heldout_loss"] for r in rows if r["step"] == result.best_step), rows[-1]["heldout_loss"])
    gates = stage.gates.model_copy(update={"checkpoint_roundtrip": False, "min_tokens_per_s": None,
                                           "min_samples_per_s": None})
    results = evaluate_gates(gates, losses, kept, 0.0, None, None)
    if stage.gates.checkpoint_roundtrip:
        results.append(roundtrip_gate(sdir, result.model, prepared.valid.x))
    return results


def write_history_text(sdir: Path, result: TabularStageResult) -> None:
    """A one-line note of what the fit did, beside its metrics (for a person listing the stage)."""
    atomic_write_text(sdir / "fit.txt", f"family {result.family}: best step {result.best_step} of {len(result.history)} "
                      f"recorded; {json.dumps(result.details, default=str)}\n")
