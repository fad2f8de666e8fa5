"""Per-request sampling: filters, seeds, batch independence, logprobs; incremental detokenization."""

from __future__ import annotations

import pytest
import torch

from runyard.serve.detokenize import IncrementalDetokenizer, StopScanner
from runyard.serve.sampling import SamplingParams, choice_seed, new_generator, sample_batch

LOGITS = torch.tensor([1.0, 3.0, 2.0, -1.0])  # softmax ~ [0.09, 0.66, 0.24, 0.01]


def draws(params: SamplingParams, n: int, seed: int = 0) -> set[int]:
    g = new_generator(seed)
    return {sample_batch(LOGITS[None], [params], [g])[0][0] for _ in range(n)}


def test_greedy_top_k_and_top_p():
    assert draws(SamplingParams(temperature=0), 10) == {1}
    assert draws(SamplingParams(temperature=1.0, top_k=1), 20) == {1}
    assert draws(SamplingParams(temperature=1.0, top_p=0.8), 300) == {1, 2}
    assert draws(SamplingParams(temperature=1.0, top_p=0.5), 50) == {1}
    assert draws(SamplingParams(temperature=1.0), 400) == {0, 1, 2, 3}


def test_bad_params_are_refused():
    for kwargs, field in ((dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
                          (dict(top_p=0.0), "top_p"), (dict(top_k=0), "top_k"), (dict(max_tokens=0), "max_tokens"),
                          (dict(logprobs=21), "logprobs")):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)


def test_a_rows_draws_do_not_depend_on_its_neighbours():
    vocab = 50
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.9), SamplingParams(temperature=0), SamplingParams(temperature=1.3, top_k=7),
              SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.0), SamplingParams(temperature=0.5)]
    seeds = [11, 12, 13, 14, 15, 16]

    def run_alone(i: int) -> list[int]:
        g = new_generator(seeds[i])
        return [sample_batch(logits[i : i + 1], [params[i]], [g])[0][0] for _ in range(30)]

    gens = [new_generator(s) for s in seeds]
    together = [sample_batch(logits, params, gens)[0] for _ in range(30)]
    for i in range(6):
        assert [step[i] for step in together] == run_alone(i), f"row {i} changed when batched"


def test_unseeded_generators_differ():
    a = [int(torch.rand(1, generator=new_generator(None)) * 1e9) for _ in range(5)]
    assert len(set(a)) == 5
    assert choice_seed(7, 0) == 7 and len({choice_seed(7, i) for i in range(5)}) == 5


def test_logprobs_are_the_models_log_softmax():
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.0]])
    tokens, lps = sample_batch(logits, [SamplingParams(temperature=0, logprobs=2)], [new_generator(0)])
    expected = torch.log_softmax(logits[0], -1)
    assert tokens == [1]
    assert lps[0].token_id == 1 and lps[0].logprob == pytest.approx(float(expected[1]))
    assert [t for t, _ in lps[0].top] == [1, 3]
    assert lps[0].top[1][1] == pytest.approx(float(expected[3]))
    _, none = sample_batch(logits, [SamplingParams(temperature=0)], [new_generator(0)])
    assert none == [None]


def test_incremental_detokenizer_equals_whole_decoding(tokenizer):
    text = "for i in range(10):\n    print(i)  # café ✓ 日本"
    ids = tokenizer.encode(text).ids
    for split in (1, 3, len(ids) // 2):
        prompt, completion = ids[:split], ids[split:]
        detok = IncrementalDetokenizer(tokenizer, prompt)
        pieces = [detok.step(t) for t in completion]
        whole = tokenizer.decode(ids)
        assert "".join(pieces) == whole[len(tokenizer.decode(prompt)) :]
        # Pieces never end inside a character: each is valid text on its own.
        assert all("\ufffd" not in p for p in pieces)


def test_stop_scanner_holds_back_a_possible_stop_prefix():
    s = StopScanner(["END"])
    assert s.feed("abcE") == "abc"
    assert s.feed("N") == ""
    assert s.feed("Dx") == "" and s.stopped
    s = StopScanner(["END"])
    assert s.feed("abE") == "ab" and s.feed("x") == "Ex" and s.flush() == ""
    s = StopScanner(["\n\n", "##"])
    assert s.feed("one\n") == "one" and s.feed("two") == "\ntwo" and s.feed("#") == "" and s.feed("#!") == ""
    assert s.stopped
    assert StopScanner([]).feed("anything") == "anything"
