"""Key/value cache for incremental decoding: each new token attends to the cached past instead of
recomputing it, so generating n tokens costs O(n) forward positions rather than O(n^2)."""

from __future__ import annotations

import torch


class KVCache:
    """Preallocated keys and values, [n_layers, batch, n_kv_heads, max_len, head_dim] each."""

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        shape = (n_layers, batch_size, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len

    def update(
        self, layer: int, start_pos: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([B, kv_heads, T, head_dim]) at positions start_pos..start_pos+T-1 of `layer`;
        return the keys and values of positions 0..start_pos+T-1."""
        end = start_pos + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; asked to write up to {end}")
        batch = k.shape[0]
        self.k[layer, :batch, :, start_pos:end] = k
        self.v[layer, :batch, :, start_pos:end] = v
        return self.k[layer, :batch, :, :end], self.v[layer, :batch, :, :end]
