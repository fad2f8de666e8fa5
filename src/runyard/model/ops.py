"""Fused building blocks of the decoder, each with a hand-written backward.

Autograd's versions of these are chains of small ops that each keep their inputs alive and, where a
fused projection's output is split, pay a zero-fill or a `cat` in backward. The versions here save
only what backward needs and write gradients straight into one buffer. Each is checked against plain
autograd (tests/model/test_ops.py); the math is unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))
        x_hat = x * rstd
        if not any(ctx.needs_input_grad):  # inference: nothing to keep
            return x_hat.mul_(weight)
        # x_hat is kept instead of x (same size): backward then needs no recompute.
        ctx.save_for_backward(x_hat, rstd, weight)
        return x_hat * weight

    @staticmethod
    def backward(ctx, grad):
        x_hat, rstd, weight = ctx.saved_tensors
        grad_x_hat = grad * weight
        # d/dx of x * rstd is rstd * (g - x_hat * mean(g * x_hat)) along the normalised dimension.
        # In place on fresh temporaries: the same arithmetic, fewer large allocations.
        dot = (grad_x_hat * x_hat).mean(-1, keepdim=True)
        grad_x = grad_x_hat.sub_(x_hat * dot).mul_(rstd)
        grad_w = (grad * x_hat).reshape(-1, x_hat.shape[-1]).sum(0)
        return grad_x, grad_w, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dimension. On CPU fp32, `F.rms_norm` is a chain of ops that
    keeps its intermediates, so the hand-written version is used; elsewhere the fused kernel."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return _RMSNorm.apply(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rotary_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """The rotary inverse frequencies [head_dim/2], fp32, computed as transformers computes them: the
    plain ones, or with `scaling` ({"rope_type": "linear" | "llama3", ...}, model/config.py)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotary_tables(
    head_dim: int, length: int, theta: float, scaling: dict[str, Any] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position times each rotary frequency, shape [length, 1, head_dim/2], fp32."""
    inv_freq = rotary_frequencies(head_dim, theta, scaling)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)


def _rotate_into(
    out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float
) -> None:
    """out = (x1*cos - sign*x2*sin, x2*cos + sign*x1*sin) for the two halves x1, x2 of the last dim."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-sign)
    torch.mul(x2, cos, out=o2)
    o2.addcmul_(x1, sin, value=sign)


class _RotaryQK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qk, cos, sin, n_q):
        ctx.save_for_backward(cos, sin)
        ctx.n_q = n_q
        q = qk.new_empty(qk.shape[:2] + (n_q, qk.shape[3]))
        k = qk.new_empty(qk.shape[:2] + (qk.shape[2] - n_q, qk.shape[3]))
        _rotate_into(q, qk[:, :, :n_q], cos, sin, 1.0)
        _rotate_into(k, qk[:, :, n_q:], cos, sin, 1.0)
        return q, k

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        # A rotation's gradient is the inverse rotation; both land in one buffer (no cat).
        cos, sin = ctx.saved_tensors
        n_q = ctx.n_q
        grad = grad_q.new_empty(grad_q.shape[:2] + (n_q + grad_k.shape[2], grad_q.shape[3]))
        _rotate_into(grad[:, :, :n_q], grad_q, cos, sin, -1.0)
        _rotate_into(grad[:, :, n_q:], grad_k, cos, sin, -1.0)
        return grad, None, None, None


def rotary_qk(
    qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_q: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of queries and keys held together in `qk` [B, T, n_q + n_k, head_dim]:
    each pair (x[i], x[i + d/2]) is rotated by its position's angle (the Llama / HF convention).
    cos, sin: [T, 1, head_dim/2]. Returns (q [B, T, n_q, d], k [B, T, n_k, d])."""
    return _RotaryQK.apply(qk, cos, sin, n_q)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate)
        if not ctx.needs_input_grad[0]:  # inference: nothing to keep
            return act.mul_(up)
        # silu(gate) is kept (as autograd would) rather than recomputed in backward: one activation
        # of memory per layer buys one fewer silu pass per layer and step.
        ctx.save_for_backward(gate_up, act)
        return act * up

    @staticmethod
    def backward(ctx, grad):
        gate_up, act = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        grad_in = torch.empty_like(gate_up)
        grad_gate, grad_up = grad_in.chunk(2, dim=-1)
        torch.mul(grad, act, out=grad_up)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        return grad_in


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, where `gate_up` holds gate and up side by side in its last dimension."""
    return _SwiGLU.apply(gate_up)
