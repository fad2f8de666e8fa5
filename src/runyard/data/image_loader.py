"""The image training loader: (pixels, label) batches from a prepared split, deterministic and resumable,
with the same ordering contract as the token loader (data/loader.py): epoch e visits every image once in
a permutation drawn from (seed, e); global step s takes stream positions [s*G, (s+1)*G) with G = batch x
world size, and rank r takes the r-th block of them. The whole position is one integer, so a checkpoint
restores it exactly, under any world size. Augmentation (data/image_augment.py) warps image k of the
stream by a hash of (seed, k), so the position restores it too; the state records the augmentation, and
a checkpoint saved with another one is refused (its resume would not be exact).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from runyard.data.image_augment import NONE, Augment, augment_batch
from runyard.data.image_prep import PreparedImages
from runyard.data.loader import EvalSample
from runyard.errors import DataError

STATE_VERSION = 2  # 2: records the augmentation (a version 1 state had none)
SAMPLE_METHOD = "stratified over the split's order: one image drawn from each of n equal stretches"


class ImageLoader:
    """Batches [batch_size, C, H, W] float32 and labels [batch_size] int64 for one rank; never stops."""

    def __init__(self, prepared: PreparedImages, split: str, batch_size: int, seed: int, rank: int = 0,
                 world_size: int = 1, shuffle: bool = True, augment: Augment = NONE):
        if batch_size < 1:
            raise DataError(f"batch_size ({batch_size}) must be positive")
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is outside world size {world_size}")
        self.x, self.y = prepared.arrays(split)
        self.num_images = len(self.y)
        if self.num_images < 1:
            raise DataError(f"the {split} split of {prepared.directory} holds no images")
        self.batch_size, self.seed, self.rank, self.world_size, self.shuffle = batch_size, seed, rank, world_size, shuffle
        self.augment = augment
        self.position = 0
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    @property
    def epoch(self) -> int:
        return self.position // self.num_images

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            self._perm = rng.permutation(self.num_images) if self.shuffle else np.arange(self.num_images)
            self._perm_epoch = epoch
        return self._perm

    def stream_indices(self, position: int) -> np.ndarray:
        """This rank's places in the training stream for the global step starting at `position`."""
        return position + self.rank * self.batch_size + np.arange(self.batch_size, dtype=np.int64)

    def image_ids(self, position: int) -> np.ndarray:
        stream = self.stream_indices(position)
        epochs = stream // self.num_images
        out = np.empty(self.batch_size, dtype=np.int64)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            out[sel] = self._permutation(int(epoch))[stream[sel] % self.num_images]
        return out

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids, stream = self.image_ids(self.position), self.stream_indices(self.position)
        self.position += self.global_batch
        order = np.argsort(ids, kind="stable")  # a sorted gather reads the memory map forwards
        rows = np.empty((len(ids), *self.x.shape[1:]), dtype=np.float32)
        rows[order] = self.x[ids[order]]
        pixels = augment_batch(torch.from_numpy(rows), stream, self.seed, self.augment)
        return pixels, torch.from_numpy(self.y[ids].astype(np.int64))

    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "position": int(self.position), "epoch": int(self.epoch),
                "seed": int(self.seed), "num_images": int(self.num_images), "world_size": int(self.world_size),
                "batch_size": int(self.batch_size), "shuffle": int(self.shuffle), "augment": self.augment.to_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the exact position; seed and data must match (world and batch size may differ)."""
        for key in ("seed", "num_images"):
            if int(state[key]) != getattr(self, key):
                raise DataError(f"loader state has {key}={state[key]}, but this loader has {getattr(self, key)}")
        if bool(state.get("shuffle", 1)) != self.shuffle:
            raise DataError("loader state was saved with a different shuffle setting")
        saved = Augment(**state["augment"]) if "augment" in state else NONE
        if saved != self.augment:
            raise DataError(f"loader state was saved with augmentation {saved.to_dict()}, but this stage augments with "
                            f"{self.augment.to_dict()} (model.cnn.augment): a resume would not repeat the run's images")
        self.position = int(state["position"])

    def close(self) -> None:
        """Nothing to release (the arrays are memory maps); here for the token loader's interface."""


def image_eval_sample(prepared: PreparedImages, split: str, batch_size: int, images: int, seed: int) -> EvalSample:
    """Up to `images` images drawn across the whole split (one from each of n equal stretches, seeded),
    in batches of `batch_size`; a split no larger than `images` is used whole, in order. The fields of
    EvalSample count images: one target each."""
    x, y = prepared.arrays(split)
    total = len(y)
    if total < 1 or images < 1 or batch_size < 1:
        raise DataError(f"an evaluation sample of the {split} split needs images (split {total}, asked {images}) "
                        f"and batch_size ({batch_size}) >= 1")
    n = min(images, total)
    if n == total:
        ids = np.arange(total)
    else:
        bounds = (np.arange(n + 1, dtype=np.int64) * total) // n
        rng = np.random.Generator(np.random.PCG64(seed))
        ids = bounds[:-1] + (rng.random(n) * (bounds[1:] - bounds[:-1])).astype(np.int64)
    batches = [(torch.from_numpy(np.asarray(x[ids[i:i + batch_size]], dtype=np.float32)),
                torch.from_numpy(y[ids[i:i + batch_size]].astype(np.int64))) for i in range(0, n, batch_size)]
    return EvalSample(batches=batches, sequences=n, tokens=n, documents=n, split_documents=total,
                      split_sequences=total, seed=seed)
