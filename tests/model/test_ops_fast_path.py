"""The decoder's fast paths against the paths they stand in for: `rotary_qkv` (heads-major q, k and v for SDPA,
one gradient buffer) against `rotary_qk` and a split, and the CPU bf16 linear taken in fp32 against autocast's
bf16 linear and against the exact product of the bf16-rounded operands."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runyard.model import ops
from runyard.model.config import ModelConfig
from runyard.model.ops import linear, rotary_qk, rotary_qkv, rotary_tables
from runyard.model.transformer import Transformer

BF16 = torch.bfloat16


def test_rotary_qkv_matches_rotary_qk_and_a_split_and_gradcheck():
    torch.manual_seed(0)
    qkv = torch.randn(2, 5, 8, 6, dtype=torch.float64, requires_grad=True)  # 4 query heads, 2 kv heads
    cos, sin = (t.double() for t in rotary_tables(6, 5, 10000.0))
    q, k, v = rotary_qkv(qkv, cos, sin, 4, 2)
    ref_q, ref_k = rotary_qk(qkv[:, :, :6], cos, sin, 4)
    torch.testing.assert_close(q, ref_q.transpose(1, 2), rtol=0, atol=0)
    torch.testing.assert_close(k, ref_k.transpose(1, 2), rtol=0, atol=0)
    torch.testing.assert_close(v, qkv[:, :, 6:].transpose(1, 2), rtol=0, atol=0)
    assert q.shape == (2, 4, 5, 6) and k.shape == v.shape == (2, 2, 5, 6)
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()  # what SDPA reads fastest
    assert torch.autograd.gradcheck(lambda t: rotary_qkv(t, cos, sin, 4, 2), (qkv,))


def test_rotary_qkv_accepts_per_row_positions():
    """cos/sin gathered per position [B, T, 1, d/2] (a serving step's own positions) broadcast the same way."""
    torch.manual_seed(0)
    qkv = torch.randn(2, 3, 4, 8)
    cos, sin = rotary_tables(8, 10, 10000.0)
    positions = torch.tensor([[0, 4, 9], [2, 3, 5]])
    q, k, _ = rotary_qkv(qkv, cos[positions], sin[positions], 2, 1)
    ref_q, ref_k = rotary_qk(qkv[:, :, :3], cos[positions], sin[positions], 2)
    torch.testing.assert_close(q, ref_q.transpose(1, 2))
    torch.testing.assert_close(k, ref_k.transpose(1, 2))


@pytest.fixture
def bf16_in_fp32(monkeypatch):
    """The fp32 path as on a CPU without bf16 matmul instructions, whatever this machine has."""
    monkeypatch.setattr(ops, "BF16_MATMUL_IN_FP32", True)


def _linear_case(bias: bool):
    torch.manual_seed(0)
    x = torch.randn(3, 7, 48, requires_grad=True)
    w = (torch.randn(40, 48) * 0.2).requires_grad_()
    b = torch.randn(40, requires_grad=True) if bias else None
    return x, w, b


def _run(fn, x, w, b, grad_out):
    for t in (x, w, b):
        if t is not None:
            t.grad = None
    with torch.autocast("cpu", dtype=BF16):
        y = fn(x, w, b)
    y.backward(grad_out)
    return y, x.grad, w.grad, None if b is None else b.grad


@pytest.mark.parametrize("bias", [False, True])
def test_cpu_bf16_linear_in_fp32_is_the_rounded_bf16_product(bf16_in_fp32, bias):
    x, w, b = _linear_case(bias)
    grad_out = torch.randn(3, 7, 40).to(BF16)
    y, gx, gw, gb = _run(linear, x, w, b, grad_out)
    assert y.dtype == BF16 and gx.dtype == gw.dtype == torch.float32  # autocast's dtypes
    # The exact product of the bf16-rounded operands, rounded to bf16: within one bf16 step of it.
    xr, wr = x.detach().to(BF16).double(), w.detach().to(BF16).double()
    exact = xr @ wr.T + (0 if b is None else b.detach().to(BF16).double())
    torch.testing.assert_close(y.double(), exact.to(BF16).double(), rtol=2**-7, atol=1e-3)
    # ...and what torch's own bf16 linear under autocast gives, gradients included.
    ref = _run(F.linear, x, w, b, grad_out)
    for ours, theirs in zip((y, gx, gw, gb), ref, strict=True):
        if ours is not None:
            torch.testing.assert_close(ours.float(), theirs.float(), rtol=2e-2, atol=2e-2 * theirs.abs().max().item())
    exact_gx = grad_out.double() @ wr
    torch.testing.assert_close(gx.double(), exact_gx.to(BF16).double(), rtol=2**-7, atol=1e-3)


def test_linear_is_torch_linear_outside_cpu_bf16_autocast(bf16_in_fp32, monkeypatch):
    x, w, b = _linear_case(True)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))  # fp32: untouched
    monkeypatch.setattr(ops, "BF16_MATMUL_IN_FP32", False)  # a CPU with bf16 matmul: torch's kernel
    with torch.autocast("cpu", dtype=BF16):
        assert torch.equal(linear(x, w, b), F.linear(x, w, b))


def test_cpus_other_than_x86_keep_torch_bf16_matmul(monkeypatch):
    monkeypatch.setattr(ops.platform, "machine", lambda: "aarch64")
    assert ops._cpu_has_bf16_matmul()


def test_transformer_under_cpu_bf16_autocast_trains_as_with_torch_bf16_matmul(monkeypatch):
    cfg = ModelConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                      context_length=16)
    torch.manual_seed(0)
    model = Transformer(cfg)
    x, y = torch.randint(0, 96, (2, 16)), torch.randint(0, 96, (2, 16))

    def loss_and_grads(in_fp32: bool):
        monkeypatch.setattr(ops, "BF16_MATMUL_IN_FP32", in_fp32)
        model.zero_grad()
        with torch.autocast("cpu", dtype=BF16):
            logits = model(x)
        assert logits.dtype == BF16
        loss = F.cross_entropy(logits.float().view(-1, 96), y.view(-1))
        loss.backward()
        return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])

    (loss_fast, grads_fast), (loss_torch, grads_torch) = loss_and_grads(True), loss_and_grads(False)
    loss_fp32, grads_fp32 = loss_and_grads_fp32(model, x, y)
    torch.testing.assert_close(loss_fast, loss_torch, rtol=1e-5, atol=1e-5)
    # bf16's own rounding separates either from fp32 by some 3e-3 of the gradient's norm here; the two bf16
    # paths differ only in the order of the fp32 sums, far below that.
    bf16_vs_fp32 = (grads_torch - grads_fp32).norm()
    assert bf16_vs_fp32 > 1e-3 * grads_fp32.norm()
    assert (grads_fast - grads_torch).norm() < 0.1 * bf16_vs_fp32
    assert not torch.equal(loss_fp32, loss_torch)


def loss_and_grads_fp32(model, x, y):
    model.zero_grad()
    loss = F.cross_entropy(model(x).view(-1, model.cfg.vocab_size), y.view(-1))
    loss.backward()
    return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])


def test_the_decoder_traces_as_one_graph_in_training_and_with_a_kv_cache():
    """torch.compile (`resources.compile`, the GPU step) sees each forward, backward included, as one graph:
    the fused ops write into strided views without `out=` while Dynamo traces, and compute the same values
    (to rounding) forward and backward."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, context_length=16)
    model = Transformer(cfg)
    x = torch.randint(0, 64, (2, 8))
    try:
        training = torch._dynamo.explain(model)(x)
        assert training.graph_count == 1 and training.graph_break_count == 0, training.break_reasons
        compiled = torch.compile(model, backend="aot_eager")  # Dynamo and AOT autograd, no code generation
        eager_out, compiled_out = model(x), compiled(x)
        torch.testing.assert_close(compiled_out, eager_out)  # AOT autograd's decompositions round differently
        eager_out.square().mean().backward()
        eager_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        compiled_out.square().mean().backward()
        for p, g in zip(model.parameters(), eager_grads, strict=True):
            torch.testing.assert_close(p.grad, g)
        cache = model.new_kv_cache(1)
        with torch.inference_mode():
            decode = torch._dynamo.explain(model)(x[:1, :4], kv_cache=cache, start_pos=0)
        assert decode.graph_break_count == 0, decode.break_reasons
    finally:
        torch._dynamo.reset()
