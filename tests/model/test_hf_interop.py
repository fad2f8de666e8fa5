"""Hugging Face model directories in and out: for every architecture runyard loads, a small random model
saved by transformers gives runyard the same logits (fp32, within 1e-5), hf -> runyard -> hf is bitwise
on weights, transformers loads what runyard writes (sharded too), and every directory runyard cannot
take exactly is refused naming the file and the field or tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from runyard.errors import RunyardError
from runyard.model import hf
from runyard.model.config import ModelConfig
from runyard.model.hf.weights import read_headers
from runyard.model.transformer import Transformer

from .hf_models import CASES, hf_model, save_hf_model

ATOL = 1e-5


def all_weights(directory) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def tokens(vocab: int, length: int = 48) -> torch.Tensor:
    return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_model_loads_with_equal_logits_and_round_trips_bitwise(tmp_path, case):
    theirs = hf_model(case)
    source = save_hf_model(theirs, tmp_path / "hf", tokenizer=False)
    ours = hf.load_model(source)
    idx = tokens(theirs.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), theirs(idx).logits, rtol=0, atol=ATOL)
    assert ours.cfg.qkv_bias is (CASES[case][0] == "Qwen2ForCausalLM")
    assert ours.cfg.tie_embeddings is theirs.config.tie_word_embeddings

    out = tmp_path / "out"
    out.mkdir()
    hf.write_model(ours, ours.cfg, out)
    before, after = all_weights(source), all_weights(out)
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor) and after[name].dtype == tensor.dtype, name
    assert hf.read_config(out) == ours.cfg

    again = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(again).__name__ == (CASES[case][0] if case != "mistral" else "LlamaForCausalLM")
    with torch.no_grad():
        torch.testing.assert_close(again(idx).logits, theirs(idx).logits, rtol=0, atol=ATOL)


def test_sharded_directories_in_and_out(tmp_path):
    theirs = hf_model("qwen2")
    source = save_hf_model(theirs, tmp_path / "hf", max_shard_size=20_000, tokenizer=False)
    index = json.loads((source / hf.INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 3  # really sharded
    ours = hf.load_model(source)
    idx = tokens(theirs.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), theirs(idx).logits, rtol=0, atol=ATOL)

    out = tmp_path / "out"
    out.mkdir()
    names = hf.write_model(ours, ours.cfg, out, max_shard_bytes=20_000)
    assert hf.INDEX_FILE in names and "model-00001-of-" in " ".join(names)
    written = json.loads((out / hf.INDEX_FILE).read_text())
    assert sorted(written["weight_map"]) == sorted(index["weight_map"])
    assert written["metadata"]["total_size"] == sum(t.numel() * 4 for t in all_weights(out).values())
    again = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(idx).logits, theirs(idx).logits, rtol=0, atol=ATOL)
    assert all(torch.equal(all_weights(out)[k], v) for k, v in all_weights(source).items())


def test_name_mapping_round_trips_bitwise_both_ways():
    cfg = ModelConfig(vocab_size=50, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=48,
                      context_length=16, tie_embeddings=False, qkv_bias=True)
    torch.manual_seed(0)
    model = Transformer(cfg)
    state = {k: v.normal_() for k, v in model.state_dict().items()}
    theirs = hf.runyard_to_hf(state, cfg)
    assert len(theirs) == len(state) + 5 * cfg.n_layers  # per layer q/k/v weight +2, q/k/v bias +2, gate/up +1
    assert theirs["model.layers.2.self_attn.k_proj.bias"].shape == (16,)
    back = hf.hf_to_runyard(theirs, cfg)
    assert sorted(back) == sorted(state) and all(torch.equal(back[k], state[k]) for k in state)
    again = hf.runyard_to_hf(back, cfg)
    assert all(torch.equal(again[k], theirs[k]) for k in theirs)


def test_bf16_weights_load_exactly_into_fp32(tmp_path):
    theirs = hf_model("llama").to(torch.bfloat16)
    source = save_hf_model(theirs, tmp_path / "hf", tokenizer=False)
    ours = hf.load_model(source)
    assert ours.tok_emb.weight.dtype == torch.float32
    assert torch.equal(ours.tok_emb.weight, theirs.model.embed_tokens.weight.float())


# --- what runyard refuses, and how it says so ------------------------------------------------------------


@pytest.fixture()
def llama_dir(tmp_path):
    return save_hf_model(hf_model("llama"), tmp_path / "hf", tokenizer=False)


def edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is ...:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("changes", "field", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures", "runyard loads exactly one of"),
        ({"architectures": ..., "model_type": "gpt2"}, "model_type", "names no architecture runyard loads"),
        ({"model_type": "qwen2"}, "model_type", "does not match architecture LlamaForCausalLM"),
        ({"hidden_act": "gelu"}, "hidden_act", "= 'gelu' is not supported"),
        ({"attention_bias": True}, "attention_bias", "biases on every attention projection"),
        ({"mlp_bias": True}, "mlp_bias", "biases in the feed-forward layer"),
        ({"head_dim": 16}, "head_dim", "differs from hidden_size / num_attention_heads"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}},
         "rope_parameters.rope_type", "= 'yarn' is not supported"),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}},
         "rope_parameters.rope_type", "= 'dynamic' is not supported"),
        ({"rope_parameters": ..., "rope_scaling": {"type": "longrope", "factor": 2.0}}, "rope_scaling.rope_type",
         "= 'longrope' is not supported"),
        ({"attention_dropout": 0.1}, "attention_dropout", "dropout inside attention"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config", "quantized weights"),
        ({"my_new_idea": 3}, "my_new_idea", "is not a field runyard knows for LlamaForCausalLM"),
        ({"hidden_size": ...}, "hidden_size", "is missing"),
        ({"num_key_value_heads": 3}, None, "n_heads (4) must be a multiple of n_kv_heads (3)"),
    ],
)
def test_unsupported_config_values_are_refused_naming_file_and_field(llama_dir, changes, field, message):
    edit_config(llama_dir, **changes)
    with pytest.raises(hf.ModelDirectoryError) as info:
        hf.load_model(llama_dir)
    text = str(info.value)
    assert str(llama_dir / "config.json") in text and message in text
    assert info.value.field == field and (field is None or f"field {field!r}" in text)
    assert isinstance(info.value, RunyardError)


def test_a_sliding_window_shorter_than_the_context_is_refused(tmp_path):
    directory = save_hf_model(hf_model("mistral", sliding_window=16), tmp_path / "m", tokenizer=False)
    with pytest.raises(hf.ModelDirectoryError, match=r"field 'sliding_window': = 16 is shorter than "
                                                     r"max_position_embeddings = 64"):
        hf.load_model(directory)
    qwen = save_hf_model(hf_model("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0),
                         tmp_path / "q", tokenizer=False)
    with pytest.raises(hf.ModelDirectoryError, match="field 'sliding_window'"):
        hf.load_model(qwen)


def test_missing_and_malformed_directories(tmp_path, llama_dir):
    with pytest.raises(hf.ModelDirectoryError, match=r"config\.json: is missing"):
        hf.load_model(tmp_path / "nowhere")
    (llama_dir / "config.json").write_text("{oops")
    with pytest.raises(hf.ModelDirectoryError, match="is not readable JSON"):
        hf.load_model(llama_dir)
    (llama_dir / "config.json").write_text("[1, 2]")
    with pytest.raises(hf.ModelDirectoryError, match="must hold a JSON object"):
        hf.load_model(llama_dir)


def test_weights_that_do_not_match_config_json(tmp_path, llama_dir):
    weights = load_file(str(llama_dir / "model.safetensors"))
    saved = dict(weights)

    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(llama_dir / "model.safetensors"))
    with pytest.raises(hf.ModelDirectoryError, match=r"lack 1 tensor\(s\).*model\.layers\.1\.mlp\.up_proj\.weight"):
        hf.load_model(llama_dir)

    weights = {**saved, "model.layers.0.self_attn.q_proj.bias": torch.zeros(32)}
    save_file(weights, str(llama_dir / "model.safetensors"))
    with pytest.raises(hf.ModelDirectoryError, match=r"model\.safetensors: holds 1 tensor\(s\) a model of this "
                                                     r"config\.json does not have: .*q_proj\.bias"):
        hf.load_model(llama_dir)

    weights = {**saved, "model.norm.weight": torch.ones(31)}
    save_file(weights, str(llama_dir / "model.safetensors"))
    with pytest.raises(hf.ModelDirectoryError, match=r"tensor 'model\.norm\.weight' has shape \(31,\), config\.json "
                                                     r"implies \(32,\)"):
        hf.load_model(llama_dir)

    weights = {**saved, "model.norm.weight": torch.ones(32, dtype=torch.int8)}
    save_file(weights, str(llama_dir / "model.safetensors"))
    with pytest.raises(hf.ModelDirectoryError, match=r"tensor 'model\.norm\.weight' is I8"):
        hf.load_model(llama_dir)

    # Older transformers saved rotary buffers with the weights: derived from the config, they are skipped.
    save_file({**saved, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}, str(llama_dir / "model.safetensors"))
    hf.load_model(llama_dir)


def test_a_tied_head_stored_anyway_must_equal_the_embedding(tmp_path):
    directory = save_hf_model(hf_model("qwen2-tied"), tmp_path / "q", tokenizer=False)
    weights = load_file(str(directory / "model.safetensors"))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, str(directory / "model.safetensors"))
    hf.load_model(directory)  # equal: accepted
    weights["lm_head.weight"][0, 0] += 1
    save_file(weights, str(directory / "model.safetensors"))
    with pytest.raises(hf.ModelDirectoryError, match="'lm_head.weight' differs from 'model.embed_tokens.weight'"):
        hf.load_model(directory)


def test_weight_files_and_indexes_that_are_missing_or_escape_the_directory(tmp_path, llama_dir):
    (llama_dir / "model.safetensors").rename(llama_dir / "pytorch_model.bin")
    with pytest.raises(hf.ModelDirectoryError, match=r"pytorch_model\.bin: holds the weights as a pickle.*convert it to safetensors"):
        hf.load_model(llama_dir)

    sharded = save_hf_model(hf_model("llama"), tmp_path / "sharded", max_shard_size=20_000, tokenizer=False)
    index_path = sharded / hf.INDEX_FILE
    index = json.loads(index_path.read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    moved = tmp_path / shard
    shutil.move(sharded / shard, moved)
    with pytest.raises(hf.ModelDirectoryError, match=rf"{shard}: is missing \(the index lists it for"):
        hf.load_model(sharded)
    shutil.move(moved, sharded / shard)

    name = next(iter(index["weight_map"]))
    index_path.write_text(json.dumps({"weight_map": {**index["weight_map"], name: "../elsewhere.safetensors"}}))
    with pytest.raises(hf.ModelDirectoryError, match=r"field 'weight_map'.*not a file of this directory"):
        hf.load_model(sharded)

    other = sorted(set(index["weight_map"].values()) - {index["weight_map"][name]})[0]
    index_path.write_text(json.dumps({"weight_map": {**index["weight_map"], name: other}}))
    with pytest.raises(hf.ModelDirectoryError, match=rf"lists {name!r} in {other}, which does not hold it"):
        hf.load_model(sharded)

    (sharded / other).write_bytes(b"not safetensors")
    with pytest.raises(hf.ModelDirectoryError, match="is not a readable safetensors file"):
        read_headers(sharded)
