"""The control plane running the spine's real `runyard run`: a preempted run checkpoints, queues
again and resumes to bitwise the same final weights as a run never preempted; a staged spec
submitted as linked jobs stops before the larger stage when the smoke stage's gate fails."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from runyard.control.client import ControlClient
from runyard.system.processes import popen_dying_with_me
from runyard.train import checkpoint as ckpt

from .conftest import REFERENCE_STEPS as STEPS
from .conftest import TINY_SPEC, merge, runyard

pytestmark = pytest.mark.slow


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    ref = ckpt.latest_good(run_dir / "stages" / "main" / "checkpoints")
    assert ref is not None and ref.step == STEPS
    return ckpt.read_checkpoint(ref.path)[0]["model"]


@pytest.fixture
def control(tmp_path):
    state = tmp_path / "control"
    with open(tmp_path / "daemon.log", "wb") as log:
        proc = popen_dying_with_me(
            [sys.executable, "-m", "runyard", "control", "start", "--foreground", "--state-dir", str(state),
             "--cpu-slots", "1", "--stop-grace", "60", "--allow-argv"],  # the urgent job below is a raw command
            env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=log, stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 20
    while not (state / "daemon.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "daemon.log").read_text()
        time.sleep(0.05)
    yield state, ControlClient.for_state_dir(state)
    proc.send_signal(signal.SIGTERM)
    proc.wait(20)


def test_preempted_run_resumes_to_the_same_weights(tmp_path, control, reference_run):
    state, client = control
    spec, reference = reference_run.spec, reference_run.run_dir  # the session's run, never preempted

    run_dir = tmp_path / "preempted"
    out = runyard("submit", str(spec), "--state-dir", str(state), "--run-dir", str(run_dir), "--priority", "0",
                  check=True)
    low_id = int(out.stdout.split()[1])
    ckpts = run_dir / "stages" / "main" / "checkpoints"
    deadline = time.monotonic() + 240
    while not (ckpts.exists() and ckpt.list_checkpoints(ckpts)):
        assert time.monotonic() < deadline and client.job(low_id)["job"]["state"] in ("pending", "starting", "running")
        time.sleep(0.2)
    high = client.submit([{"name": "urgent", "argv": [sys.executable, "-c", "print('urgent work')"], "priority": 10}])
    assert client.wait(high[0]["id"], timeout_s=120)["state"] == "succeeded"
    final = client.wait(low_id, timeout_s=300, poll_s=0.5)
    assert final["state"] == "succeeded", client.logs(low_id)["text"][-3000:]
    assert final["restart_count"] == 1
    states = [h["to_state"] for h in client.job(low_id)["history"]]
    assert states == ["pending", "starting", "running", "preempted", "pending", "starting", "running", "succeeded"]
    assert "checkpointed and exited 4" in client.job(low_id)["history"][4]["reason"]
    expected, got = final_weights(reference), final_weights(run_dir)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected), "resumed weights differ from the reference"
    assert (run_dir / "eval" / "report.md").exists()


def test_staged_submission_stops_after_a_failed_smoke_gate(tmp_path, control):
    state, client = control
    spec = tmp_path / "staged.yaml"
    spec.write_text(yaml.safe_dump(merge(TINY_SPEC, {
        "train": {"steps": 6},
        "stages": [{"name": "smoke", "gates": {"min_loss_drop": 0.99}}, {"name": "full"}],
        "resources": {"nproc": 1},
    })))
    out = runyard("submit", str(spec), "--state-dir", str(state), "--staged", check=True)
    ids = [int(line.split()[1]) for line in out.stdout.splitlines()]
    assert len(ids) == 2 and f"after job {ids[0]}" in out.stdout
    smoke = client.wait(ids[0], timeout_s=240, poll_s=0.5)
    assert smoke["state"] == "failed" and smoke["failure"] == "gate_failed" and smoke["attempt"] == 1
    assert "--stage" in smoke["argv"] and "smoke" in smoke["argv"]
    full = client.wait(ids[1], timeout_s=30)
    assert full["state"] == "failed" and full["failure"] == "dependency_failed" and full["attempt"] == 0
    assert not (Path(smoke["run_dir"]) / "stages" / "full").exists()
