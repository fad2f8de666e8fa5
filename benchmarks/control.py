"""Control-plane figures, each beside a named peer measured in the same run.

1. Scheduling pass against Slurm's own scheduler (where Slurm is installed: `sinfo`). The same queue on
   the same inventory (Slurm's node here: 2 GPUs): one high-priority job holds one device for an hour;
   N jobs wait, the first (top priority) needing both devices, the rest one device with time limits
   from 1 to 120 minutes and mixed priorities, so backfill fires (short jobs start on the free device
   without delaying the top job). runyard: read the N pending jobs from its SQLite queue and decide for
   all of them (`scheduler.plan`, preemption off as in Slurm's config here). Slurm: the same jobs
   submitted with the same priorities, gres and time limits; its backfill cycle time and depth read
   from `sdiag` once per cycle while runyard's passes are timed in between. Figure: microseconds per
   job considered, runyard against Slurm's backfill scheduler.
2. A trace where backfill and preemption fire: 8 devices, jobs arriving over time (1 to 8 devices,
   priorities 0 to 9, time limits above their real durations), replayed through runyard's scheduler on
   a simulated clock (a preempted job goes back to the queue and resumes from where it stopped). Peer:
   the same trace under strict priority order (the same scheduler with backfill and preemption off).
   Figures: device utilisation and the top-priority jobs' mean wait.
3. Time from a worker's death (SIGKILL) to its job's first resumed training step, for a tiny real
   `runyard run`: restarted by runyard's control plane (it sees the death, classifies it as infra,
   relaunches after its backoff, the run resumes from its last good checkpoint), beside the same job
   restarted by `torchrun --max-restarts` alone. Repeats interleaved, the order alternated.

    .venv/bin/python benchmarks/control.py [--jobs 500] [--repeats 3] [--skip-slurm] [--skip-recovery] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Report, Samples, add_common_args, interleaved, paired_ratio  # noqa: E402
from schedule_sim import make_job, make_trace, simulate  # noqa: E402

from runyard.control import scheduler  # noqa: E402
from runyard.control.client import ControlClient  # noqa: E402
from runyard.control.jobs import add_jobs  # noqa: E402
from runyard.control.loop import ControlConfig  # noqa: E402
from runyard.control.states import JobState  # noqa: E402
from runyard.control.store import JobStore  # noqa: E402
from runyard.train import checkpoint as ckpt  # noqa: E402

# Like tests/e2e/conftest.py's TINY_SPEC but long enough to be killed mid-run (400 steps, a checkpoint
# every 5, no gate): kept here because a benchmark must not import the test suite's conftest.
TINY = {
    "name": "bench", "seed": 7,
    "data": {"sources": [{"path": "{stdlib}/json/*.py"}, {"path": "{stdlib}/email/*.py"}], "heldout_fraction": 0.1,
             "tokenizer": {"vocab_size": 512}, "shard_tokens": 16384, "workers": 1},
    "model": {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "context_length": 64},
    "optim": {"lr": 0.02}, "schedule": {"warmup_steps": 3},
    "train": {"steps": 400, "batch_size": 8},
    "stages": [{"name": "main", "gates": {"min_loss_drop": 0.0}}],
    "eval": {"interval": 1000, "batches": 1, "final_batches": 1, "prompts": ["def "], "sample_tokens": 4},
    "checkpoint": {"interval": 5, "keep_last": 2},
    "resources": {"device": "cpu", "threads": 1},
}
SLURM_NAME = "runyard-bench-sched"  # every Slurm job this benchmark submits; cancelled by this name


# -- 1. one scheduling pass, against Slurm -------------------------------------------------------------


def snapshot_queue(n_jobs: int, seed: int = 0) -> list[dict]:
    """The waiting jobs: the first needs both devices at top priority, the rest one device each."""
    rng = random.Random(seed)
    jobs = [{"devices": 2, "priority": 900, "minutes": 30}]
    jobs += [{"devices": 1, "priority": rng.randint(1, 800), "minutes": rng.choice([1, 5, 10, 30, 90, 120])}
             for _ in range(n_jobs - 1)]
    return jobs


def runyard_pass(n_jobs: int, repeats: int) -> tuple[Samples, list]:
    """Seconds per pass (read the pending jobs from SQLite + plan), and one pass's actions."""
    inventory = ["cuda:0", "cuda:1"]
    now = time.time()
    busy = make_job(0, priority=1000, state=JobState.RUNNING, allocation=["cuda:0"], started_at=now,
                    time_limit_s=3600.0)
    config = scheduler.SchedulerConfig(inventory=inventory, preemption=False, backfill=True)
    with tempfile.TemporaryDirectory() as tmp:
        store = JobStore(Path(tmp) / "control.db")
        control = ControlConfig(state_dir=Path(tmp), inventory=inventory)
        add_jobs(store, [{"name": f"q{i}", "argv": ["true"], "devices": j["devices"], "priority": j["priority"],
                          "time_limit_s": 60.0 * j["minutes"]} for i, j in enumerate(snapshot_queue(n_jobs))],
                 control, "bench")
        actions: list = []

        def one_pass() -> None:
            actions[:] = scheduler.plan(config, store.jobs([JobState.PENDING]), [busy], time.time())

        samples = interleaved({"runyard": one_pass}, repeats, progress=False)
    return samples["runyard"], actions


def slurm_available() -> bool:
    return shutil.which("sbatch") is not None and subprocess.run(
        ["sinfo", "-h"], capture_output=True, timeout=30).returncode == 0


def sdiag_backfill() -> dict[str, int]:
    text = subprocess.run(["sdiag"], capture_output=True, text=True, check=True, timeout=30).stdout
    section = text[text.index("Backfilling stats"):]
    out = {}
    for key, label in [("cycles", "Total cycles"), ("last_us", "Last cycle"), ("depth", "Last depth cycle"),
                       ("backfilled", "Total backfilled jobs (since last stats cycle start)")]:
        m = re.search(rf"^\s*{re.escape(label)}:\s*(\d+)", section, re.M)
        out[key] = int(m.group(1)) if m else 0
    return out


def slurm_pass(n_jobs: int, samples_wanted: int, between) -> tuple[Samples, list[int], int]:
    """Submit the same queue to Slurm; sample its backfill cycle (us per job considered) each cycle,
    calling `between()` (runyard's pass) after each sample so both are measured interleaved."""
    def sbatch(devices: int, priority: int, minutes: int, hold: bool) -> None:
        # Held by a start time rather than --hold: a released hold would reset the priority we set.
        cmd = ["sbatch", "--parsable", "-J", SLURM_NAME, f"--gres=gpu:{devices}", "-c", "1", f"--time={minutes}",
               f"--priority={priority}", "-o", "/dev/null", "--wrap", "sleep 3600"]
        subprocess.run(cmd + (["--begin=now+600"] if hold else []), check=True, capture_output=True, timeout=60)

    per_job, depths = Samples(), []
    try:
        sbatch(1, 1000, 60, hold=False)  # the busy job: one device, an hour
        for j in snapshot_queue(n_jobs):
            sbatch(j["devices"], j["priority"], j["minutes"], hold=True)
        ids = subprocess.run(["squeue", "-h", "-n", SLURM_NAME, "-t", "PD", "-o", "%i"], capture_output=True,
                             text=True, check=True).stdout.split()
        subprocess.run(["sdiag", "--reset"], check=True, capture_output=True)
        subprocess.run(["scontrol", "update", f"jobid={','.join(ids)}", "StartTime=now"], check=True,
                       capture_output=True)
        last = sdiag_backfill()["cycles"]
        deadline = time.monotonic() + 30 + 5 * samples_wanted
        while len(per_job.values) < samples_wanted and time.monotonic() < deadline:
            time.sleep(0.2)
            stats = sdiag_backfill()
            if stats["cycles"] > last and stats["depth"] > 0:
                last = stats["cycles"]
                per_job.values.append(stats["last_us"] / stats["depth"])
                depths.append(stats["depth"])
                between()
        backfilled = sdiag_backfill()["backfilled"]
    finally:
        subprocess.run(["scancel", "-n", SLURM_NAME], capture_output=True, timeout=60)
    if not per_job.values:
        raise RuntimeError("Slurm ran no backfill cycle within the time allowed (see `sdiag`)")
    return per_job, depths, backfilled


def bench_scheduling_vs_slurm(args, report: Report) -> None:
    print(f"== one scheduling pass: {args.jobs} waiting jobs, 2 devices (one busy), backfill on ==")
    ours_us: list[float] = []
    actions: list = []

    def runyard_once() -> None:
        samples, acts = runyard_pass(args.jobs, 1)
        ours_us.append(samples.values[0] * 1e6 / args.jobs)
        actions[:] = acts

    slurm_us, depths, backfilled = slurm_pass(args.jobs, args.repeats, runyard_once)
    ours = Samples(ours_us)
    started = [a for a in actions if isinstance(a, scheduler.Start)]  # all past the waiting top job
    print(f"  runyard (SQLite read + plan): {ours.spread()} us per job; started by backfill: "
          f"{[a.job_id for a in started]} past the waiting 2-device job")
    print(f"  Slurm {slurm_version()} sched/backfill: {slurm_us.spread()} us per job considered "
          f"(depth per cycle {min(depths)}..{max(depths)}); backfilled jobs: {backfilled}")
    report.ratio("scheduling_us_per_job_vs_slurm", paired_ratio(slurm_us, ours),
                 f"Slurm {slurm_version()} backfill cycle, same queue", ">=", 1.0,
                 {"runyard_us_per_job": ours.values, "slurm_us_per_job": slurm_us.values, "slurm_depth": depths,
                  "runyard_backfilled": len(started), "slurm_backfilled": backfilled})
    report.ratio("scheduling_backfilled_vs_slurm", Samples([len(started) / max(backfilled, 1)]),
                 f"Slurm {slurm_version()} backfill, same queue (jobs started past the waiting top job)", ">=", 1.0,
                 {"runyard": len(started), "slurm": backfilled})
    report.note("Slurm here has PreemptType=preempt/none, so the pass against Slurm runs with preemption off "
                "on both sides; the trace figures below exercise runyard's preemption.")


def slurm_version() -> str:
    out = subprocess.run(["sinfo", "--version"], capture_output=True, text=True).stdout.split()
    return out[-1] if out else "?"


# -- 2. a trace where backfill and preemption fire ------------------------------------------------------


def bench_trace(args, report: Report) -> None:
    trace = make_trace(args.trace_jobs)
    inventory = [f"cuda:{i}" for i in range(8)]
    ours_cfg = scheduler.SchedulerConfig(inventory=inventory, preemption=True, backfill=True)
    peer_cfg = scheduler.SchedulerConfig(inventory=inventory, preemption=False, backfill=False)
    print(f"== trace: {len(trace)} jobs over {trace[-1]['arrival'] / 3600:.1f} simulated hours, 8 devices ==")
    ours, peer = simulate(trace, ours_cfg), simulate(trace, peer_cfg)
    for name, r in [("runyard (backfill + preemption)", ours), ("strict priority order (peer)", peer)]:
        print(f"  {name:<32} utilisation {r['utilisation']:.3f}, top-priority mean wait {r['top_wait_s']:.0f} s, "
              f"makespan {r['makespan_s'] / 3600:.2f} h, backfilled {r['backfilled']}, preempted {r['preempted']}, "
              f"{r['decisions'] / r['plan_s']:,.0f} job decisions/s")
    if ours["backfilled"] == 0 or ours["preempted"] == 0:
        raise RuntimeError("the trace did not exercise backfill and preemption; choose another --trace-jobs")
    report.ratio("trace_utilisation_vs_strict_priority", Samples([ours["utilisation"] / peer["utilisation"]]),
                 "strict priority order, same trace", ">=", 1.0, {"runyard": ours, "peer": peer})
    report.ratio("trace_top_priority_wait_vs_strict_priority", Samples([ours["top_wait_s"] / peer["top_wait_s"]]),
                 "strict priority order, same trace", "<=", 1.0, {"runyard": ours, "peer": peer})


# -- 3. recovery ---------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for kid in _children(todo.pop()):
            out.append(kid)
            todo.append(kid)
    return out


def _wait_checkpoint(run_dir: Path, timeout_s: float = 300) -> None:
    path = run_dir / "stages" / "main" / "checkpoints"
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and len(ckpt.list_checkpoints(path)) >= 1):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no checkpoint in {path}")
        time.sleep(0.1)
    time.sleep(0.5)  # a few more steps past it


def _first_resumed_step_after(run_dir: Path, t_kill: float, timeout_s: float = 300) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            events = json.loads((run_dir / "recovery.json").read_text())["events"]
        except (FileNotFoundError, json.JSONDecodeError):
            events = []
        later = [e for e in events if e.get("recorded_at", 0) > t_kill]
        if later:
            return later[0]["recorded_at"] - t_kill
        time.sleep(0.05)
    raise TimeoutError(f"no resumed step recorded in {run_dir}/recovery.json")


def recovery_ours(spec: Path, root: Path) -> float:
    state, run_dir = root / "control", root / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    daemon = subprocess.Popen([sys.executable, "-m", "runyard", "control", "start", "--foreground", "--state-dir",
                               str(state), "--cpu-slots", "1", "--backoff", "0.1"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not (state / "daemon.json").exists():
            if daemon.poll() is not None:
                raise RuntimeError(f"the control daemon exited with {daemon.returncode}")
            time.sleep(0.05)
        client = ControlClient.for_state_dir(state)
        job = client.submit_spec(spec.read_text(), run_dir=str(run_dir.resolve()))[0]
        _wait_checkpoint(run_dir)
        shim = client.job(job["id"])["job"]["pid"]
        worker = _children(shim)[0]
        t_kill = time.time()
        os.kill(worker, signal.SIGKILL)
        took = _first_resumed_step_after(run_dir, t_kill)
        client.cancel(job["id"])
        client.wait(job["id"], timeout_s=120)
        return took
    finally:
        daemon.terminate()
        daemon.wait(30)


def recovery_torchrun(spec: Path, root: Path) -> float:
    run_dir = root / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launcher = subprocess.Popen([sys.executable, "-m", "runyard", "run", str(spec), "--run-dir", str(run_dir),
                                 "--max-restarts", "3", "--no-progress"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_checkpoint(run_dir)
        workers = [p for p in _descendants(launcher.pid)
                   if b"LOCAL_RANK=" in Path(f"/proc/{p}/environ").read_bytes()]
        t_kill = time.time()
        os.kill(workers[-1], signal.SIGKILL)
        return _first_resumed_step_after(run_dir, t_kill)
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()


def bench_recovery(args, report: Report) -> None:
    print(f"== worker SIGKILL -> first resumed training step: {args.repeats} interleaved repeats ==")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        spec = root / "spec.yaml"
        spec.write_text(yaml.safe_dump(TINY))
        counter = iter(range(10**6))

        def fresh(name: str) -> Path:
            path = root / f"{name}-{next(counter)}"
            path.mkdir()
            return path

        took: dict[str, Samples] = {"runyard control plane": Samples(), "torchrun --max-restarts": Samples()}
        runs = {"runyard control plane": lambda: recovery_ours(spec, fresh("ours")),
                "torchrun --max-restarts": lambda: recovery_torchrun(spec, fresh("torchrun"))}
        names = list(runs)
        for r in range(args.repeats):
            for name in names if r % 2 == 0 else names[::-1]:
                took[name].values.append(runs[name]())
            print(f"  round {r + 1}/{args.repeats}: " + ", ".join(f"{n} {took[n].values[-1]:.2f}s" for n in names),
                  file=sys.stderr, flush=True)
    for name, s in took.items():
        print(f"  {name:<26} {s.spread()} s")
    report.ratio("recovery_time_vs_torchrun", paired_ratio(took["runyard control plane"],
                                                           took["torchrun --max-restarts"]),
                 "torchrun --max-restarts alone", "<=", 1.5,
                 {name: s.values for name, s in took.items()})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=500, help="waiting jobs in the pass against Slurm (default 500)")
    parser.add_argument("--trace-jobs", type=int, default=400, help="jobs in the simulated trace (default 400)")
    parser.add_argument("--skip-slurm", action="store_true", help="leave out the pass against Slurm")
    parser.add_argument("--skip-recovery", action="store_true", help="leave out the recovery figure")
    add_common_args(parser, repeats=3)
    args = parser.parse_args(argv)
    report = Report("control", args)
    if args.skip_slurm or not slurm_available():
        if not args.skip_slurm:
            report.note("Slurm is not installed or not answering here: the pass against Slurm is left out")
        samples, _ = runyard_pass(args.jobs, args.repeats)
        print(f"runyard pass, {args.jobs} waiting jobs: {Samples([v * 1e6 / args.jobs for v in samples.values]).spread()} "
              "us per job")
    else:
        bench_scheduling_vs_slurm(args, report)
    bench_trace(args, report)
    if not args.skip_recovery:
        bench_recovery(args, report)
    return report.finish()


if __name__ == "__main__":
    sys.exit(main())
