import json
import math

import numpy as np
import pytest
import torch

from runyard.evaluate.heldout import summarise, unigram_loss
from runyard.evaluate.report import verdict, write_report
from runyard.spec.job import EvalSpec


def test_unigram_loss_is_the_smoothed_cross_entropy():
    counts = np.array([3, 1, 0, 0])
    y = torch.tensor([[0, 1, 0]])
    p = (counts + 1) / (counts.sum() + 4)
    expected = -(2 * math.log(p[0]) + math.log(p[1])) / 3
    assert unigram_loss(counts, [y]) == pytest.approx(expected)


def test_verdict_names_every_failed_threshold():
    m = summarise(heldout_loss=3.0, train_loss=1.0, unigram=2.5, heldout_tokens=100)
    v = verdict(m, EvalSpec(max_heldout_perplexity=10, max_gap=0.5, must_beat_unigram=True))
    assert not v.fit_to_ship
    assert len(v.reasons) == 3 and any("unigram" in r for r in v.reasons) and any("gap" in r for r in v.reasons)
    ok = verdict(summarise(2.0, 1.9, 3.0, 100), EvalSpec(max_heldout_perplexity=10, max_gap=0.5))
    assert ok.fit_to_ship and ok.reasons == []


def test_report_files_are_written(tmp_path):
    m = summarise(2.0, 1.9, 3.0, 100)
    rows = [{"step": i, "loss": 3 - i * 0.1, "lr": 0.01, "heldout_loss": 3.0 if i % 2 else None} for i in range(1, 6)]
    report = write_report(tmp_path, "r", m, verdict(m, EvalSpec()), [{"prompt": "a", "completion": "b"}],
                          {"main": rows}, [{"name": "main", "steps": 5, "final_loss": 2.5, "heldout_loss": 3.0,
                                            "tokens_per_s": 10.0, "gates_passed": True}])
    assert report["fit_to_ship"] is True
    for name in ("report.md", "report.json", "loss.png", "lr.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert "FIT TO SHIP" in (tmp_path / "report.md").read_text()


def test_report_says_what_each_evaluation_sample_covered(tmp_path):
    coverage = {
        "held-out": {"sequences": 64, "tokens": 4096, "documents": 23, "split_documents": 25,
                     "split_sequences": 300, "method": "stratified", "seed": 11},
        "train": {"sequences": 64, "tokens": 4096, "documents": 61, "split_documents": 230,
                  "split_sequences": 2900, "method": "stratified", "seed": 12},
    }
    m = summarise(2.0, 1.9, 3.0, 4096, coverage=coverage)
    report = write_report(tmp_path, "r", m, verdict(m, EvalSpec()), [], {"main": [{"step": 1, "loss": 3.0, "lr": 0.1}]},
                          [])
    assert report["metrics"]["coverage"] == coverage
    assert json.loads((tmp_path / "report.json").read_text())["metrics"]["coverage"]["train"]["documents"] == 61
    md = (tmp_path / "report.md").read_text()
    assert "| held-out | 64 of 300 | 4,096 | 23 of 25 | 11 |" in md
    assert "| train | 64 of 2,900 | 4,096 | 61 of 230 | 12 |" in md
