"""The fused decoder kernels against their plain-torch definitions (Triton's interpreter on CPU)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from kvfit.models import fused_ops  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _ref_norm(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("cols", [64, 100])
def test_add_rms_norm(with_residual, cols):
    g = torch.Generator().manual_seed(cols)
    x = torch.randn(5, cols, generator=g).to(DEVICE)
    res = torch.randn(5, cols, generator=g).to(DEVICE) if with_residual else None
    w = torch.randn(cols, generator=g).to(DEVICE)
    out, new_res = fused_ops.add_rms_norm(x, res, w, 1e-6)
    total = x + res if with_residual else x
    torch.testing.assert_close(new_res, total)
    torch.testing.assert_close(out, _ref_norm(total, w, 1e-6), rtol=1e-5, atol=1e-5)


def test_rope_matches_rotate_half():
    from kvfit.models.rope import apply_rope
    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, 4, 32, generator=g).to(DEVICE)
    k = torch.randn(6, 2, 32, generator=g).to(DEVICE)
    pos = torch.tensor([0, 1, 5, 17, 300, 4095]).to(DEVICE)
    freqs = 1.0 / (10000 ** (torch.arange(0, 32, 2).float() / 32)).to(DEVICE)
    ref_q, ref_k = apply_rope(q.clone(), k.clone(), pos, freqs)
    torch.testing.assert_close(fused_ops.rope_(q.clone(), pos, freqs), ref_q, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fused_ops.rope_(k.clone(), pos, freqs), ref_k, rtol=1e-4, atol=1e-4)


def test_rope_on_a_strided_view_of_fused_qkv():
    from kvfit.models.rope import apply_rope
    qkv = torch.randn(3, (4 + 2 + 2) * 16).to(DEVICE)
    q = qkv[:, :64].view(3, 4, 16)
    k = qkv[:, 64:96].view(3, 2, 16)
    pos = torch.tensor([3, 9, 40]).to(DEVICE)
    freqs = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)).to(DEVICE)
    ref_q, ref_k = apply_rope(q.clone(), k.clone(), pos, freqs)
    v_before = qkv[:, 96:].clone()
    fused_ops.rope_(q, pos, freqs)
    fused_ops.rope_(k, pos, freqs)
    torch.testing.assert_close(q, ref_q, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(k, ref_k, rtol=1e-4, atol=1e-4)
    assert torch.equal(qkv[:, 96:], v_before)


def test_silu_mul():
    gu = torch.randn(4, 2 * 1500).to(DEVICE)
    ref = torch.nn.functional.silu(gu[:, :1500]) * gu[:, 1500:]
    torch.testing.assert_close(fused_ops.silu_mul(gu), ref, rtol=1e-5, atol=1e-5)
