"""The compiled decode step of one sequence (serve/decode_graph.py): its fixed-shape view attends as the
eager step does, its key buckets cover the context, and an engine with `compile=True` gives the eager
engine's greedy tokens, or runs eagerly when compiling fails."""

from __future__ import annotations

import logging

import pytest
import torch

from runyard.model.kv_cache import DecodeRows, PrefillChunk
from runyard.serve import decode_graph
from runyard.serve.batch_engine import BatchEngine
from runyard.serve.decode_graph import key_buckets
from runyard.serve.sampling import SamplingParams

PROMPTS = ["def add(a, b):", "import os\nimport sys\n", "for i in range(10):\n"]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0)


def test_key_buckets_double_from_a_32nd_of_the_context_and_end_at_it():
    assert key_buckets(512) == [64, 128, 256, 512]
    assert key_buckets(300) == [64, 128, 256, 300]
    assert key_buckets(64) == [64]
    assert key_buckets(8192) == [256, 512, 1024, 2048, 4096, 8192]  # at most 6 graphs, under Dynamo's 8


def test_a_fixed_shape_view_attends_as_the_step_over_the_sequence_alone(tokenizer, make_model):
    """Eager, no compiler: the same logits whether the keys past the sequence are cut (PoolStep) or masked
    (DecodeRows over a longer bucket), and the same keys written into the pool."""
    torch.manual_seed(0)
    model = make_model(tokenizer, context_length=64).eval()
    pools = [model.new_kv_pool(2) for _ in range(2)]
    prompt = torch.tensor([tokenizer.encode("def add(a, b):").ids])
    n = prompt.shape[1]
    view = DecodeRows(pools[1], rows=1, keys=64)
    with torch.inference_mode():
        for pool in pools:  # the prompt's keys, the same in both pools
            step = pool.step([], [PrefillChunk(0, 0, n)])
            model(prompt, kv_cache=step, positions=step.positions[None])
        token = torch.tensor([[7]])
        cut = model(token, kv_cache=pools[0].step([n]), positions=torch.tensor([[n]]), logits_at=torch.tensor([0]))
        view.move_to([n])
        masked = model(token, kv_cache=view, positions=view.positions[None], logits_at=torch.tensor([0]))
    torch.testing.assert_close(masked, cut, rtol=1e-5, atol=1e-6)
    for a, b in zip(pools[0].k + pools[0].v, pools[1].k + pools[1].v, strict=True):
        torch.testing.assert_close(a[0, :, : n + 1], b[0, :, : n + 1], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="cannot hold positions"):
        view.move_to([64])


@pytest.mark.slow
def test_an_engine_compiling_its_decode_steps_gives_the_eager_engines_tokens(tokenizer, make_model):
    model = make_model(tokenizer, context_length=64)
    ids = [tokenizer.encode(p).ids for p in PROMPTS]
    eager = BatchEngine(model, tokenizer, max_batch=2).generate(ids, [greedy(20)] * len(ids))
    engine = BatchEngine(model, tokenizer, max_batch=2, compile=True)
    alone = [engine.generate([p], [greedy(20)])[0] for p in ids]  # one sequence at a time: compiled steps
    assert engine.decode_graph.failed is None and engine.decode_graph.steps >= 3 * 15
    assert [c.token_ids for c in alone] == [c.token_ids for c in eager]
    together = engine.generate(ids, [greedy(20)] * len(ids))  # several at once: eager steps, same tokens
    assert [c.token_ids for c in together] == [c.token_ids for c in eager]
    # One sequence decodes alone (compiled steps write its keys), then a second joins (eager steps read them).
    before = engine.decode_graph.steps
    joined = engine.generate(ids[:2], [greedy(20)] * 2, start_at_step=[0, 6])
    assert engine.decode_graph.steps > before
    assert [c.token_ids for c in joined] == [c.token_ids for c in eager[:2]]


def test_an_engine_whose_compiler_fails_decodes_eagerly_and_says_so(tokenizer, make_model, monkeypatch, caplog):
    model = make_model(tokenizer, context_length=64)
    ids = tokenizer.encode(PROMPTS[0]).ids
    eager = BatchEngine(model, tokenizer, max_batch=1).generate([ids], [greedy(10)])[0]

    def no_compiler(fn, **kwargs):
        def fails(*args):
            raise RuntimeError("InvalidCxxCompiler: no working C++ compiler found")
        return fails

    monkeypatch.setattr(decode_graph.torch, "compile", no_compiler)
    engine = BatchEngine(model, tokenizer, max_batch=1, compile=True)
    with caplog.at_level(logging.WARNING, logger="runyard.serve.decode_graph"):
        got = engine.generate([ids], [greedy(10)])[0]
    assert got.token_ids == eager.token_ids
    assert "InvalidCxxCompiler" in engine.decode_graph.failed and engine.decode_graph.steps == 0
    assert "compiled decoding is off" in caplog.text
