"""Turning generated token ids into text as they arrive, and cutting text at stop strings.

Detokenization is incremental with constant work per token: `tokenizers`' `DecodeStream` keeps only
the few ids since the last complete character, so each step decodes a short window, never the whole
completion. It is primed with the prompt's last few ids, so a character or a word-boundary space that
spans the prompt and the completion comes out whole.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

PROMPT_CONTEXT_IDS = 5  # prompt ids the decoder is primed with (vLLM's choice too)


class IncrementalDetokenizer:
    """Text pieces for a sequence's new token ids, one `step` per id."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stream = DecodeStream(list(prompt_ids[-PROMPT_CONTEXT_IDS:]), skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        """The text this token completes ('' while it ends inside a multi-byte character)."""
        return self.stream.step(self.tokenizer, token_id) or ""


class StopScanner:
    """Cuts streamed text at the first stop string, holding back a tail that could begin one. Work per
    piece is bounded by the pieces' and the stop strings' lengths, not by the text so far."""

    def __init__(self, stops: tuple[str, ...] | list[str]):
        self.stops, self.pending, self.stopped = tuple(stops), "", False

    def feed(self, piece: str) -> str:
        """Text that is safe to emit now; sets `stopped` once a stop string appears (the stop string
        and everything after it are dropped, as OpenAI does)."""
        if not self.stops:
            return piece
        self.pending += piece
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.pending = self.pending[: min(hits)], ""
            return out
        hold = max(
            (k for s in self.stops for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0
        )
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out) :]
        return out

    def flush(self) -> str:
        """What was held back, once the sequence has ended without a stop string."""
        out, self.pending = self.pending, ""
        return out
