"""Text generation with a KV cache: prefill the prompt once, then decode one token per forward.

Sampling is temperature (0 means greedy), then top-k, then top-p (nucleus), drawn from a
`torch.Generator` seeded per call, so the same seed and prompt give the same completion.
When a sequence outgrows the model's context, the cache is rebuilt from the most recent half of
the context (a sliding window), so generation can run past `context_length`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
from tokenizers import Tokenizer

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|eos|>", "<|end|>")


def find_eos_id(tokenizer: Tokenizer) -> int | None:
    """The id of the tokenizer's end-of-text token, if it has one under a common name."""
    for token in EOS_CANDIDATES:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token_id
    return None


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> int:
    """Pick the next token id from one position's logits [vocab]."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    logits = logits.float()
    if temperature == 0:
        return int(torch.argmax(logits))
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # Drop a token when the tokens ranked above it already reach top_p; the first always stays.
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
        logits = logits.masked_fill(drop_sorted.scatter(0, order, drop_sorted), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


class Generator:
    """Generates completions from a decoder language model (a `model.registry` family with a KV cache:
    `model.cfg`, `model.new_kv_cache`) and its tokenizer."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Tokenizer,
        device: str | torch.device = "cpu",
        eos_ids: Iterable[int] | None = None,
    ):
        """`eos_ids`: the tokens that end a generation (an export's, `model.hf.export.export_eos_ids`: a chat
        model may end turns and documents with different ones); default the tokenizer's end-of-text."""
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids) if eos_ids else frozenset({find_eos_id(tokenizer)} - {None})

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def iter_ids(
        self,
        prompt_ids: Sequence[int],
        max_tokens: int = 64,
        temperature: float = 0.8,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        stop_at_eos: bool = True,
        eos_id: int | None = None,
    ) -> Iterator[int]:
        """Yield completion token ids one by one (the prompt is not repeated); `eos_id`, when given, is the
        one token that ends it instead of the generator's."""
        ids = list(prompt_ids)
        eos = frozenset({eos_id}) if eos_id is not None else self.eos_ids
        if not ids:
            if not eos:
                raise ValueError("the prompt encodes to no tokens and the tokenizer has no end-of-text token")
            ids = [min(eos)]  # start as if at a document boundary
        vocab = self.model.cfg.vocab_size
        if not all(0 <= i < vocab for i in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        generator = torch.Generator(device="cpu").manual_seed(seed)
        cache = self.model.new_kv_cache(batch_size=1)

        was_training = self.model.training
        self.model.eval()  # no dropout while sampling; the caller's mode is restored afterwards
        try:
            yield from self._decode(
                ids, max_tokens, temperature, top_k, top_p, generator, cache, stop_at_eos, eos
            )
        finally:
            self.model.train(was_training)

    def _decode(self, ids, max_tokens, temperature, top_k, top_p, generator, cache, stop_at_eos, eos):
        ctx = self.model.cfg.context_length
        window = ids[-ctx:]
        logits = self._forward(window, cache, 0)
        pos = len(window)
        for _ in range(max_tokens):
            token = sample_next(logits.to("cpu"), temperature, top_k, top_p, generator)
            if stop_at_eos and token in eos:
                return
            yield token
            ids.append(token)
            if pos == ctx:
                # Context full: slide, re-prefilling the most recent half of it.
                window = ids[-(ctx // 2 or 1) :]
                logits = self._forward(window, cache, 0)
                pos = len(window)
            else:
                logits = self._forward([token], cache, pos)
                pos += 1

    def _forward(self, ids: list[int], cache, start_pos: int) -> torch.Tensor:
        # inference_mode only around the forward: a generator must not leave it on across its yields.
        with torch.inference_mode():
            idx = torch.tensor([ids], dtype=torch.long, device=self.device)
            return self.model(idx, kv_cache=cache, start_pos=start_pos)[0, -1]

    def generate_ids(self, prompt_ids: Sequence[int], **kwargs) -> list[int]:
        """Completion token ids; keyword arguments as `iter_ids`."""
        return list(self.iter_ids(prompt_ids, **kwargs))

    def stream(self, prompt: str, **kwargs) -> Iterator[str]:
        """Yield completion text in pieces as tokens arrive; keyword arguments as `iter_ids`."""
        prompt_ids = self.encode(prompt)
        return self.decode_stream(prompt_ids, self.iter_ids(prompt_ids, **kwargs))

    def decode_stream(self, prompt_ids: Sequence[int], token_ids: Iterable[int]) -> Iterator[str]:
        """Turn completion token ids into text pieces. A piece is held back while it ends in an
        incomplete UTF-8 sequence (byte-level BPE can split a character across tokens)."""
        prompt_ids = list(prompt_ids)
        completion: list[int] = []
        emitted = ""
        for token in token_ids:
            completion.append(token)
            text = self._completion_text(prompt_ids, completion)
            if not text.endswith("\ufffd") and text.startswith(emitted):
                if len(text) > len(emitted):
                    yield text[len(emitted) :]
                emitted = text
        text = self._completion_text(prompt_ids, completion)
        if text.startswith(emitted) and len(text) > len(emitted):
            yield text[len(emitted) :]

    def generate(
        self,
        prompt: str,
        max_tokens: int = 64,
        temperature: float = 0.8,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        stop_at_eos: bool = True,
        eos_id: int | None = None,
    ) -> str:
        """The completion of `prompt` as text (without the prompt). Deterministic for a seed;
        temperature 0 decodes greedily."""
        prompt_ids = self.encode(prompt)
        completion = self.generate_ids(
            prompt_ids,
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            stop_at_eos=stop_at_eos,
            eos_id=eos_id,
        )
        return self._completion_text(prompt_ids, completion)

    def _completion_text(self, prompt_ids: list[int], completion: list[int]) -> str:
        # Decode prompt and completion together so a character split across the boundary comes out
        # whole, then drop the prompt's text.
        prefix = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        full = self.tokenizer.decode(list(prompt_ids) + completion, skip_special_tokens=False)
        if full.startswith(prefix):
            return full[len(prefix) :]
        return self.tokenizer.decode(completion, skip_special_tokens=False)
