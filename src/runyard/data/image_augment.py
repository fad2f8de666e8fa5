"""Training-image augmentation: one random affine warp per image (shift, rotation, scale, optional
mirror), bilinear, with the border pixels extended (a glyph's background, not a black frame).

The random numbers are counter-based: image k of the training stream (the loader's position plus its
offset in the batch) gets its warp from a hash of (seed, k) alone. So a run repeats its warps, a resumed
run draws the same ones from its loader's position (nothing else to checkpoint), and the draws do not
depend on the batch size or the number of processes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

_DRAWS = 5  # uniforms per image: rotation, scale, shift x, shift y, flip
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True)
class Augment:
    """The warp's ranges (spec: model.cnn.augment)."""

    shift: float = 0.0
    rotate: float = 0.0
    scale: float = 0.0
    horizontal_flip: bool = False

    @property
    def active(self) -> bool:
        return bool(self.shift or self.rotate or self.scale or self.horizontal_flip)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_spec(cls, spec: Any) -> Augment:
        return cls(float(spec.shift), float(spec.rotate), float(spec.scale), bool(spec.horizontal_flip))


NONE = Augment()


def _splitmix64(x: np.ndarray) -> np.ndarray:
    z = x + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def uniforms(seed: int, stream: np.ndarray) -> np.ndarray:
    """[len(stream), _DRAWS] floats in [0, 1), a pure function of (seed, each stream index)."""
    with np.errstate(over="ignore"):
        key = _splitmix64(np.asarray([seed % 2**64], dtype=np.uint64))[0]
        counters = stream.astype(np.uint64)[:, None] * np.uint64(_DRAWS) + np.arange(_DRAWS, dtype=np.uint64)
        bits = _splitmix64(counters ^ key)
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53


def augment_batch(pixels: torch.Tensor, stream: np.ndarray, seed: int, aug: Augment) -> torch.Tensor:
    """`pixels` [N, C, H, W] in [0, 1] warped as images `stream` (their training-stream indices) of `seed`."""
    if not aug.active:
        return pixels
    u = uniforms(seed, stream) * 2.0 - 1.0  # in [-1, 1)
    angle = np.deg2rad(aug.rotate) * u[:, 0]
    zoom = 1.0 + aug.scale * u[:, 1]
    flip = np.where(aug.horizontal_flip & (u[:, 4] < 0), -1.0, 1.0)
    cos, sin = np.cos(angle) / zoom, np.sin(angle) / zoom
    # theta maps output to input coordinates in [-1, 1]; a shift of s of the width is 2s there.
    theta = np.stack([np.stack([cos * flip, -sin, 2 * aug.shift * u[:, 2]], axis=1),
                      np.stack([sin * flip, cos, 2 * aug.shift * u[:, 3]], axis=1)], axis=1)
    theta_t = torch.from_numpy(theta.astype(np.float32))
    grid = F.affine_grid(theta_t, list(pixels.shape), align_corners=False)
    return F.grid_sample(pixels, grid, mode="bilinear", padding_mode="border", align_corners=False)

