"""The fused ops' hand-written backwards against plain autograd (float64 gradcheck) and references."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runyard.model.ops import _RMSNorm, rms_norm, rotary_qk, rotary_tables, swiglu


def rotary_reference(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def test_rotary_qk_matches_reference_and_gradcheck():
    torch.manual_seed(0)
    qk = torch.randn(2, 5, 6, 8, dtype=torch.float64, requires_grad=True)
    cos, sin = (t.double() for t in rotary_tables(8, 5, 10000.0))
    q, k = rotary_qk(qk, cos, sin, 4)
    expected = rotary_reference(qk, cos, sin)
    torch.testing.assert_close(q, expected[:, :, :4])
    torch.testing.assert_close(k, expected[:, :, 4:])
    assert torch.autograd.gradcheck(lambda t: rotary_qk(t, cos, sin, 4), (qk,))


def test_rotary_preserves_norms_and_position_zero_is_identity():
    cos, sin = rotary_tables(16, 7, 10000.0)
    qk = torch.randn(1, 7, 3, 16)
    q, k = rotary_qk(qk, cos, sin, 2)
    out = torch.cat([q, k], dim=2)
    torch.testing.assert_close(out.norm(dim=-1), qk.norm(dim=-1))
    torch.testing.assert_close(out[:, 0], qk[:, 0])


def test_rms_norm_matches_torch_and_gradcheck():
    torch.manual_seed(0)
    h = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(_RMSNorm.apply(h, w, 1e-5), F.rms_norm(h, (16,), w, 1e-5))
    assert torch.autograd.gradcheck(lambda a, b: _RMSNorm.apply(a, b, 1e-5), (h, w))
    x = torch.randn(3, 16)
    torch.testing.assert_close(rms_norm(x, w.float().detach(), 1e-5), F.rms_norm(x, (16,), w.float(), 1e-5))


def test_swiglu_matches_reference_and_gradcheck():
    torch.manual_seed(0)
    gu = torch.randn(2, 5, 12, dtype=torch.float64, requires_grad=True)
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(swiglu(gu), F.silu(gate) * up)
    assert torch.autograd.gradcheck(swiglu, (gu,))
