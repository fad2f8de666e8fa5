"""Evaluation samples represent their split: drawn across every part of it (so every document long
enough), fixed for a seed whatever else the process drew, the same size for train and held-out, and
saying what they covered."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from runyard.data.loader import documents_covered, eval_sample
from runyard.data.shards import ShardWriter, write_index
from runyard.errors import DataError

SEQ = 7  # windows of 8 tokens


def write_split(root: Path, doc_lengths: list[int], shard_tokens: int = 1000) -> Path:
    """A split whose token stream is 0, 1, 2, ...: a window's first token names its sequence."""
    total = sum(doc_lengths)
    w = ShardWriter(root, "split", shard_tokens, np.dtype(np.uint32))
    w.add_tokens(np.arange(total), np.array(doc_lengths))
    write_index(root / "split.json", w.finish(), dtype=np.dtype(np.uint32), vocab_size=1 << 20, eos_id=0,
                shard_tokens=shard_tokens, num_documents=len(doc_lengths))
    return root / "split.json"


def seq_ids(sample) -> list[int]:
    return [int(i) for x, _ in sample.batches for i in (x[:, 0] // (SEQ + 1))]


def test_one_sequence_from_each_stretch_of_the_split(tmp_path):
    index = write_split(tmp_path, [8 * 120 + 5])  # 120 sequences
    sample = eval_sample(index, SEQ, batch_size=8, sequences=24, seed=3)
    ids = seq_ids(sample)
    assert len(ids) == 24 and [len(x) for x, _ in sample.batches] == [8, 8, 8]
    # 24 stretches of 5 sequences, one drawn from each: the whole split is represented, in order.
    assert all(5 * j <= i < 5 * (j + 1) for j, i in enumerate(ids))
    assert ids != list(range(24)), "not the first sequences of the split"
    for x, y in sample.batches:
        assert torch.equal(y, x + 1)
    assert sample.tokens == 24 * SEQ and sample.split_sequences == 120 and sample.sequences == 24


def test_the_sample_is_fixed_by_its_seed_alone(tmp_path):
    index = write_split(tmp_path, [8 * 120 + 5])
    first = seq_ids(eval_sample(index, SEQ, 8, 24, seed=3))
    torch.manual_seed(99), np.random.seed(99), random.seed(99)  # whatever the run drew meanwhile
    torch.rand(5), np.random.rand(5)
    assert seq_ids(eval_sample(index, SEQ, 8, 24, seed=3)) == first
    assert seq_ids(eval_sample(index, SEQ, 8, 24, seed=4)) != first


def test_the_sample_reaches_across_the_documents_where_the_first_batches_covered_few(tmp_path):
    rng = np.random.default_rng(0)
    lengths = [int(n) for n in rng.integers(40, 400, size=30)]  # 30 documents of 5 to 50 sequences
    index = write_split(tmp_path, lengths, shard_tokens=512)
    sample = eval_sample(index, SEQ, batch_size=8, sequences=64, seed=1)
    width, total = SEQ + 1, sum(lengths) // (SEQ + 1)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    ends = starts + np.array(lengths)
    # Brute force: the documents each drawn window reads from.
    touched = set()
    for i in seq_ids(sample):
        lo, hi = i * width, (i + 1) * width
        touched.update(d for d in range(30) if starts[d] < hi and ends[d] > lo)
    assert sample.documents == len(touched) and sample.split_documents == 30
    # Every document that holds a whole stretch of the split (one draw each) is in the sample.
    bounds = np.arange(65) * total // 64
    holds_a_stretch = {d for d in range(30) for j in range(64)
                       if starts[d] <= bounds[j] * width and bounds[j + 1] * width <= ends[d]}
    assert holds_a_stretch <= touched and len(touched) >= 25
    # The first 64 sequences in stream order (what held-out evaluation used to score) reach few.
    assert documents_covered(starts, np.arange(64), width) < 10
    assert sample.coverage() | {"method": None} == {
        "sequences": 64, "tokens": 64 * SEQ, "documents": len(touched), "split_documents": 30,
        "split_sequences": total, "method": None, "seed": 1,
    }


def test_a_split_smaller_than_the_sample_is_used_whole(tmp_path):
    index = write_split(tmp_path, [8 * 10 + 3, 8 * 5])
    sample = eval_sample(index, SEQ, batch_size=4, sequences=64, seed=0)
    assert seq_ids(sample) == list(range(15)) and sample.sequences == 15
    assert [len(x) for x, _ in sample.batches] == [4, 4, 4, 3]
    assert sample.documents == 2


def test_a_split_too_short_for_one_sequence_is_a_clear_error(tmp_path):
    index = write_split(tmp_path, [5])
    with pytest.raises(DataError, match="cannot make one sequence"):
        eval_sample(index, SEQ, 4, 8, seed=0)
