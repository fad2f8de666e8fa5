"""Tokenized instruction samples on disk, and the loader that batches them for SFT and DPO.

A store holds one split's samples as four arrays (`<name>.tokens.npy` int32, `<name>.mask.npy` uint8,
`<name>.offsets.npy` int64, `<name>.prompt_end.npy` int64), memory-mapped when read. `mask[i] = 1`
marks token i as the assistant's: the loss predicts it. A sample is one conversation; `prompt_end` is
where its last assistant turn starts (what a generation is prompted with).

Batching is by padding, one sample per row: each micro-batch is padded on the right to its longest
sample, padding and prompt positions get the ignore label. Causal attention means right padding never
changes a real position's output, so no attention mask is needed and the fast causal SDPA kernels stay
in use (see the note of issue 11 for the measured alternative, packing with block-diagonal masks).
Waste is cut by drawing batches from windows of `length_grouping` micro-batches sorted by length.

Order: as the token loader's (data/loader.py). Epoch e visits every sample once, in a permutation drawn
from (seed, e), then sorted by length within fixed windows; the epochs are one stream; the global step
at stream position p gives rank r the samples [p + r*B, p + (r+1)*B). The position is one integer that
means the same under any world size, so resume is O(1) and exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runyard.errors import DataError

STATE_VERSION = 1
IGNORE_INDEX = -100  # the label of a position the loss skips (torch's and HF's convention)
_PARTS = ("tokens", "mask", "offsets", "prompt_end")


def write_store(directory: Path, name: str, samples: list[tuple[list[int], list[int], int]]) -> dict[str, int]:
    """Write (tokens, mask, prompt_end) samples as store `name` in `directory`; returns its counts."""
    lengths = np.array([len(t) for t, _, _ in samples], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.fromiter((x for t, _, _ in samples for x in t), dtype=np.int32, count=int(offsets[-1]))
    mask = np.fromiter((x for _, m, _ in samples for x in m), dtype=np.uint8, count=int(offsets[-1]))
    prompt_end = np.array([p for _, _, p in samples], dtype=np.int64)
    for part, array in zip(_PARTS, (tokens, mask, offsets, prompt_end), strict=True):
        with open(directory / f"{name}.{part}.npy", "wb") as f:
            np.save(f, array)
    return {"samples": len(samples), "tokens": int(offsets[-1]), "supervised_tokens": int(mask.sum())}


class SampleStore:
    """A split's samples, memory-mapped."""

    def __init__(self, directory: Path, name: str):
        try:
            arrays = {p: np.load(directory / f"{name}.{p}.npy", mmap_mode="r") for p in _PARTS}
        except (OSError, ValueError) as exc:
            raise DataError(f"{directory}: sample store {name!r} is missing or damaged ({exc})") from None
        self.tokens, self.mask = arrays["tokens"], arrays["mask"]
        self.offsets, self.prompt_end = arrays["offsets"], arrays["prompt_end"]
        self.name = name
        if len(self.offsets) < 2:
            raise DataError(f"{directory}: sample store {name!r} holds no samples")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        return np.asarray(self.tokens[lo:hi]), np.asarray(self.mask[lo:hi])

    def prompt(self, i: int) -> list[int]:
        """The tokens a generation for sample i is prompted with (everything before its last response)."""
        lo = int(self.offsets[i])
        return [int(t) for t in self.tokens[lo : lo + int(self.prompt_end[i])]]


@dataclass(frozen=True)
class Batch:
    """Padded rows: inputs [R, T], labels [R, T] (IGNORE_INDEX where not supervised). For DPO the rows
    are the chosen responses then the rejected ones (`pairs` each); for SFT `pairs` is None."""

    inputs: torch.Tensor
    labels: torch.Tensor
    real_tokens: int  # input positions that are not padding
    pairs: int | None = None

    @property
    def supervised(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())


def pad_rows(rows: list[tuple[np.ndarray, np.ndarray]], pad_id: int, pairs: int | None = None) -> Batch:
    """Input/label rows from (tokens, mask) samples, padded on the right to the longest."""
    width = max(len(t) for t, _ in rows) - 1
    inputs = np.full((len(rows), width), pad_id, dtype=np.int64)
    labels = np.full((len(rows), width), IGNORE_INDEX, dtype=np.int64)
    real = 0
    for r, (tokens, mask) in enumerate(rows):
        n = len(tokens) - 1
        inputs[r, :n] = tokens[:-1]
        labels[r, :n] = np.where(mask[1:] > 0, tokens[1:], IGNORE_INDEX)
        real += n
    return Batch(torch.from_numpy(inputs), torch.from_numpy(labels), real, pairs)


class SampleLoader:
    """Padded batches of `batch_size` samples (pairs for DPO) for one rank, forever (epoch after epoch).
    `stores` is one store (SFT) or two aligned ones, chosen and rejected (DPO)."""

    def __init__(self, stores: list[SampleStore], batch_size: int, seed: int, pad_id: int, rank: int = 0,
                 world_size: int = 1, length_grouping: int = 0):
        if batch_size < 1 or not 0 <= rank < world_size:
            raise DataError(f"batch_size {batch_size}, rank {rank}, world size {world_size}: not a valid layout")
        if len({len(s) for s in stores}) != 1:
            raise DataError("chosen and rejected stores hold different numbers of samples")
        self.stores, self.batch_size, self.seed, self.pad_id = stores, batch_size, seed, pad_id
        self.rank, self.world_size, self.length_grouping = rank, world_size, length_grouping
        self.num_samples = len(stores[0])
        self._lengths = np.maximum.reduce([s.lengths for s in stores])
        self.position = 0
        self._order_epoch, self._order = -1, np.empty(0, dtype=np.int64)

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The samples of `epoch` in stream order: a seeded permutation, sorted by length (longest first)
        within windows of length_grouping x batch_size samples."""
        if epoch != self._order_epoch:
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            order = rng.permutation(self.num_samples)
            window = self.length_grouping * self.batch_size
            if window > 1:
                for lo in range(0, len(order), window):
                    chunk = order[lo : lo + window]
                    order[lo : lo + window] = chunk[np.argsort(-self._lengths[chunk], kind="stable")]
            self._order_epoch, self._order = epoch, order
        return self._order

    def sample_ids(self, position: int) -> np.ndarray:
        stream = position + self.rank * self.batch_size + np.arange(self.batch_size, dtype=np.int64)
        out = np.empty(self.batch_size, dtype=np.int64)
        for i, pos in enumerate(stream):
            out[i] = self.epoch_order(int(pos // self.num_samples))[pos % self.num_samples]
        return out

    def next_batch(self) -> Batch:
        ids = self.sample_ids(self.position)
        self.position += self.global_batch
        if len(self.stores) == 1:
            return pad_rows([self.stores[0].sample(int(i)) for i in ids], self.pad_id)
        chosen, rejected = self.stores
        rows = [chosen.sample(int(i)) for i in ids] + [rejected.sample(int(i)) for i in ids]
        return pad_rows(rows, self.pad_id, pairs=len(ids))

    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "position": int(self.position), "seed": int(self.seed),
                "num_samples": int(self.num_samples), "length_grouping": int(self.length_grouping),
                "batch_size": int(self.batch_size), "world_size": int(self.world_size)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the position; the seed, the data and the grouping must be the saved ones."""
        for key in ("seed", "num_samples", "length_grouping"):
            if int(state[key]) != getattr(self, key):
                raise DataError(f"sample loader state has {key}={state[key]}, but this loader has {getattr(self, key)}")
        if self.length_grouping and int(state["batch_size"]) != self.batch_size:
            raise DataError("a length-grouped sample loader cannot resume with another batch_size")
        self.position = int(state["position"])


def eval_batches(stores: list[SampleStore], batch_size: int, samples: int, seed: int, pad_id: int) -> tuple[list[Batch], np.ndarray]:
    """A fixed, seeded draw of up to `samples` samples (pairs) of a split, in batches; and their ids."""
    n = len(stores[0])
    ids = np.sort(np.random.Generator(np.random.PCG64(seed)).permutation(n)[: min(samples, n)])
    batches = []
    for lo in range(0, len(ids), batch_size):
        chunk = ids[lo : lo + batch_size]
        if len(stores) == 1:
            batches.append(pad_rows([stores[0].sample(int(i)) for i in chunk], pad_id))
        else:
            rows = [stores[0].sample(int(i)) for i in chunk] + [stores[1].sample(int(i)) for i in chunk]
            batches.append(pad_rows(rows, pad_id, pairs=len(chunk)))
    return batches, ids
