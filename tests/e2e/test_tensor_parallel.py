"""Tensor parallel (resources.parallel: {tp: 2}) through the real command line: two torchrun workers on CPU
with gloo split every block by the decoder family's plan (Q/K/V and gate/up column-wise, the attention
output and down projection row-wise, through DTensor's parallelize_module). Per-step losses and held-out
losses equal the one-process run within fp32 tolerance, the stage's gates pass (its checkpoint reloads
bitwise as the consolidated model), and the checkpoint's whole weights are in the model's own order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from runyard.train import checkpoint as ckpt

from .conftest import TINY_SPEC, merge, runyard

pytestmark = pytest.mark.slow

STEPS = 6
SPEC = {
    "model": {"dropout": 0.0},
    "train": {"steps": STEPS, "batch_size": 4},
    "stages": [{"name": "main", "gates": {"min_loss_drop": None}}],
    "eval": {"interval": 3},
    "checkpoint": {"interval": 3, "keep_last": 2},
}


def run(tmp: Path, name: str, patch: dict, *extra: str) -> Path:
    spec = tmp / f"{name}.yaml"
    spec.write_text(yaml.safe_dump(merge(merge(TINY_SPEC, SPEC), patch)))
    runyard("train", str(spec), "--run-dir", str(tmp / name), "--no-progress", *extra, check=True, timeout=400)
    return tmp / name


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "stages/main/metrics.jsonl").read_text().splitlines()]


def test_two_tensor_parallel_processes_match_one_process(tmp_path):
    one = run(tmp_path, "one", {})
    tp = run(tmp_path, "tp", {"resources": {"parallel": {"tp": 2}}}, "--nproc", "2")
    a, b = rows(one), rows(tp)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    for ra, rb in zip(a, b, strict=True):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5), ra["step"]
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-4), ra["step"]
        if "heldout_loss" in ra:
            assert rb["heldout_loss"] == pytest.approx(ra["heldout_loss"], rel=1e-5)
    gates = json.loads((tp / "stages/main/gates.json").read_text())
    assert gates["passed"], gates
    w1 = ckpt.read_model_weights(ckpt.latest_good(one / "stages/main/checkpoints").path)
    w2 = ckpt.read_model_weights(ckpt.latest_good(tp / "stages/main/checkpoints").path)
    assert w1.keys() == w2.keys()
    for name in w1:
        assert torch.allclose(w1[name], w2[name], rtol=0, atol=1e-4), name


def test_a_tensor_parallel_run_stopped_by_sigterm_resumes_on_the_same_curve(tmp_path):
    """SIGTERM mid-run: every rank checkpoints its shards (fused rows rank by rank) and exits 4; `resume`
    under the same layout loads them and the curve continues the one-process run's (here with every
    block recomputed in backward as well)."""
    import signal

    from runyard.errors import EXIT_PREEMPTED

    from .test_distributed import start, wait_for_step

    steps = 12
    longer = {"train": {"steps": steps}, "checkpoint": {"interval": 2}}
    one = run(tmp_path, "one", longer)
    spec = tmp_path / "tp.yaml"
    # with activation checkpointing too: recomputed tensor-parallel blocks give the same curve
    tp_patch = {"train": {"steps": steps, "activation_checkpointing": "full"}, "checkpoint": {"interval": 2},
                "resources": {"parallel": {"tp": 2}}}
    spec.write_text(yaml.safe_dump(merge(merge(TINY_SPEC, SPEC), tp_patch)))
    run_dir = tmp_path / "tp"
    proc = start("train", str(spec), "--run-dir", str(run_dir), "--nproc", "2")
    wait_for_step(run_dir, 3, proc)
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err
    stopped = ckpt.list_checkpoints(run_dir / "stages/main/checkpoints")[-1].step
    assert 3 <= stopped < steps
    runyard("resume", str(run_dir), "--no-progress", "--nproc", "2", check=True, timeout=400)
    a, b = rows(one), rows(run_dir)
    assert [r["step"] for r in b] == list(range(1, steps + 1))
    for ra, rb in zip(a, b, strict=True):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5), ra["step"]
