"""Random tokens written twice, as the same stream: runyard's token store (shards + index) and nanoGPT's
flat .bin of uint16, so a benchmark's runyard loop and its nanoGPT peer read identical data."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from runyard.data.shards import ShardWriter, write_index

DOCUMENT_TOKENS = 4096  # the split is cut into documents of this many tokens (the last takes the rest)


def write_random_split(root: Path, name: str, vocab: int, tokens: int, seed: int,
                       shard_tokens: int) -> tuple[Path, Path]:
    """`tokens` ids drawn uniformly from [1, vocab) with `seed` (0 is the eos id); returns (index, .bin)."""
    ids = np.random.default_rng(seed).integers(1, vocab, size=tokens, dtype=np.int64).astype(np.uint16)
    lengths = np.full(max(tokens // DOCUMENT_TOKENS, 1), min(tokens, DOCUMENT_TOKENS))
    lengths[-1] += tokens - int(lengths.sum())
    writer = ShardWriter(root, name, shard_tokens, np.dtype(np.uint16))
    writer.add_tokens(ids, lengths)
    write_index(root / f"{name}.json", writer.finish(), dtype=np.dtype(np.uint16), vocab_size=vocab, eos_id=0,
                shard_tokens=shard_tokens, num_documents=len(lengths))
    ids.tofile(root / f"{name}.bin")
    return root / f"{name}.json", root / f"{name}.bin"
