"""Gradient accumulation: micro-batches with the loss normalised over the whole accumulated batch give
the gradient of one large batch."""

from __future__ import annotations

import torch

from runyard.model.compute import forward_backward
from runyard.model.transformer import ModelConfig, Transformer


def tiny_model() -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, context_length=16)
    return Transformer(cfg)


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_four_micro_batches_equal_one_large_batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 97, (8, 16), generator=g)
    y = torch.randint(0, 97, (8, 16), generator=g)
    tokens = x.numel()
    cpu = torch.device("cpu")

    big = tiny_model()
    loss_big = forward_backward(big, x, y, 1.0 / tokens, cpu, "fp32")
    small = tiny_model()
    loss_small = sum(forward_backward(small, x[i : i + 2], y[i : i + 2], 1.0 / tokens, cpu, "fp32") for i in range(0, 8, 2))

    assert torch.allclose(loss_big, loss_small, rtol=1e-6, atol=1e-6)
    gb, gs = grads(big), grads(small)
    assert gb.keys() == gs.keys() and len(gb) > 0
    for name in gb:
        assert torch.allclose(gb[name], gs[name], rtol=1e-5, atol=1e-7), name


def test_unnormalised_accumulation_would_differ():
    """Guards the test above: summing per-micro-batch means (the common bug) gives 4x the gradient."""
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, 97, (8, 16), generator=g)
    y = torch.randint(0, 97, (8, 16), generator=g)
    cpu = torch.device("cpu")
    big = tiny_model()
    forward_backward(big, x, y, 1.0 / x.numel(), cpu, "fp32")
    wrong = tiny_model()
    for i in range(0, 8, 2):
        forward_backward(wrong, x[i : i + 2], y[i : i + 2], 1.0 / x[i : i + 2].numel(), cpu, "fp32")
    name = "tok_emb.weight"
    assert not torch.allclose(grads(big)[name], grads(wrong)[name], rtol=1e-3)
