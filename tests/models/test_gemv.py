"""The one-token Triton GEMV against F.linear (Triton's interpreter on CPU, the real kernel on a GPU)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

COMPILE_CHECK = __name__ == "__main__" and sys.argv[1:] == ["--compile-check"]
if not torch.cuda.is_available() and not COMPILE_CHECK:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from kvfit.models import gemv  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1" and not COMPILE_CHECK:
    import importlib

    from triton.runtime.interpreter import InterpretedFunction
    if not isinstance(gemv._gemv_kernel, InterpretedFunction):     # imported before TRITON_INTERPRET was set
        gemv = importlib.reload(gemv)

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


def silu_mul_reference(x, gate_up, bias, dtype):
    """silu(gate) * up as the unfused path computes it: the matmul rounded to dtype, then fp32 math."""
    y = (x.double() @ gate_up.double().T + (0 if bias is None else bias.double())).to(dtype).float()
    gate, up = y.chunk(2, dim=1)
    return (gate / (1.0 + torch.exp(-gate)) * up).to(dtype)


@pytest.mark.parametrize("n,k,config", [(37, 100, (4, 64, 4, 1)), (64, 512, (2, 512, 4, 1)), (5, 1030, None),
                                        (9, 300, (1, 128, 4, 1)), (16, 8200, None), (130, 96, (16, 128, 4, 1))])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_silu_mul_matches_the_two_kernel_path(n, k, config, bias):
    g = torch.Generator().manual_seed(n * k)
    x = torch.randn(1, k, generator=g).to(DEVICE)
    w = (torch.randn(2 * n, k, generator=g) / k ** 0.5).to(DEVICE)
    b = torch.randn(2 * n, generator=g).to(DEVICE) if bias else None
    got = gemv.gemv_silu_mul(x, w, b, config=config)
    assert got.shape == (1, n)
    torch.testing.assert_close(got, silu_mul_reference(x, w, b, torch.float32), rtol=1e-4, atol=1e-4)
    # bf16: the gate/up values round to bf16 before the SiLU, as the unfused matmul stores them (a rounding
    # that falls the other way in fp32 than in float64 moves the product by up to ~3 bf16 steps)
    xb, wb = x.bfloat16(), w.bfloat16()
    bb = b.bfloat16() if bias else None
    got = gemv.gemv_silu_mul(xb, wb, bb, config=config)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), silu_mul_reference(xb, wb, bb, torch.bfloat16).float(),
                               rtol=2.5e-2, atol=1e-2)
    # and the two-kernel path it replaces (the GEMV, then SiLU and product in fp32), on the same sums
    two = gemv.gemv(xb, wb, bb).float()
    gate, up = two.chunk(2, dim=1)
    torch.testing.assert_close(got, (gate / (1.0 + torch.exp(-gate)) * up).bfloat16(), rtol=1e-2, atol=1e-2)


def test_gemv_silu_mul_reads_a_shards_rows():
    # a rank's fused [gate shard; up shard] is its own tensor; a row slice (stride(0) > K) also works
    big = torch.randn(12, 80).to(DEVICE)
    w = big[:, 8:72]
    x = torch.randn(1, 64).to(DEVICE)
    torch.testing.assert_close(gemv.gemv_silu_mul(x, w, config=(2, 32, 4, 1)),
                               silu_mul_reference(x, w, None, torch.float32), rtol=1e-4, atol=1e-4)


def _compile_check() -> None:
    """Both GEMV kernels compiled for sm_90 with PDL at the 8B shapes' configs; ptxas: no spills."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))      # tests/ (a script here)
    from triton_interpreter import compile_sm90
    for kernel, (rows, k) in ((gemv._gemv_kernel, (6144, 4096)), (gemv._gemv_kernel, (4096, 14336)),
                              (gemv._gemv_kernel, (128256, 4096)), (gemv._gemv_silu_mul_kernel, (28672, 4096))):
        block_n, block_k, warps, _ = gemv.config_for(rows, k)
        if kernel is gemv._gemv_silu_mul_kernel:
            block_n //= 2
        consts = dict(K=k, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=False, PDL=True)
        sig = {n: "constexpr" if n in consts else "*bf16" if n.endswith("_ptr") else "i32" for n in kernel.arg_names}
        _, spills, report = compile_sm90(kernel, sig, consts, {n for n in sig if sig[n].startswith("*")},
                                         {"num_warps": warps})
        print(f"{kernel.__name__} [{rows}, {k}]: spills {spills} B")
        assert spills == 0, report
    print("ok: gemv kernels compile for sm_90")


def test_kernels_compile_for_sm90():
    from triton_interpreter import run_compile_check
    run_compile_check(__file__, "ok: gemv kernels compile")


if COMPILE_CHECK:
    _compile_check()
