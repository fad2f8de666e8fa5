"""Stage gates: each bound decides pass/fail, and the gates record is written durably."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from runyard.spec.job import GateSpec
from runyard.train.gates import (
    GATES_FILE,
    evaluate_gates,
    evaluate_recorded_gates,
    format_failures,
    read_gates,
    write_gates,
)


def _by_name(results):
    return {r.name: r for r in results}


def test_each_gate_passes_and_fails_on_its_bound():
    model = torch.nn.Linear(2, 2)
    gates = GateSpec(min_loss_drop=0.2, max_heldout_loss=3.0, min_tokens_per_s=100.0, checkpoint_roundtrip=False)
    good = _by_name(evaluate_gates(gates, [5.0] * 5 + [3.0] * 5, 2.5, 150.0, None, model))
    assert all(r.passed for r in good.values()) and set(good) == {"finite", "loss_drop", "heldout_loss", "throughput"}
    bad = _by_name(evaluate_gates(gates, [5.0] * 5 + [4.5] * 4 + [math.nan], 3.5, 50.0, None, model))
    assert not any(r.passed for r in bad.values())
    assert bad["finite"].detail.endswith("[10]")


def test_heldout_drop_is_measured_from_the_initial_weights_or_the_first_evaluation():
    gates = GateSpec(min_loss_drop=None, checkpoint_roundtrip=False, require_finite=False, min_heldout_loss_drop=0.1)
    rows = [{"step": 1, "loss": 4.0, "heldout_loss": 4.0}, {"step": 2, "loss": 3.0},
            {"step": 3, "loss": 2.0, "heldout_loss": 3.5}]
    (first,) = evaluate_recorded_gates(gates, rows, None, torch.nn.Linear(2, 2))  # 4.0 -> 3.5: 12.5%
    assert first.passed and first.value == pytest.approx(0.125) and "4.0000 -> 3.5000" in first.detail
    # a fine-tuning stage's `before` record: 3.8 -> 3.5 is under 10%
    (before,) = evaluate_recorded_gates(gates, rows, None, torch.nn.Linear(2, 2), heldout_start=3.8)
    assert not before.passed and before.value == pytest.approx(0.3 / 3.8)
    (none,) = evaluate_recorded_gates(gates, [{"step": 1, "loss": 2.0}], None, torch.nn.Linear(2, 2))
    assert not none.passed and none.detail == "no held-out loss to compare"
    (worse,) = evaluate_gates(gates, [1.0], math.nan, 1.0, None, None, heldout_start=3.0)
    assert not worse.passed


def test_missing_checkpoint_fails_the_roundtrip_gate():
    results = evaluate_gates(GateSpec(min_loss_drop=None), [1.0], None, 1.0, None, torch.nn.Linear(2, 2))
    assert [r.name for r in results if not r.passed] == ["checkpoint_roundtrip"]


def test_gates_record_round_trips_and_is_fsynced(tmp_path: Path, monkeypatch):
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    results = evaluate_gates(GateSpec(min_loss_drop=0.5, checkpoint_roundtrip=False), [2.0, 1.9], None, 1.0, None,
                             torch.nn.Linear(2, 2))
    record = write_gates(tmp_path / "s", "main", results)
    assert synced, "gates.json must be fsynced before it is renamed into place"
    assert read_gates(tmp_path / "s") == record and record["passed"] is False
    assert "loss_drop" in format_failures(record)
    assert [p.name for p in (tmp_path / "s").iterdir()] == [GATES_FILE]
    assert read_gates(tmp_path / "missing") is None


def test_damaged_gates_record_is_a_clear_error(tmp_path):
    from runyard.errors import RunyardError

    (tmp_path / "gates.json").write_text('{"stage": "main", "pas')
    with pytest.raises(RunyardError, match="damaged.*delete it to train stage"):
        read_gates(tmp_path)
