"""sft stages through the real command line: 2 DDP processes give the loss of 1 process with the same
global batch at every step (masks differ per micro-batch, so this checks the global supervised-token
normalisation), and a whole run reports its fine-tuning stage before and after."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

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


@pytest.mark.parametrize("lora", [None, {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "down_proj"]}])
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
    spec = write(tmp_path, "run", {"stages": [{"name": "pre", "train": {"steps": 4}, "gates": {"min_loss_drop": None}},
                                              SFT_STAGE]})
    run_dir = tmp_path / "run"
    runyard("run", str(spec), "--run-dir", str(run_dir), "--no-progress", check=True)
    report = (run_dir / "eval/report.md").read_text()
    assert "## Fine-tuning: stage tune (sft)" in report and "| heldout_loss |" in report
    data_report = (run_dir / "data/tune/report.md").read_text()
    assert "Python functions:" in data_report and "supervised tokens" in data_report
    record = json.loads((run_dir / "stages/tune/finetune.json").read_text())
    assert record["before"]["metrics"]["heldout_loss"] > record["after"]["metrics"]["heldout_loss"]
    assert json.loads((run_dir / "stages/tune/gates.json").read_text())["passed"]
