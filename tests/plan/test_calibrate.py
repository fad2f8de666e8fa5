"""The calibration: bounded, deterministic in everything but its timings, harmless to the caller's RNG;
and the stage estimates it feeds, checked against arithmetic written out by hand."""

import math

import pytest
import torch

from runyard.model.config import ModelConfig
from runyard.model.registry import get_family
from runyard.plan.calibrate import (
    Machine,
    StageCalibration,
    calibrate_stage,
    decode_token_seconds,
    measure_disk_write,
    measure_machine,
)
from runyard.plan.devices import UTILISATION
from runyard.plan.disk import checkpoint_bytes
from runyard.plan.planner import stage_memory, stage_phases
from runyard.plan.sizing import MemoryEstimate, plan_stage
from runyard.spec.job import OptimSpec, parse_spec

DECODER = get_family("decoder")
CONFIG = ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=96, context_length=16)
MACHINE = Machine("cpu", "cpu", 2, 1e10, 1e8, 300 << 20, 8 << 30)
TIMINGS = ("forward_backward_s", "optimizer_s", "first_step_extra_s", "forward_s", "decode_token_s", "wall_s",
           "peak_bytes", "spread")


def _calibrate(**kw) -> StageCalibration:
    return calibrate_stage("main", DECODER, CONFIG, OptimSpec(), 4, MACHINE, "fp32", None, **kw)


def test_calibration_is_bounded_by_its_budget_and_step_count():
    assert _calibrate(budget_s=0.0).steps == 1  # always one timed step after the warm-up
    assert _calibrate(budget_s=600.0, max_steps=2).steps == 2


def test_calibration_reports_the_same_apart_from_its_timings_and_leaves_the_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    first = _calibrate(budget_s=600.0, max_steps=2)
    assert torch.equal(torch.rand(3), expected)  # the caller's random stream is where it was
    second = _calibrate(budget_s=600.0, max_steps=2)
    keep = lambda c: {k: v for k, v in vars(c).items() if k not in TIMINGS}  # noqa: E731
    assert keep(first) == keep(second) == {"stage": "main", "micro_batch": 4, "steps": 2}
    assert all(getattr(first, k) > 0 for k in ("forward_backward_s", "optimizer_s", "forward_s", "decode_token_s"))
    gen = torch.Generator().manual_seed(5)
    x1, _ = DECODER.synthetic_batch(CONFIG, 4, gen)
    x2, _ = DECODER.synthetic_batch(CONFIG, 4, torch.Generator().manual_seed(5))
    assert torch.equal(x1, x2) and x1.shape == (4, 16)


def test_decode_timing_restores_the_training_mode():
    model = DECODER.build(CONFIG)
    model.train()
    assert decode_token_seconds(model, torch.device("cpu")) > 0
    assert model.training
    assert decode_token_seconds(torch.nn.Linear(2, 2), torch.device("cpu")) is None  # no KV cache


def test_machine_measurement_and_disk_write_leave_nothing_behind(tmp_path):
    target = tmp_path / "runs" / "not-yet"  # its nearest existing parent is measured
    assert measure_disk_write(target, nbytes=1 << 20) > 0
    assert list(tmp_path.iterdir()) == []
    m = measure_machine("cpu", 1, target)
    assert (m.kind, m.torch_device, m.devices, m.calibrated) == ("cpu", "cpu", 1, True)
    assert m.matmul_flops > 0 and m.framework_rss_bytes > 0


SPEC = {
    "name": "p", "data": {"sources": [{"path": "x"}]},
    "model": {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 96, "context_length": 16},
    "train": {"steps": 100, "batch_size": 4, "grad_accum": 3},
    "eval": {"interval": 30, "batches": 5},
    "checkpoint": {"interval": 40},
}


def test_stage_time_from_a_calibration_by_hand():
    spec = parse_spec(SPEC)
    plan = plan_stage(spec, "main", vocab_size=256)
    cal = StageCalibration("main", 4, 3, forward_backward_s=0.2, optimizer_s=0.05, first_step_extra_s=1.0,
                           forward_s=0.07, decode_token_s=0.01, wall_s=2.0, peak_bytes=50 << 20)
    phases, how = stage_phases(spec, plan, MACHINE, cal)
    assert phases["training"] == pytest.approx(100 * (3 * 0.2 + 0.05) + 1.0)  # 66 s
    # Evaluations at steps 30, 60, 90 and the last (100): 4 x 5 batches x 0.07 s.
    assert phases["evaluation"] == pytest.approx(4 * 5 * 0.07)
    # Checkpoints at 40, 80 and 100, and the gate's read of the last: 4 x its bytes at 100 MB/s.
    assert phases["checkpoints"] == pytest.approx(4 * (plan.parameters * 12 + (1 << 20)) / 1e8)
    assert checkpoint_bytes(plan.parameters) == plan.parameters * 12 + (1 << 20)
    assert "calibrated: 3 real steps" in how
    two = parse_spec({**SPEC, "resources": {"nproc": 2}})
    phases2, _ = stage_phases(two, plan_stage(two, "main", vocab_size=256), MACHINE, cal)
    assert phases2["training"] == pytest.approx(2 * phases["training"])  # two ranks share one CPU


def test_stage_time_without_a_calibration_is_flops_at_the_stated_share_of_the_matmul_rate():
    spec = parse_spec(SPEC)
    plan = plan_stage(spec, "main", vocab_size=256)
    phases, how = stage_phases(spec, plan, MACHINE, None)
    tokens = 100 * 4 * 3 * 16
    n = 2 * (32 * (4 + 2 * 2) * 8 + 4 * 8 * 32 + 3 * 32 * 96 + 2 * 32) + 32  # non-embedding, hand count
    flops_per_token = 6 * (n + 256 * 32) + 12 * 2 * 16 * 32  # tied head is a matmul; attention
    assert plan.training_flops == pytest.approx(flops_per_token * tokens)
    rate = 1e10 * UTILISATION["cpu_of_matmul_peak"]
    assert phases["training"] == pytest.approx(flops_per_token * tokens / rate)
    eval_tokens = 4 * 5 * 4 * 16  # 4 evaluations x 5 batches x 4 sequences x 16 tokens
    assert phases["evaluation"] == pytest.approx(flops_per_token / 3 * eval_tokens / rate)
    assert "FLOPs at 50% of the measured matmul rate" in how


def test_memory_counts_each_part_once_and_the_measured_peak_replaces_the_stated_activations():
    m = MemoryEstimate(framework=300, states=160, activations=500, evaluation=90, loader=7, how="x")
    assert m.total == 300 + 7 + max(160 + 500, 120 + 90)
    m2 = MemoryEstimate(framework=300, states=160, activations=10, evaluation=900, loader=7, how="x")
    assert m2.total == 300 + 7 + 120 + 900  # evaluation without gradients: 12 of the 16 bytes a parameter
    spec = parse_spec(SPEC)
    plan = plan_stage(spec, "main", vocab_size=256, framework=300 << 20, loader=1 << 20)
    assert plan.memory["states"] == plan.parameters * 16
    cal = StageCalibration("main", 4, 1, 0.1, 0.1, 0.0, 0.1, None, 1.0, peak_bytes=80 << 20)
    measured = stage_memory(plan, cal)
    assert measured.total == (300 << 20) + (1 << 20) + (80 << 20)  # framework + loader + the measured peak
    assert stage_memory(plan, None).activations == plan.memory["activations"]
    assert math.isclose(measured.activations, (80 << 20) - plan.parameters * 16)
