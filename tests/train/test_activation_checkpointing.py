"""Activation checkpointing (train.activation_checkpointing) recomputes the family's blocks in backward:
the losses and weights are bitwise those without it on CPU, it keeps fewer bytes for backward (counted
through saved-tensor hooks), and the plan's memory estimate accounts for it."""

from __future__ import annotations

import pytest
import torch

from runyard.model.compute import checkpointed_indices, is_recomputed, token_loss_sum
from runyard.model.registry import get_family
from runyard.model.transformer import ModelConfig
from runyard.plan.sizing import plan_stage
from runyard.spec.job import parse_spec, resolved_stage
from runyard.train import layout, parallel
from tests.train.test_loop_resume import prepared  # noqa: F401  (the fixture)

CTX = parallel.DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
CFG = ModelConfig(vocab_size=97, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                  context_length=32, dropout=0.1)
FAMILY = get_family("decoder")


def train_cfg(mode: str, every: int = 2):
    return resolved_stage(parse_spec({
        "name": "ac", "data": {"sources": [{"path": "unused"}]},
        "train": {"activation_checkpointing": mode, "activation_checkpointing_every": every}}), "main").train


def laid_out(mode: str, every: int = 2):
    torch.manual_seed(0)
    model = FAMILY.build(CFG)
    return model, layout.lay_out(model, FAMILY, CTX, parse_spec({
        "name": "ac", "data": {"sources": [{"path": "unused"}]}}).resources, train_cfg(mode, every))


def test_which_blocks_recompute():
    assert checkpointed_indices(6, "none") == []
    assert checkpointed_indices(6, "full") == [0, 1, 2, 3, 4, 5]
    assert checkpointed_indices(6, "selective", 2) == [1, 3, 5]
    assert checkpointed_indices(6, "selective", 3) == [2, 5]
    model, _ = laid_out("selective", 2)
    assert [is_recomputed(b) for b in model.blocks] == [False, True, False, True]


def run_steps(mode: str, steps: int = 4) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    model, module = laid_out(mode)
    optimizer = torch.optim.AdamW(FAMILY.optimizer_groups(model, parse_spec({
        "name": "ac", "data": {"sources": [{"path": "unused"}]}}).optim), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(7)  # the dropout stream, the same for both runs
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, CFG.vocab_size, (4, CFG.context_length + 1), generator=g)
        loss = token_loss_sum(module(tokens[:, :-1]), tokens[:, 1:]) / tokens[:, 1:].numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_losses_and_weights_are_bitwise_those_without_it(mode):
    torch.set_num_threads(1)
    plain_losses, plain_state = run_steps("none")
    ac_losses, ac_state = run_steps(mode)
    assert [t.item() for t in ac_losses] == [t.item() for t in plain_losses]
    assert plain_state.keys() == ac_state.keys()  # no name moved
    for k in plain_state:
        assert torch.equal(plain_state[k], ac_state[k]), k


def saved_bytes(mode: str) -> int:
    """Bytes of distinct storages kept for backward by one forward (weights and buffers not counted): the
    saved-tensor hooks see what autograd keeps outside recomputed blocks; a recomputed block keeps its
    inputs (counted through a pre-hook on it)."""
    model, module = laid_out(mode)
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    kept: dict[int, int] = {}

    def keep(t: torch.Tensor) -> None:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in own:
            kept[ptr] = t.untyped_storage().nbytes()

    def pack(t):
        keep(t)
        return t

    def inputs(block, args):
        for a in args:
            if isinstance(a, torch.Tensor):
                keep(a)

    hooks = [b.register_forward_pre_hook(inputs) for b in model.blocks if is_recomputed(b)]
    tokens = torch.randint(0, CFG.vocab_size, (4, CFG.context_length + 1), generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = token_loss_sum(module(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    for h in hooks:
        h.remove()
    return sum(kept.values())


def test_it_keeps_fewer_bytes_for_backward_and_the_plan_counts_it():
    none, selective, full = saved_bytes("none"), saved_bytes("selective"), saved_bytes("full")
    print(f"bytes kept for backward: none {none}, selective {selective}, full {full} ({full / none:.2f}x)")
    assert full < selective < none
    assert full <= 0.5 * none  # the target: at most half the activation memory

    size = FAMILY.sizing(CFG, micro_batch=4)
    assert size.activation_bytes_with(0) == size.activation_bytes
    assert size.activation_bytes_with(4) < size.activation_bytes_with(2) < size.activation_bytes
    spec = {"name": "ac", "data": {"sources": [{"path": "unused"}]},
            "model": {"d_model": 256, "n_layers": 8, "n_heads": 4, "context_length": 512}}
    plain = plan_stage(parse_spec(spec), "main", vocab_size=1000)
    recomputed = plan_stage(parse_spec({**spec, "train": {"activation_checkpointing": "full"}}), "main",
                            vocab_size=1000)
    assert recomputed.memory["activations"] < plain.memory["activations"]
    assert recomputed.memory_per_device_bytes < plain.memory_per_device_bytes
    assert "8 of 8 blocks recomputed" in recomputed.memory["how"]


@pytest.mark.slow
def test_a_stage_with_it_logs_bitwise_the_same_rows(prepared, tmp_path):  # noqa: F811
    """Through the real loop (train_stage; dropout on): every metrics row and the final weights match."""
    from runyard.train.loop import train_stage
    from tests.train.test_loop_resume import CTX as LOOP_CTX
    from tests.train.test_loop_resume import SPEC, metric_rows

    torch.set_num_threads(1)
    results = {}
    for mode in ("none", "full"):
        spec = SPEC.model_copy(update={"train": SPEC.train.model_copy(update={"activation_checkpointing": mode})})
        stage_dir = tmp_path / mode / "stages" / "main"
        result = train_stage(spec, resolved_stage(spec, "main"), prepared, stage_dir, LOOP_CTX, show_progress=False)
        assert all(is_recomputed(b) for b in result.model.blocks) == (mode == "full")
        results[mode] = (metric_rows(stage_dir), result.model.state_dict())
    assert results["full"][0] == results["none"][0]
    for k, v in results["none"][1].items():
        assert torch.equal(v, results["full"][1][k]), k
