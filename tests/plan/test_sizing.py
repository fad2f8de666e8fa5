"""Sizing against counts that do not come from runyard's own model: Hugging Face's LlamaForCausalLM built
from a config of the same shape (no download), and the parameter and 6ND arithmetic written out by hand."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from runyard.model.config import ModelConfig
from runyard.plan.sizing import count_parameters, flops_per_token, plan_run
from runyard.spec.job import parse_spec

SHAPES = [
    # vocab, d_model, layers, heads, kv heads, ffn, context, tied
    (300, 64, 3, 4, 4, 96, 32, True),
    (300, 64, 3, 4, 2, 96, 32, False),
    (4096, 256, 4, 8, 1, 688, 256, True),
    (32000, 768, 12, 12, 12, 3072, 1024, False),  # GPT-2-small-like, untied: 162M
]


def config(shape) -> ModelConfig:
    vocab, d, layers, heads, kv, ffn, context, tied = shape
    return ModelConfig(vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads, n_kv_heads=kv, ffn_hidden=ffn,
                       context_length=context, tie_embeddings=tied)


def hf_llama(cfg: ModelConfig) -> LlamaForCausalLM:
    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_hidden,
                         num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                         num_key_value_heads=cfg.n_kv_heads, max_position_embeddings=cfg.context_length,
                         tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, mlp_bias=False)
    with torch.device("meta"):  # shapes only: the 162M model costs no memory
        return LlamaForCausalLM(hf_cfg)


def by_hand(cfg: ModelConfig) -> tuple[int, int]:
    """(total, non-embedding) parameters of a Llama decoder without biases, counted from the shape."""
    d, head_dim = cfg.d_model, cfg.d_model // cfg.n_heads
    attention = d * (cfg.n_heads + 2 * cfg.n_kv_heads) * head_dim + cfg.n_heads * head_dim * d  # q, k, v, o
    feed_forward = 3 * d * cfg.ffn_hidden  # gate, up, down
    norms = 2 * d
    embedding = cfg.vocab_size * d
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    total = embedding + cfg.n_layers * (attention + feed_forward + norms) + d + head  # + final norm
    return total, total - embedding


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"d{s[1]}-L{s[2]}-kv{s[4]}-{'tied' if s[7] else 'untied'}")
def test_parameter_count_matches_hugging_face_and_the_hand_count(shape):
    cfg = config(shape)
    total, non_embedding = count_parameters(cfg)
    hf = hf_llama(cfg)
    assert total == hf.num_parameters()
    assert non_embedding == hf.num_parameters(exclude_embeddings=True)
    assert (total, non_embedding) == by_hand(cfg)


@pytest.mark.parametrize("shape", SHAPES[:3], ids=["tied", "untied-gqa", "tied-mqa"])
def test_flops_per_token_is_6n_plus_attention(shape):
    cfg = config(shape)
    _, non_embedding = by_hand(cfg)
    # 6 FLOPs per matmul weight per token (2 forward, 4 backward); the output head is a matmul whether or
    # not it shares the embedding's tensor, the embedding lookup is not. Attention scores and the weighted
    # sum: 2 matmuls x 2 FLOPs x context x d_model per layer forward, x3 with the backward.
    matmul_weights = non_embedding + (cfg.vocab_size * cfg.d_model if cfg.tie_embeddings else 0)
    expected = 6 * matmul_weights + 3 * 2 * 2 * cfg.n_layers * cfg.context_length * cfg.d_model
    assert flops_per_token(cfg) == pytest.approx(expected, rel=1e-12)


def test_plan_training_flops_follow_6nd_for_every_stage():
    spec = parse_spec({
        "name": "p", "data": {"sources": [{"path": "x"}]},
        "model": {"d_model": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 256,
                  "context_length": 64, "tie_embeddings": False},
        "train": {"steps": 300, "batch_size": 4, "grad_accum": 2},
    })
    vocab = 1000
    plan = plan_run(spec, vocab_size=vocab)
    stage = plan["stages"][0]
    tokens = 300 * 4 * 2 * 64  # steps x batch x accumulation x context, one process
    n = 2 * (128 * (4 + 2 * 2) * 32 + 4 * 32 * 128 + 3 * 128 * 256 + 2 * 128) + 128 + vocab * 128
    assert stage["tokens"] == tokens
    assert stage["non_embedding_parameters"] == n
    assert stage["parameters"] == n + vocab * 128
    expected = (6 * n + 12 * 2 * 128 * 64) * tokens
    assert plan["training_flops"] == pytest.approx(expected, rel=1e-12)


def test_plan_raises_requirement_duration_to_the_estimate():
    spec = parse_spec({
        "name": "p", "data": {"sources": [{"path": "x"}]},
        "train": {"steps": 1000, "batch_size": 8},
        "resources": {"requirement": {"duration_s": 60}},
    })
    plan = plan_run(spec, vocab_size=4096, tokens_per_s=100.0)
    tokens = plan["stages"][0]["tokens"]
    assert tokens == 1000 * 8 * 256
    assert plan["requirement"]["duration_s"] > tokens / 100.0
    assert plan["training_flops"] == pytest.approx(plan["stages"][0]["flops_per_token"] * tokens)
