"""The scheduling decision alone: a pure function of the queue and the free KV slots."""

from __future__ import annotations

import pytest

from runyard.serve.scheduler import Chunk, SchedulerConfig, WaitingSequence, schedule


def queue(*lengths: int) -> list[WaitingSequence]:
    return [WaitingSequence(f"s{i}", n) for i, n in enumerate(lengths)]


def plan(chunks: list[Chunk]) -> list[tuple[str, int]]:
    return [(c.seq_id, c.tokens) for c in chunks]


def test_admits_in_order_while_slots_are_free():
    assert plan(schedule(queue(5, 6, 7, 8), free_slots=2, config=SchedulerConfig())) == [("s0", 5), ("s1", 6)]
    assert plan(schedule(queue(5, 6), free_slots=8, config=SchedulerConfig())) == [("s0", 5), ("s1", 6)]
    assert schedule(queue(5, 5), free_slots=0, config=SchedulerConfig()) == []
    assert schedule([], free_slots=4, config=SchedulerConfig()) == []


def test_the_budget_counts_prompt_tokens_and_cuts_the_last_prompt():
    config = SchedulerConfig(max_prefill_tokens=100)
    # 40 + 10 fit whole; the third prompt gets the 50 tokens left and continues next step.
    assert plan(schedule(queue(40, 10, 70, 5), free_slots=8, config=config)) == [("s0", 40), ("s1", 10), ("s2", 50)]
    # Exactly the budget: nothing is cut and nothing more is taken.
    assert plan(schedule(queue(60, 40, 5), free_slots=8, config=config)) == [("s0", 60), ("s1", 40)]


def test_a_long_prompt_is_prefilled_in_budget_sized_chunks_before_anyone_behind_it():
    config = SchedulerConfig(max_prefill_tokens=100)
    assert plan(schedule([WaitingSequence("long", 250), *queue(5)], free_slots=4, config=config)) == [("long", 100)]
    # The next steps continue it (it holds a slot already, so it needs none of the free ones).
    rest = WaitingSequence("long", 150)
    assert plan(schedule(queue(5), free_slots=3, config=config, partial=rest)) == [("long", 100)]
    rest = WaitingSequence("long", 50)  # its last chunk: the queue follows in the same step
    assert plan(schedule(queue(5, 60), free_slots=3, config=config, partial=rest)) == [("long", 50), ("s0", 5), ("s1", 45)]


def test_the_partial_prompt_comes_first_and_the_rest_fill_the_budget():
    config = SchedulerConfig(max_prefill_tokens=100)
    rest = WaitingSequence("p", 30)
    assert plan(schedule(queue(50, 60), free_slots=3, config=config, partial=rest)) == [("p", 30), ("s0", 50), ("s1", 20)]
    # No free slot: only the prompt that already has one goes on.
    assert plan(schedule(queue(5), free_slots=0, config=config, partial=rest)) == [("p", 30)]


def test_prefill_rows_are_capped():
    chunks = schedule(queue(*[3] * 10), free_slots=10, config=SchedulerConfig(max_prefill_seqs=4))
    assert plan(chunks) == [("s0", 3), ("s1", 3), ("s2", 3), ("s3", 3)]
    rest = WaitingSequence("p", 3)
    chunks = schedule(queue(*[3] * 10), free_slots=10, config=SchedulerConfig(max_prefill_seqs=2), partial=rest)
    assert plan(chunks) == [("p", 3), ("s0", 3)]


def test_the_decision_depends_only_on_its_inputs():
    config = SchedulerConfig(max_prefill_tokens=64)
    waiting = queue(30, 50, 7)
    first = schedule(waiting, free_slots=5, config=config)
    assert schedule(list(waiting), free_slots=5, config=config) == first
    assert waiting == queue(30, 50, 7)  # the queue it was given is not changed


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        SchedulerConfig(max_prefill_tokens=0)
