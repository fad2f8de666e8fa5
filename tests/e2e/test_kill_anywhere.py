"""Issue 10: kill -9 anywhere. Real `runyard` processes on the tiny spec, killed at seeded random
moments (RUNYARD_FAULT_SEED), each outcome checked against an uninterrupted run: bitwise-identical
final weights and export on CPU, the same loss at every step, no hang (every wait is bounded and
fails the test when it runs out), and no process of the test left alive afterwards (tests/e2e/faults.py).

The five reported failures each have a test here: a hang after the main process dies in the data
stage (also tests/data/test_kill_safety.py), a stale export from a damaged final checkpoint, a
throughput gate measured as 0 after a resume, orphaned workers and two writers in one run directory,
and the leftovers (temporary files, recovery figures before the first checkpoint, launcher folders).
The fault-injection runs kill the main process alone, torchrun alone, or the whole tree, in the data
stage, in training with one and two processes, and under the control plane. (A killed torchrun under
the control plane is `infra` because the launcher then exits 128 + the signal, tested here, and the
control plane files every exit >= 128 as `infra`, tested in tests/control.)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from runyard.control.client import ControlClient
from runyard.train import checkpoint as ckpt

from .conftest import TINY_SPEC, merge, runyard
from .faults import ProcessTree, children, fault_rng, finish, wait_until

# One worker runs the module: its tests compare against the module's reference runs. The fast tier keeps one
# instance of each property (a kill in the data stage, one in training, one under the control plane, the
# damaged checkpoint, the gates, one writer, the recovery record); the full tier adds the whole tree killed
# in the data stage and the two-process runs (torchrun killed alone, the launcher, the tree).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("e2e_kill_anywhere")]

STEPS = 24
PATCH = {
    "train": {"steps": STEPS},
    "checkpoint": {"interval": 4, "keep_last": 2},
    "stages": [{"name": "main", "gates": {"min_loss_drop": 0.05, "min_tokens_per_s": 1.0}}],
    # Over 1 MiB of sources: more than one clean and tokenize part, so two workers really run (one part is
    # cleaned in the main process and no pool starts).
    "data": {"workers": 2, "sources": [{"path": "{stdlib}/json/*.py"}, {"path": "{stdlib}/email/*.py"},
                                       {"path": "{stdlib}/asyncio/*.py"}, {"path": "{stdlib}/logging/*.py"}]},
}
# Two processes: the same global batch (2 ranks x 4 sequences) and dropout on (per-rank RNG restored).
TWO = {"train": {"batch_size": 4}, "resources": {"nproc": 2}}
RUN_TIMEOUT = 240


def metrics_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "stages/main/metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in metrics_rows(run_dir)]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    ref = ckpt.latest_good(run_dir / "stages/main/checkpoints")
    assert ref is not None and ref.step == STEPS, f"final checkpoint missing in {run_dir}"
    return ckpt.read_checkpoint(ref.path)[0]["model"]


def assert_same_run(run_dir: Path, reference: Path, export: bool = True) -> None:
    assert losses(run_dir) == losses(reference), "the same loss at every step"
    expected, got = final_weights(reference), final_weights(run_dir)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), f"{name} differs from the uninterrupted run"
    if export:
        a = load_file(str(reference / "export/model.safetensors"))
        b = load_file(str(run_dir / "export/model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "export differs"


def steps_done(run_dir: Path) -> int:
    return len(metrics_rows(run_dir))


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("spec") / "spec.yaml"
    path.write_text(yaml.safe_dump(merge(TINY_SPEC, PATCH)))
    return path


@pytest.fixture(scope="module")
def spec_two(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("spec2") / "spec.yaml"
    path.write_text(yaml.safe_dump(merge(merge(TINY_SPEC, PATCH), TWO)))
    return path


@pytest.fixture(scope="module")
def reference(spec, tmp_path_factory) -> Path:
    """The uninterrupted one-process run."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    runyard("run", str(spec), "--run-dir", str(run_dir), "--no-progress", check=True, timeout=RUN_TIMEOUT)
    return run_dir


@pytest.fixture(scope="module")
def reference_two(spec_two, tmp_path_factory) -> Path:
    """The uninterrupted two-process run."""
    run_dir = tmp_path_factory.mktemp("reference2") / "run"
    runyard("run", str(spec_two), "--run-dir", str(run_dir), "--no-progress", check=True, timeout=RUN_TIMEOUT)
    return run_dir


@pytest.fixture
def tree():
    t = ProcessTree()
    yield t
    t.assert_none_left(timeout=20)


def resume(run_dir: Path, *extra: str, env: dict | None = None) -> str:
    proc = runyard("resume", str(run_dir), "--no-progress", *extra, timeout=RUN_TIMEOUT, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


# -- 10.2: a stage's result is its final checkpoint -------------------------------------------------------
def test_a_damaged_final_checkpoint_is_retrained_never_exported_stale(reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    final = ckpt.list_checkpoints(run_dir / "stages/main/checkpoints")[-1]
    assert final.step == STEPS
    model_file = final.path / "model.safetensors"
    data = bytearray(model_file.read_bytes())
    data[-100] ^= 0xFF
    model_file.write_bytes(bytes(data))
    out = " ".join(resume(run_dir).split())  # log lines may be wrapped
    assert f"final checkpoint (step {STEPS})" in out and "retrain" in out
    assert_same_run(run_dir, reference)


# -- 10.3: gates computed from what was recorded ---------------------------------------------------------
@pytest.mark.full  # a kill point; fast tier: the damaged final checkpoint and kills in training and prepare
def test_a_kill_between_the_final_checkpoint_and_the_gates_resumes_to_the_same_gates(reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    # The state a kill leaves after the final checkpoint and before gates.json (or a SIGTERM in the last
    # step, which checkpoints the final step and exits): nothing after the checkpoint was written.
    (run_dir / "stages/main/gates.json").unlink()
    shutil.rmtree(run_dir / "eval")
    shutil.rmtree(run_dir / "export")
    resume(run_dir)
    gates = json.loads((run_dir / "stages/main/gates.json").read_text())
    assert gates == json.loads((reference / "stages/main/gates.json").read_text())
    throughput = next(g for g in gates["gates"] if g["name"] == "throughput")
    assert throughput["passed"] and throughput["value"] > 1.0
    assert_same_run(run_dir, reference)


# -- 10.4: one writer per run directory; readers say the run is live --------------------------------------
def test_a_second_writer_is_refused_and_readers_say_the_run_is_live(spec, reference, tmp_path, tree):
    run_dir = tmp_path / "run"
    first = tree.runyard("run", str(spec), "--run-dir", str(run_dir), "--no-progress", log=tmp_path / "first.log")
    wait_until(lambda: steps_done(run_dir) >= 1, RUN_TIMEOUT, "the first run to train", proc=first, poll=0.002)
    first.send_signal(signal.SIGSTOP)  # a live writer, held mid-run while the others try (steps take ms)
    for args in (["run", str(spec), "--run-dir", str(run_dir)], ["resume", str(run_dir)]):
        second = runyard(*args, "--no-progress", timeout=60)
        assert second.returncode == 1, second.stderr
        assert f"pid {first.pid}" in second.stderr and "being written by" in second.stderr, second.stderr
    show = runyard("show", str(run_dir), timeout=60)
    assert show.returncode == 0 and f"is live (written by pid {first.pid}" in " ".join(show.stderr.split())
    first.send_signal(signal.SIGCONT)
    assert finish(first, RUN_TIMEOUT) == 0, (tmp_path / "first.log").read_text()[-3000:]
    assert_same_run(run_dir, reference)  # nothing interleaved in metrics.jsonl, no checkpoint saved twice
    show = runyard("show", str(run_dir), timeout=60)
    assert "is live" not in show.stderr


# -- 10.5: leftovers -------------------------------------------------------------------------------------
@pytest.mark.full  # a kill point; fast tier: kills in training again and again, and in prepare
def test_a_kill_before_the_first_checkpoint_is_recorded_and_resumes_bitwise(reference, tmp_path, tree):
    # The first checkpoint at step 16 (saving a checkpoint changes no weight or random stream).
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(merge(merge(TINY_SPEC, PATCH), {"checkpoint": {"interval": 16}})))
    run_dir = tmp_path / "run"
    proc = tree.runyard("run", str(spec), "--run-dir", str(run_dir), "--no-progress", log=tmp_path / "run.log")
    wait_until(lambda: steps_done(run_dir) >= 2, RUN_TIMEOUT, "two steps", proc=proc, poll=0.002)
    assert not ckpt.list_checkpoints(run_dir / "stages/main/checkpoints")
    lost = steps_done(run_dir)
    proc.send_signal(signal.SIGKILL)
    finish(proc, 30)
    resume(run_dir)
    (event,) = json.loads((run_dir / "recovery.json").read_text())["events"]
    assert event["resumed_from_step"] == 0 and event["last_step_before_interruption"] >= lost
    assert event["steps_lost"] == event["last_step_before_interruption"]
    assert event["seconds_to_first_resumed_step"] > 0
    assert_same_run(run_dir, reference)


# -- the fault-injection suite: random moments, main process alone or the whole tree ----------------------
@pytest.mark.parametrize("victim", ["main", pytest.param("tree", marks=pytest.mark.full)])
def test_killed_in_prepare_then_rerun_is_bitwise_identical(spec, reference, tmp_path, tree, victim):
    rng = fault_rng(f"prepare-{victim}")
    run_dir = tmp_path / "run"
    env = tree.env(RUNYARD_CACHE_DIR=str(tmp_path / "cache"))  # a cold cache: the data stage really runs
    proc = tree.start([sys.executable, "-m", "runyard", "run", str(spec), "--run-dir", str(run_dir),
                       "--no-progress"], env=env, log=tmp_path / "first.log")
    # A moment in the data stage: clean workers, tokenizer training, tokenization, shard and index writes.
    report = run_dir / "data" / "report.json"
    delay = rng.uniform(0.3, 3.0)
    with contextlib.suppress(subprocess.TimeoutExpired):  # still running after the delay, as wanted
        proc.wait(delay)
    if victim == "main":
        os.kill(proc.pid, signal.SIGKILL)
    else:
        tree.kill_all()
    proc.wait(30)
    in_prepare = not report.exists()
    tree.assert_none_left(timeout=15)
    again = runyard("run", str(spec), "--run-dir", str(run_dir), "--no-progress", timeout=RUN_TIMEOUT,
                    env={"RUNYARD_CACHE_DIR": str(tmp_path / "cache")})
    assert again.returncode == 0, again.stderr[-3000:]
    assert_same_run(run_dir, reference)
    print(f"killed after {delay:.2f}s, {'in' if in_prepare else 'after'} the data stage")


def kill_at(tree: ProcessTree, proc, run_dir: Path, step: int, victim: str) -> int:
    """Wait for `step` to be logged, then kill `victim`: "main" (the process the test started, alone),
    "torchrun" (the launcher's child alone) or "tree" (every process of the test). Then check that no
    process of the test is left. Returns the main process's exit code."""
    wait_until(lambda: steps_done(run_dir) >= step, RUN_TIMEOUT, f"step {step}", proc=proc, poll=0.002)
    if victim == "main":
        proc.send_signal(signal.SIGKILL)
    elif victim == "torchrun":
        (torchrun,) = children(proc.pid)
        assert len(children(torchrun)) == 2
        os.kill(torchrun, signal.SIGKILL)
    else:
        tree.kill_all()
    code = finish(proc, 60)
    tree.assert_none_left(timeout=15)  # nothing trains on beside the next writer
    return code


def test_one_process_killed_in_training_again_and_again_ends_bitwise_identical(spec, reference, tmp_path, tree):
    rng = fault_rng("train-one")
    run_dir = tmp_path / "run"
    proc = tree.runyard("run", str(spec), "--run-dir", str(run_dir), "--no-progress", log=tmp_path / "1.log")
    kill_at(tree, proc, run_dir, rng.randint(1, 8), "main")
    proc = tree.runyard("resume", str(run_dir), "--no-progress", log=tmp_path / "2.log")
    kill_at(tree, proc, run_dir, rng.randint(13, 19), "tree")
    resume(run_dir)
    assert_same_run(run_dir, reference)


@pytest.mark.full
def test_two_processes_killed_in_training_again_and_again_end_bitwise_identical(spec_two, reference_two, tmp_path,
                                                                                 tree):
    rng = fault_rng("train-two")
    run_dir = tmp_path / "run"
    tmp = tmp_path / "tmp"  # the launchers' temporary directory, to check that they leave nothing there
    tmp.mkdir()
    env = tree.env(TMPDIR=str(tmp))

    def start(*args: str, log: str) -> subprocess.Popen:
        return tree.start([sys.executable, "-m", "runyard", *args, "--no-progress"], env=env, log=tmp_path / log)

    proc = start("run", str(spec_two), "--run-dir", str(run_dir), log="1.log")
    code = kill_at(tree, proc, run_dir, rng.randint(1, 6), "torchrun")
    assert code >= 128, f"a killed torchrun is an infrastructure failure (exit >= 128), got {code}"
    assert "torchrun was killed by SIGKILL" in (tmp_path / "1.log").read_text()
    proc = start("resume", str(run_dir), log="2.log")
    kill_at(tree, proc, run_dir, rng.randint(9, 14), "main")  # the launcher alone: torchrun and workers follow
    proc = start("resume", str(run_dir), log="3.log")
    kill_at(tree, proc, run_dir, rng.randint(17, 20), "tree")
    assert any(p.name.startswith("runyard-launch-") for p in tmp.iterdir()), "killed launchers left theirs"
    resume(run_dir, env={"TMPDIR": str(tmp)})
    assert_same_run(run_dir, reference_two)
    assert [p.name for p in tmp.iterdir() if p.name.startswith("runyard-launch-")] == []


# -- under the control plane ------------------------------------------------------------------------------
@pytest.fixture
def control(tmp_path, tree):
    """control(**env) -> (state dir, client) of a real daemon with two CPU slots, started in the test's
    process tree (so its jobs' processes are checked for orphans too)."""
    daemons = []

    def start(**env: str):
        state = tmp_path / f"control{len(daemons)}"
        proc = tree.start([sys.executable, "-m", "runyard", "control", "start", "--foreground", "--state-dir",
                           str(state), "--cpu-slots", "2", "--backoff", "0.1"],
                          env=tree.env(**env), log=tmp_path / f"daemon{len(daemons)}.log")
        daemons.append(proc)
        wait_until(lambda: (state / "daemon.json").exists(), 60, "the daemon to listen", proc=proc)
        return state, ControlClient.for_state_dir(state)

    yield start
    for proc in daemons:
        proc.send_signal(signal.SIGTERM)
        finish(proc, 30)


def submit(state: Path, spec: Path, run_dir: Path) -> int:
    out = runyard("submit", str(spec), "--state-dir", str(state), "--run-dir", str(run_dir), check=True, timeout=60)
    return int(out.stdout.split()[1])


def launcher_of(client: ControlClient, job_id: int) -> int:
    """The job's `runyard` process: the only child of the shim the daemon launched."""
    shim = wait_until(lambda: client.job(job_id)["job"].get("pid"), 60, "the job to be launched")
    (launcher,) = wait_until(lambda: children(shim), 60, "the shim to start the job")
    return launcher


def assert_retried_as_infra(client: ControlClient, job_id: int) -> None:
    final = client.wait(job_id, timeout_s=RUN_TIMEOUT, poll_s=0.5)
    assert final["state"] == "succeeded", client.logs(job_id)["text"][-3000:]
    history = client.job(job_id)["history"]
    retried = [h for h in history if h["to_state"] == "recovering"]
    assert len(retried) == 1 and retried[0]["reason"].startswith("infra"), history


def test_under_the_control_plane_a_main_process_killed_in_prepare_never_hangs_the_retry(
        spec, reference, tmp_path, control):
    state, client = control(RUNYARD_CACHE_DIR=str(tmp_path / "cache"))  # cold: the data stage runs
    run_dir = tmp_path / "run"
    job_id = submit(state, spec, run_dir)
    launcher = launcher_of(client, job_id)
    wait_until(lambda: children(launcher), 120, "the clean step's worker pool", poll=0.002)
    os.kill(launcher, signal.SIGKILL)  # the main process alone, with its data workers running
    assert_retried_as_infra(client, job_id)
    assert_same_run(run_dir, reference)
