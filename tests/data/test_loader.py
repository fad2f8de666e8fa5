"""Loader: determinism, exact O(1) restore (also across world sizes), rank coverage, prefetch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from runyard.data.loader import TokenLoader
from runyard.data.shards import ShardWriter, write_index
from runyard.errors import DataError

SEQ = 7  # windows of 8 tokens


@pytest.fixture
def counting_index(tmp_path: Path) -> Path:
    """A split whose token stream is 0, 1, 2, ...: a window's first token names its sequence. Shards of
    1000 tokens, so many windows cross a shard boundary."""
    total = 8 * 120 + 5  # 120 sequences and a tail too short for another
    w = ShardWriter(tmp_path, "train", 1000, np.dtype(np.uint32))
    w.add_tokens(np.arange(total), np.array([total]))
    write_index(
        tmp_path / "train.json",
        w.finish(),
        dtype=np.dtype(np.uint32),
        vocab_size=1 << 20,
        eos_id=0,
        shard_tokens=1000,
        num_documents=1,
    )
    return tmp_path / "train.json"


def seq_ids(x: torch.Tensor) -> list[int]:
    return (x[:, 0] // (SEQ + 1)).tolist()


def test_batches_are_shifted_windows(counting_index: Path):
    loader = TokenLoader(counting_index, SEQ, 4, seed=3)
    x, y = loader.next_batch()
    assert x.dtype == torch.long and x.shape == (4, SEQ) and y.shape == (4, SEQ)
    assert torch.equal(y, x + 1)  # target is the input shifted by one token
    assert bool((x[:, 0] % (SEQ + 1) == 0).all())  # windows start at multiples of seq_len + 1
    assert loader.num_sequences == 120


def test_same_seed_same_batches_other_seed_other_order(counting_index: Path):
    a = [TokenLoader(counting_index, SEQ, 4, seed=1).next_batch()[0] for _ in range(2)]
    assert torch.equal(a[0], a[1])
    la, lb = TokenLoader(counting_index, SEQ, 4, seed=1), TokenLoader(counting_index, SEQ, 4, seed=2)
    assert [seq_ids(la.next_batch()[0]) for _ in range(5)] != [seq_ids(lb.next_batch()[0]) for _ in range(5)]


def test_exact_restore_without_replay(counting_index: Path):
    ref = TokenLoader(counting_index, SEQ, 4, seed=5)
    for _ in range(37):  # past the end of epoch 0 (30 steps)
        ref.next_batch()
    state = ref.state_dict()
    assert state["epoch"] == 1 and all(isinstance(v, int | str) for v in state.values())
    expected = [ref.next_batch()[0] for _ in range(10)]
    restored = TokenLoader(counting_index, SEQ, 4, seed=5)
    restored.load_state_dict(state)
    assert restored.epoch == 1
    for want in expected:
        assert torch.equal(restored.next_batch()[0], want)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ranks_cover_every_sequence_once_per_epoch(counting_index: Path, world_size: int):
    loaders = [
        TokenLoader(counting_index, SEQ, 4, seed=9, rank=r, world_size=world_size) for r in range(world_size)
    ]
    steps = 120 // (4 * world_size)
    seen = []
    for _ in range(steps):
        per_rank = [seq_ids(ld.next_batch()[0]) for ld in loaders]
        flat = [s for ids in per_rank for s in ids]
        assert len(set(flat)) == len(flat)  # no overlap between ranks within a step
        seen += flat
    assert sorted(seen) == list(range(120))
    assert all(ld.epoch == 1 for ld in loaders)


def test_restore_onto_another_world_size(counting_index: Path):
    two = [TokenLoader(counting_index, SEQ, 4, seed=11, rank=r, world_size=2) for r in range(2)]
    seen = []
    for _ in range(6):
        for ld in two:
            seen += seq_ids(ld.next_batch()[0])
    state = two[0].state_dict()
    assert state == two[1].state_dict()
    three = [TokenLoader(counting_index, SEQ, 4, seed=11, rank=r, world_size=3) for r in range(3)]
    for ld in three:
        ld.load_state_dict(state)
    for _ in range(6):  # 48 + 72 = 120: exactly the rest of the epoch
        for ld in three:
            seen += seq_ids(ld.next_batch()[0])
    assert sorted(seen) == list(range(120))
    # And the continuation is what a single rank restored at the same point would read.
    one = TokenLoader(counting_index, SEQ, 12, seed=11)
    one.load_state_dict(state)
    assert sorted(seq_ids(one.next_batch()[0])) == sorted(seen[48:60])


def test_prefetch_gives_the_same_batches(counting_index: Path):
    plain = TokenLoader(counting_index, SEQ, 4, seed=2)
    ahead = TokenLoader(counting_index, SEQ, 4, seed=2, prefetch=3)
    for i in range(40):
        if i == 5:
            state = plain.state_dict()
        if i == 20:  # a restore to an earlier point discards the batches prefetched past it
            plain.load_state_dict(state)
            ahead.load_state_dict(state)
        assert torch.equal(plain.next_batch()[0], ahead.next_batch()[0])
    ahead.close()


def test_state_from_other_data_is_refused(counting_index: Path):
    state = TokenLoader(counting_index, SEQ, 4, seed=2).state_dict()
    with pytest.raises(DataError, match="seed"):
        TokenLoader(counting_index, SEQ, 4, seed=3).load_state_dict(state)
    with pytest.raises(DataError, match="seq_len"):
        TokenLoader(counting_index, SEQ + 1, 4, seed=2).load_state_dict(state)


def test_too_short_split_is_a_clear_error(counting_index: Path):
    with pytest.raises(DataError, match="cannot make one sequence"):
        TokenLoader(counting_index, 5000, 1, seed=0)
