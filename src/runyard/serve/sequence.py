"""What the engine keeps per sequence and what it reports: one `SeqEvent` per token to the sequence's
`Sink` (serve/batch_engine.py, and the vLLM adapter in serve/vllm_engine.py, which reports the same)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from runyard.serve.detokenize import IncrementalDetokenizer, StopScanner
from runyard.serve.sampling import SamplingParams, TokenLogprobs


@dataclass(frozen=True)
class SeqEvent:
    """What one step produced for one sequence: the token (None when it ended without one), the text it
    released (possibly empty: a partial character, or text held back as a possible stop string), and
    the finish reason on its last event ('stop', 'length', 'abort' or 'error')."""

    seq_id: str
    token_id: int | None
    text: str
    logprobs: TokenLogprobs | None
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


Sink = Callable[[SeqEvent], None]


@dataclass
class SequenceState:
    """A sequence in the engine: its request, its sampling state and how far it has got."""

    seq_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: Sink
    generator: torch.Generator
    detok: IncrementalDetokenizer
    scanner: StopScanner
    output_ids: list[int] = field(default_factory=list)
    pos: int = 0  # tokens in the KV cache: where the next fed token is written (mid-prompt while prefilling)
    last_token: int = -1
    finish_reason: str | None = None
    started: float | None = None  # when its prefill ran


@dataclass
class Completion:
    """A finished sequence, as `generate` returns it."""

    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[TokenLogprobs]
