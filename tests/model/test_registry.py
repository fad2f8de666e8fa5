"""The model registry: the decoder is its first family, the spec's choices match it, and a family's
config, builder, sizing and export agree with one another."""

from __future__ import annotations

import typing

import pytest
import torch

from runyard.errors import RunyardError
from runyard.model import DEFAULT_FAMILY, family_names, get_family, registry
from runyard.model.config import ModelConfig
from runyard.model.registry import ExportError, FamilyUnavailable, ModelFamily, UnknownFamily, register
from runyard.spec.job import ModelSpec, OptimSpec, parse_spec
from runyard.spec.sections import Family


def test_the_spec_offers_exactly_the_registered_families():
    choices = typing.get_args(Family)
    assert sorted(choices) == family_names() == ["cnn", "decoder", "lightgbm", "linear"]
    # Left out, the family is the decoder for a language model (and the data's choice for other tasks).
    assert ModelSpec().family is None and DEFAULT_FAMILY == "decoder"
    lm = parse_spec({"name": "x", "data": {"sources": [{"path": "a"}]}})
    assert lm.model.family == "decoder"


def test_an_unknown_family_is_a_clear_error():
    with pytest.raises(UnknownFamily, match=r"no model family 'rnn'; runyard has \['cnn', 'decoder', 'lightgbm', 'linear'\]") as info:
        get_family("rnn")
    assert isinstance(info.value, RunyardError)


def test_a_lazy_family_is_imported_on_first_use_and_a_missing_extra_says_what_to_install(monkeypatch):
    pytest.importorskip("lightgbm")  # the predict extra (absent in .ci/floors.sh's trainer venv)
    assert get_family("lightgbm").name == "lightgbm" and not get_family("lightgbm").trains_with_loop
    monkeypatch.setitem(registry._LAZY, "ghost", ("runyard.model.no_such_module", "ghostly"))
    with pytest.raises(FamilyUnavailable, match=r"needs the optional extra 'ghostly': pip install 'runyard\[ghostly\]'"):
        get_family("ghost")


def test_a_family_cannot_be_registered_twice():
    with pytest.raises(ValueError, match="registered twice"):
        register(get_family("decoder"))


def test_decoder_config_builder_and_sizing_agree():
    family = get_family("decoder")
    cfg = family.config_from_spec(ModelSpec(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, context_length=32,
                                            tie_embeddings=False), vocab_size=300)
    assert isinstance(cfg, ModelConfig) and cfg.vocab_size == 300 and cfg.n_kv_heads == 2
    assert family.config_from_dict(family.config_to_dict(cfg)) == cfg
    model = family.build(cfg)
    size = family.sizing(cfg, micro_batch=2)
    assert size.parameters == sum(p.numel() for p in model.parameters())
    assert size.non_embedding_parameters == size.parameters - 300 * 64
    assert size.flops_per_unit == pytest.approx(model.flops_per_token()) and size.unit == "token"
    assert size.activation_bytes > 0
    assert family.shard_units(model) == list(model.blocks)
    groups = family.optimizer_groups(model, OptimSpec(weight_decay=0.1))
    assert [g["name"] for g in groups] == ["decay", "no_decay"]
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))


def test_decoder_export_files_round_trip(tmp_path):
    family = get_family("decoder")
    cfg = ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, context_length=16)
    torch.manual_seed(0)
    model = family.build(cfg).eval()
    assert family.export_files(model, cfg, tmp_path) == ["config.json", "model.safetensors"]
    loaded = family.load_files(tmp_path, cfg)
    idx = torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        assert torch.equal(loaded(idx), model(idx))
    other = ModelConfig(**{**cfg.to_dict(), "d_model": 64})
    with pytest.raises(ExportError, match="not the config given to export"):
        family.export_files(model, other, tmp_path)


def test_a_family_outside_the_loop_says_so():
    class Trees(ModelFamily):  # the shape of a gradient-boosted-trees family: no torch loop
        name = "trees-example"
        trains_with_loop = False

        def config_from_spec(self, spec, **data_facts):
            return spec

        def config_from_dict(self, data):
            return data

        def sizing(self, config, micro_batch=1):
            raise NotImplementedError

        def export_files(self, model, config, directory):
            return []

        def load_files(self, directory, config, device="cpu"):
            return None

    with pytest.raises(RunyardError, match="not built for the torch training loop"):
        Trees().build({})
