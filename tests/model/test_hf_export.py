"""The export is a Hugging Face model directory with runyard's provenance beside it: runyard loads it back
with the same logits, transformers loads it with logits equal to runyard's, and damage is a clear error."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from safetensors import safe_open

from runyard.errors import RunyardError
from runyard.model.hf.export import ExportError, export_model, load_export, read_export_config
from runyard.serve.vllm_engine import check_hf_directory

EXPORT_FILES = ["config.json", "generation_config.json", "model.safetensors", "runyard.json", "tokenizer.json",
                "tokenizer_config.json"]


@pytest.mark.parametrize("tie", [True, False])
def test_export_then_load_gives_identical_logits(tmp_path, tokenizer, tokenizer_path, tie, make_model):
    model = make_model(tokenizer, tie=tie)
    out = export_model(model, model.cfg, tokenizer_path, tmp_path / "export", extra_config={"step": 7})
    assert sorted(p.name for p in out.iterdir()) == EXPORT_FILES
    loaded, cfg, tok = load_export(out)
    assert cfg == model.cfg
    assert tok.get_vocab() == tokenizer.get_vocab()
    idx = torch.tensor([tokenizer.encode("def add(a, b):").ids])
    with torch.no_grad():
        assert torch.equal(loaded(idx), model(idx))
    assert (loaded.lm_head.weight is loaded.tok_emb.weight) is tie
    provenance = read_export_config(out)
    assert provenance["extra"] == {"step": 7}
    assert sorted(provenance["files"]) == [name for name in EXPORT_FILES if name != "runyard.json"]


@pytest.mark.parametrize("tie", [True, False])
def test_transformers_loads_the_export_with_equal_logits(tmp_path, tokenizer, tokenizer_path, tie, make_model):
    model = make_model(tokenizer, tie=tie, seed=3)
    out = export_model(model, model.cfg, tokenizer_path, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is tie
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(theirs).__name__ == "LlamaForCausalLM"
    idx = torch.randint(0, model.cfg.vocab_size, (2, model.cfg.context_length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(idx).logits, model(idx), rtol=0, atol=1e-5)
    # The tokenizer files load too, and tokenize as runyard's tokenizer does.
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok("def add(a, b):")["input_ids"] == tokenizer.encode("def add(a, b):").ids
    assert hf_tok.eos_token == "<|endoftext|>"
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.token_to_id("<|endoftext|>")
    assert check_hf_directory(out)["architectures"] == ["LlamaForCausalLM"]  # what `serve --engine vllm` checks


def test_chat_template_and_a_model_directorys_tokenizer_config_are_carried(tmp_path, tokenizer, tokenizer_path,
                                                                         make_model):
    model = make_model(tokenizer)
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    out = export_model(model, model.cfg, tokenizer_path, tmp_path / "a", chat_template=template)
    # Where transformers 5's save_pretrained writes it, and nowhere else.
    assert (out / "chat_template.jinja").read_text() == template
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())
    own = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": {"content": "<|endoftext|>"}, "custom": 1}
    out = export_model(model, model.cfg, tokenizer_path, tmp_path / "b", tokenizer_config=own,
                       generation_config={"eos_token_id": [0, 1], "do_sample": True})
    assert json.loads((out / "tokenizer_config.json").read_text()) == own
    assert json.loads((out / "generation_config.json").read_text()) == {"eos_token_id": [0, 1], "do_sample": True}
    with pytest.raises(ExportError, match="eos_token '</s>' is not in"):
        export_model(model, model.cfg, tokenizer_path, tmp_path / "c", tokenizer_config={"eos_token": "</s>"})


def test_tied_weights_saved_once_under_the_ecosystems_names(tmp_path, tokenizer, tokenizer_path, make_model):
    model = make_model(tokenizer, tie=True)
    out = export_model(model, model.cfg, tokenizer_path, tmp_path / "export")
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"} <= keys
    # q, k, v and gate, up are stored apart (runyard fuses them): 5 more tensors per layer, the head once.
    assert len(keys) == len(model.state_dict()) - 1 + 3 * model.cfg.n_layers


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
    before = (tmp_path / "export" / "runyard.json").read_text()
    with pytest.raises(ExportError, match="does not exist"):
        export_model(model, model.cfg, tmp_path / "nope.json", tmp_path / "export")
    assert (tmp_path / "export" / "runyard.json").read_text() == before
    assert os.listdir(tmp_path) == ["export"]


@pytest.fixture()
def exported(tmp_path, tokenizer, tokenizer_path, make_model):
    model = make_model(tokenizer)
    return export_model(model, model.cfg, tokenizer_path, tmp_path / "export")


@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json",
                                  "runyard.json"])
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


def test_a_truncated_file_is_refused_by_its_recorded_size(exported):
    path = exported / "model.safetensors"
    size = path.stat().st_size
    assert read_export_config(exported)["sizes"]["model.safetensors"] == size
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(ExportError, match=rf"model\.safetensors fails its checksum: it has {size - 100} bytes"):
        load_export(exported)


@pytest.mark.parametrize("name", ["tokenizer.json", "config.json"])
def test_tampered_json_files_fail_the_checksum(exported, name):
    path = exported / name
    path.write_text(path.read_text().replace('"<|endoftext|>"', '"<|end|>"', 1).replace('"silu"', '"gelu"'))
    with pytest.raises(ExportError, match=rf"{name.replace('.', '[.]')} fails its checksum"):
        load_export(exported)


def test_provenance_that_contradicts_config_json_is_reported(exported):
    path = exported / "runyard.json"
    record = json.loads(path.read_text())
    record["model"]["ffn_hidden"] = 96
    path.write_text(json.dumps(record))
    with pytest.raises(ExportError, match=r"config\.json: describes ffn_hidden 64 \(expected 96\)"):
        load_export(exported)


def test_bad_config_is_reported(exported):
    path = exported / "runyard.json"
    record = json.loads(path.read_text())
    record["model"]["n_kv_heads"] = 3
    path.write_text(json.dumps(record))
    with pytest.raises(ExportError, match="bad model config: n_heads"):
        load_export(exported)
    path.write_text("{not json")
    with pytest.raises(ExportError, match="not valid JSON"):
        load_export(exported)


def test_not_an_export_directory(tmp_path, exported):
    with pytest.raises(ExportError, match="does not exist"):
        load_export(tmp_path / "absent")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ExportError, match="not a runyard export"):
        load_export(empty)
    (exported / "runyard.json").unlink()  # a plain Hugging Face directory now
    with pytest.raises(ExportError, match=r"runyard\.json is missing.*\{from: hf"):
        load_export(exported)


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


def test_the_drift_reference_is_part_of_the_export_and_a_missing_file_is_refused(tmp_path, tokenizer, tokenizer_path,
                                                                                 make_model):
    """Files the caller adds (the run's drift reference) are written before the rename and listed in
    runyard.json; an export missing any listed file is refused naming it."""
    import numpy as np

    from runyard.serve.drift import DRIFT_FILES, REFERENCE_FILE, SAMPLE_FILE, DriftReference

    model = make_model(tokenizer)
    reference = DriftReference(np.arange(model.cfg.vocab_size), chunks=np.zeros((4, 8), dtype=np.int64))
    seen = {}

    def drift(directory):
        seen["dir"] = directory
        assert directory.name != "export"  # written into the temporary directory, before the rename
        reference.save(directory)
        return [n for n in DRIFT_FILES if (directory / n).is_file()]

    out = export_model(model, model.cfg, tokenizer_path, tmp_path / "export", extra_files=drift)
    assert not seen["dir"].exists()
    listed = read_export_config(out)["files"]
    assert REFERENCE_FILE in listed and SAMPLE_FILE in listed
    load_export(out)
    assert DriftReference.load(out) is not None
    (out / SAMPLE_FILE).unlink()
    with pytest.raises(ExportError, match=SAMPLE_FILE):
        load_export(out)
