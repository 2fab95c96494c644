"""The one-token Triton GEMV against F.linear (Triton's interpreter on CPU, the real kernel on a GPU)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from kvfit.models import gemv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("n,k,config", [(37, 100, (8, 64, 4, 1)), (64, 512, (8, 512, 4, 3)),
                                        (5, 1030, (16, 256, 4, 2)), (130, 96, (4, 1024, 4, 3)),
                                        (3, 100, (1, 64, 4, 1)), (7, 300, None), (9, 8200, None)])
def test_gemv_matches_linear(n, k, config):
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=g).to(DEVICE)
    w = torch.randn(n, k, generator=g).to(DEVICE)
    torch.testing.assert_close(gemv.gemv(x, w, config=config), x @ w.T, rtol=1e-4, atol=1e-4)
    b = torch.randn(n, generator=g).to(DEVICE)
    torch.testing.assert_close(gemv.gemv(x, w, b, config=config), x @ w.T + b, rtol=1e-4, atol=1e-4)


def test_config_by_weight_shape():
    # long rows: one row per program; many rows: 2 x 4096; else 2 x 1024; BLOCK_K no wider than K needs
    assert gemv.config_for(4096, 14336) == gemv.LONG_ROW_CONFIG
    assert gemv.config_for(128256, 4096) == gemv.MANY_ROWS_CONFIG
    assert gemv.config_for(6144, 4096) == gemv.DEFAULT_CONFIG
    assert gemv.config_for(32000, 1000)[1] == 1024 and gemv.config_for(64, 100)[1] == 128


def test_gemv_reads_rows_of_a_strided_weight():
    # a weight that is a row slice of a wider matrix (stride(0) > K), as sharded weights can be
    big = torch.randn(20, 80).to(DEVICE)
    w = big[:, 16:64]
    x = torch.randn(1, 48).to(DEVICE)
    torch.testing.assert_close(gemv.gemv(x, w, config=(8, 32, 4, 1)), x @ w.T, rtol=1e-4, atol=1e-4)


def test_linear_falls_back_to_torch_off_cuda_or_with_more_rows():
    x2 = torch.randn(2, 16)
    w = torch.randn(8, 16)
    b = torch.randn(8)
    torch.testing.assert_close(gemv.linear(x2, w, b), torch.nn.functional.linear(x2, w, b))
    assert not gemv.gemv_applies(torch.randn(1, 16), w)              # CPU tensors: plain F.linear
    if torch.cuda.is_available():
        xc, wc, bc = x2[:1].cuda(), w.cuda(), b.cuda()
        assert gemv.gemv_applies(xc, wc)
        torch.testing.assert_close(gemv.linear(xc, wc, bc), torch.nn.functional.linear(xc, wc, bc),
                                   rtol=1e-4, atol=1e-4)
