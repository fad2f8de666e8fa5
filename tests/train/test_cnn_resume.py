"""The image CNN trains through the same loop as the language model: a stage stopped by SIGTERM mid-way
and resumed ends bitwise equal on CPU to one that never stopped (weights, batch-norm statistics, every
logged loss), and a gate reads its images/s."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from runyard.data.image_prep import prepare_images
from runyard.errors import Preempted
from runyard.spec.job import parse_spec, resolved_stage
from runyard.train import checkpoint, parallel
from runyard.train.gates import evaluate_recorded_gates
from runyard.train.loop import train_stage
from runyard.train.signals import StopRequest

pytestmark = pytest.mark.slow

CTX = parallel.DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def make_spec(npz: Path):
    return parse_spec({
        "task": "image_classification", "name": "cnn-resume", "seed": 11,
        "data": {"heldout_fraction": 0.2, "sources": [{"path": str(npz), "format": "npz"}]},
        "model": {"family": "cnn", "cnn": {"channels": [4, 8], "hidden": 16, "dropout": 0.2}},
        "optim": {"lr": 0.01}, "schedule": {"warmup_steps": 2},
        "train": {"steps": 12, "batch_size": 8},
        "eval": {"interval": 3, "batches": 2},
        "checkpoint": {"interval": 4, "keep_last": 2},
        "stages": [{"name": "main", "gates": {"min_loss_drop": None, "min_samples_per_s": 1e12}}],
        "resources": {"device": "cpu"},
    })


class StopAtStep(StopRequest):
    def __init__(self, metrics: Path, step: int):
        super().__init__()
        self.metrics, self.step = metrics, step

    @property
    def requested(self) -> bool:
        if not self._event.is_set() and self.metrics.is_file() and len(self.metrics.read_text().splitlines()) >= self.step:
            self.request("SIGTERM")
        return self._event.is_set()


def rows(stage_dir: Path) -> list[dict]:
    out = [json.loads(line) for line in (stage_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("time", "samples_per_s", "mfu")} for r in out]


def test_a_resumed_cnn_stage_is_bitwise_equal_to_one_that_never_stopped(tmp_path):
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    labels = np.arange(120) % 3
    pixels = (rng.random((120, 6, 6)) * 120 + labels[:, None, None] * 60).astype(np.uint8)
    np.savez(tmp_path / "d.npz", x=pixels, y=labels)
    spec = make_spec(tmp_path / "d.npz")
    prepared = prepare_images(spec.data, seed=1, cache_root=tmp_path / "cache")
    stage = resolved_stage(spec, "main")
    reference = train_stage(spec, stage, prepared, tmp_path / "reference", CTX, show_progress=False)

    stopped = tmp_path / "stopped"
    with pytest.raises(Preempted, match="stopped by SIGTERM at step 7"):
        train_stage(spec, stage, prepared, stopped, CTX, stop=StopAtStep(stopped / "metrics.jsonl", 7), show_progress=False)
    resumed = train_stage(spec, stage, prepared, stopped, CTX, show_progress=False)
    assert resumed.resumed_from == 7

    assert rows(stopped) == rows(tmp_path / "reference")
    held = [r for r in rows(stopped) if "heldout_loss" in r]
    assert [r["step"] for r in held] == [3, 6, 9, 12]
    # 2 batches of 8 asked; the validation split is smaller, so it is scored whole, every time
    assert {r["heldout_samples"] for r in held} == {prepared.stats["split"]["counts"]["validation"]} == {15}
    final = checkpoint.read_model_weights(checkpoint.latest_good(stopped / "checkpoints").path)
    state = reference.model.state_dict()
    assert any("running_mean" in name for name in state)  # batch-norm statistics are part of the exact state
    for name, tensor in state.items():
        assert torch.equal(final[name], tensor), name

    # The loop's gates read an image stage's samples/s (here bound to fail) and its checkpoint round trip.
    results = {g.name: g for g in evaluate_recorded_gates(stage.gates, [json.loads(line) for line in
               (stopped / "metrics.jsonl").read_text().splitlines()], resumed.checkpoint, resumed.model)}
    assert not results["throughput"].passed and 0 < results["throughput"].value < 1e12
    assert results["checkpoint_roundtrip"].passed
