"""The pieces of tensor parallel that need no processes: the layout a spec asks for, the decoder's split
plan, and the row order of fused projections (the e2e test, tests/e2e/test_tensor_parallel.py, runs it)."""

from __future__ import annotations

import pytest
import torch

from runyard.model.registry import NoTensorParallelPlan, get_family
from runyard.model.transformer import ModelConfig
from runyard.spec.job import parse_spec
from runyard.train.checkpoint.reader import model_order
from runyard.train.parallel import Layout, LayoutError, layout_of
from runyard.train.tensor_parallel import FusedRows, rank_major_rows

CFG = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, context_length=16)


def parallel_setting(value):
    return parse_spec({"name": "p", "data": {"sources": [{"path": "unused"}]},
                       "resources": {"parallel": value}}).resources.parallel


def test_ddp_and_fsdp_are_shorthands_and_a_layout_must_fill_the_world():
    assert layout_of(parallel_setting("ddp"), 4) == Layout(4, 1, 1)
    assert layout_of(parallel_setting("fsdp"), 4) == Layout(1, 4, 1)
    assert layout_of(parallel_setting({"tp": 2}), 2) == Layout(1, 1, 2)
    with pytest.raises(LayoutError, match="does not equal the 3 processes"):
        layout_of(parallel_setting({"tp": 2}), 3)
    # tensor parallel inside FSDP on a 2-D mesh (dp_shard x tp); not yet with replicas
    assert layout_of(parallel_setting({"dp_shard": 2, "tp": 2}), 4) == Layout(1, 2, 2)
    with pytest.raises(LayoutError, match=r"combined with FSDP \(dp_shard\) only, not yet with replicas"):
        layout_of(parallel_setting({"dp_replicate": 2, "tp": 2}), 4)


def test_each_rank_holds_its_share_of_every_fused_part():
    # Q rows 0-3, K rows 4-5, V rows 6-7 over 2 ranks: rank 0 gets q0 q1 k0 v0, rank 1 q2 q3 k1 v1.
    order = rank_major_rows((4, 2, 2), 2)
    assert order.tolist() == [0, 1, 4, 6, 2, 3, 5, 7]
    w = torch.arange(8.0).reshape(8, 1)
    assert torch.equal(model_order({"w": w[order]}, {"w": [4, 2, 2]}, 2)["w"], w)  # a reader undoes it


def test_fused_rows_move_between_any_two_layouts_orders():
    # What a checkpoint load does: rows stored in one order (the model's, or an older tp job's rank by rank)
    # come out in the loading layout's order, and a save puts them back in the model's.
    parts = (8, 4, 4)
    w = torch.arange(16.0).reshape(16, 1)
    tp2, tp4, model_order_ = FusedRows({"w": parts}, 2), FusedRows({"w": parts}, 4), FusedRows({}, 1)
    state = {"w": w}
    tp4.reorder(state, None)
    assert torch.equal(state["w"], w[rank_major_rows(parts, 4)])
    moments = {"state": {"w": {"exp_avg": w[rank_major_rows(parts, 2)], "step": torch.tensor(3.0)}}}
    saved = {"w": w[rank_major_rows(parts, 2)]}
    model_order_.reorder(saved, moments, stored=tp2)  # a tp 2 job saving
    assert torch.equal(saved["w"], w) and torch.equal(moments["state"]["w"]["exp_avg"], w)
    legacy = {"w": w[rank_major_rows(parts, 2)]}
    tp4.reorder(legacy, None, stored=tp2)  # an old rank-by-rank tp 2 checkpoint onto tp 4
    assert torch.equal(legacy["w"], w[rank_major_rows(parts, 4)])


def test_the_decoder_states_its_plan_and_refuses_a_split_its_shape_cannot_take():
    family = get_family("decoder")
    model = family.build(CFG)
    plan = family.tensor_parallel_plan(model, 2)
    assert plan.styles["blocks.0.attn.wqkv"] == "colwise" and plan.styles["blocks.1.ffn.w_down"] == "rowwise"
    assert plan.fused_rows["blocks.0.attn.wqkv.weight"] == (32, 16, 16)
    assert plan.local_attributes == {"blocks.0.attn.n_heads": 2, "blocks.0.attn.n_kv_heads": 1,
                                     "blocks.1.attn.n_heads": 2, "blocks.1.attn.n_kv_heads": 1}
    with pytest.raises(NoTensorParallelPlan, match=r"model.n_kv_heads \(2\) divisible by 4"):
        family.tensor_parallel_plan(model, 4)
