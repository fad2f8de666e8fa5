"""Distributed training through the real command line: torchrun workers on CPU with gloo, the tiny spec.

- DDP and FSDP on 2 processes give the loss of 1 process with the same global batch at each of 20 steps
  (fp32; relative tolerance 1e-5: only the order of floating-point sums differs).
- SIGKILL of one worker mid-run with --max-restarts 1: the job restarts, resumes from the last good
  checkpoint, and ends bitwise equal to an uninterrupted run (dropout on: per-rank RNG is restored).
- SIGTERM: checkpoint and exit 4; resumes onto 1 -> 2 -> 3 -> 1 processes (one with a truncated shard in
  its newest checkpoint, which falls back to the previous one) follow the uninterrupted loss curve.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from runyard.errors import EXIT_PREEMPTED
from runyard.system.processes import popen_dying_with_me
from runyard.train import checkpoint as ckpt

from .conftest import TINY_SPEC, merge, runyard

# One worker runs the module: its tests compare against one uninterrupted run (a module fixture).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("e2e_distributed")]

STEPS = 20
# Global batch 24 sequences: batch 2 x 12 micro-batches on 1 process, x 6 on 2, x 4 on 3 (resumes keep it).
ELASTIC = {
    "model": {"dropout": 0.0},
    "train": {"steps": STEPS, "batch_size": 2, "grad_accum": 12},
    "checkpoint": {"interval": 3, "keep_last": 3},
    "eval": {"interval": 100},
    "resources": {"parallel": "fsdp"},
}
LOSS_RTOL = 1e-5


def write(tmp: Path, name: str, patch: dict) -> Path:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(merge(TINY_SPEC, patch)))
    return path


def losses(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "stages/main/metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows]


def assert_same_curve(a: list[tuple[int, float]], b: list[tuple[int, float]], rtol: float = LOSS_RTOL) -> None:
    assert [s for s, _ in a] == [s for s, _ in b] == list(range(1, STEPS + 1))
    for (step, la), (_, lb) in zip(a, b, strict=True):
        assert la == pytest.approx(lb, rel=rtol), f"step {step}: {la} vs {lb}"


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    ref = ckpt.latest_good(run_dir / "stages/main/checkpoints")
    assert ref is not None and ref.step == STEPS
    return ckpt.read_checkpoint(ref.path)[0]["model"]


def train(spec: Path, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return runyard("train", str(spec), "--run-dir", str(run_dir), "--no-progress", *extra, check=True)


def start(*args: str) -> subprocess.Popen:
    return popen_dying_with_me(
        [sys.executable, "-m", "runyard", *args, "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    metrics = run_dir / "stages/main/metrics.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= step:
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended early with {proc.returncode}: {proc.stderr.read()}")
        time.sleep(0.02)
    raise AssertionError(f"run did not reach step {step} in time")


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return sorted(out)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The uninterrupted single-process run every distributed run is compared with."""
    tmp = tmp_path_factory.mktemp("one")
    spec = write(tmp, "elastic", ELASTIC)
    train(spec, tmp / "run")
    return spec, tmp / "run"


@pytest.mark.parametrize("parallel", ["ddp", pytest.param("fsdp", marks=pytest.mark.full)])  # fsdp also below
def test_two_processes_match_one_process_at_every_step(one_process, tmp_path, parallel):
    _spec, ref_dir = one_process
    # Same global batch: 2 ranks x 6 micro-batches of 2 (accumulation exercises no_sync / no reduce).
    spec = write(tmp_path, parallel, merge(ELASTIC, {"train": {"grad_accum": 6}, "resources": {"parallel": parallel}}))
    run_dir = tmp_path / "run"
    proc = train(spec, run_dir, "--nproc", "2")
    assert_same_curve(losses(run_dir), losses(ref_dir))
    assert proc.stdout.count("run directory") == 1, "only rank 0 prints the summary"
    stalls = [json.loads(line) for line in (run_dir / "stages/main/checkpoints.jsonl").read_text().splitlines()]
    assert {r["mode"] for r in stalls} == {"async-sharded"} and all(r["stall_s"] >= 0 for r in stalls)
    newest = ckpt.latest_good(run_dir / "stages/main/checkpoints")
    assert sorted(p.name for p in (newest.path / "dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    # Weights: Adam's normalised update amplifies summation-order differences of near-zero gradients, so
    # after 20 steps they agree to ~1e-5 absolute (weights ~0.2), not to the loss's 1e-5 relative.
    ref_w, w = final_weights(ref_dir), final_weights(run_dir)
    for name in ref_w:
        assert torch.allclose(ref_w[name], w[name], rtol=0, atol=1e-4), name


@pytest.mark.full  # fast tier: kill_anywhere kills a training process again and again and resumes bitwise
def test_killed_worker_restarts_and_ends_bitwise_equal(tmp_path):
    patch = {"model": {"dropout": 0.1}, "train": {"steps": STEPS, "batch_size": 4, "grad_accum": 3},
             "checkpoint": {"interval": 4},
             "eval": {"interval": 100}}
    spec = write(tmp_path, "kill", patch)
    reference = tmp_path / "reference"
    train(spec, reference, "--nproc", "2")

    run_dir = tmp_path / "run"
    proc = start("train", str(spec), "--run-dir", str(run_dir), "--nproc", "2", "--max-restarts", "1")
    # A random step after the first checkpoint is committed (steps are fast; commits are asynchronous).
    deadline = time.time() + 180
    while not ckpt.list_checkpoints(run_dir / "stages/main/checkpoints") and time.time() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.02)
    done = len((run_dir / "stages/main/metrics.jsonl").read_text().splitlines())
    wait_for_step(run_dir, done + random.Random().randint(0, 3), proc)
    (torchrun,) = children(proc.pid)
    victim = random.Random().choice(children(torchrun))
    os.kill(victim, signal.SIGKILL)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    assert "worker failure(s), recovered" in err

    events = json.loads((run_dir / "recovery.json").read_text())["events"]
    (event,) = [e for e in events if e["kind"] == "restart"]
    assert event["resumed_from_step"] % 4 == 0 and event["resumed_from_step"] <= event["last_step_before_interruption"]
    assert event["steps_lost"] == event["last_step_before_interruption"] - event["resumed_from_step"]
    assert event["seconds_to_first_resumed_step"] > 0
    failures = json.loads((run_dir / "failures.json").read_text())["launches"][-1]["failures"]
    assert failures[0]["attempt"] == 0 and any("signal" in r["error"] for r in failures[0]["failed_ranks"])

    assert losses(run_dir) == losses(reference)
    expected, got = final_weights(reference), final_weights(run_dir)
    for name in expected:
        assert torch.equal(expected[name], got[name]), f"{name} differs after the restart"


def stop_with_sigterm(spec: Path, run_dir: Path, nproc: int, after_step: int, verb: str = "train") -> int:
    args = ["train", str(spec), "--run-dir", str(run_dir)] if verb == "train" else ["resume", str(run_dir)]
    proc = start(*args, "--nproc", str(nproc))
    wait_for_step(run_dir, after_step, proc)
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err
    assert "stopped by SIGTERM" in err
    stopped = ckpt.list_checkpoints(run_dir / "stages/main/checkpoints")[-1].step
    assert after_step <= stopped < STEPS
    return stopped


@pytest.mark.full  # fast tier: a resume onto another layout (test_tensor_parallel, one process -> TP)
def test_sigterm_and_resumes_onto_other_world_sizes_follow_the_same_curve(one_process, tmp_path):
    spec, ref_dir = one_process
    run_dir = tmp_path / "run"
    first = stop_with_sigterm(spec, run_dir, 1, 3)
    second = stop_with_sigterm(spec, run_dir, 2, first + 3, verb="resume")  # 1 -> 2
    # The newest checkpoint loses the end of a shard: the 2 -> 3 resume must fall back to the one before.
    newest = ckpt.list_checkpoints(run_dir / "stages/main/checkpoints")[-1]
    shard = newest.path / "dcp" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-64])
    third = stop_with_sigterm(spec, run_dir, 3, second + 3, verb="resume")  # 2 -> 3
    resumed = runyard("resume", str(run_dir), "--no-progress", "--nproc", "1", check=True)  # 3 -> 1
    assert third < STEPS and "run directory" in resumed.stdout

    assert_same_curve(losses(run_dir), losses(ref_dir), rtol=1e-4)
    events = json.loads((run_dir / "recovery.json").read_text())["events"]
    assert [e["world_size"] for e in events] == [2, 3, 1]
    assert events[1]["resumed_from_step"] < second, "fell back past the truncated checkpoint"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert [s["world_size"] for s in manifest["sessions"]] == [1, 2, 3, 1]
    expected, got = final_weights(ref_dir), final_weights(run_dir)
    for name in expected:
        assert torch.allclose(expected[name], got[name], rtol=0, atol=1e-4), name
