"""The objectives against hand computations: the masked loss, accumulation with masks, DPO."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from runyard.data.samples import IGNORE_INDEX, pad_rows
from runyard.model.compute import token_loss_sum
from runyard.model.transformer import ModelConfig, Transformer
from runyard.train.objectives import dpo_loss, sequence_logprobs, supervised_tokens


def test_masked_loss_equals_a_hand_computation():
    logits = torch.tensor([[[2.0, 0.0, -1.0], [0.5, 0.5, 0.0], [0.0, 3.0, 1.0]]])
    labels = torch.tensor([[IGNORE_INDEX, 2, 1]])  # the first position is the prompt's

    def nll(row, target):
        return math.log(sum(math.exp(v) for v in row)) - row[target]

    expected = nll([0.5, 0.5, 0.0], 2) + nll([0.0, 3.0, 1.0], 1)
    assert float(token_loss_sum(logits, labels)) == pytest.approx(expected, rel=1e-6)
    assert supervised_tokens(labels) == 2
    assert float(sequence_logprobs(logits, labels)[0]) == pytest.approx(-expected, rel=1e-6)


def test_padding_rows_mask_prompt_and_padding():
    tokens = [np.array([5, 6, 7, 8]), np.array([9, 10])]
    masks = [np.array([0, 0, 1, 1]), np.array([0, 1])]
    batch = pad_rows(list(zip(tokens, masks, strict=True)), pad_id=0)
    assert batch.inputs.tolist() == [[5, 6, 7], [9, 0, 0]]
    assert batch.labels.tolist() == [[IGNORE_INDEX, 7, 8], [10, IGNORE_INDEX, IGNORE_INDEX]]
    assert batch.real_tokens == 4 and batch.supervised == 3


def tiny() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                                   context_length=24))


def masked_batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 50, (8, 20), generator=g)
    y = torch.randint(0, 50, (8, 20), generator=g)
    # Uneven supervision per row: row i supervises its last 2 + 2i positions.
    for i in range(8):
        y[i, : 20 - (2 + 2 * i)] = IGNORE_INDEX
    return x, y


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_accumulation_with_masks_equals_one_large_batch():
    x, y = masked_batch(1)
    total = supervised_tokens(y)
    big = tiny()
    (token_loss_sum(big(x), y) / total).backward()
    small = tiny()
    for i in range(0, 8, 2):  # four micro-batches, each with a different number of supervised tokens
        (token_loss_sum(small(x[i : i + 2]), y[i : i + 2]) / total).backward()
    gb, gs = grads(big), grads(small)
    assert gb.keys() == gs.keys() and gb
    for name in gb:
        assert torch.allclose(gb[name], gs[name], rtol=1e-5, atol=1e-7), name

    wrong = tiny()  # the common bug: each micro-batch normalised by its own count
    for i in range(0, 8, 2):
        (token_loss_sum(wrong(x[i : i + 2]), y[i : i + 2]) / supervised_tokens(y[i : i + 2])).backward()
    assert not torch.allclose(gb["tok_emb.weight"], grads(wrong)["tok_emb.weight"], rtol=1e-3)


def test_dpo_loss_equals_a_hand_computation():
    pc, pr = torch.tensor([-5.0, -2.0]), torch.tensor([-6.0, -1.0])
    rc, rr = torch.tensor([-5.5, -2.5]), torch.tensor([-5.5, -2.0])
    beta = 0.5
    terms = dpo_loss(pc, pr, rc, rr, beta)
    # pair 0: (pc - pr) - (rc - rr) = 1 - 0 = 1; pair 1: -1 - (-0.5) = -0.5
    expected = [-math.log(1 / (1 + math.exp(-beta * 1.0))), -math.log(1 / (1 + math.exp(-beta * -0.5)))]
    assert terms.losses.tolist() == pytest.approx(expected, rel=1e-6)
    assert terms.chosen_rewards.tolist() == pytest.approx([0.25, 0.25])
    assert terms.rejected_rewards.tolist() == pytest.approx([-0.25, 0.5])
    assert terms.margins.tolist() == pytest.approx([0.5, -0.25])


def test_dpo_gradient_flows_into_the_policy_only():
    pc = torch.tensor([-3.0], requires_grad=True)
    rc = torch.tensor([-3.0], requires_grad=True)
    dpo_loss(pc, torch.tensor([-3.0]), rc, torch.tensor([-3.0]), 0.1).losses.sum().backward()
    assert pc.grad is not None and float(pc.grad) == pytest.approx(-0.05)  # -beta * sigmoid(0)
    assert rc.grad is None
