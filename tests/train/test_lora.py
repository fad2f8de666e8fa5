"""LoRA: only adapters train, a merge equals the adapted forward, the reference switch is the base."""

from __future__ import annotations

import pytest
import torch

from runyard.model.transformer import ModelConfig, Transformer
from runyard.spec.finetune import LoRASpec
from runyard.train.lora import adapters_disabled, apply_lora, base_sha256, merged_state_dict

CFG = ModelConfig(vocab_size=60, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, context_length=16)


def adapted(targets: list[str]):
    torch.manual_seed(0)
    model = Transformer(CFG)
    adapters = apply_lora(model, LoRASpec(rank=4, alpha=8, targets=targets), seed=1)
    with torch.no_grad():  # B starts at zero; give it values so the update is not trivially nothing
        for p in adapters.parameters():
            p.normal_(0, 0.1)
    return model, adapters


@pytest.mark.parametrize("targets", [["q_proj", "k_proj", "v_proj", "o_proj"], ["v_proj", "gate_proj", "down_proj"],
                                     ["up_proj"]])
def test_merge_equals_the_adapted_forward(targets):
    model, _ = adapted(targets)
    x = torch.randint(0, 60, (2, 16))
    model.eval()
    with torch.no_grad():
        expected = model(x)
        plain = Transformer(CFG).eval()
        plain.load_state_dict(merged_state_dict(model))
        got = plain(x)
        with adapters_disabled(model):
            base = model(x)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(base, expected, atol=1e-3), "the adapters change the output"


def test_only_adapters_train_and_the_base_hash_is_stable():
    model, adapters = adapted(["q_proj", "v_proj"])
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora." in n for n in trainable)
    # q and v of each of 2 blocks: A [4, 32] each, B [32, 4] (q) and [16, 4] (v: 2 kv heads x 8)
    assert adapters.trainable_parameters() == 2 * (4 * 32 + 32 * 4 + 4 * 32 + 16 * 4)
    assert set(adapters.state_dict()) == {f"adapters.blocks/{i}/attn/wqkv.{ab}.{t}" for i in range(2)
                                          for ab in "ab" for t in ("q_proj", "v_proj")}
    torch.manual_seed(0)
    assert base_sha256(Transformer(CFG)) == adapters.base_sha256, "the hash covers the base alone"
    x = torch.randint(0, 60, (2, 16))
    model(x).sum().backward()
    assert all(p.grad is None for n, p in model.named_parameters() if ".lora." not in n)
    assert all(p.grad is not None for p in adapters.parameters())
