"""The continuous-batching engine, driven step by step on the test's thread (no HTTP)."""

from __future__ import annotations

import threading

import pytest
import torch

from runyard.serve.batch_engine import BatchEngine, SeqEvent
from runyard.serve.engine import Generator
from runyard.serve.errors import EngineUnavailable, InvalidRequest, QueueFull
from runyard.serve.sampling import SamplingParams
from runyard.serve.scheduler import SchedulerConfig

PROMPTS = ["def add(a, b):", "import os\nimport sys\n", "for i in range(10):\n", "class Thing:", "x", "print(i)  # café"]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, **kw)


@pytest.fixture()
def setup(tokenizer, make_model):
    model = make_model(tokenizer, context_length=64)
    return model, tokenizer


def test_batched_greedy_decoding_equals_each_prompt_alone(setup):
    """Prompts of different lengths, joining the running batch at different steps, give what the
    single-sequence generator gives each alone."""
    model, tok = setup
    engine = BatchEngine(model, tok, max_batch=4)  # fewer slots than prompts: some wait for a slot
    ids = [tok.encode(p).ids for p in PROMPTS]
    out = engine.generate(ids, [greedy(12 + i) for i in range(len(ids))], start_at_step=[0, 0, 3, 3, 5, 9])
    single = Generator(model, tok)
    for i, (prompt, done) in enumerate(zip(ids, out, strict=True)):
        assert done.token_ids == single.generate_ids(prompt, max_tokens=12 + i, temperature=0), f"prompt {i}"
        assert done.finish_reason in ("length", "stop")
        assert done.text == single.generate(PROMPTS[i], max_tokens=12 + i, temperature=0)
    assert not engine.running and not engine.waiting


@pytest.mark.parametrize("others", [0, 1, 5])
@pytest.mark.parametrize("join_at", [0, 4])
def test_a_seeded_request_gives_the_same_text_alone_and_in_any_batch(setup, others, join_at):
    model, tok = setup
    ours = SamplingParams(max_tokens=40, temperature=1.0, top_p=0.95, seed=1234)
    prompt = tok.encode("def add(a, b):").ids
    alone = BatchEngine(model, tok, max_batch=8).generate([prompt], [ours])[0]
    crowd = [tok.encode(p).ids for p in PROMPTS[:others]]
    params = [SamplingParams(max_tokens=10 + 7 * i, temperature=0.8, seed=i) for i in range(others)]
    batch = BatchEngine(model, tok, max_batch=8).generate(
        [*crowd, prompt], [*params, ours], start_at_step=[*range(others), join_at]
    )[-1]
    assert batch.text == alone.text and batch.token_ids == alone.token_ids
    assert len(alone.token_ids) == 40  # no end-of-text cut it short: the comparison covers 40 draws


def test_requests_without_a_seed_are_random(setup):
    model, tok = setup
    engine = BatchEngine(model, tok)
    prompt = tok.encode("import ").ids
    texts = {engine.generate([prompt], [SamplingParams(max_tokens=20, temperature=1.0)])[0].text for _ in range(4)}
    assert len(texts) > 1


def test_stop_strings_cut_and_eos_stops(setup):
    model, tok = setup
    engine = BatchEngine(model, tok)
    prompt = tok.encode("class ").ids
    full = engine.generate([prompt], [greedy(20)])[0]
    stop = full.text[3:5]
    cut = engine.generate([prompt], [greedy(20, stop=(stop,))])[0]
    assert cut.text == full.text[: full.text.index(stop)] and cut.finish_reason == "stop"
    # A token the greedy path emits, declared end-of-text: output ends before it.
    eos = full.token_ids[4]
    stopped = engine.generate([prompt], [greedy(20, stop_token_ids=frozenset({eos}))])[0]
    assert stopped.token_ids == full.token_ids[: full.token_ids.index(eos)] and stopped.finish_reason == "stop"


def test_logprobs_follow_the_tokens(setup):
    model, tok = setup
    engine = BatchEngine(model, tok)
    prompt = tok.encode("import os").ids
    done = engine.generate([prompt], [greedy(5, logprobs=3)])[0]
    assert [lp.token_id for lp in done.logprobs] == done.token_ids
    with torch.no_grad():
        first = torch.log_softmax(model(torch.tensor([prompt]))[0, -1], -1)
    assert done.logprobs[0].logprob == pytest.approx(float(first[done.token_ids[0]]), abs=1e-5)
    assert [t for t, _ in done.logprobs[0].top] == torch.topk(first, 3).indices.tolist()


def test_kv_budget_sets_the_slots(setup):
    model, tok = setup
    cfg = model.cfg
    per_slot = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.context_length * cfg.head_dim * 4
    assert BatchEngine(model, tok, kv_cache_bytes=3 * per_slot + 10, max_batch=64).n_slots == 3
    assert BatchEngine(model, tok, kv_cache_bytes=100 * per_slot, max_batch=5).n_slots == 5
    with pytest.raises(EngineUnavailable, match="holds no sequence"):
        BatchEngine(model, tok, kv_cache_bytes=per_slot - 1)


def test_prompts_the_context_cannot_hold_are_refused(setup):
    model, tok = setup
    engine = BatchEngine(model, tok)
    with pytest.raises(InvalidRequest, match="context is 64") as info:
        engine.submit("a", list(range(64)), greedy(1), lambda e: None)
    assert info.value.param == "prompt"
    with pytest.raises(InvalidRequest, match="token ids"):
        engine.submit("b", [10_000], greedy(1), lambda e: None)


def test_a_sequence_stops_at_the_end_of_the_context(setup):
    model, tok = setup
    engine = BatchEngine(model, tok)
    done = engine.generate([list(range(1, 60))], [greedy(50)])[0]
    assert len(done.token_ids) == 64 - 59 and done.finish_reason == "length"


def test_queue_bound(setup):
    model, tok = setup
    engine = BatchEngine(model, tok, max_batch=2, max_queue=3)
    for i in range(3):
        engine.submit(f"s{i}", [1, 2], greedy(2), lambda e: None)
    engine.check_admission(0)
    with pytest.raises(QueueFull) as info:
        engine.check_admission(1)
    assert info.value.retry_after_s >= 1


def test_aborted_sequence_leaves_the_batch_at_the_next_step(setup):
    model, tok = setup
    engine = BatchEngine(model, tok, max_batch=2)
    events: dict[str, list[SeqEvent]] = {"a": [], "b": [], "c": []}
    for name in events:
        engine.submit(name, tok.encode("def ").ids, greedy(50), events[name].append)
    engine.step()
    assert {s.seq_id for s in engine.running} == {"a", "b"} and [s.seq_id for s in engine.waiting] == ["c"]
    engine.abort("a")
    engine.step()  # a leaves and its slot goes to c in the same step
    assert {s.seq_id for s in engine.running} == {"b", "c"}
    assert events["a"][-1].finish_reason == "abort"
    tokens_a = len(events["a"])
    engine.abort("c")
    engine.abort("b")
    engine.step()
    assert not engine.running and len(events["a"]) == tokens_a
    assert events["b"][-1].finish_reason == events["c"][-1].finish_reason == "abort"


def test_engine_thread_serves_concurrent_submitters(setup):
    model, tok = setup
    engine = BatchEngine(model, tok, max_batch=4).start()
    try:
        results: dict[int, list[int]] = {}
        done = threading.Event()

        finished: set[int] = set()

        def submit(i):
            def sink(event: SeqEvent):
                if event.token_id is not None:
                    results.setdefault(i, []).append(event.token_id)
                if event.finish_reason is not None:
                    finished.add(i)
                    if len(finished) == 6:
                        done.set()
            engine.submit(f"t{i}", tok.encode(PROMPTS[i]).ids, greedy(8), sink)

        threads = [threading.Thread(target=submit, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert done.wait(60)
        single = Generator(model, tok)
        for i in range(6):
            assert results[i] == single.generate_ids(tok.encode(PROMPTS[i]).ids, max_tokens=8, temperature=0)
    finally:
        engine.close()
    with pytest.raises(RuntimeError):
        engine.start().generate([[1]], [greedy(1)])
    engine.close()


def test_prompts_cut_into_chunks_decode_as_they_would_alone(setup):
    """With a small prompt-token budget, prompts are prefilled over several steps beside decoding
    sequences (and a sequence finishing meanwhile moves the partly prefilled prompt to a new slot);
    every sequence still gets the single-sequence generator's tokens."""
    model, tok = setup
    engine = BatchEngine(model, tok, max_batch=4, scheduler=SchedulerConfig(max_prefill_tokens=5))
    ids = [tok.encode(p).ids for p in PROMPTS]
    assert max(map(len, ids)) > 5  # some prompt really is cut
    lengths = [3, 12, 4, 9, 15, 6]
    out = engine.generate(ids, [greedy(n) for n in lengths], start_at_step=[0, 0, 1, 2, 2, 6])
    single = Generator(model, tok)
    for i, (prompt, done) in enumerate(zip(ids, out, strict=True)):
        assert done.token_ids == single.generate_ids(prompt, max_tokens=lengths[i], temperature=0), f"prompt {i}"
    assert not engine.running and engine.prefilling is None


def test_a_partly_prefilled_prompt_can_be_aborted(setup):
    model, tok = setup
    engine = BatchEngine(model, tok, max_batch=3, scheduler=SchedulerConfig(max_prefill_tokens=4))
    events: dict[str, list[SeqEvent]] = {"short": [], "long": [], "next": []}
    engine.submit("short", tok.encode("x").ids, greedy(30), events["short"].append)
    engine.submit("long", tok.encode(PROMPTS[1] * 2).ids, greedy(30), events["long"].append)
    engine.submit("next", tok.encode("def ").ids, greedy(3), events["next"].append)
    engine.step()
    assert [s.seq_id for s in engine.running] == ["short"] and engine.prefilling.seq_id == "long"
    engine.abort("long")
    engine.step()  # long leaves before its prompt is done; next takes the budget
    assert events["long"] == [events["long"][0]] and events["long"][0].finish_reason == "abort"
    while engine.step():
        pass
    assert len(events["next"]) == 3 and events["next"][-1].finish_reason == "length"
    assert len(events["short"]) == 30
