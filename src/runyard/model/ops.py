"""Fused building blocks of the decoder, each with a hand-written backward.

Autograd's versions of these are chains of small ops that each keep their inputs alive and, where a
fused projection's output is split, pay a zero-fill or a `cat` in backward. The versions here save
only what backward needs and write gradients straight into one buffer. Each is checked against plain
autograd (tests/model/test_ops.py); the math is unchanged.

`linear` is the projections' matmul. Under CPU bf16 autocast on an x86 CPU without bf16 matrix
instructions (no AVX512-BF16, no AMX), torch's bf16 matmul falls back to a generic kernel that runs at
0.3-25 GFLOP/s depending on the operands' layout, against ~85 for fp32 on the same core
(benchmarks/results/train_profile.md); there the product of the bf16-rounded operands is taken in fp32
instead, which is what a bf16 matmul computes (exact products, fp32 accumulation, the result rounded to
bf16), so the values autocast defines are kept, to the order of accumulation.
"""

from __future__ import annotations

import math
import platform
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
    if torch.compiler.is_compiling():
        # Dynamo cannot trace `out=` into a strided view (a graph break at every block); a product copied
        # in is the same arithmetic, and inductor fuses it away.
        o1.copy_(x1 * cos)
        o2.copy_(x2 * cos)
    else:
        torch.mul(x1, cos, out=o1)
        torch.mul(x2, cos, out=o2)
    o1.addcmul_(x2, sin, value=-sign)
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


class _RotaryQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, n_q, n_kv):
        ctx.save_for_backward(cos, sin)
        ctx.n_q, ctx.n_kv = n_q, n_kv
        B, T, _, D = qkv.shape
        # Heads-major [B, heads, T, D] in memory: CPU SDPA alone runs ~20% faster on it than on the projection's
        # [B, T, heads, D] (benchmarks/results/train_profile.md); written there directly, not copied after.
        q, k, v = (qkv.new_empty(B, n, T, D) for n in (n_q, n_kv, n_kv))
        _rotate_into(q.transpose(1, 2), qkv[:, :, :n_q], cos, sin, 1.0)
        _rotate_into(k.transpose(1, 2), qkv[:, :, n_q:n_q + n_kv], cos, sin, 1.0)
        v.transpose(1, 2).copy_(qkv[:, :, n_q + n_kv:])
        return q, k, v

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_v):
        # The inverse rotations and V's gradient land in one buffer of the projection's layout (no cat).
        cos, sin = ctx.saved_tensors
        n_q, n_kv = ctx.n_q, ctx.n_kv
        B, _, T, D = grad_q.shape
        grad = grad_q.new_empty(B, T, n_q + 2 * n_kv, D)
        _rotate_into(grad[:, :, :n_q], grad_q.transpose(1, 2), cos, sin, -1.0)
        _rotate_into(grad[:, :, n_q:n_q + n_kv], grad_k.transpose(1, 2), cos, sin, -1.0)
        grad[:, :, n_q + n_kv:].copy_(grad_v.transpose(1, 2))
        return grad, None, None, None, None


def rotary_qkv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_q: int, n_kv: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rotary_qk` of the queries and keys in a fused projection's output `qkv` [B, T, n_q + 2 n_kv, head_dim],
    returned with its values as attention takes them: q [B, n_q, T, d], k and v [B, n_kv, T, d], each
    contiguous."""
    return _RotaryQKV.apply(qkv, cos, sin, n_q, n_kv)


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
        if torch.compiler.is_compiling():  # no `out=` into strided views under Dynamo (see _rotate_into)
            grad_up.copy_(grad * act)
            grad_gate.copy_(torch.ops.aten.silu_backward(grad * up, gate))
        else:
            torch.mul(grad, act, out=grad_up)
            torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        return grad_in


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, where `gate_up` holds gate and up side by side in its last dimension."""
    return _SwiGLU.apply(gate_up)


def _cpu_has_bf16_matmul() -> bool:
    """Whether torch multiplies bf16 in hardware on this CPU: x86 with AVX512-BF16 or AMX. Other
    architectures are taken to (their bf16 path is left as torch has it)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True
    cpu = torch.cpu
    checks = (getattr(cpu, "_is_avx512_bf16_supported", None), getattr(cpu, "_is_amx_tile_supported", None))
    return any(check is None or check() for check in checks)  # an unknown torch: leave its kernels alone


# Decided once per process: the CPU does not change under it.
BF16_MATMUL_IN_FP32 = not _cpu_has_bf16_matmul()


class _Bf16LinearInFp32(torch.autograd.Function):
    """x @ weight.T (+ bias) for bf16 operands, the products summed in fp32, the result rounded to bf16;
    backward likewise. Saves the bf16 operands, as autocast's linear does."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        if any(ctx.needs_input_grad):
            ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return out.to(torch.bfloat16)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1]).float()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ weight.float()).to(torch.bfloat16).view(x.shape)
        if ctx.needs_input_grad[1]:
            grad_w = (g.t() @ x.reshape(-1, x.shape[-1]).float()).to(torch.bfloat16)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0).to(torch.bfloat16)
        return grad_x, grad_w, grad_b


def _bf16_in_fp32(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """CPU bf16 autocast on a CPU without bf16 matmul, for plain tensors (not a DTensor's shards)."""
    return (BF16_MATMUL_IN_FP32 and x.device.type == "cpu" and torch.is_autocast_enabled("cpu")
            and torch.get_autocast_dtype("cpu") == torch.bfloat16
            and type(x) is torch.Tensor and type(weight) in (torch.Tensor, torch.nn.Parameter))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear: x @ weight.T (+ bias). Under CPU bf16 autocast on a CPU without bf16 matmul, the
    bf16-rounded operands are multiplied in fp32 and the result rounded to bf16 (module docstring)."""
    if not _bf16_in_fp32(x, weight):
        return F.linear(x, weight, bias)
    bf16 = torch.bfloat16
    with torch.autocast("cpu", enabled=False):  # the casts autocast would make, recorded for backward
        return _Bf16LinearInFp32.apply(x.to(bf16), weight.to(bf16), None if bias is None else bias.to(bf16))
