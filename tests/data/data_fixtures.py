"""Small real corpora for the data-stage tests (imported by the tests and conftest)."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

from runyard.spec.data import DataSpec

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "theta",
    "kappa",
    "lambda",
    "omega",
    "river",
    "stone",
    "cloud",
    "forest",
    "window",
    "garden",
    "engine",
    "signal",
    "number",
    "vector",
    "matrix",
    "tensor",
    "kernel",
    "buffer",
    "packet",
    "socket",
    "thread",
    "lock",
    "queue",
    "stack",
    "heap",
]


def make_doc(rng: random.Random, n_words: int) -> str:
    lines, line = [], []
    for _ in range(n_words):
        line.append(rng.choice(WORDS))
        if len(line) >= rng.randint(6, 12):
            lines.append(" ".join(line))
            line = []
    if line:
        lines.append(" ".join(line))
    return "\n".join(lines) + "\n"


def write_corpus(
    directory: Path, n_docs: int = 40, seed: int = 0, words: tuple[int, int] = (80, 200)
) -> Path:
    """n_docs distinct text files of random words under directory; returns the directory. Their
    modification times are set a minute back, as for files that existed before the data stage ran (a
    file modified just before it is read is "racy": see data/clean.py)."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        path = directory / f"doc_{i:04d}.txt"
        path.write_text(f"# document {i}\n" + make_doc(rng, rng.randint(*words)))
        age_file(path)
    return directory


def age_file(path: Path, seconds: float = 60.0) -> None:
    """Set a file's modification time `seconds` back."""
    then = time.time() - seconds
    os.utime(path, (then, then))


def spec_for(path: str, **overrides) -> DataSpec:
    """A small, fast DataSpec over `path`: tiny vocabulary, one process."""
    raw = {
        "sources": [{"path": path}],
        "tokenizer": {"vocab_size": 320},
        "shard_tokens": 1024,
        "heldout_fraction": 0.2,
        "workers": 1,
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key] = {**raw[key], **value}
        else:
            raw[key] = value
    return DataSpec.model_validate(raw)
