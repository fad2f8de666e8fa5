"""The scheduling decision alone: a pure function of the queue and the free KV slots."""

from __future__ import annotations

import pytest

from runyard.serve.scheduler import SchedulerConfig, WaitingSequence, schedule


def queue(*lengths: int) -> list[WaitingSequence]:
    return [WaitingSequence(f"s{i}", n) for i, n in enumerate(lengths)]


def test_admits_in_order_while_slots_are_free():
    assert schedule(queue(5, 5, 5, 5), free_slots=2, config=SchedulerConfig()) == ["s0", "s1"]
    assert schedule(queue(5, 5), free_slots=8, config=SchedulerConfig()) == ["s0", "s1"]
    assert schedule(queue(5, 5), free_slots=0, config=SchedulerConfig()) == []
    assert schedule([], free_slots=4, config=SchedulerConfig()) == []


def test_prefill_budget_counts_padded_tokens():
    config = SchedulerConfig(max_prefill_tokens=100)
    # Padded to the longest: 2 x 40 = 80 fits; a third row makes 3 x 40 = 120.
    assert schedule(queue(40, 10, 20), free_slots=8, config=config) == ["s0", "s1"]
    # A long prompt joining short ones pads them all: 2 x 60 = 120 > 100.
    assert schedule(queue(10, 60), free_slots=8, config=config) == ["s0"]


def test_first_come_first_served_never_skips_a_long_prompt():
    config = SchedulerConfig(max_prefill_tokens=100)
    # s1 does not fit beside s0; s2 would, but must not overtake s1.
    assert schedule(queue(50, 90, 5), free_slots=8, config=config) == ["s0"]
    # Once s0 has been admitted, s1 goes first even though its prompt alone is near the budget.
    assert schedule(queue(90, 5), free_slots=8, config=config) == ["s0"]


def test_the_head_is_admitted_even_past_the_budget():
    assert schedule(queue(500, 5), free_slots=4, config=SchedulerConfig(max_prefill_tokens=100)) == ["s0"]


def test_prefill_rows_are_capped():
    assert schedule(queue(*[3] * 10), free_slots=10, config=SchedulerConfig(max_prefill_seqs=4)) == [
        "s0", "s1", "s2", "s3",
    ]


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        SchedulerConfig(max_prefill_tokens=0)
