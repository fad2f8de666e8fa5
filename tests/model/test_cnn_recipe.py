"""The CNN's training recipe: label smoothing in the training loss matches a hand computation (and the
held-out loss stays plain cross-entropy), and the image template writes the recipe's defaults."""

from __future__ import annotations

import math

import pytest
import torch

from runyard.data.loader import EvalSample
from runyard.spec.job import parse_spec
from runyard.spec.predictive import CnnAugmentSpec, CnnSpec
from runyard.spec.templates import TEMPLATES, render_template
from runyard.train.objectives import smoothed_loss_sum
from runyard.train.stage_kinds import PretrainObjective


def hand_smoothed(logits: list[list[float]], labels: list[int], eps: float) -> float:
    total = 0.0
    for row, y in zip(logits, labels, strict=True):
        z = math.log(sum(math.exp(v) for v in row))
        nll = [z - v for v in row]  # -log p_k
        total += (1 - eps) * nll[y] + eps * sum(nll) / len(row)
    return total


def test_label_smoothing_matches_a_hand_computation():
    logits = [[2.0, -1.0, 0.5], [0.1, 0.2, 3.0], [-2.0, 1.5, 0.0], [0.0, 0.0, 0.0]]
    labels = [0, 1, 2, 1]
    for eps in (0.0, 0.1, 0.3):
        got = smoothed_loss_sum(torch.tensor(logits), torch.tensor(labels), eps)
        assert float(got) == pytest.approx(hand_smoothed(logits, labels, eps), rel=1e-6)


def test_the_image_objective_smooths_its_training_loss_only():
    x, y = torch.randn(4, 3), torch.tensor([0, 2, 1, 1])
    model = torch.nn.Linear(3, 3)
    logits = model(x).tolist()
    sample = EvalSample([(x, y)], 4, 4, None, None, 4, 0)
    smoothed = PretrainObjective(None, sample, unit="sample", label_smoothing=0.1)
    got = smoothed.loss_sum(model, (x, y), torch.device("cpu"), _null)
    assert float(got.detach()) == pytest.approx(hand_smoothed(logits, y.tolist(), 0.1), rel=1e-6)
    plain = PretrainObjective(None, sample, unit="sample").loss_sum(model, (x, y), torch.device("cpu"), _null)
    assert float(plain.detach()) == pytest.approx(hand_smoothed(logits, y.tolist(), 0.0), rel=1e-6)


def _null():
    return torch.autocast("cpu", enabled=False)


def test_the_image_template_writes_the_recipes_defaults():
    values = TEMPLATES["image_classification"]("t")
    cnn = values["model"]["cnn"]
    defaults = CnnSpec()
    # The template writes the defaults (measured best for short runs: no augmentation, no smoothing).
    assert cnn["label_smoothing"] == defaults.label_smoothing == 0.0
    assert cnn["batch_norm"] is defaults.batch_norm is True
    assert cnn["augment"] == CnnAugmentSpec().model_dump() and cnn["augment"]["horizontal_flip"] is False
    assert values["schedule"]["decay"] == "cosine" and values["schedule"]["warmup_steps"] > 0
    text = render_template("image_classification", "t")
    for line in ("label_smoothing: 0.0", "horizontal_flip: false", "shift: 0.0", "rotate: 0.0", "batch_norm: true"):
        assert line in text
    spec = parse_spec(values)
    assert spec.model.cnn.augment == CnnAugmentSpec() and spec.model.cnn.label_smoothing == 0.0


def test_the_recipe_fields_refuse_bad_values():
    with pytest.raises(ValueError, match="label_smoothing"):
        CnnSpec(label_smoothing=1.0)
    with pytest.raises(ValueError, match="shift"):
        CnnAugmentSpec(shift=0.6)
