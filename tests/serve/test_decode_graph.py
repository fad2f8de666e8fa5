"""Compiled decode-only steps (serve/decode_graph.py): their view attends as the eager step does, and an
engine with `compile=True` gives the eager engine's greedy tokens from two graphs (one sequence, several),
falls back to its second set of compiler options when the first fails, and runs eagerly when both fail."""

from __future__ import annotations

import logging

import pytest
import torch

from runyard.model.kv_cache import DecodeRows, PrefillChunk
from runyard.serve import decode_graph
from runyard.serve.batch_engine import BatchEngine
from runyard.serve.sampling import SamplingParams

PROMPTS = ["def add(a, b):", "import os\nimport sys\n", "for i in range(10):\n"]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0)


def test_a_view_whose_counts_are_its_masks_sizes_attends_as_the_step(tokenizer, make_model):
    """Eager, no compiler: DecodeRows (rows and keys counted by its mask's sizes) gives PoolStep's logits and
    writes the same keys into the pool, for sequences of different lengths."""
    torch.manual_seed(0)
    model = make_model(tokenizer, context_length=64).eval()
    pools = [model.new_kv_pool(3) for _ in range(2)]
    prompts = [tokenizer.encode(p).ids for p in PROMPTS]
    with torch.inference_mode():
        for pool in pools:  # the prompts' keys, the same in both pools
            for slot, ids in enumerate(prompts):
                step = pool.step([], [PrefillChunk(slot, 0, len(ids))])
                model(torch.tensor([ids]), kv_cache=step, positions=step.positions[None])
        tokens, positions = torch.tensor([[7, 8, 9]]), [len(ids) for ids in prompts]
        step = model(tokens, kv_cache=pools[0].step(positions), positions=torch.tensor([positions]),
                     logits_at=torch.arange(3))
        view = DecodeRows(pools[1], positions)
        assert (view.n_decode, view.length) == (3, max(positions) + 1)
        rows = model(tokens, kv_cache=view, positions=view.positions[None], logits_at=torch.arange(3))
    torch.testing.assert_close(rows, step, rtol=1e-5, atol=1e-6)
    for a, b in zip(pools[0].k + pools[0].v, pools[1].k + pools[1].v, strict=True):
        for slot, n in enumerate(positions):
            torch.testing.assert_close(a[slot, :, : n + 1], b[slot, :, : n + 1], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"a pool of 3 slots of 64 positions cannot decode at \[5, 64\]"):
        DecodeRows(pools[1], [5, 64])


@pytest.mark.slow
def test_an_engine_compiling_its_decode_steps_gives_the_eager_engines_tokens(tokenizer, make_model):
    model = make_model(tokenizer, context_length=64)
    ids = [tokenizer.encode(p).ids for p in PROMPTS]
    eager = BatchEngine(model, tokenizer, max_batch=3).generate(ids, [greedy(20)] * len(ids))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    engine = BatchEngine(model, tokenizer, max_batch=3, compile=True)  # compiles its two graphs
    alone = [engine.generate([p], [greedy(20)])[0] for p in ids]  # one sequence at a time: compiled steps
    assert engine.decode_graph.failed is None and engine.decode_graph.steps >= 3 * 15
    # The first option set (the GEMM templates alone) compiled both graphs, and every step of every sequence
    # came from them: the key count is a dynamic size.
    assert all(len(g.tries) == len(decode_graph._CPU_OPTION_SETS) for g in (engine.decode_graph._one,
                                                                           engine.decode_graph._many))
    assert [c.token_ids for c in alone] == [c.token_ids for c in eager]
    before = engine.decode_graph.steps
    together = engine.generate(ids, [greedy(20)] * len(ids))  # several at once (the second graph), same tokens
    assert [c.token_ids for c in together] == [c.token_ids for c in eager]
    assert engine.decode_graph.steps - before >= 15
    # One sequence decodes alone (the first graph writes its keys), then a second joins (the second reads them).
    before = engine.decode_graph.steps
    joined = engine.generate(ids[:2], [greedy(20)] * 2, start_at_step=[0, 6])
    assert engine.decode_graph.steps > before
    assert [c.token_ids for c in joined] == [c.token_ids for c in eager[:2]]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 2  # no recompiling on the way


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
    assert "compiled decoding of one sequence is off" in caplog.text


def test_an_engine_whose_first_compiler_options_fail_uses_its_second(tokenizer, make_model, monkeypatch):
    """The first option set failing (its GEMM templates cannot take the model, say) is not the end of
    compiled decoding: the second set serves the steps. The "compiler" here runs the function as it is."""
    model = make_model(tokenizer, context_length=64)
    ids = tokenizer.encode(PROMPTS[0]).ids
    eager = BatchEngine(model, tokenizer, max_batch=1).generate([ids], [greedy(10)])[0]
    tried: list[dict] = []

    def first_fails(fn, **kwargs):
        tried.append(kwargs["options"])

        def run(*args):
            if kwargs["options"] is decode_graph._CPU_OPTION_SETS[0]:
                raise RuntimeError("NoValidChoicesError: no GEMM template")
            return fn(*args)
        return run

    monkeypatch.setattr(decode_graph.torch, "compile", first_fails)
    engine = BatchEngine(model, tokenizer, max_batch=1, compile=True)
    got = engine.generate([ids], [greedy(10)])[0]
    assert tried == list(decode_graph._CPU_OPTION_SETS)
    assert got.token_ids == eager.token_ids
    assert engine.decode_graph.failed is None and engine.decode_graph.steps == 9  # every step after the prompt's
