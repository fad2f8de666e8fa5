"""Which waiting requests join the running batch this step: a pure function of the queue and the free
KV memory, so it is tested without a model.

The KV memory is a pool of slots, one per running sequence (model/kv_cache.py `KVPool`); a sequence
holds its slot from prefill until it finishes, and a slot holds a whole context, so a running
sequence never runs out of room and nothing is ever preempted. Admission is first come, first served:
the queue's head is admitted while slots are free and the step's prefill stays within its token
budget (rows times the longest prompt, since a batched prefill is padded to it); the scan stops at
the first request that does not fit, so a long prompt is never overtaken and starved by short ones.
The head is admitted even if its prompt alone exceeds the budget, so every prompt eventually runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class WaitingSequence:
    """What the scheduler needs to know about a queued sequence."""

    seq_id: str
    prompt_tokens: int


@dataclass(frozen=True)
class SchedulerConfig:
    max_prefill_tokens: int = 4096  # padded prompt tokens prefilled in one step (bounds a step's stall)
    max_prefill_seqs: int = 64  # prompts prefilled together in one step

    def __post_init__(self) -> None:
        if self.max_prefill_tokens < 1 or self.max_prefill_seqs < 1:
            raise ValueError("max_prefill_tokens and max_prefill_seqs must be >= 1")


def schedule(waiting: Sequence[WaitingSequence], free_slots: int, config: SchedulerConfig) -> list[str]:
    """The ids of the waiting sequences to prefill this step, in queue order."""
    admitted: list[str] = []
    longest = 0
    for seq in waiting:
        if len(admitted) >= min(free_slots, config.max_prefill_seqs):
            break
        padded = (len(admitted) + 1) * max(longest, seq.prompt_tokens)
        if admitted and padded > config.max_prefill_tokens:
            break
        admitted.append(seq.seq_id)
        longest = max(longest, seq.prompt_tokens)
    return admitted
