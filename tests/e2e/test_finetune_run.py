"""sft stages through the real command line: 2 DDP processes give the loss of 1 process with the same
global batch at every step (masks differ per micro-batch, so this checks the global supervised-token
normalisation), and a whole run reports its fine-tuning stage before and after."""

from __future__ import annotations

import json
import os
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

pytestmark = pytest.mark.slow

STEPS = 6
SFT_STAGE = {
    "name": "tune", "kind": "sft",
    "data": {"sources": [{"path": "{stdlib}/json/*.py", "format": "python_functions", "max_body_lines": 12},
                         {"path": "{stdlib}/email/_*.py", "format": "python_functions", "max_body_lines": 12}],
             "too_long": "truncate", "heldout_fraction": 0.2},
    "gates": {"min_loss_drop": None},
    "sft": {"task_prompts": 2, "samples": 1, "max_new_tokens": 8},
}
PATCH = {
    "model": {"dropout": 0.0, "context_length": 128},
    "train": {"steps": STEPS, "batch_size": 2, "grad_accum": 4},
    "eval": {"interval": 3},
    "checkpoint": {"interval": 3},
    "stages": [SFT_STAGE],
}


def write(tmp: Path, name: str, patch: dict) -> Path:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(merge(merge(TINY_SPEC, PATCH), patch)))
    return path


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "stages/tune/metrics.jsonl").read_text().splitlines()]


# LoRA under DDP in the full tier (the fast tier trains LoRA adapters in the SIGTERM test below).
@pytest.mark.parametrize("lora", [None, pytest.param({"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "down_proj"]},
                                                     marks=pytest.mark.full)])
def test_two_ddp_processes_match_one_with_masks(tmp_path, lora):
    stage = merge(SFT_STAGE, {"lora": lora} if lora else {})
    one = write(tmp_path, "one", {"stages": [stage]})
    two = write(tmp_path, "two", {"stages": [stage], "train": {"grad_accum": 2}})
    runyard("train", str(one), "--run-dir", str(tmp_path / "one"), "--no-progress", check=True)
    runyard("train", str(two), "--run-dir", str(tmp_path / "two"), "--no-progress", "--nproc", "2", check=True)
    a, b = rows(tmp_path / "one"), rows(tmp_path / "two")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    for ra, rb in zip(a, b, strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5), ra["step"]
        assert ra["tokens"] == rb["tokens"]
    assert [r["heldout_loss"] for r in a if "heldout_loss" in r] == pytest.approx(
        [r["heldout_loss"] for r in b if "heldout_loss" in r], rel=1e-5)


def test_a_run_with_an_sft_stage_reports_before_and_after(tmp_path):
    gated = merge(SFT_STAGE, {"gates": {"min_heldout_loss_drop": 0.001}})  # measured from the `before` record
    # The verdict's bounds on: the run ends in sft, so it is judged on that stage's own figures (the
    # tiny pretrain stage's text would never beat its unigram baseline by eval.unigram_margin).
    spec = write(tmp_path, "run", {"stages": [{"name": "pre", "train": {"steps": 4}, "gates": {"min_loss_drop": None}},
                                              gated],
                                   "eval": {"must_beat_unigram": True, "min_response_loss_drop": 0.0,
                                            "min_task_score": None}})
    run_dir = tmp_path / "run"
    proc = runyard("run", str(spec), "--run-dir", str(run_dir), "--no-progress", check=True)
    assert "fit to ship: yes" in proc.stdout
    verdict = json.loads((run_dir / "eval/report.json").read_text())
    assert verdict["fit_to_ship"] and not any("unigram" in line for line in verdict["passed"] + verdict["reasons"])
    assert any("stage tune's held-out response loss" in line and "below its initial weights'" in line
               for line in verdict["passed"])
    report = (run_dir / "eval/report.md").read_text()
    assert "## Fine-tuning: stage tune (sft)" in report and "| heldout_loss |" in report
    data_report = (run_dir / "data/tune/report.md").read_text()
    assert "Python functions:" in data_report and "supervised tokens" in data_report
    record = json.loads((run_dir / "stages/tune/finetune.json").read_text())
    assert record["before"]["metrics"]["heldout_loss"] > record["after"]["metrics"]["heldout_loss"]
    gates = json.loads((run_dir / "stages/tune/gates.json").read_text())
    assert gates["passed"]
    (drop,) = [g for g in gates["gates"] if g["name"] == "heldout_loss_drop"]
    start, end = record["before"]["metrics"]["heldout_loss"], record["after"]["metrics"]["heldout_loss"]
    assert drop["value"] == pytest.approx((start - end) / start)


def test_sigterm_mid_sft_then_resume_is_bitwise_equal(tmp_path):
    """A real SIGTERM to `runyard train` during an sft stage: checkpoint, exit 4; `runyard resume` then
    ends with the metrics and adapter weights of a run that never stopped."""
    stage = merge(SFT_STAGE, {"lora": {"rank": 4, "alpha": 8, "dropout": 0.1}})
    spec = write(tmp_path, "spec", {"stages": [stage], "model": {"dropout": 0.1}, "checkpoint": {"interval": 2},
                                    "train": {"steps": 12}})
    runyard("train", str(spec), "--run-dir", str(tmp_path / "reference"), "--no-progress", check=True)
    run_dir = tmp_path / "run"
    proc = popen_dying_with_me([sys.executable, "-m", "runyard", "train", str(spec), "--run-dir", str(run_dir),
                  "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                 env=dict(os.environ, OMP_NUM_THREADS="1"))
    metrics = run_dir / "stages/tune/metrics.jsonl"
    deadline = time.time() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3) and time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[1]
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err
    assert len(rows(run_dir)) < 12
    runyard("resume", str(run_dir), "--no-progress", check=True)

    def steady(rs):
        return [{k: v for k, v in r.items() if k not in ("time", "tokens_per_s", "mfu")} for r in rs]

    assert steady(rows(run_dir)) == steady(rows(tmp_path / "reference"))
    final = ckpt.read_model_weights(ckpt.latest_good(run_dir / "stages/tune/checkpoints").path)
    expected = ckpt.read_model_weights(ckpt.latest_good(tmp_path / "reference/stages/tune/checkpoints").path)
    assert final.keys() == expected.keys() and all(k.startswith("adapters.") for k in final)
    for name, tensor in expected.items():
        assert torch.equal(final[name], tensor), name
