"""The decoder's math: shapes, causality, GQA, KV-cache decoding, parameter and FLOP counts, init."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from runyard.model.config import ModelConfig, default_ffn_hidden
from runyard.model.transformer import Transformer
from runyard.spec.job import ModelSpec

torch.set_num_threads(1)


def tiny(**overrides) -> ModelConfig:
    base = dict(
        vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, context_length=24
    )
    base.update(overrides)
    return ModelConfig(**base)


def build(cfg: ModelConfig, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(cfg).eval()


def test_logits_shape_and_dtype():
    model = build(tiny())
    idx = torch.randint(0, 97, (3, 11))
    logits = model(idx)
    assert logits.shape == (3, 11, 97)
    assert logits.dtype == torch.float32


def test_init_is_deterministic_given_seed_and_differs_across_seeds():
    a, b, c = build(tiny(), 1), build(tiny(), 1), build(tiny(), 2)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)


def test_residual_projections_have_scaled_init():
    cfg = tiny(d_model=64, n_layers=8, ffn_hidden=256, vocab_size=512)
    model = build(cfg)
    expected = 0.02 / math.sqrt(2 * cfg.n_layers)
    wo = torch.cat([b.attn.wo.weight.flatten() for b in model.blocks])
    down = torch.cat([b.ffn.w_down.weight.flatten() for b in model.blocks])
    qkv = torch.cat([b.attn.wqkv.weight.flatten() for b in model.blocks])
    assert wo.std().item() == pytest.approx(expected, rel=0.05)
    assert down.std().item() == pytest.approx(expected, rel=0.05)
    assert qkv.std().item() == pytest.approx(0.02, rel=0.05)


def test_future_tokens_do_not_change_past_logits():
    model = build(tiny())
    idx = torch.randint(0, 97, (2, 16))
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 97
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])  # the change is visible where it should be


def test_gqa_equals_mha_with_repeated_kv_heads():
    """A GQA model equals an MHA model whose K/V heads are the GQA ones, each repeated n_heads/n_kv times."""
    gqa = build(tiny(n_kv_heads=2))
    mha = build(tiny(n_kv_heads=4))
    H, KV, hd = 4, 2, 8
    state = gqa.state_dict()
    for i in range(2):
        w = state[f"blocks.{i}.attn.wqkv.weight"]
        q, k, v = w.split([H * hd, KV * hd, KV * hd])
        rep = lambda t: t.view(KV, hd, -1).repeat_interleave(H // KV, dim=0).reshape(H * hd, -1)  # noqa: E731
        state[f"blocks.{i}.attn.wqkv.weight"] = torch.cat([q, rep(k), rep(v)])
    mha.load_state_dict(state)
    idx = torch.randint(0, 97, (2, 12))
    torch.testing.assert_close(mha(idx), gqa(idx), rtol=1e-5, atol=1e-5)


def test_mha_matches_a_reference_attention_written_out():
    """Cross-check SDPA + rotary against explicit softmax(QK^T/sqrt(d) + causal mask) V."""
    cfg = tiny(n_kv_heads=4, n_layers=1)
    model = build(cfg)
    idx = torch.randint(0, 97, (1, 9))
    block = model.blocks[0]
    x = model.tok_emb(idx)
    h = block.attn_norm(x)
    q, k, v = block.attn.wqkv(h).view(1, 9, 12, 8).split([4, 4, 4], dim=2)
    pos = torch.arange(9, dtype=torch.float32)
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    ang = torch.outer(pos, inv)
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]

    def rotate_half(t):
        return torch.cat([-t[..., 4:], t[..., :4]], dim=-1)

    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(8)
    scores = scores.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
    att = (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, 9, 32)
    x = x + block.attn.wo(att)
    gate, up = block.ffn.w_gate_up(block.ffn_norm(x)).chunk(2, -1)
    x = x + block.ffn.w_down(F.silu(gate) * up)
    expected = model.lm_head(model.norm(x))
    torch.testing.assert_close(model(idx), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_kv_cache_decoding_equals_full_forward_greedy(kv_heads):
    model = build(tiny(n_kv_heads=kv_heads))
    prompt = torch.randint(0, 97, (1, 5))
    # Full forward each step, greedy.
    seq = prompt.clone()
    with torch.no_grad():
        for _ in range(12):
            nxt = model(seq)[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    # Cached: prefill then one token at a time.
    cache = model.new_kv_cache(1)
    with torch.no_grad():
        logits = model(prompt, kv_cache=cache, start_pos=0)
        out = prompt.clone()
        for _ in range(12):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            out = torch.cat([out, nxt], dim=1)
            logits = model(nxt, kv_cache=cache, start_pos=out.shape[1] - 1)
    assert out.tolist() == seq.tolist()


def test_kv_cache_chunked_prefill_matches_full_forward():
    """Several tokens appended at start_pos > 0 (a masked, non-square attention) equal the full forward."""
    model = build(tiny())
    idx = torch.randint(0, 97, (2, 20))
    full = model(idx)
    cache = model.new_kv_cache(2)
    with torch.no_grad():
        parts = [model(idx[:, :7], cache, 0), model(idx[:, 7:15], cache, 7), model(idx[:, 15:], cache, 15)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)


def test_forward_beyond_context_is_refused():
    model = build(tiny(context_length=8))
    with pytest.raises(ValueError, match="context_length 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def expected_params(cfg: ModelConfig) -> int:
    d, hd = cfg.d_model, cfg.head_dim
    attn = d * (cfg.n_heads + 2 * cfg.n_kv_heads) * hd + d * d
    ffn = 3 * d * cfg.ffn_hidden
    per_layer = attn + ffn + 2 * d
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    return cfg.vocab_size * d + cfg.n_layers * per_layer + d + head


@pytest.mark.parametrize("tie", [True, False])
def test_parameter_count_matches_formula(tie):
    cfg = tiny(tie_embeddings=tie)
    model = build(cfg)
    assert model.num_parameters() == expected_params(cfg)
    assert model.num_parameters(non_embedding=True) == expected_params(cfg) - cfg.vocab_size * cfg.d_model
    # Tied: the head and the embedding are one tensor.
    assert (model.lm_head.weight is model.tok_emb.weight) is tie


@pytest.mark.parametrize("tie", [True, False])
def test_flops_per_token_formula(tie):
    cfg = tiny(tie_embeddings=tie)
    model = build(cfg)
    n_matmul = (
        expected_params(cfg) - cfg.vocab_size * cfg.d_model + (cfg.vocab_size * cfg.d_model if tie else 0)
    )
    assert model.flops_per_token(10) == 6 * n_matmul + 12 * cfg.n_layers * cfg.d_model * 10
    assert model.flops_per_token() == model.flops_per_token(cfg.context_length)


def test_param_groups_decay_only_matrices_by_default():
    model = build(tiny(tie_embeddings=False))
    groups = {g["name"]: g for g in model.param_groups(0.1)}
    decay = {id(p) for p in groups["decay"]["params"]}
    no_decay = {id(p) for p in groups["no_decay"]["params"]}
    assert groups["decay"]["weight_decay"] == 0.1 and groups["no_decay"]["weight_decay"] == 0.0
    assert id(model.tok_emb.weight) in no_decay
    assert id(model.lm_head.weight) in decay
    assert id(model.blocks[0].attn_norm.weight) in no_decay
    assert id(model.blocks[0].attn.wqkv.weight) in decay
    assert len(decay) + len(no_decay) == len(list(model.parameters()))
    assert not decay & no_decay
    torch.optim.AdamW(model.param_groups(0.1), lr=1e-3)  # accepted as is


def test_param_groups_flags_move_norms_and_embeddings():
    model = build(tiny())
    groups = model.param_groups(0.1, decay_norms_and_biases=True, decay_embeddings=True)
    assert [g["name"] for g in groups] == ["decay"]
    assert len(groups[0]["params"]) == len(list(model.parameters()))


def test_from_spec_fills_defaults():
    cfg = ModelConfig.from_spec(ModelSpec(d_model=96, n_heads=4), vocab_size=300)
    assert cfg.vocab_size == 300 and cfg.n_kv_heads == 4
    assert cfg.ffn_hidden == default_ffn_hidden(96) == 256  # 8/3 * 96 = 256, a multiple of 32
    assert default_ffn_hidden(256) == 704 and default_ffn_hidden(256) % 32 == 0
    assert ModelConfig.from_spec(ModelSpec(vocab_size=512), vocab_size=300).vocab_size == 512
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        ModelConfig.from_spec(ModelSpec(vocab_size=256), vocab_size=300)


def test_config_dict_round_trip_and_validation():
    cfg = tiny()
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown model config keys"):
        ModelConfig.from_dict({**cfg.to_dict(), "n_experts": 8})
    with pytest.raises(ValueError, match="missing keys"):
        ModelConfig.from_dict({"d_model": 32})
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        tiny(n_kv_heads=3)


def test_training_step_reduces_loss_and_dropout_is_active_in_train_mode():
    cfg = tiny(dropout=0.1)
    model = build(cfg).train()
    idx = torch.randint(0, 97, (4, 16))
    torch.manual_seed(1)
    a = model(idx)
    b = model(idx)
    assert not torch.equal(a, b)  # dropout on
    model.eval()
    torch.testing.assert_close(model(idx), model(idx))
    model.train()
    opt = torch.optim.AdamW(model.param_groups(0.0), lr=1e-2)
    losses = []
    for _ in range(15):
        logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 97), idx[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.7


@pytest.mark.slow
def test_model_traces_under_torch_compile_with_the_same_loss_and_grads():
    """The fused ops' autograd Functions must survive graph capture (train/ compiles on request)."""
    model = build(tiny()).train()
    idx = torch.randint(0, 97, (2, 16))

    def loss_and_grads(forward):
        model.zero_grad()
        loss = F.cross_entropy(forward(idx).reshape(-1, 97), idx.reshape(-1))
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    eager_loss, eager_grads = loss_and_grads(model)
    compiled_loss, compiled_grads = loss_and_grads(torch.compile(model, backend="aot_eager"))
    torch.testing.assert_close(compiled_loss, eager_loss)
    for a, b in zip(compiled_grads, eager_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
