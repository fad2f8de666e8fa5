"""A dpo stage under FSDP (resources.parallel: fsdp) through the real command line: two torchrun workers on
CPU with gloo shard the frozen reference over the same units as the policy (train/layout.py `frozen_copy`),
so each rank holds about half of it rather than a whole copy, and the stage's per-step losses, reward
figures and held-out figures equal one process's with the same global batch."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from .conftest import TINY_SPEC, merge, runyard
from .uneven_records import sft_stage_patch, write_uneven_pairs

pytestmark = pytest.mark.slow

STEPS = 8
SPEC = {
    "model": {"dropout": 0.0},  # the policy equals the reference at the first step
    "train": {"steps": STEPS, "batch_size": 2, "grad_accum": 2},
    "eval": {"interval": 4},
    "checkpoint": {"interval": 4},
}
HELD = re.compile(r"dpo reference: (\d+) of its (\d+) parameters on this rank")


def train(tmp: Path, name: str, patch: dict, *extra: str) -> tuple[Path, str]:
    spec = tmp / f"{name}.yaml"
    spec.write_text(yaml.safe_dump(merge(merge(TINY_SPEC, SPEC), patch)))
    proc = runyard("train", str(spec), "--run-dir", str(tmp / name), "--no-progress", *extra, check=True, timeout=400)
    return tmp / name, proc.stdout + proc.stderr


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "stages/main/metrics.jsonl").read_text().splitlines()]


def test_a_dpo_stage_under_fsdp_shards_its_reference_and_matches_one_process(tmp_path):
    dpo = sft_stage_patch(write_uneven_pairs(tmp_path / "pairs.jsonl"), kind="dpo")
    one, one_log = train(tmp_path, "one", dpo)
    two, two_log = train(tmp_path, "two", merge(dpo, {"train": {"grad_accum": 1}, "resources": {"parallel": "fsdp"}}),
                         "--nproc", "2")
    (whole,) = {(int(held), int(total)) for held, total in HELD.findall(one_log)}
    assert whole[0] == whole[1] > 0  # one process: the whole reference
    (held, total), = {(int(held), int(total)) for held, total in HELD.findall(two_log)}  # rank 0 narrates
    assert total == whole[1] and 0.45 * total <= held <= 0.55 * total
    a, b = rows(one), rows(two)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    assert a[0]["reward_margin"] == pytest.approx(0.0, abs=1e-6)  # the reference is the initial policy
    for ra, rb in zip(a, b, strict=True):
        assert ra.keys() == rb.keys()
        for key in (k for k in ra if k in FIGURES or k.startswith("heldout_")):
            assert same(key, ra[key], rb[key]), (ra["step"], key, ra[key], rb[key])
    fa, fb = (json.loads((d / "stages/main/finetune.json").read_text()) for d in (one, two))
    for when in ("before", "after"):  # the whole policy on rank 0 against the held-out reference scores
        assert fa[when]["metrics"].keys() == fb[when]["metrics"].keys()
        for key, value in fa[when]["metrics"].items():
            assert same(key, value, fb[when]["metrics"][key]), (when, key, value, fb[when]["metrics"][key])


FIGURES = ("loss", "grad_norm", "reward_accuracy", "reward_margin")


def same(key: str, a: float, b: float) -> bool:
    """Equal within fp32 rounding: a loss or norm relatively; a reward margin (beta x a difference of two
    responses' summed log-probabilities, near 0) absolutely; accuracies and counts exactly."""
    if key.endswith("margin"):
        return abs(a - b) <= 1e-5
    if key.endswith(("accuracy", "pairs")):
        return a == b
    return b == pytest.approx(a, rel=1e-5)
