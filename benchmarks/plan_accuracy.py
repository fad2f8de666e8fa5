"""How close `runyard plan` comes to the run it plans: estimated against measured wall time and peak
memory, for each example spec.

For every spec (examples/*.yaml, and the starting spec `runyard spec init` writes, a short run), each
round: `runyard plan SPEC --json` on a cold data cache (its calibration measures this machine as it is at
that moment), then `runyard run SPEC` on another cold cache, in its own process: its wall time from start
to exit and its peak resident memory (the process's high-water mark, `ru_maxrss` from `wait4`). Rounds
alternate which of the two goes first, so load from other processes falls on both alike.

The peer is the measurement itself. A figure is the estimate's error factor, max(estimated / measured,
measured / estimated), the median over rounds: 1.0 is exact, and the target (the issue's "within 25%")
is <= 1.25. The raw estimated / measured ratios are kept in the record's detail.

Run: python benchmarks/plan_accuracy.py [--spec FILE ...] [--repeats N] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, Report, Samples, add_common_args  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", action="append", type=Path, default=None,
                   help="a spec to measure (repeatable; default: examples/*.yaml and the starting spec)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds one run may take (default 3600)")
    add_common_args(p, repeats=1)
    return p.parse_args(argv)


def runyard_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "runyard", *args]


def default_specs(work: Path) -> list[Path]:
    specs = sorted((REPO / "examples").glob("*.yaml"))
    starter = work / "starter.yaml"
    subprocess.run(runyard_command("spec", "init", str(starter)), check=True, capture_output=True)
    return [*specs, starter]


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
    proc = subprocess.Popen(runyard_command("run", str(spec), "--no-progress", "--run-dir", str(work / "run")),
                            cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = t0 + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.perf_counter() > deadline:
            proc.kill()
            pid, status, usage = os.wait4(proc.pid, 0)
            raise RuntimeError(f"runyard run {spec} took over {timeout} s")
        time.sleep(0.05)
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
        out[stage["stage"]] = stage["phases"]["training"] + stage["phases"]["evaluation"]
    out["final"] = sum(plan["final_phases"].values())
    return out


def fresh_env(cache: Path) -> dict:
    env = dict(os.environ, RUNYARD_CACHE_DIR=str(cache), PYTHONPATH=str(REPO / "src"))
    env.pop("RUNYARD_RUNS_DIR", None)
    return env


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = Report("plan_accuracy", args)
    root = Path(tempfile.mkdtemp(prefix="runyard-plan-accuracy-"))
    try:
        specs = [s.resolve() for s in args.spec] if args.spec else default_specs(root)
        for spec in specs:
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
                print(f"  {spec.name} round {r + 1}: time {plan['estimated_seconds']:.1f} s estimated / {wall:.1f} s "
                      f"measured = {t_ratio:.2f}; peak memory {plan['peak_memory_bytes'] / 2**20:.0f} MiB / "
                      f"{peak / 2**20:.0f} MiB = {m_ratio:.2f} (plan took {plan['calibration_s']:.1f} s)",
                      file=sys.stderr, flush=True)
                for phase, seconds in phases["estimated"].items():
                    got = phases["measured"].get(phase)
                    print(f"    {phase}: {seconds:.1f} s estimated" + (f" / {got:.1f} s recorded" if got else ""),
                          file=sys.stderr, flush=True)
            name = spec.stem.replace("-", "_")
            report.ratio(f"plan_time_error_{name}", time_error, "measured wall time of `runyard run`", "<=", 1.25,
                         {"rounds": rows})
            report.ratio(f"plan_memory_error_{name}", memory_error, "measured peak resident memory of `runyard run`",
                         "<=", 1.25, {"rounds": rows})
        report.note("error factor = max(estimated/measured, measured/estimated); each round on cold data caches")
        return report.finish()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
