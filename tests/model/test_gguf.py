"""GGUF out (model/hf/gguf.py, `runyard export-gguf`): the file read back with the gguf package's own reader
(metadata, tokenizer arrays, every tensor against the export's safetensors), the rotary permutation checked
against the rotation it stands for, refusals named; and, where llama-cpp-python is installed (the `bench`
extra), llama.cpp loading the file: its greedy continuation equals runyard's, and held-out perplexity in
f32 and q8_0 beside runyard's own."""

from __future__ import annotations

import json
import math
import sysconfig
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from runyard.cli import main
from runyard.model.config import ModelConfig
from runyard.model.hf.export import export_eos_ids, export_model, load_export
from runyard.model.hf.gguf import TYPES, default_gguf_path, write_gguf
from runyard.model.registry import ExportError
from runyard.model.transformer import Transformer
from runyard.serve.engine import Generator
from tests.model.small_model import TEXTS

CHAT_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
PERMUTED = {"attn_q": "n_heads", "attn_k": "n_kv_heads"}


@pytest.fixture(scope="module")
def export(tmp_path_factory, tokenizer_path) -> Path:
    """An untied small model (so the output head is a tensor of its own) with a chat template."""
    tok = Tokenizer.from_file(str(tokenizer_path))
    cfg = ModelConfig(vocab_size=tok.get_vocab_size() + 4, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      ffn_hidden=96, context_length=64, tie_embeddings=False, rope_theta=5000.0)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    return export_model(model, cfg, tokenizer_path, tmp_path_factory.mktemp("gguf") / "export",
                        chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def written(export, tmp_path_factory) -> dict[str, gguf.GGUFReader]:
    out = tmp_path_factory.mktemp("files")
    return {name: gguf.GGUFReader(write_gguf(export, out / f"m.{name}.gguf", name)) for name in TYPES}


def field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


def hf_tensors(export: Path) -> dict[str, torch.Tensor]:
    return load_file(str(export / "model.safetensors"))


def gguf_name(hf_name: str) -> str:
    """The llama.cpp name, written out here rather than asked of the package the module uses."""
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, block, rest = hf_name.split(".", 3)
    short = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
             "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
             "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
             "mlp.down_proj.weight": "ffn_down.weight"}[rest]
    return f"blk.{block}.{short}"


def rope_halves(x: torch.Tensor, pos: int, theta: float) -> torch.Tensor:
    """transformers' Llama rotation of one head's vector: x[i] pairs with x[i + d/2]."""
    d = x.shape[-1]
    freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d) * pos
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * freq.cos() - b * freq.sin(), b * freq.cos() + a * freq.sin()], -1)


def rope_pairs(x: torch.Tensor, pos: int, theta: float) -> torch.Tensor:
    """llama.cpp's `llama` rotation (GGML_ROPE_TYPE_NORM): x[2i] pairs with x[2i + 1]."""
    d = x.shape[-1]
    freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d) * pos
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * freq.cos() - b * freq.sin(), b * freq.cos() + a * freq.sin()], -1).flatten(-2)


def test_metadata_declares_the_llama_architecture_and_the_models_shape(written, export):
    cfg = json.loads((export / "config.json").read_text())
    for reader in written.values():
        assert field(reader, "general.architecture") == "llama"
        assert field(reader, "llama.block_count") == cfg["num_hidden_layers"]
        assert field(reader, "llama.embedding_length") == cfg["hidden_size"]
        assert field(reader, "llama.feed_forward_length") == cfg["intermediate_size"]
        assert field(reader, "llama.attention.head_count") == cfg["num_attention_heads"]
        assert field(reader, "llama.attention.head_count_kv") == cfg["num_key_value_heads"]
        assert field(reader, "llama.context_length") == cfg["max_position_embeddings"]
        assert field(reader, "llama.rope.dimension_count") == cfg["head_dim"]
        assert field(reader, "llama.rope.freq_base") == pytest.approx(5000.0)
        assert field(reader, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(cfg["rms_norm_eps"])
        assert field(reader, "llama.vocab_size") == cfg["vocab_size"]
    assert {name: field(r, "general.file_type") for name, r in written.items()} == {
        "f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
        "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}


def test_the_tokenizer_is_the_exports_in_id_order_with_its_merges_special_tokens_and_chat_template(written, export):
    reader = written["f32"]
    spec = json.loads((export / "tokenizer.json").read_text())
    tok = Tokenizer.from_file(str(export / "tokenizer.json"))
    n_model = json.loads((export / "config.json").read_text())["vocab_size"]
    tokens, types = field(reader, "tokenizer.ggml.tokens"), field(reader, "tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == n_model
    eos = tok.token_to_id("<|endoftext|>")
    for i in range(tok.get_vocab_size()):
        assert tokens[i] == tok.id_to_token(i)
        assert types[i] == (gguf.TokenType.CONTROL if i == eos else gguf.TokenType.NORMAL)
    # ids the model has beyond the tokenizer's vocabulary are placeholders llama.cpp never produces
    assert tokens[tok.get_vocab_size():] == [f"[PAD{i}]" for i in range(tok.get_vocab_size(), n_model)]
    assert set(types[tok.get_vocab_size():]) == {gguf.TokenType.UNUSED}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    assert field(reader, "tokenizer.ggml.merges") == merges
    assert field(reader, "tokenizer.ggml.model") == "gpt2"
    assert field(reader, "tokenizer.ggml.pre") == "gpt-2"
    assert field(reader, "tokenizer.ggml.eos_token_id") == eos
    assert field(reader, "tokenizer.ggml.bos_token_id") == eos  # no start token: GPT-2's convention
    assert field(reader, "tokenizer.ggml.add_bos_token") is False
    assert field(reader, "tokenizer.chat_template") == CHAT_TEMPLATE


def test_f32_tensors_are_the_exports_bit_for_bit_with_query_and_key_rows_in_rotary_pairs(written, export):
    cfg = json.loads((export / "config.json").read_text())
    hf = hf_tensors(export)
    got = {t.name: t for t in written["f32"].tensors}
    assert sorted(got) == sorted(gguf_name(n) for n in hf)
    head_dim = cfg["head_dim"]
    for name, tensor in hf.items():
        t = got[gguf_name(name)]
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        data = np.asarray(t.data).reshape(tuple(tensor.shape))
        kind = gguf_name(name).split(".")[-2]
        if kind in PERMUTED:
            heads = cfg["num_attention_heads" if kind == "attn_q" else "num_key_value_heads"]
            # row r of head h's second half sits right after row r of its first half
            expected = tensor.reshape(heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(tensor.shape)
            assert not torch.equal(expected, tensor)
        else:
            expected = tensor
        assert np.array_equal(data.view(np.uint32), expected.numpy().view(np.uint32)), name


def test_the_permutation_makes_llama_cpps_rotation_compute_transformers_attention_scores(written, export):
    """Scores q.k after rotation: the export's rows under transformers' rotation equal the file's rows under
    llama.cpp's. A wrong permutation (or none) changes every score."""
    cfg = json.loads((export / "config.json").read_text())
    hf = {k: v.double() for k, v in hf_tensors(export).items()}
    got = {t.name: torch.from_numpy(np.asarray(t.data).astype(np.float64)) for t in written["f32"].tensors}
    d, hd, theta = cfg["hidden_size"], cfg["head_dim"], cfg["rope_theta"]
    x = torch.randn(2, d, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for layer in range(cfg["num_hidden_layers"]):
        theirs = f"model.layers.{layer}.self_attn."
        ours = f"blk.{layer}."
        q_hf = (hf[theirs + "q_proj.weight"] @ x[0]).view(-1, hd)
        k_hf = (hf[theirs + "k_proj.weight"] @ x[1]).view(-1, hd)
        q_gg = (got[ours + "attn_q.weight"].view(-1, d) @ x[0]).view(-1, hd)
        k_gg = (got[ours + "attn_k.weight"].view(-1, d) @ x[1]).view(-1, hd)
        group = cfg["num_attention_heads"] // cfg["num_key_value_heads"]
        for head in range(cfg["num_attention_heads"]):
            want = rope_halves(q_hf[head], 7, theta) @ rope_halves(k_hf[head // group], 3, theta)
            have = rope_pairs(q_gg[head], 7, theta) @ rope_pairs(k_gg[head // group], 3, theta)
            assert have.item() == pytest.approx(want.item(), rel=1e-9, abs=1e-12)


def test_norms_stay_f32_and_matrices_are_stored_in_the_type_asked(written, export):
    hf = hf_tensors(export)
    for type_name, reader in written.items():
        qtype = TYPES[type_name][0]
        for t in reader.tensors:
            assert t.tensor_type == (gguf.GGMLQuantizationType.F32 if len(t.shape) == 1 else qtype), (type_name, t.name)
    f32 = {t.name: np.asarray(t.data) for t in written["f32"].tensors}
    for name in ("f16", "bf16"):
        for t in written[name].tensors:
            if len(t.shape) > 1:
                values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(f32[t.name].shape)
                rounded = torch.tensor(f32[t.name]).to(torch.float16 if name == "f16" else torch.bfloat16)
                assert np.array_equal(values, rounded.float().numpy()), (name, t.name)
    assert len(hf) == len(f32)


def test_q8_0_dequantises_to_the_f32_weights_within_half_a_step_of_each_block(written):
    f32 = {t.name: np.asarray(t.data) for t in written["f32"].tensors}
    for t in written["q8_0"].tensors:
        if t.tensor_type != gguf.GGMLQuantizationType.Q8_0:
            continue
        exact = f32[t.name].reshape(-1, 32)
        values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(exact.shape)
        step = np.abs(exact).max(axis=1, keepdims=True) / 127  # each block: 8-bit steps of its largest weight / 127
        error = np.abs(values - exact)
        # half a step of rounding, plus the scale's own f16 rounding (relative 2^-11) times up to 127 steps
        assert (error <= step * (0.5 + 127 * 2.0**-11) + 1e-12).all(), t.name
        assert error.max() > 0  # it is quantised, not a copy


def test_the_command_writes_beside_the_run_and_where_told(export, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "export").symlink_to(export, target_is_directory=True)
    assert main(["export-gguf", str(run), "--type", "q8_0"]) == 0
    assert default_gguf_path(run / "export", "q8_0") == run / "model.q8_0.gguf"
    assert gguf.GGUFReader(run / "model.q8_0.gguf").fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q8_0
    assert "model.q8_0.gguf" in capsys.readouterr().out
    out = tmp_path / "elsewhere" / "m.gguf"
    assert main(["export-gguf", str(export), "--out", str(out)]) == 0
    assert field(gguf.GGUFReader(out), "general.file_type") == gguf.LlamaFileType.ALL_F32
    assert [p.name for p in out.parent.iterdir()] == ["m.gguf"]  # no temporary file left


def test_a_modified_export_is_refused_before_anything_is_written(export, tmp_path):
    copy = tmp_path / "export"
    copy.mkdir()
    for path in export.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    with open(copy / "model.safetensors", "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\x00\x00\x80\x7f")
    with pytest.raises(ExportError, match="model.safetensors fails its checksum"):
        write_gguf(copy, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()


def test_a_tokenizer_without_gpt2s_byte_level_split_is_refused_naming_its_pre_tokenizer(tmp_path, make_model,
                                                                                      tokenizer):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=200, special_tokens=["<|endoftext|>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    model = make_model(tokenizer)
    export = export_model(model, model.cfg, tmp_path / "tokenizer.json", tmp_path / "export")
    with pytest.raises(ExportError, match=r"pre_tokenizer .*Whitespace.* is not GPT-2's byte-level split"):
        write_gguf(export, tmp_path / "m.gguf")


def test_a_model_with_qkv_biases_is_refused(tmp_path, tokenizer_path, tokenizer):
    cfg = ModelConfig(vocab_size=tokenizer.get_vocab_size(), d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                      ffn_hidden=64, context_length=32, qkv_bias=True)
    export = export_model(Transformer(cfg).eval(), cfg, tokenizer_path, tmp_path / "export")
    with pytest.raises(ExportError, match="query/key/value biases"):
        write_gguf(export, tmp_path / "m.gguf")
    with pytest.raises(ExportError, match="'q4_k' is not one runyard writes"):
        write_gguf(export, tmp_path / "m.gguf", "q4_k")


# llama.cpp itself -------------------------------------------------------------------------------------------

STDLIB = Path(sysconfig.get_paths()["stdlib"])
PROMPTS = ["def ", "import re\n", "class JSON", "    if ", "        return s  # café ✓\n"]


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        pytest.skip("llama-cpp-python is not installed (the `bench` extra; it builds llama.cpp from source)")
    return llama_cpp


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tokenizer_path):
    """A small model trained for a few seconds on the standard library's json package; held-out text comes
    from its email package."""
    _llama_cpp()  # skip before training when there is no llama.cpp to compare with
    tok = Tokenizer.from_file(str(tokenizer_path))
    cfg = ModelConfig(vocab_size=tok.get_vocab_size(), d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      ffn_hidden=128, context_length=64, tie_embeddings=True)
    torch.manual_seed(0)
    model = Transformer(cfg)
    texts = [path.read_text(encoding="utf-8") for path in sorted((STDLIB / "json").glob("*.py"))]
    ids = torch.tensor([i for text in texts for i in tok.encode(text + "<|endoftext|>").ids])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        starts = torch.randint(0, len(ids) - 33, (16,), generator=gen)
        batch = torch.stack([ids[s:s + 33] for s in starts])
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    export = export_model(model, cfg, tokenizer_path, tmp_path_factory.mktemp("trained") / "export")
    files = {name: write_gguf(export, export.parent / f"m.{name}.gguf", name) for name in ("f32", "q8_0")}
    return export, files


def _nll(logits: np.ndarray, targets: list[int]) -> float:
    logits = logits.astype(np.float64)
    top = logits.max(axis=1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(axis=1, keepdims=True))
    return float(-logp[np.arange(len(targets)), targets].mean())


def test_llama_cpp_continues_greedily_as_runyard_does_and_q8_0_perplexity_stays_near_f32(trained):
    llama_cpp = _llama_cpp()
    export, files = trained
    model, _cfg, tok = load_export(export)  # what `runyard generate` runs
    llms = {name: llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=1, n_batch=64, logits_all=True,
                                  verbose=False, seed=0) for name, path in files.items()}
    llm = llms["f32"]
    generator = Generator(model, tok, eos_ids=export_eos_ids(export, tok))
    continued = set()
    for prompt in PROMPTS:
        ids = tok.encode(prompt).ids
        assert llm.tokenize(prompt.encode(), add_bos=False, special=True) == ids, prompt
        ours = list(generator.iter_ids(ids, max_tokens=20, temperature=0.0, stop_at_eos=False))
        llm.reset()
        llm.eval(ids)
        theirs = []
        for _ in range(20):
            theirs.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval([theirs[-1]])
        assert theirs == ours, prompt
        continued.update(ours)
    assert len(continued) > 10  # a trained model's continuations, not one repeated token

    stream = tok.encode((STDLIB / "email" / "_parseaddr.py").read_text(encoding="utf-8")).ids
    windows = [stream[i:i + 64] for i in range(0, 16 * 64, 64)]  # 16 windows of the model's context
    with torch.inference_mode():
        nll = {"runyard": np.mean([_nll(model(torch.tensor([w]))[0, :-1].numpy(), w[1:]) for w in windows])}
    for name, llm in llms.items():
        scores = []
        for w in windows:
            llm.reset()
            llm.eval(w)
            scores.append(_nll(np.asarray(llm.scores[: len(w) - 1]), w[1:]))
        nll[name] = np.mean(scores)
    ppl = {name: math.exp(value) for name, value in nll.items()}
    print(f"held-out perplexity ({len(windows)} windows of 64 tokens): "
          + ", ".join(f"{k} {v:.4f}" for k, v in ppl.items()))
    assert ppl["f32"] == pytest.approx(ppl["runyard"], rel=1e-4)
    assert ppl["q8_0"] == pytest.approx(ppl["f32"], rel=0.02)
