"""Key/value caches for incremental decoding: each new token attends to the cached past instead of
recomputing it, so generating n tokens costs O(n) forward positions rather than O(n^2).

Two kinds, one protocol. The attention layer calls `update(layer, start_pos, k, v)`, which stores the
new keys and values and returns every key and value the new queries may see, then
`attention_mask(T, start_pos, device)`, which returns the mask for them (or `is_causal`):

- `KVCache`: one contiguous cache for a batch whose rows all sit at the same position (one request
  generating alone, or a batch of prompts of equal length);
- `KVPool`: a preallocated pool of slots, one per running sequence, each up to `max_len` positions
  (the serving engine's fixed KV memory budget). A step works on a view of it: `pool.prefill(...)` for
  a batch of new prompts written into fresh slots, `pool.decode(positions)` for one new token per
  running sequence, each at its own position.
"""

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

    def attention_mask(
        self, n_queries: int, start_pos: int, device: torch.device
    ) -> tuple[torch.Tensor | None, bool]:
        """(mask, is_causal) for `n_queries` new queries at start_pos.. over the keys `update` returned."""
        if n_queries == 1:
            return None, False  # one new query may see every cached position
        if start_pos > 0:
            # Query i sits at position start_pos + i and sees keys up to it.
            keys = torch.arange(start_pos + n_queries, device=device)
            return keys[None, :] <= (start_pos + torch.arange(n_queries, device=device))[:, None], False
        return None, True


class KVPool:
    """The serving engine's KV memory: `n_slots` sequences of up to `max_len` positions each, allocated
    once, [n_layers, n_slots, n_kv_heads, max_len, head_dim] for keys and the same for values.

    Running sequences occupy slots 0..n-1 in order (the engine moves the last one into a slot that
    frees up), so a decode step reads one contiguous view of the pool and copies nothing."""

    def __init__(
        self,
        n_layers: int,
        n_slots: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        shape = (n_layers, n_slots, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.n_slots, self.max_len = n_slots, max_len

    @staticmethod
    def bytes_per_slot(n_layers: int, n_kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype) -> int:
        """Memory one slot takes (keys and values of every layer), for sizing a pool to a budget."""
        return 2 * n_layers * n_kv_heads * max_len * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def prefill(self, first_slot: int, n_rows: int) -> PoolPrefill:
        """A view for prefilling `n_rows` prompts (right-padded to one length, all starting at
        position 0) into slots first_slot.. first_slot+n_rows-1."""
        if first_slot < 0 or first_slot + n_rows > self.n_slots:
            raise ValueError(f"slots {first_slot}..{first_slot + n_rows - 1} outside the pool's {self.n_slots}")
        return PoolPrefill(self, first_slot, n_rows)

    def decode(self, positions: torch.Tensor, length: int | None = None) -> PoolDecode:
        """A view for one new token in each of slots 0..len(positions)-1, row i at positions[i].
        `length` (max(positions) + 1) may be passed when known, to spare a device sync."""
        return PoolDecode(self, positions, length)

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of slot `src` into slot `dst` (compaction after a
        sequence leaves)."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]


class PoolPrefill:
    """Writes a prefill's keys and values into consecutive slots; attention is plain causal (every
    row starts at position 0; padding sits after a row's prompt, where no real query looks)."""

    def __init__(self, pool: KVPool, first_slot: int, n_rows: int):
        self.pool, self.rows = pool, slice(first_slot, first_slot + n_rows)

    def update(self, layer: int, start_pos: int, k: torch.Tensor, v: torch.Tensor):
        length = k.shape[2]
        if length > self.pool.max_len:
            raise ValueError(f"KV pool slots hold {self.pool.max_len} positions; prefill has {length}")
        self.pool.k[layer, self.rows, :, :length] = k
        self.pool.v[layer, self.rows, :, :length] = v
        return k, v

    def attention_mask(self, n_queries: int, start_pos: int, device: torch.device):
        return None, True


class PoolDecode:
    """One new token per running sequence (slots 0..B-1), each at its own position: keys are written
    at (slot, position) and every row sees its own keys up to its position."""

    def __init__(self, pool: KVPool, positions: torch.Tensor, length: int | None = None):
        self.pool = pool
        self.positions = positions
        self.rows = torch.arange(len(positions), device=positions.device)
        self.length = length if length is not None else (int(positions.max()) + 1 if len(positions) else 0)
        if self.length > pool.max_len:
            raise ValueError(f"KV pool slots hold {pool.max_len} positions; a row is at {self.length - 1}")
        keys = torch.arange(self.length, device=positions.device)
        # [B, 1 (heads), 1 (query), keys]: row b sees keys 0..positions[b].
        self.mask = (keys[None, :] <= positions[:, None])[:, None, None, :]

    def update(self, layer: int, start_pos: int, k: torch.Tensor, v: torch.Tensor):
        batch = len(self.positions)
        self.pool.k[layer, self.rows, :, self.positions] = k[:, :, 0]
        self.pool.v[layer, self.rows, :, self.positions] = v[:, :, 0]
        return self.pool.k[layer, :batch, :, : self.length], self.pool.v[layer, :batch, :, : self.length]

    def attention_mask(self, n_queries: int, start_pos: int, device: torch.device):
        return self.mask, False
