"""A nanoGPT-style Llama of runyard's shape: the peer that isolates framework overhead.

Written the way nanoGPT's model.py is (a handful of plain modules, no framework), with the same fusions
runyard makes: one Q/K/V projection (`c_attn`), one gate+up projection (`c_fc`), SDPA with grouped-query
attention, and torch's own `F.rms_norm`. Rotary embeddings rotate the two halves of each head (HF Llama's
convention, as runyard's). What differs from runyard is only runyard's own code (model/ops.py): its fused
RMSNorm, rotary and SwiGLU ops with hand-written backwards, the heads-major queries, keys and values it hands
SDPA, and its bf16 linear on CPUs without bf16 matmul instructions. `load_from_runyard` copies a runyard
model's weights so the two compute the same function (train_throughput.py checks the logits); the loops
that train it (nanoGPT's train.py loop) are in train_throughput.py and gpu_check.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, d_model // n_heads
        self.c_attn = nn.Linear(d_model, (n_heads + 2 * n_kv_heads) * self.head_dim, bias=False)
        self.c_proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        H, KV, D = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.c_attn(x).split([H * D, KV * D, KV * D], dim=2)
        q = rotate(q.view(B, T, H, D).transpose(1, 2), cos, sin)
        k = rotate(k.view(B, T, KV, D).transpose(1, 2), cos, sin)
        v = v.view(B, T, KV, D).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=KV != H)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class MLP(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.c_fc = nn.Linear(d_model, 2 * hidden, bias=False)
        self.c_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.c_fc(x).chunk(2, dim=-1)
        return self.c_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, hidden: int, eps: float):
        super().__init__()
        self.ln_1 = nn.RMSNorm(d_model, eps=eps)
        self.attn = CausalSelfAttention(d_model, n_heads, n_kv_heads)
        self.ln_2 = nn.RMSNorm(d_model, eps=eps)
        self.mlp = MLP(d_model, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cos, sin)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, d_model: int, n_layers: int, n_heads: int, n_kv_heads: int, hidden: int,
                 context: int, tied: bool, eps: float = 1e-5, rope_theta: float = 10000.0):
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.h = nn.ModuleList(Block(d_model, n_heads, n_kv_heads, hidden, eps) for _ in range(n_layers))
        self.ln_f = nn.RMSNorm(d_model, eps=eps)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight
        head_dim = d_model // n_heads
        inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = torch.outer(torch.arange(context, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.wte(idx)
        for block in self.h:
            x = block(x, cos, sin)
        return self.lm_head(self.ln_f(x))


def from_config(cfg) -> GPT:
    """The peer for a runyard ModelConfig."""
    return GPT(cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_hidden,
               cfg.context_length, cfg.tie_embeddings, cfg.norm_eps, cfg.rope_theta)


@torch.no_grad()
def load_from_runyard(peer: GPT, ours: nn.Module) -> None:
    """Copy runyard's weights (same fused layouts: wqkv is q|k|v, w_gate_up is gate|up)."""
    peer.wte.weight.copy_(ours.tok_emb.weight)
    for mine, theirs in zip(peer.h, ours.blocks, strict=True):
        mine.ln_1.weight.copy_(theirs.attn_norm.weight)
        mine.attn.c_attn.weight.copy_(theirs.attn.wqkv.weight)
        mine.attn.c_proj.weight.copy_(theirs.attn.wo.weight)
        mine.ln_2.weight.copy_(theirs.ffn_norm.weight)
        mine.mlp.c_fc.weight.copy_(theirs.ffn.w_gate_up.weight)
        mine.mlp.c_proj.weight.copy_(theirs.ffn.w_down.weight)
    peer.ln_f.weight.copy_(ours.norm.weight)
    if peer.lm_head.weight is not peer.wte.weight:
        peer.lm_head.weight.copy_(ours.lm_head.weight)
