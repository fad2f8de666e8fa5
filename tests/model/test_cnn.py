"""The image CNN family: its config round trip, sizing against a hand count, normalisation inside the
model, parameter groups and its safetensors export."""

from __future__ import annotations

import pytest
import torch

from runyard.model import get_family
from runyard.model.cnn import CnnConfig
from runyard.model.registry import ExportError
from runyard.spec.predictive import CnnSpec
from runyard.spec.sections import ModelSpec, OptimSpec


def config(**over) -> CnnConfig:
    spec = ModelSpec(family="cnn", cnn=CnnSpec(channels=[4, 8], hidden=16, **over))
    return get_family("cnn").config_from_spec(spec, shape=(1, 8, 8), n_classes=10, mean=[0.25], std=[0.5])


def test_config_round_trip_and_bad_values():
    family = get_family("cnn")
    cfg = config()
    assert family.config_from_dict(family.config_to_dict(cfg)) == cfg
    with pytest.raises(ValueError, match="n_classes must be at least 2"):
        CnnConfig(1, 8, 8, 1, (4,), 3, 16, 0.0, True, (0.0,), (1.0,))
    with pytest.raises(ValueError, match="unknown keys \\['extra'\\]"):
        family.config_from_dict({**family.config_to_dict(cfg), "extra": 1})


def test_sizing_matches_a_hand_count():
    family = get_family("cnn")
    cfg = config()
    model = family.build(cfg)
    size = family.sizing(cfg)
    assert size.parameters == sum(p.numel() for p in model.parameters())
    # By hand: conv1 (1->4, 3x3, no bias with batch norm) + bn (4+4), conv2 (4->8) + bn (8+8),
    # hidden 8->16 (+16), head 16->10 (+10).
    assert size.parameters == 1 * 4 * 9 + 8 + 4 * 8 * 9 + 16 + 8 * 16 + 16 + 16 * 10 + 10
    # FLOPs: conv1 at 8x8, conv2 at 4x4 (after one pooling), two linears; x2 per multiply-add, x3 for training.
    forward = 2 * (9 * 1 * 4 * 64 + 9 * 4 * 8 * 16 + 8 * 16 + 16 * 10)
    assert size.flops_per_unit == 3 * forward and size.unit == "sample"
    assert family.units_per_example(cfg) == 1


def test_normalisation_lives_in_the_model_and_logits_have_the_classes():
    family = get_family("cnn")
    cfg = config(batch_norm=False)
    torch.manual_seed(0)
    model = family.build(cfg).eval()
    pixels = torch.rand(3, 1, 8, 8)
    h = (pixels - 0.25) / 0.5  # the training split's mean and std, applied by the model itself
    for block in model.blocks:
        h = block(h)
    by_hand = model.head(torch.relu(model.hidden(h.mean(dim=(2, 3)))))
    assert torch.allclose(model(pixels), by_hand) and by_hand.shape == (3, 10)
    assert not torch.allclose(model(pixels), model.head(torch.relu(model.hidden(_unnormalised(model, pixels)))))
    assert "pixel_mean" not in model.state_dict()  # a constant of the config, not a weight
    groups = family.optimizer_groups(model, OptimSpec(weight_decay=0.1))
    assert all(p.ndim >= 2 for p in groups[0]["params"]) and all(p.ndim == 1 for p in groups[1]["params"])


def test_export_and_load_are_exact_and_a_mismatch_is_refused(tmp_path):
    family = get_family("cnn")
    cfg = config()
    torch.manual_seed(1)
    model = family.build(cfg)
    model(torch.rand(4, 1, 8, 8))  # batch-norm running statistics move
    family.export_files(model, cfg, tmp_path)
    loaded = family.load_files(tmp_path, cfg)
    model.eval()
    x = torch.rand(5, 1, 8, 8)
    assert torch.equal(loaded(x), model(x))
    other = family.config_from_spec(ModelSpec(family="cnn", cnn=CnnSpec(channels=[4, 16])), shape=(1, 8, 8), n_classes=10)
    with pytest.raises(ExportError, match="has shape"):
        family.load_files(tmp_path, other)


def _unnormalised(model, pixels):
    h = pixels
    for block in model.blocks:
        h = block(h)
    return h.mean(dim=(2, 3))
