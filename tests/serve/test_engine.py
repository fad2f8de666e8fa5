"""Generation: KV-cached decoding equals full-forward decoding; seeds, sampling filters, stopping."""

from __future__ import annotations

import pytest
import torch

from runyard.model.hf.export import export_model, load_export
from runyard.serve.engine import Generator, sample_next


def greedy_full_forward(model, prompt_ids, n):
    seq = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt_ids) :]


def test_greedy_generation_with_cache_equals_full_forward(tokenizer, make_model):
    model = make_model(tokenizer)
    gen = Generator(model, tokenizer)
    prompt = tokenizer.encode("def add(a, b):").ids
    ids = gen.generate_ids(prompt, max_tokens=20, temperature=0, stop_at_eos=False)
    assert ids == greedy_full_forward(model, prompt, 20)


def test_generation_past_the_context_slides_the_window(tokenizer, make_model):
    model = make_model(tokenizer, context_length=16)
    gen = Generator(model, tokenizer)
    ids = gen.generate_ids([5, 6, 7], max_tokens=40, temperature=0.9, stop_at_eos=False)
    assert len(ids) == 40
    # The first tokens, produced within the context, equal full-forward greedy decoding.
    assert gen.generate_ids(
        [5, 6, 7], max_tokens=13, temperature=0, stop_at_eos=False
    ) == greedy_full_forward(model, [5, 6, 7], 13)


def test_sampling_is_deterministic_for_a_seed_and_varies_across_seeds(tokenizer, make_model):
    gen = Generator(make_model(tokenizer), tokenizer)
    a = gen.generate("import ", max_tokens=30, temperature=1.0, seed=3, stop_at_eos=False)
    b = gen.generate("import ", max_tokens=30, temperature=1.0, seed=3, stop_at_eos=False)
    others = {
        gen.generate("import ", max_tokens=30, temperature=1.0, seed=s, stop_at_eos=False)
        for s in range(4, 8)
    }
    assert a == b
    assert len(others | {a}) > 1


def test_generate_returns_only_the_completion_text(tokenizer, make_model):
    gen = Generator(make_model(tokenizer), tokenizer)
    prompt = "class Thing:"
    ids = gen.generate_ids(tokenizer.encode(prompt).ids, max_tokens=10, temperature=0, stop_at_eos=False)
    text = gen.generate(prompt, max_tokens=10, temperature=0, stop_at_eos=False)
    assert prompt + text == tokenizer.decode(tokenizer.encode(prompt).ids + ids)
    assert "".join(gen.stream(prompt, max_tokens=10, temperature=0, stop_at_eos=False)) == text


def test_stops_at_eos(tokenizer, make_model):
    gen = Generator(make_model(tokenizer), tokenizer)
    assert gen.eos_ids == {tokenizer.token_to_id("<|endoftext|>")}  # found by its conventional name
    full = gen.generate_ids([5, 6], max_tokens=12, temperature=0, stop_at_eos=False)
    stop = full[4]  # treat a token the greedy path emits as end-of-text: output ends before it
    assert gen.generate_ids([5, 6], max_tokens=12, temperature=0, eos_id=stop) == full[: full.index(stop)]
    assert gen.generate_ids([5, 6], max_tokens=12, temperature=0, eos_id=stop, stop_at_eos=False) == full


def test_any_of_several_end_tokens_ends_a_generation(tokenizer, make_model):
    model = make_model(tokenizer)
    sampled = {"max_tokens": 12, "temperature": 1.0, "seed": 3}  # the same tokens up to the stop
    full = Generator(model, tokenizer).generate_ids([5, 6], stop_at_eos=False, **sampled)
    distinct = list(dict.fromkeys(full))  # in order of first appearance
    assert len(distinct) >= 3, full
    first, later = distinct[1], distinct[2]  # a chat export ends turns and documents with different tokens
    for ends in ({first, later}, {later}):
        gen = Generator(model, tokenizer, eos_ids=ends)
        stop = min(full.index(t) for t in ends)
        assert gen.generate_ids([5, 6], **sampled) == full[:stop]


def test_empty_prompt_starts_from_end_of_text(tokenizer, make_model):
    gen = Generator(make_model(tokenizer), tokenizer)
    assert len(gen.generate_ids([], max_tokens=5, temperature=0, stop_at_eos=False)) == 5


def test_top_k_one_is_greedy_and_top_p_keeps_the_nucleus():
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    g = torch.Generator().manual_seed(0)
    assert {sample_next(logits, 1.0, 1, None, g) for _ in range(20)} == {1}
    # softmax([1,3,2,-1]) ~ [0.09, 0.66, 0.24, 0.01]: top_p 0.8 keeps tokens 1 and 2 only.
    assert {sample_next(logits, 1.0, None, 0.8, g) for _ in range(200)} == {1, 2}
    assert {sample_next(logits, 1.0, None, 0.5, g) for _ in range(50)} == {1}
    with pytest.raises(ValueError, match="top_p"):
        sample_next(logits, 1.0, None, 0.0, g)
    with pytest.raises(ValueError, match="temperature"):
        sample_next(logits, -1.0, None, None, g)


def test_generate_from_an_export_equals_the_in_memory_model(tmp_path, tokenizer, tokenizer_path, make_model):
    model = make_model(tokenizer)
    export = export_model(model, model.cfg, tokenizer_path, tmp_path / "export")
    loaded, _, tok = load_export(export)
    kwargs = dict(max_tokens=16, temperature=0.8, top_k=20, top_p=0.95, seed=11, stop_at_eos=False)
    assert Generator(loaded, tok).generate("def ", **kwargs) == Generator(model, tokenizer).generate(
        "def ", **kwargs
    )


def test_generation_leaves_the_callers_mode_and_grad_state_alone(tokenizer, make_model):
    model = make_model(tokenizer).train()
    gen = Generator(model, tokenizer)
    for _ in gen.stream("def ", max_tokens=3, temperature=0, stop_at_eos=False):
        assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    assert model.training
