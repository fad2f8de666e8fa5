"""Which waiting requests are prefilled this step, and how much of each: a pure function of the queue
and the free KV memory, so it is tested without a model.

The KV memory is a pool of slots, one per sequence (model/kv_cache.py `KVPool`); a sequence holds its
slot from its first prefill chunk until it finishes, and a slot holds a whole context, so a running
sequence never runs out of room and nothing is ever preempted.

Every step is one forward over the decoding sequences' next tokens and chunks of prompts (chunked
prefill, as vLLM schedules it): prompts are taken first come, first served while slots are free, each
as far as the step's prompt-token budget reaches. A prompt the budget cuts short continues at the
head of the next step (one prompt at a time is partly prefilled), so a long prompt neither stalls the
decoding sequences for more than a budget's worth of tokens nor is ever overtaken by short ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class WaitingSequence:
    """What the scheduler needs to know about a sequence still to be prefilled."""

    seq_id: str
    prompt_tokens: int  # prompt tokens not yet in the KV cache


@dataclass(frozen=True)
class SchedulerConfig:
    max_prefill_tokens: int = 4096  # prompt tokens prefilled in one step (bounds a step's stall)
    max_prefill_seqs: int = 64  # prompts (chunks) prefilled together in one step

    def __post_init__(self) -> None:
        if self.max_prefill_tokens < 1 or self.max_prefill_seqs < 1:
            raise ValueError("max_prefill_tokens and max_prefill_seqs must be >= 1")


@dataclass(frozen=True)
class Chunk:
    """Prefill the next `tokens` prompt tokens of `seq_id` this step."""

    seq_id: str
    tokens: int


def schedule(
    waiting: Sequence[WaitingSequence],
    free_slots: int,
    config: SchedulerConfig,
    partial: WaitingSequence | None = None,
) -> list[Chunk]:
    """This step's prefill chunks, in order: first the rest of `partial` (a prompt an earlier step cut
    short; it already holds a slot), then waiting prompts in queue order, one free slot each, while the
    step's prompt-token budget lasts. The last chunk may be a prompt's first part."""
    chunks: list[Chunk] = []
    budget = config.max_prefill_tokens
    if partial is not None:
        take = min(partial.prompt_tokens, budget)
        chunks.append(Chunk(partial.seq_id, take))
        budget -= take
    for seq in waiting[: max(0, min(free_slots, config.max_prefill_seqs - len(chunks)))]:
        if budget <= 0:
            break
        take = min(seq.prompt_tokens, budget)
        chunks.append(Chunk(seq.seq_id, take))
        budget -= take
    return chunks
