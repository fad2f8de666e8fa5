"""Export to safetensors + tokenizer + config, and load back: same logits, clear errors on damage."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from runyard.errors import RunyardError
from runyard.serve.export import ExportError, export_model, load_export


@pytest.mark.parametrize("tie", [True, False])
def test_export_then_load_gives_identical_logits(tmp_path, tokenizer, tokenizer_path, tie, make_model):
    model = make_model(tokenizer, tie=tie)
    out = export_model(model, model.cfg, tokenizer_path, tmp_path / "export", extra_config={"step": 7})
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    loaded, cfg, tok = load_export(out)
    assert cfg == model.cfg
    assert tok.get_vocab() == tokenizer.get_vocab()
    idx = torch.tensor([tokenizer.encode("def add(a, b):").ids])
    with torch.no_grad():
        assert torch.equal(loaded(idx), model(idx))
    assert (loaded.lm_head.weight is loaded.tok_emb.weight) is tie
    config = json.loads((out / "config.json").read_text())
    assert config["extra"] == {"step": 7}


def test_tied_weights_saved_once(tmp_path, tokenizer, tokenizer_path, make_model):
    model = make_model(tokenizer, tie=True)
    out = export_model(model, model.cfg, tokenizer_path, tmp_path / "export")
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "tok_emb.weight" in keys and "lm_head.weight" not in keys
    assert len(keys) == len(model.state_dict()) - 1


def test_export_replaces_an_existing_export_and_leaves_no_temp_dirs(
    tmp_path, tokenizer, tokenizer_path, make_model
):
    first, second = make_model(tokenizer, seed=0), make_model(tokenizer, seed=1)
    export_model(first, first.cfg, tokenizer_path, tmp_path / "export")
    export_model(second, second.cfg, tokenizer_path, tmp_path / "export")
    assert os.listdir(tmp_path) == ["export"]
    loaded, _, _ = load_export(tmp_path / "export")
    assert torch.equal(loaded.tok_emb.weight, second.tok_emb.weight)


def test_failed_export_leaves_the_old_one(tmp_path, tokenizer, tokenizer_path, make_model):
    model = make_model(tokenizer)
    export_model(model, model.cfg, tokenizer_path, tmp_path / "export")
    before = (tmp_path / "export" / "config.json").read_text()
    with pytest.raises(ExportError, match="does not exist"):
        export_model(model, model.cfg, tmp_path / "nope.json", tmp_path / "export")
    assert (tmp_path / "export" / "config.json").read_text() == before
    assert os.listdir(tmp_path) == ["export"]


@pytest.fixture()
def exported(tmp_path, tokenizer, tokenizer_path, make_model):
    model = make_model(tokenizer)
    return export_model(model, model.cfg, tokenizer_path, tmp_path / "export")


@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json", "config.json"])
def test_missing_file_is_a_clear_error(exported, name):
    (exported / name).unlink()
    with pytest.raises(ExportError, match=name.replace(".", r"\.")) as info:
        load_export(exported)
    assert isinstance(info.value, RunyardError)
    assert "missing" in str(info.value)


def test_tampered_weights_fail_the_checksum(exported):
    path = exported / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # flip bits inside the last tensor's data
    path.write_bytes(bytes(data))
    with pytest.raises(ExportError, match=r"model\.safetensors fails its checksum"):
        load_export(exported)


def test_tampered_tokenizer_fails_the_checksum(exported):
    path = exported / "tokenizer.json"
    path.write_text(path.read_text().replace('"<|endoftext|>"', '"<|end|>"', 1))
    with pytest.raises(ExportError, match=r"tokenizer\.json fails its checksum"):
        load_export(exported)


def test_config_shape_mismatch_is_reported(exported):
    path = exported / "config.json"
    config = json.loads(path.read_text())
    config["model"]["ffn_hidden"] = 96
    path.write_text(json.dumps(config))
    with pytest.raises(
        ExportError, match=r"ffn\.w_gate_up\.weight has shape \(128, 32\), config implies \(192, 32\)"
    ):
        load_export(exported)


def test_bad_config_is_reported(exported):
    path = exported / "config.json"
    config = json.loads(path.read_text())
    config["model"]["n_kv_heads"] = 3
    path.write_text(json.dumps(config))
    with pytest.raises(ExportError, match="bad model config: n_heads"):
        load_export(exported)
    path.write_text("{not json")
    with pytest.raises(ExportError, match="not valid JSON"):
        load_export(exported)


def test_not_an_export_directory(tmp_path):
    with pytest.raises(ExportError, match="does not exist"):
        load_export(tmp_path / "absent")
    with pytest.raises(ExportError, match="not a runyard export"):
        load_export(tmp_path)


def test_loading_does_not_touch_the_global_rng(exported):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    load_export(exported)
    assert torch.equal(torch.rand(3), expected)


def test_unserialisable_extra_config_is_refused_cleanly(tmp_path, tokenizer, tokenizer_path, make_model):
    model = make_model(tokenizer)
    with pytest.raises(ExportError, match="JSON-serialisable"):
        export_model(model, model.cfg, tokenizer_path, tmp_path / "export", extra_config={"when": object()})
    assert os.listdir(tmp_path) == []
