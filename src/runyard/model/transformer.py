"""A Llama-style decoder-only transformer: the model math only.

RMSNorm pre-normalisation, rotary position embeddings (optionally scaled, as Llama 3), grouped-query
attention through `F.scaled_dot_product_attention` (optionally with query/key/value biases, as Qwen2),
and a SwiGLU feed-forward. Parallelism, compilation and the
training loop live elsewhere (train/); this module never knows how it is run.

Speed notes: Q, K and V come from one fused projection and the SwiGLU gate and up projections are
one matmul; RMSNorm, rotary embeddings and the SwiGLU activation are fused ops with hand-written
backwards (model/ops.py) that save less and copy less than autograd's chains. Rotary writes the queries,
keys and values heads-major, the layout CPU SDPA runs fastest on, and takes their gradients back in one
buffer. The projections are `Linear` (nn.Linear with model/ops.py's `linear`: under CPU bf16 autocast on a
CPU without bf16 matmul instructions, the bf16 product is taken in fp32). The rotary convention
(rotate the two halves of each head) is the one HF's Llama uses, so weights map one to one
(benchmarks/train_throughput.py checks both give the same logits).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from runyard.model.config import ModelConfig, default_ffn_hidden
from runyard.model.kv_cache import KVCache, KVPool, PoolStep
from runyard.model.ops import linear, rms_norm, rotary_qk, rotary_qkv, rotary_tables, swiglu

__all__ = ["KVCache", "KVPool", "ModelConfig", "Transformer", "default_ffn_hidden"]

KVView = KVCache | PoolStep  # what attention layers accept as `kv_cache`

INIT_STD = 0.02


class Linear(nn.Linear):
    """nn.Linear (the same parameters, names and hooks) whose product is model/ops.py's `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.dropout = cfg.dropout
        self.wqkv = Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVView | None = None,
        layer: int = 0,
        start_pos: int = 0,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        H, KV = self.n_heads, self.n_kv_heads
        qkv = self.wqkv(x).view(B, T, H + 2 * KV, self.head_dim)
        if kv_cache is None:  # training, and any forward of whole sequences
            q, k, v = rotary_qkv(qkv, cos, sin, H, KV)  # heads-major and contiguous: what SDPA reads fastest
            mask, causal = None, True
        else:
            # split (not slicing) so the backward is one cat rather than a zero-filled buffer per slice.
            qk, v = qkv.split([H + KV, KV], dim=2)
            q, k = rotary_qk(qk, cos, sin, H)
            if isinstance(kv_cache, PoolStep):  # serving: one flat row of many sequences' tokens (B == 1)
                y = kv_cache.attend(layer, q[0], k[0], v[0])
                return self.wo(y.reshape(B, T, H * self.head_dim))
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            k, v = kv_cache.update(layer, start_pos, k, v)
            mask, causal = kv_cache.attention_mask(T, start_pos, x.device)
        # enable_gqa lets each K/V head serve its group of query heads without materialising copies.
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=causal,
            enable_gqa=KV != H,
        )
        return self.wo(y.transpose(1, 2).reshape(B, T, H * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_gate_up = Linear(cfg.d_model, 2 * cfg.ffn_hidden, bias=False)
        self.w_down = Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(swiglu(self.w_gate_up(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = SwiGLU(cfg)
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()

    def forward(self, x, cos, sin, kv_cache=None, layer=0, start_pos=0):
        x = x + self.drop(self.attn(self.attn_norm(x), cos, sin, kv_cache, layer, start_pos))
        return x + self.drop(self.ffn(self.ffn_norm(x)))


class Transformer(nn.Module):
    """Decoder-only language model: `model(idx)` maps token ids [B, T] to logits [B, T, vocab]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        cos, sin = rotary_tables(cfg.head_dim, cfg.context_length, cfg.rope_theta, cfg.rope_scaling)
        # Derived from the config, so not saved: checkpoints and exports carry only learned weights.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """N(0, 0.02) for matrices and embeddings; residual projections scaled by 1/sqrt(2 * n_layers)
        so the residual stream's variance does not grow with depth (GPT-2). Deterministic given the
        torch seed: parameters are initialised in module order."""
        residual_std = INIT_STD / math.sqrt(2 * self.cfg.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                if module is self.lm_head and self.cfg.tie_embeddings:
                    continue  # shares the embedding's tensor, already initialised
                std = residual_std if name.endswith(("attn.wo", "ffn.w_down")) else INIT_STD
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def forward(
        self,
        idx: torch.Tensor,
        kv_cache: KVView | None = None,
        start_pos: int = 0,
        positions: torch.Tensor | None = None,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits for every position. With `kv_cache`, `idx` holds the tokens at positions
        start_pos.. start_pos+T-1; their keys and values are appended to the cache.

        Serving options: `positions` [B, T] gives each token its own position (for a `KVPool` step, one
        row holding many sequences' tokens); `logits_at` [B] computes the logits at one position per
        row only, returning [B, vocab] (a prefill needs only each prompt's last one); with B == 1 it may
        list several positions of the one row, returning [len(logits_at), vocab]."""
        T = idx.shape[1]
        if positions is None:
            if start_pos + T > self.cfg.context_length:
                raise ValueError(
                    f"sequence reaches position {start_pos + T}, beyond context_length {self.cfg.context_length}"
                )
            cos = self.rope_cos[start_pos : start_pos + T]
            sin = self.rope_sin[start_pos : start_pos + T]
        else:
            # [B, T, 1, head_dim/2]: broadcasts over heads as the shared [T, 1, head_dim/2] tables do.
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        x = self.drop(self.tok_emb(idx))
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, kv_cache, i, start_pos)
        if logits_at is not None:
            x = x[torch.arange(x.shape[0], device=x.device), logits_at]
        return self.lm_head(self.norm(x))

    def new_kv_cache(self, batch_size: int = 1, max_len: int | None = None) -> KVCache:
        """An empty cache for up to `max_len` positions (default: the context length)."""
        p = self.tok_emb.weight
        return KVCache(
            n_layers=self.cfg.n_layers,
            batch_size=batch_size,
            n_kv_heads=self.cfg.n_kv_heads,
            max_len=max_len or self.cfg.context_length,
            head_dim=self.cfg.head_dim,
            dtype=p.dtype,
            device=p.device,
        )

    def new_kv_pool(self, n_slots: int, max_len: int | None = None, dtype: torch.dtype | None = None) -> KVPool:
        """A serving pool of `n_slots` sequences of up to `max_len` positions (default: the context)."""
        p = self.tok_emb.weight
        return KVPool(
            n_layers=self.cfg.n_layers,
            n_slots=n_slots,
            n_kv_heads=self.cfg.n_kv_heads,
            max_len=max_len or self.cfg.context_length,
            head_dim=self.cfg.head_dim,
            dtype=dtype or p.dtype,
            device=p.device,
        )

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Distinct trainable parameters (a tied embedding counts once). `non_embedding` leaves out
        the token embedding table (vocab x d_model), the convention of scaling-law papers."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.tok_emb.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward) at sequence length `seq_len` (default: context).

        6 * N_matmul + 12 * n_layers * d_model * seq_len, after Kaplan et al. / PaLM appendix B:
        - N_matmul counts the weights that take part in a matmul, each costing 2 FLOPs per token
          forward and 4 backward: every non-embedding parameter plus the output head (vocab x d_model,
          a matmul whether or not it is tied); the embedding lookup is free.
        - attention scores and the weighted sum cost 2 * 2 * seq_len * d_model forward per layer,
          times 3 for forward + backward. Causal masking is not discounted (the common convention).
        """
        t = self.cfg.context_length if seq_len is None else seq_len
        n_matmul = self.num_parameters(non_embedding=True) + self.cfg.vocab_size * self.cfg.d_model
        if not self.cfg.tie_embeddings:
            n_matmul -= self.cfg.vocab_size * self.cfg.d_model  # already counted as a non-embedding weight
        return 6.0 * n_matmul + 12.0 * self.cfg.n_layers * self.cfg.d_model * t

    def param_groups(
        self, weight_decay: float, decay_norms_and_biases: bool = False, decay_embeddings: bool = False
    ) -> list[dict]:
        """AdamW parameter groups: matrices decay; norm weights and biases (1-D) and the token embedding
        (also the output head when tied) do not unless asked. Groups are in a fixed order, empty ones
        dropped, each named so a checkpoint's optimizer state lines up."""
        decay, no_decay = [], []
        embedding = self.tok_emb.weight
        for p in self.parameters():  # deduplicated: a tied weight appears once
            if p is embedding:
                is_decayed = decay_embeddings
            elif p.ndim < 2:
                is_decayed = decay_norms_and_biases
            else:
                is_decayed = True
            (decay if is_decayed else no_decay).append(p)
        groups = [
            {"name": "decay", "params": decay, "weight_decay": weight_decay},
            {"name": "no_decay", "params": no_decay, "weight_decay": 0.0},
        ]
        return [g for g in groups if g["params"]]
