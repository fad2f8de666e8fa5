"""The fixed costs of a table or image run on this machine, measured once and kept.

A small run's wall time is mostly not training: the process starting and importing torch, LightGBM,
scikit-learn, matplotlib and ONNX; the environment lock; the data report and its plots; the evaluation
report and its plots; the export and its ONNX conversion. These do not depend on the user's data (the
plots are capped in features and drawn per class), so they are measured once per machine, task and family
by a real `runyard run` of a tiny spec in its own process (a 400-row CSV the module writes, or 240 8x8
images in an .npz), and its wall time is split at the files the run writes in order:

  start-up      launch -> spec.yaml (interpreter, imports, the pre-flight read of the tiny data)
  environment   spec.yaml -> env/environment.json (the environment lock)
  data report   env/environment.json -> data/report.md (the tiny data read again, the report, its plots)
  stage setup   data/report.md -> the stage's gates.json, less the tiny training the stage recorded
  evaluation    gates.json -> eval/report.md (test predictions, the trees' linear baseline, report, plots)
  export        eval/report.md -> the last export file (the model, the schema, ONNX conversion and check)
  exit          the last export file -> the process's exit

The measurement is cached in `$RUNYARD_PLAN_CACHE/fixed_costs.json` (default ~/.cache/runyard/plan) under
a key of the machine (CPU model, cores, threads) and the versions that shape it (Python, runyard, torch,
LightGBM, scikit-learn, onnx), so a later plan on the same machine reads it. These parts are one core's
Python work (imports, plotting, conversion), so a shared machine's load changes them: beside them the
cache keeps `speed_probe()`, the seconds of a fixed piece of pure-Python work timed just before the tiny
run, and a later plan scales the cached parts by the probe now over the probe then (the measured figure
and the factor are both printed). When it cannot be measured
(`plan --no-calibrate`, or the tiny run failed) STATED_PARTS are used instead: the same parts measured on
the 2-core development machine (tabular-wine and digits-cnn, December 2026), and the plan says so.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from runyard import __version__
from runyard.errors import EXIT_NOT_FIT
from runyard.spec.checks import IMAGE_TASK
from runyard.system.cpus import cpu_model
from runyard.system.files import atomic_write_json

CACHE_ENV = "RUNYARD_PLAN_CACHE"
CACHE_FILE = "fixed_costs.json"
TINY_RUN_TIMEOUT_S = 600
PARTS = ("start-up", "environment", "data report", "stage setup", "evaluation", "export", "exit")
# Seconds of each part when nothing was measured: a run on the 2-core development machine (see the doc).
STATED_PARTS = {
    "table": {"start-up": 8.0, "environment": 5.0, "data report": 4.0, "stage setup": 0.2, "evaluation": 2.0,
              "export": 2.5, "exit": 0.5},
    "images": {"start-up": 8.0, "environment": 5.0, "data report": 3.0, "stage setup": 1.0, "evaluation": 1.5,
               "export": 3.0, "exit": 0.5},
}


PROBE_LOOPS = 100_000  # the speed probe's work: about 15 ms of pure Python on a quiet 2020s core


def speed_probe(repeats: int = 5) -> float:
    """Seconds of a fixed piece of pure-Python work here now (the median of `repeats`): how fast one core
    runs the interpreter at this moment, load included."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        total = 0
        for i in range(PROBE_LOOPS):
            total += i * i % 7
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


@dataclass(frozen=True)
class FixedCosts:
    """The fixed parts of a run (seconds, PARTS' names), and whether and how they were measured."""

    parts: dict[str, float]
    measured: bool
    how: str

    @property
    def seconds(self) -> float:
        return sum(self.parts.values())

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v:.1f} s" for k, v in self.parts.items())
        return f"fixed costs ~{self.seconds:.1f} s ({parts}; {self.how})"


def cache_path() -> Path:
    root = os.environ.get(CACHE_ENV)
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "runyard" / "plan") / CACHE_FILE


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_key(task: str, family: str, threads: int | None) -> str:
    """What a measurement holds for: this machine, the task and family, the threads, the versions."""
    parts = {"task": task, "family": family, "threads": threads, "cpu": cpu_model(), "cores": os.cpu_count(),
             "python": platform.python_version(), "runyard": __version__,
             **{name: _version(name) for name in ("torch", "lightgbm", "scikit-learn", "onnx", "matplotlib")}}
    return json.dumps(parts, sort_keys=True)


def stated(task: str, why: str) -> FixedCosts:
    kind = "images" if task == IMAGE_TASK else "table"
    return FixedCosts(dict(STATED_PARTS[kind]), False, f"stated, measured on the development machine: {why}")


def fixed_costs(task: str, family: str, threads: int | None, measure: bool = True) -> FixedCosts:
    """The fixed costs of a `task` run of `family` here: cached, else measured by a tiny run (and cached),
    else stated (module doc)."""
    if not measure:
        return stated(task, "nothing measured (--no-calibrate)")
    key = machine_key(task, family, threads)
    path = cache_path()
    cache = _read_cache(path)
    if key in cache:
        entry = cache[key]
        then = entry.get("probe_s")
        factor = speed_probe() / then if isinstance(then, (int, float)) and then > 0 else 1.0
        parts = {k: v * factor for k, v in entry["parts"].items()}
        return FixedCosts(parts, True, f"measured by a tiny real run here on {entry['measured_at'][:10]} "
                          f"({sum(entry['parts'].values()):.1f} s then), cached in {path}, scaled x{factor:.2f} by "
                          "this core's speed now against then (a pure-Python probe)")
    try:
        probe = speed_probe()
        parts = measure_fixed_costs(task, family, threads)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return stated(task, f"the tiny run to measure them failed ({exc})")
    cache[key] = {"parts": parts, "probe_s": probe,
                  "measured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, cache)
    except OSError:
        pass  # an unwritable cache: measured again next time
    return FixedCosts(parts, True, "measured now by a tiny real run here (cached for the next plan)")


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def tiny_spec(task: str, family: str, threads: int | None, where: Path) -> Path:
    """A tiny spec of `task` and `family` with its data, written in `where`."""
    gen = np.random.default_rng(0)
    resources = {"device": "cpu", **({"threads": threads} if threads else {})}
    if task == IMAGE_TASK:
        x = gen.random((240, 8, 8), dtype=np.float32)
        y = np.arange(240) % 3
        np.savez(where / "images.npz", x=x, y=y)
        spec = {"task": task, "name": "fixed-costs", "seed": 0,
                "data": {"sources": [{"path": str(where / "images.npz"), "format": "npz"}], "heldout_fraction": 0.2},
                "model": {"family": family, "cnn": {"channels": [8], "hidden": 16}},
                "train": {"steps": 4, "batch_size": 16}, "schedule": {"warmup_steps": 1},
                "stages": [{"name": "main", "gates": {"min_loss_drop": None}}],
                "eval": {"interval": 4, "batches": 1, "prediction": {"min_accuracy": 0.0, "baseline_margin": 0.0}},
                "checkpoint": {"interval": 4}, "resources": resources}
    else:
        rows = 400
        columns = {f"x{i}": gen.normal(size=rows).round(4) for i in range(10)}
        columns["colour"] = gen.choice(["red", "green", "blue"], size=rows)
        columns["size"] = gen.choice(["s", "m", "l", "xl"], size=rows)
        signal = columns["x0"] + columns["x1"]
        target = (np.digitize(signal, [-0.5, 0.5]).astype(str) if task == "tabular_classification"
                  else (signal + gen.normal(scale=0.1, size=rows)).round(4).astype(str))
        lines = [",".join([*columns, "target"])]
        lines += [",".join([*(str(columns[c][i]) for c in columns), str(target[i])]) for i in range(rows)]
        (where / "table.csv").write_text("\n".join(lines) + "\n")
        prediction = ({"min_accuracy": 0.0, "baseline_margin": 0.0} if task == "tabular_classification"
                      else {"baseline_margin": 0.0})
        spec = {"task": task, "name": "fixed-costs", "seed": 0,
                "data": {"sources": [{"path": str(where / "table.csv"), "format": "csv"}], "heldout_fraction": 0.2,
                         "table": {"target": "target"}},
                "model": {"family": family, "trees": {"num_boost_round": 100, "early_stopping_rounds": None}},
                "stages": [{"name": "main"}], "eval": {"prediction": prediction}, "resources": resources}
        if family != "lightgbm":
            spec["model"].pop("trees")
    path = where / "tiny.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def measure_fixed_costs(task: str, family: str, threads: int | None) -> dict[str, float]:
    """Seconds of each fixed part (PARTS) of a tiny real run in its own process (module doc)."""
    with tempfile.TemporaryDirectory(prefix="runyard-fixed-costs-") as tmp:
        where = Path(tmp)
        spec = tiny_spec(task, family, threads, where)
        run_dir = where / "run"
        env = {**os.environ, "RUNYARD_CACHE_DIR": str(where / "cache")}
        env.pop("RUNYARD_RUNS_DIR", None)
        launched = time.time()
        done = subprocess.run([sys.executable, "-m", "runyard", "run", str(spec), "--no-progress", "--run-dir",
                               str(run_dir)], cwd=where, env=env, capture_output=True, text=True,
                              timeout=TINY_RUN_TIMEOUT_S, check=False)
        ended = time.time()
        # Not fit to ship (the tiny data is noise) still evaluates and exports: every part ran.
        if done.returncode not in (0, EXIT_NOT_FIT):
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"runyard run of the tiny {task} spec exited {done.returncode}: {tail[0]}")
        return split_run(run_dir, launched, ended)


def _training_seconds(metrics: Path) -> float:
    """What the stage's training itself took, as it recorded it: a fit's `fit_seconds`, or the loop's span
    between its first and last logged steps plus one mean step."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    if rows and "fit_seconds" in rows[-1]:
        return float(rows[-1]["fit_seconds"])
    times = [r["time"] for r in rows if "time" in r]
    return (times[-1] - times[0]) * len(times) / (len(times) - 1) if len(times) >= 2 else 0.0


def split_run(run_dir: Path, launched: float, ended: float) -> dict[str, float]:
    """A finished run's wall time split at the files it wrote in order (module doc)."""
    stage = next(iter(sorted((run_dir / "stages").iterdir())))
    export = max(p.stat().st_mtime for p in (run_dir / "export").rglob("*") if p.is_file())
    marks = [launched, (run_dir / "spec.yaml").stat().st_mtime, (run_dir / "env" / "environment.json").stat().st_mtime,
             (run_dir / "data" / "report.md").stat().st_mtime, (stage / "gates.json").stat().st_mtime,
             (run_dir / "eval" / "report.md").stat().st_mtime, export, ended]
    spans = [max(0.0, b - a) for a, b in zip(marks, marks[1:], strict=False)]
    parts = dict(zip(PARTS, spans, strict=True))
    parts["stage setup"] = max(0.0, parts["stage setup"] - _training_seconds(stage / "metrics.jsonl"))
    return parts
