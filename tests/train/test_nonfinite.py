"""A NaN at step k stops the stage before its optimizer step, names the step, and leaves no checkpoint
after step k-1 (train.nonfinite: stop); with skip_step the step is skipped, counted, and within budget the
stage trains on. The NaN comes from a forward hook on the real model the loop builds through its family."""

from __future__ import annotations

import json

import pytest
import torch

from runyard.errors import EXIT_NON_FINITE
from runyard.model.decoder import DecoderFamily
from runyard.spec.job import parse_spec, resolved_stage
from runyard.train import checkpoint
from runyard.train.loop import train_stage
from runyard.train.nonfinite import NonFiniteLoss
from tests.train.test_loop_resume import CTX, prepared  # noqa: F401  (the fixture)

NAN_AT = 3  # the optimizer step whose forward gives NaN logits


def spec(**train):
    return parse_spec({
        "name": "nan", "seed": 5, "data": {"sources": [{"path": "unused"}]},
        "model": {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "context_length": 16},
        "optim": {"lr": 0.01}, "train": {"steps": 6, "batch_size": 2, **train},
        "eval": {"interval": 100, "batches": 1}, "checkpoint": {"interval": 1, "keep_last": 10},
        "resources": {"device": "cpu"},
    })


@pytest.fixture
def nan_at_step(monkeypatch):
    """Every model the family builds gives NaN logits in training forward number NAN_AT (grad_accum 1: step
    NAN_AT), and counts the optimizer steps taken on it."""
    built = DecoderFamily.build
    taken = []

    def build(self, config):
        model = built(self, config)
        calls = [0]

        def poison(module, inputs, output):
            if not torch.is_grad_enabled():
                return output
            calls[0] += 1
            return output * float("nan") if calls[0] == NAN_AT else output

        model.lm_head.register_forward_hook(poison)
        return model

    original_step = torch.optim.AdamW.step

    def step(self, *a, **k):
        taken.append(1)
        return original_step(self, *a, **k)

    monkeypatch.setattr(DecoderFamily, "build", build)
    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    return taken


def test_nan_stops_the_stage_before_its_optimizer_step(prepared, tmp_path, nan_at_step):  # noqa: F811
    s = spec()
    stage_dir = tmp_path / "stages" / "main"
    with pytest.raises(NonFiniteLoss, match=f"not finite at step {NAN_AT}; stopped before its optimizer step") as err:
        train_stage(s, resolved_stage(s, "main"), prepared, stage_dir, CTX, show_progress=False)
    assert err.value.exit_code == EXIT_NON_FINITE == 6
    assert len(nan_at_step) == NAN_AT - 1  # the optimizer stepped only on the good steps
    saved = [c.step for c in checkpoint.list_checkpoints(stage_dir / "checkpoints")]
    assert max(saved) == NAN_AT - 1
    rows = [json.loads(line) for line in (stage_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, NAN_AT))


def test_skip_step_skips_counts_and_trains_on(prepared, tmp_path, nan_at_step):  # noqa: F811
    s = spec(nonfinite="skip_step", nonfinite_budget=1)
    stage_dir = tmp_path / "stages" / "main"
    result = train_stage(s, resolved_stage(s, "main"), prepared, stage_dir, CTX, show_progress=False)
    assert result.steps == 6 and len(nan_at_step) == 5  # one step skipped
    rows = [json.loads(line) for line in (stage_dir / "metrics.jsonl").read_text().splitlines()]
    skipped = rows[NAN_AT - 1]
    assert "loss" not in skipped and skipped["skipped_loss"] == "nan" and skipped["nonfinite_skipped"] == 1
    assert [r["nonfinite_skipped"] for r in rows] == [0, 0, 1, 1, 1, 1]
    assert len(result.losses) == 5 and all(torch.isfinite(torch.tensor(result.losses)))


def test_skip_step_past_its_budget_stops(prepared, tmp_path, nan_at_step):  # noqa: F811
    s = spec(nonfinite="skip_step", nonfinite_budget=0)
    with pytest.raises(NonFiniteLoss, match=f"step {NAN_AT}.*exceed train.nonfinite_budget 0"):
        train_stage(s, resolved_stage(s, "main"), prepared, tmp_path / "stages" / "main", CTX, show_progress=False)


def test_a_device_side_assert_at_the_log_is_reported_as_non_finite():
    """On a GPU the failed guard is a device-side assert that surfaces at the log's readback."""
    from runyard.train.nonfinite import device_assert_as_nonfinite

    with pytest.raises(NonFiniteLoss, match="at a step in 11..20"), device_assert_as_nonfinite("main", 11, 20):
        raise RuntimeError("CUDA error: device-side assert triggered")
    with pytest.raises(RuntimeError, match="something else"), device_assert_as_nonfinite("main", 11, 20):
        raise RuntimeError("something else")
