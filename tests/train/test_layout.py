"""The layout's order (torchtitan's): recompute, then compile each block, then wrap for data parallelism;
and LoRA adapters (with their optimizer state) in fp32 whatever the base's dtype."""

from __future__ import annotations

import torch

from runyard.model.compute import is_recomputed
from runyard.model.registry import get_family
from runyard.model.transformer import ModelConfig
from runyard.spec.finetune import LoRASpec
from runyard.spec.job import parse_spec, resolved_stage
from runyard.train import layout, parallel
from runyard.train.lora import apply_lora

CFG = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, context_length=16)
FAMILY = get_family("decoder")


def test_blocks_are_compiled_in_place_before_the_model_is_wrapped(monkeypatch):
    spec = parse_spec({"name": "c", "data": {"sources": [{"path": "unused"}]},
                       "resources": {"compile": True}, "train": {"activation_checkpointing": "full"}})
    # A CUDA context without touching CUDA: compile is lazy and one process is never wrapped.
    ctx = parallel.DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cuda", 0))
    model = FAMILY.build(CFG)
    names = list(model.state_dict())
    seen = {}

    def wrap(m, ctx, resources, shard_units=(), mesh=None):
        seen["compiled"] = [b._compiled_call_impl is not None for b in m.blocks]
        seen["recomputed"] = [is_recomputed(b) for b in m.blocks]
        return m

    monkeypatch.setattr(parallel, "wrap_model", wrap)
    module = layout.lay_out(model, FAMILY, ctx, spec.resources, resolved_stage(spec, "main").train)
    assert module is model
    assert seen == {"compiled": [True, True], "recomputed": [True, True]}
    assert list(model.state_dict()) == names  # compiled in place: no `_orig_mod.` prefix


def test_compile_is_not_applied_on_cpu():
    spec = parse_spec({"name": "c", "data": {"sources": [{"path": "unused"}]}, "resources": {"compile": True}})
    ctx = parallel.DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    model = FAMILY.build(CFG)
    layout.lay_out(model, FAMILY, ctx, spec.resources, resolved_stage(spec, "main").train)
    assert all(b._compiled_call_impl is None for b in model.blocks)


def test_lora_adapters_and_their_optimizer_state_are_fp32_on_a_bf16_base():
    torch.manual_seed(0)
    model = FAMILY.build(CFG).to(torch.bfloat16)
    adapters = apply_lora(model, LoRASpec(rank=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"]), seed=1)
    assert {p.dtype for p in adapters.parameters()} == {torch.float32}
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    optimizer = torch.optim.AdamW(adapters.parameters(), lr=1e-2)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.context_length))
    logits = model(x)
    assert logits.dtype == torch.bfloat16
    logits.float().square().mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in adapters.parameters())
    optimizer.step()
    states = [optimizer.state[p] for p in adapters.parameters()]
    assert {s["exp_avg"].dtype for s in states} == {s["exp_avg_sq"].dtype for s in states} == {torch.float32}
