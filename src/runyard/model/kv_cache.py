"""Key/value caches for incremental decoding: each new token attends to the cached past instead of
recomputing it, so generating n tokens costs O(n) forward positions rather than O(n^2).

Two kinds, one protocol. The attention layer calls `update(layer, start_pos, k, v)`, which stores the
new keys and values and returns every key and value the new queries may see, then
`attention_mask(T, start_pos, device)`, which returns the mask for them (or `is_causal`):

- `KVCache`: one contiguous cache for a batch whose rows all sit at the same position (one request
  generating alone, or a batch of prompts of equal length);
- `KVPool`: a preallocated pool of slots, one per running sequence, each up to `max_len` positions
  (the serving engine's fixed KV memory budget). One engine step is one forward over a flat row of
  tokens, `pool.step(decode_positions, chunks)`: one new token for each decoding sequence (each at its
  own position) followed by chunks of prompts being prefilled. That view computes attention itself
  (`attend`), since every sequence in the row sees a different slot and length.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class KVStore:
    """Preallocated keys and values, one [rows, n_kv_heads, max_len, head_dim] tensor per layer each: the
    memory both kinds of cache hold (a row is a batch row of `KVCache`, a slot of `KVPool`). A tensor per
    layer rather than one for all: a compiled decode step writes each layer's new keys into its own input,
    where a write into a view of one shared tensor makes the compiler copy the whole of it."""

    def __init__(
        self,
        n_layers: int,
        rows: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        shape = (rows, n_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.max_len, self.dtype, self.device = max_len, dtype, torch.device(device)

    @staticmethod
    def bytes_per_slot(n_layers: int, n_kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype) -> int:
        """Memory one row takes (keys and values of every layer), for sizing a pool to a budget."""
        return 2 * n_layers * n_kv_heads * max_len * head_dim * dtype.itemsize

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)


class KVCache(KVStore):
    """One contiguous cache for a batch whose rows all sit at the same position."""

    def __init__(self, n_layers: int, batch_size: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__(n_layers, batch_size, n_kv_heads, max_len, head_dim, dtype, device)

    def update(
        self, layer: int, start_pos: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([B, kv_heads, T, head_dim]) at positions start_pos..start_pos+T-1 of `layer`;
        return the keys and values of positions 0..start_pos+T-1."""
        end = start_pos + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; asked to write up to {end}")
        batch = k.shape[0]
        self.k[layer][:batch, :, start_pos:end] = k
        self.v[layer][:batch, :, start_pos:end] = v
        return self.k[layer][:batch, :, :end], self.v[layer][:batch, :, :end]

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


class KVPool(KVStore):
    """The serving engine's KV memory: `n_slots` sequences of up to `max_len` positions each, allocated
    once, [n_slots, n_kv_heads, max_len, head_dim] per layer for keys and the same for values.

    Decoding sequences occupy slots 0..n-1 in order (the engine moves the last one into a slot that
    frees up), so a decode step reads one contiguous view of the pool and copies nothing."""

    def __init__(self, n_layers: int, n_slots: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__(n_layers, n_slots, n_kv_heads, max_len, head_dim, dtype, device)
        self.n_slots = n_slots

    def step(self, decode_positions: list[int], chunks: list[PrefillChunk] = ()) -> PoolStep:
        """The view for one engine step: a token for each of slots 0..len(decode_positions)-1, slot i
        at decode_positions[i], then the tokens of each prefill chunk in order."""
        return PoolStep(self, decode_positions, list(chunks))

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of slot `src` into slot `dst` (compaction after a
        sequence leaves)."""
        for layer in self.k + self.v:
            layer[dst, :, :length] = layer[src, :, :length]


class PrefillChunk(NamedTuple):
    """Prompt tokens start..start+length-1 of the sequence in `slot` (its positions 0..start-1 are
    already in the slot, from earlier chunks)."""

    slot: int
    start: int
    length: int


def padding_bias(positions: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask [B, 1 (kv heads), 1 (group), length] of decoding rows at `positions` [B] over a
    slot view `length` keys long: -inf past each row's own position."""
    past = torch.arange(length, device=positions.device) > positions[:, None]
    bias = torch.zeros(past.shape, dtype=dtype, device=positions.device).masked_fill_(past, float("-inf"))
    return bias[:, None, None, :]


class PoolStep:
    """One engine step over a flat row of tokens [N]: first one token per decoding sequence (slots
    0..B-1, each at its own position), then the prefill chunks' tokens. The model's attention layers
    call `attend`, which writes the new keys and values into the pool and attends each token to its
    own sequence's past.

    Decode attention folds each key/value head's group of query heads into the query dimension
    ([B, kv_heads, group, head_dim] against the slot's [B, kv_heads, length, head_dim]), so grouped
    queries share their keys without copies; rows shorter than the longest are masked by one additive
    bias built once per step, not once per layer."""

    def __init__(self, pool: KVPool, decode_positions: list[int], chunks: list[PrefillChunk]):
        self.pool, self.chunks = pool, chunks
        self.n_decode = len(decode_positions)
        self.n_tokens = self.n_decode + sum(c.length for c in chunks)
        ends = [p + 1 for p in decode_positions] + [c.start + c.length for c in chunks]
        if any(c.slot < 0 or c.slot >= pool.n_slots for c in chunks) or self.n_decode > pool.n_slots:
            raise ValueError(f"a step uses slots outside the pool's {pool.n_slots}")
        if ends and max(ends) > pool.max_len:
            raise ValueError(f"KV pool slots hold {pool.max_len} positions; a step writes up to {max(ends)}")
        device = pool.device
        positions = list(decode_positions)
        for c in chunks:
            positions.extend(range(c.start, c.start + c.length))
        self.positions = torch.tensor(positions, device=device)
        self.length = max(decode_positions) + 1 if decode_positions else 0
        self.bias = None
        if self.n_decode and min(decode_positions) + 1 < self.length:
            self.bias = padding_bias(self.positions[: self.n_decode], self.length, pool.dtype)
        self.decode_slots = torch.arange(self.n_decode, device=device)
        # A chunk that continues a prompt sees its earlier positions and, causally, its own.
        self.chunk_masks = [
            None if c.start == 0 else
            torch.arange(c.start + c.length, device=device)[None, :]
            <= torch.arange(c.start, c.start + c.length, device=device)[:, None]
            for c in chunks
        ]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, heads, head_dim], k and v [N, kv_heads, head_dim] (after rotary embedding) for the
        step's tokens; returns the attention output [N, heads, head_dim]."""
        n_heads, n_kv, head_dim = q.shape[1], k.shape[1], k.shape[2]
        pool_k, pool_v = self.pool.k[layer], self.pool.v[layer]
        out = []
        B = self.n_decode
        if B:
            decode_pos = self.positions[:B]
            pool_k[self.decode_slots, :, decode_pos] = k[:B]
            pool_v[self.decode_slots, :, decode_pos] = v[:B]
            group_q = q[:B].reshape(B, n_kv, n_heads // n_kv, head_dim)
            y = F.scaled_dot_product_attention(
                group_q, pool_k[:B, :, : self.length], pool_v[:B, :, : self.length], attn_mask=self.bias
            )
            out.append(y.reshape(B, n_heads, head_dim))
        offset = B
        for chunk, mask in zip(self.chunks, self.chunk_masks, strict=True):
            end = chunk.start + chunk.length
            tokens = slice(offset, offset + chunk.length)
            pool_k[chunk.slot, :, chunk.start : end] = k[tokens].transpose(0, 1)
            pool_v[chunk.slot, :, chunk.start : end] = v[tokens].transpose(0, 1)
            y = F.scaled_dot_product_attention(
                q[tokens].transpose(0, 1)[None],
                pool_k[chunk.slot : chunk.slot + 1, :, :end],
                pool_v[chunk.slot : chunk.slot + 1, :, :end],
                attn_mask=mask,
                is_causal=mask is None,
                enable_gqa=n_kv != n_heads,
            )
            out.append(y[0].transpose(0, 1))
            offset += chunk.length
        return out[0] if len(out) == 1 else torch.cat(out)


class DecodeRows(PoolStep):
    """A decode-only step of the sequences in slots 0..B-1, each at its position, over the keys up to the
    furthest one (a row's keys past its own position masked). The row and key counts are the sizes of the
    additive mask ([B, 1, 1, keys]) rather than Python ints, so a compiler told that these sizes are dynamic
    keeps one graph however many sequences decode and however long they grow (serve/decode_graph.py)."""

    def __init__(self, pool: KVPool, positions: list[int]):
        # PoolStep's own __init__ computes the counts as ints; this view reads them from the mask.
        if not positions or max(positions) >= pool.max_len or len(positions) > pool.n_slots:
            raise ValueError(f"a pool of {pool.n_slots} slots of {pool.max_len} positions cannot decode at {positions}")
        self.pool, self.chunks, self.chunk_masks = pool, [], []
        self.positions = torch.tensor(positions, device=pool.device)
        self.decode_slots = torch.arange(len(positions), device=pool.device)
        self.bias = padding_bias(self.positions, max(positions) + 1, pool.dtype)

    @property
    def n_decode(self) -> int:
        return self.bias.shape[0]

    n_tokens = n_decode  # every token decodes: no prompt in the step

    @property
    def length(self) -> int:
        return self.bias.shape[-1]
