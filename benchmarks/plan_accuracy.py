"""How close `runyard plan` comes to the run it plans: estimated against measured wall time and peak
memory, for each example spec.

Cases (`--case`, repeatable; default all): `language` is examples/*.yaml's language models and the
starting spec `runyard spec init` writes; `table` is a CSV the script writes (TABLE_ROWS rows of
scikit-learn's `make_classification` with two text categories, trees chosen from the data) and the
examples' tabular specs; `images` is a folder of PNG files the script writes (scikit-learn's 8x8 digits
upscaled to 16x16, one subfolder per class, a CNN) and the examples' digits-cnn. For every spec, each
round: `runyard plan SPEC --json` on a cold data cache (its calibration measures this machine as it is at
that moment), then `runyard run SPEC` on another cold cache, in its own process: its wall time from start
to exit and its peak resident memory (the process's high-water mark, `ru_maxrss` from `wait4`). Rounds
alternate which of the two goes first, so load from other processes falls on both alike.

The peer is the measurement itself. A figure is the estimate's error factor, max(estimated / measured,
measured / estimated), the median over rounds: 1.0 is exact, and the target (issue 28: every estimate
within 0.75-1.33x of the measured run) is <= 1.33. The raw estimated / measured ratios are printed and
kept in the record's detail. The plan's once-per-machine measurements (the fixed costs of a table or
image run, plan/fixed_costs.py) are cached in the benchmark's own directory: the first plan measures
them, in the same conditions as the runs.

`--max-steps N` measures a shorter run of the same specs (each stage's steps capped at N; model, data,
evaluation and export unchanged), for a machine too loaded to run the full ones in the time at hand; the
figures' names say so (`..._steps<N>`).

Run: python benchmarks/plan_accuracy.py [--case table|images|language ...] [--spec FILE ...] [--max-steps N]
     [--table-rows N] [--repeats N] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, Report, Samples, add_common_args  # noqa: E402

from runyard.system.processes import die_with_parent  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", action="append", type=Path, default=None,
                   help="a spec to measure (repeatable; replaces the cases)")
    p.add_argument("--case", action="append", choices=CASES, default=None,
                   help="which cases to measure (repeatable; default all): " + ", ".join(CASES))
    p.add_argument("--table-rows", type=int, default=TABLE_ROWS, metavar="N",
                   help=f"rows of the written table (default {TABLE_ROWS})")
    p.add_argument("--timeout", type=float, default=3600, help="seconds one run may take (default 3600)")
    p.add_argument("--max-steps", type=int, default=None, metavar="N",
                   help="cap every stage's training steps at N (a shorter run of the same model and data)")
    add_common_args(p, repeats=1)
    return p.parse_args(argv)


def runyard_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "runyard", *args]


CASES = ("table", "images", "language")
TABLE_ROWS = 20_000
TARGET = 1.33  # issue 28: every estimate within 0.75-1.33x of the measured run


def example_specs(case: str) -> list[Path]:
    out = []
    for path in sorted((REPO / "examples").glob("*.yaml")):
        task = yaml.safe_load(path.read_text()).get("task", "language_model")
        kind = "table" if task.startswith("tabular") else "images" if task == "image_classification" else "language"
        if kind == case:
            out.append(path)
    return out


def table_case(work: Path, rows: int) -> Path:
    """A CSV of `rows` rows (18 numeric features, two text categories, 3 classes) and its spec (the family
    left to the data: trees)."""
    from sklearn.datasets import make_classification

    x, y = make_classification(n_samples=rows, n_features=18, n_informative=8, n_classes=3, random_state=0)
    gen = np.random.default_rng(0)
    colour = gen.choice(["red", "green", "blue"], size=rows)
    grade = np.where(x[:, 0] > 0, "high", "low")
    header = [f"f{i}" for i in range(18)] + ["colour", "grade", "label"]
    lines = [",".join(header)] + [",".join([*(f"{v:.5g}" for v in x[i]), colour[i], grade[i], f"c{y[i]}"])
                                  for i in range(rows)]
    (work / "table.csv").write_text("\n".join(lines) + "\n")
    spec = {"task": "tabular_classification", "name": "written-table", "seed": 0,
            "data": {"sources": [{"path": str(work / "table.csv"), "format": "csv"}], "heldout_fraction": 0.2,
                     "table": {"target": "label"}},
            "stages": [{"name": "main"}], "eval": {"prediction": {"min_accuracy": 0.5}},
            "resources": {"device": "cpu", "threads": 1}}
    path = work / "written-table.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def image_case(work: Path) -> Path:
    """A folder of PNGs (scikit-learn's 8x8 digits upscaled to 16x16, a subfolder per class) and a CNN spec."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    root = work / "digits-png"
    for i, (image, label) in enumerate(zip(digits.images, digits.target, strict=True)):
        folder = root / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        pixels = (image / 16.0 * 255).astype(np.uint8)
        Image.fromarray(pixels).resize((16, 16), Image.Resampling.BILINEAR).save(folder / f"{i:04d}.png")
    spec = {"task": "image_classification", "name": "written-images", "seed": 0,
            "data": {"sources": [{"path": str(root), "format": "image_folder"}], "heldout_fraction": 0.2,
                     "images": {"validation_fraction": 0.15}},
            "model": {"family": "cnn", "cnn": {"channels": [16, 32], "hidden": 64}},
            "optim": {"lr": 0.005}, "train": {"steps": 150, "batch_size": 64},
            "stages": [{"name": "main", "gates": {"min_loss_drop": 0.3}}],
            "eval": {"interval": 25, "batches": 4, "prediction": {"min_accuracy": 0.5}},
            "checkpoint": {"interval": 50}, "resources": {"device": "cpu", "threads": 1}}
    path = work / "written-images.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def default_specs(work: Path, cases: list[str], table_rows: int) -> list[Path]:
    out: list[Path] = []
    if "table" in cases:
        out += [table_case(work, table_rows), *example_specs("table")]
    if "images" in cases:
        out += [image_case(work), *example_specs("images")]
    if "language" in cases:
        starter = work / "starter.yaml"
        subprocess.run(runyard_command("spec", "init", str(starter)), check=True, capture_output=True)
        out += [*example_specs("language"), starter]
    return out


def capped_spec(spec: Path, max_steps: int) -> Path:
    """A copy of `spec` whose stages train at most `max_steps` steps (warmups capped to fit, gates
    dropped), next to the original so that relative source paths still resolve."""
    raw = yaml.safe_load(spec.read_text())
    if str(raw.get("task", "")).startswith("tabular"):
        return spec  # a fit by its library has no steps to cap
    sections = [raw, *raw.get("stages", [])]
    raw.setdefault("train", {}).setdefault("steps", max_steps)
    for section in sections:
        train, schedule = section.get("train") or {}, section.get("schedule") or {}
        if "steps" in train:
            train["steps"] = min(train["steps"], max_steps)
        if "warmup_steps" in schedule:
            schedule["warmup_steps"] = min(schedule["warmup_steps"], max_steps // 2)
        if section is not raw:
            section.pop("gates", None)  # a shortened stage need not pass the full one's gates to go on
    raw["name"] = f"{raw.get('name', spec.stem)}-steps{max_steps}"
    out = spec.parent / f".{spec.stem}-steps{max_steps}.{os.getpid()}.yaml"
    out.write_text(yaml.safe_dump(raw, sort_keys=False))
    return out


def estimate(spec: Path, work: Path, env: dict) -> dict:
    """`runyard plan --json` in `work` on a cold cache: (seconds, peak bytes) and the plan."""
    out = subprocess.run(runyard_command("plan", str(spec), "--json"), cwd=work, env=env, capture_output=True,
                         text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"runyard plan {spec} exited {out.returncode}:\n{out.stderr}")
    return json.loads(out.stdout)


def measure(spec: Path, work: Path, env: dict, timeout: float) -> tuple[float, int]:
    """Wall seconds and peak resident bytes of `runyard run SPEC` in its own process."""
    log = open(work / "run.log", "w")  # noqa: SIM115 - closed below, after the child exits
    t0 = time.perf_counter()
    parent = os.getpid()
    proc = subprocess.Popen(runyard_command("run", str(spec), "--no-progress", "--run-dir", str(work / "run")),
                            cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: die_with_parent(signal.SIGTERM, parent))
    deadline = t0 + timeout
    try:
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                raise RuntimeError(f"runyard run {spec} took over {timeout} s")
            time.sleep(0.05)
    except BaseException:  # a timeout or an interrupt: the run stops (checkpointing) before we go on
        proc.terminate()
        proc.wait()
        raise
    wall = time.perf_counter() - t0
    log.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"runyard run {spec} exited {proc.returncode}; see {work / 'run.log'}")
    return wall, usage.ru_maxrss * 1024  # Linux reports KiB


def measured_phases(run_dir: Path) -> dict[str, float]:
    """Where the run's time went, from what it recorded: the data stage's timings (manifest) and each
    stage's span in its metrics log (first to last step, plus one mean step)."""
    manifest = json.loads((run_dir / "manifest.json").read_text())
    out = {"data": sum((manifest.get("data", {}).get("stats", {}).get("timings") or {}).values())}
    for metrics in sorted((run_dir / "stages").glob("*/metrics.jsonl")):
        times = [json.loads(line)["time"] for line in metrics.read_text().splitlines() if line.strip()]
        if len(times) >= 2:
            out[metrics.parent.name] = (times[-1] - times[0]) * len(times) / (len(times) - 1)
    return out


def estimated_phases(plan: dict) -> dict[str, float]:
    out = {"data": plan["data"]["seconds"]}
    for stage in plan["stages"]:
        out[stage["stage"]] = stage["phases"]["training"] + stage["phases"].get("evaluation", 0.0)
    out["final"] = sum(plan["final_phases"].values())
    if plan.get("fixed_costs"):
        out["fixed"] = sum(plan["fixed_costs"]["parts"].values())
    return out


def interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def fresh_env(cache: Path) -> dict:
    env = dict(os.environ, RUNYARD_CACHE_DIR=str(cache), PYTHONPATH=str(REPO / "src"),
               RUNYARD_PLAN_CACHE=str(cache.parent.parent / "plan-cache"))
    env.pop("RUNYARD_RUNS_DIR", None)
    return env


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = Report("plan_accuracy", args)
    root = Path(tempfile.mkdtemp(prefix="runyard-plan-accuracy-"))
    # SIGTERM unwinds like Ctrl-C, so the temporary specs and runs below are removed.
    signal.signal(signal.SIGTERM, interrupt)
    capped: list[Path] = []
    try:
        cases = args.case or list(CASES)
        specs = [s.resolve() for s in args.spec] if args.spec else default_specs(root, cases, args.table_rows)
        names = [spec.stem.replace("-", "_") for spec in specs]
        if args.max_steps:
            originals = specs
            specs = [capped_spec(spec, args.max_steps) for spec in originals]
            capped = [c for c, o in zip(specs, originals, strict=True) if c != o]
            names = [f"{n}_steps{args.max_steps}" if c != o else n for n, c, o in zip(names, specs, originals, strict=True)]
        for spec, name in zip(specs, names, strict=True):
            time_error, memory_error = Samples(), Samples()
            rows = []
            for r in range(args.repeats):
                work = root / f"{spec.stem}-{r}"
                work.mkdir()
                order = ("plan", "run") if r % 2 == 0 else ("run", "plan")
                results: dict = {}
                for step in order:
                    cache = work / f"cache-{step}"
                    if step == "plan":
                        results["plan"] = estimate(spec, work, fresh_env(cache))
                    else:
                        results["run"] = measure(spec, work, fresh_env(cache), args.timeout)
                    shutil.rmtree(cache, ignore_errors=True)
                plan, (wall, peak) = results["plan"], results["run"]
                phases = {"estimated": estimated_phases(plan), "measured": measured_phases(work / "run")}
                t_ratio = plan["estimated_seconds"] / wall
                m_ratio = plan["peak_memory_bytes"] / peak
                time_error.values.append(max(t_ratio, 1 / t_ratio))
                memory_error.values.append(max(m_ratio, 1 / m_ratio))
                rows.append({"estimated_s": plan["estimated_seconds"], "measured_s": wall,
                             "estimated_peak_bytes": plan["peak_memory_bytes"], "measured_peak_bytes": peak,
                             "time_ratio": t_ratio, "memory_ratio": m_ratio, "calibration_s": plan["calibration_s"],
                             "phases": phases, "load_1min": os.getloadavg()[0]})
                print(f"  {name} round {r + 1}: time {plan['estimated_seconds']:.1f} s estimated / {wall:.1f} s "
                      f"measured = {t_ratio:.2f}; peak memory {plan['peak_memory_bytes'] / 2**20:.0f} MiB / "
                      f"{peak / 2**20:.0f} MiB = {m_ratio:.2f} (plan took {plan['calibration_s']:.1f} s)",
                      file=sys.stderr, flush=True)
                for phase, seconds in phases["estimated"].items():
                    got = phases["measured"].get(phase)
                    print(f"    {phase}: {seconds:.1f} s estimated" + (f" / {got:.1f} s recorded" if got else ""),
                          file=sys.stderr, flush=True)
            report.ratio(f"plan_time_error_{name}", time_error, "measured wall time of `runyard run`", "<=", TARGET,
                         {"rounds": rows})
            report.ratio(f"plan_memory_error_{name}", memory_error, "measured peak resident memory of `runyard run`",
                         "<=", TARGET, {"rounds": rows})
        report.note("error factor = max(estimated/measured, measured/estimated); each round on cold data caches")
        return report.finish()
    finally:
        for path in capped:
            path.unlink(missing_ok=True)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
