"""Tokenizer: train a byte-level BPE with HF `tokenizers` on the training split, or load one.

Byte-level means every input is representable (no unknown token); the end-of-document token
`<|endoftext|>` is special id 0 in a trained tokenizer, and for a loaded one it must exist in its vocab.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from runyard.errors import DataError

EOS_TOKEN = "<|endoftext|>"


def vocab_shortfall(asked: int, got: int) -> str:
    """Why a trained vocabulary is smaller than the spec asked, and what to do about it."""
    return (
        f"data.tokenizer.vocab_size asked for {asked:,} tokens but the training text (up to "
        f"data.tokenizer.train_max_bytes) supports only {got:,}: no further pair occurs "
        f"data.tokenizer.min_frequency times. The vocabulary has {got:,} tokens; set vocab_size to {got:,} "
        "or less, add text, or lower min_frequency."
    )


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int, max_bytes: int) -> Tokenizer:
    """Train a byte-level BPE on `texts`, reading at most `max_bytes` (UTF-8) of them in order."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def capped() -> Iterator[str]:
        used = 0
        for text in texts:
            if used >= max_bytes:
                return
            size = len(text.encode("utf-8"))
            if used + size > max_bytes:
                text = text.encode("utf-8")[: max_bytes - used].decode("utf-8", errors="ignore")
                size = max_bytes - used
            used += size
            yield text

    tok.train_from_iterator(capped(), trainer=trainer)
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a `tokenizer.json`; raises DataError if it is unreadable or lacks the end-of-document token."""
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on bad files
        raise DataError(f"cannot load tokenizer {path}: {exc}") from None
    if tok.token_to_id(EOS_TOKEN) is None:
        raise DataError(f"tokenizer {path} has no end-of-document token {EOS_TOKEN!r} in its vocabulary")
    return tok


def eos_id(tok: Tokenizer) -> int:
    token_id = tok.token_to_id(EOS_TOKEN)
    if token_id is None:
        raise DataError(f"tokenizer has no {EOS_TOKEN!r} token")
    return token_id
