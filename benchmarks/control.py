"""Control-plane figures, each printed beside a named peer measured in the same run.

1. Scheduling decisions per second with 1,000 queued jobs on the embedded scheduler: one control
   loop tick reads the queue from SQLite and decides for every queued job (priority, gang, backfill,
   quotas, preemption) while all devices are busy. Peer: a bare `heapq` priority queue that only
   pops by priority and checks one device count (none of our rules, no state file).
2. Time from a worker's death (SIGKILL) to its job's first resumed training step, for a tiny real
   `runyard run`: restarted by our control plane (it sees the death, classifies it as infra,
   relaunches after its backoff, the run resumes from its last good checkpoint), beside the same job
   restarted by `torchrun --max-restarts` alone. The ratio shows what our recovery adds.

    .venv/bin/python benchmarks/control.py [--jobs 1000] [--skip-recovery]
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from runyard.control import procs  # noqa: E402
from runyard.control.backends.local import LocalBackend  # noqa: E402
from runyard.control.jobs import add_jobs  # noqa: E402
from runyard.control.loop import ControlConfig, ControlLoop  # noqa: E402
from runyard.control.store import JobStore  # noqa: E402

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


# -- 1. scheduling decisions ---------------------------------------------------------------------


def bench_scheduling(n_jobs: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        config = ControlConfig(state_dir=Path(tmp), inventory=[f"cuda:{i}" for i in range(8)],
                               tenant_quotas={"t3": 4})
        store = JobStore(Path(tmp) / "control.db")
        loop = ControlLoop(config, store, LocalBackend(procs.instance_id(tmp)))
        sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
        # Fill every device with top-priority work (it cannot be preempted), then queue n_jobs.
        add_jobs(store, [{"name": "busy", "argv": sleeper, "devices": 2, "priority": 1000}] * 4, config, "bench")
        loop.tick()
        queued = [{"name": f"q{i}", "argv": ["true"], "devices": 1 + i % 4, "priority": i % 7,
                   "tenant": f"t{i % 5}", "time_limit_s": 60.0 * (1 + i % 9)} for i in range(n_jobs)]
        add_jobs(store, queued, config, "bench")
        try:
            loop.tick()  # warm
            t0 = time.perf_counter()
            for _ in range(rounds):
                loop.tick()
            ours = (time.perf_counter() - t0) / rounds
        finally:
            for job in store.jobs():
                procs.kill_job_processes(loop.instance, job.id)
        assert len(store.jobs(["pending"])) == n_jobs, "nothing should have started: all devices are busy"

    # Peer: a priority queue of (priority, seq) with one free-device check per pop.
    jobs = [(-(i % 7), i, 1 + i % 4) for i in range(n_jobs)]
    t0 = time.perf_counter()
    for _ in range(rounds):
        heap = list(jobs)
        heapq.heapify(heap)
        free = 0
        while heap:
            _, _, devices = heapq.heappop(heap)
            if devices <= free:
                free -= devices
    peer = (time.perf_counter() - t0) / rounds
    print(f"scheduling, {n_jobs} queued jobs, 8 busy devices:")
    print(f"  runyard control-loop tick (SQLite + all rules): {ours * 1e3:8.2f} ms/round = "
          f"{n_jobs / ours:>10,.0f} job decisions/s")
    print(f"  peer: bare heapq priority queue (no rules, no state): {peer * 1e3:8.2f} ms/round = "
          f"{n_jobs / peer:>10,.0f} job decisions/s")
    print(f"  ratio runyard/peer time per round: {ours / peer:.1f}x")


# -- 2. recovery ---------------------------------------------------------------------------------


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
    from runyard.train import checkpoint as ckpt

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
    state, run_dir = root / "control", root / "ours"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    daemon = subprocess.Popen([sys.executable, "-m", "runyard", "control", "start", "--foreground", "--state-dir",
                               str(state), "--cpu-slots", "1", "--backoff", "0.1"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not (state / "daemon.json").exists():
            time.sleep(0.05)
        from runyard.control.client import ControlClient

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
    run_dir = root / "torchrun"
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


def bench_recovery() -> None:
    import yaml

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        spec = root / "spec.yaml"
        spec.write_text(yaml.safe_dump(TINY))
        peer = recovery_torchrun(spec, root)
        ours = recovery_ours(spec, root)
    print("worker SIGKILL -> first resumed training step (tiny CPU run, resumes from its last checkpoint):")
    print(f"  runyard control plane (detect, classify infra, backoff 0.1 s, relaunch): {ours:6.2f} s")
    print(f"  peer: torchrun --max-restarts alone:                                    {peer:6.2f} s")
    print(f"  ratio runyard/torchrun: {ours / peer:.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1000, help="queued jobs (default 1000)")
    parser.add_argument("--rounds", type=int, default=20, help="scheduling rounds to time (default 20)")
    parser.add_argument("--skip-recovery", action="store_true", help="only the scheduling figure")
    args = parser.parse_args()
    bench_scheduling(args.jobs, args.rounds)
    if not args.skip_recovery:
        bench_recovery()
    return 0


if __name__ == "__main__":
    sys.exit(main())
