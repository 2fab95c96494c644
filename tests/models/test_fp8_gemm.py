"""FP8 GEMMs: quantization round trips, the block-wise Triton GEMM against the fp32 reference (Triton's
interpreter on CPU, the real kernel on a GPU), and the kernel compiled for sm_90 without a GPU."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

COMPILE_CHECK = __name__ == "__main__" and sys.argv[1:] == ["--compile-check"]
if not torch.cuda.is_available() and not COMPILE_CHECK:
    os.environ.setdefault("TRITON_INTERPRET", "1")     # before the kernel's module is (re)imported
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

from kvfit.models.quant import block_gemm as bg  # noqa: E402
from kvfit.models.quant.fp8 import (FP8_DTYPE, Fp8Weight, dequantize_weight, fp8_linear_reference,  # noqa: E402
                                    quantize_activations, quantize_groups, quantize_weight_blocks,
                                    quantize_weight_per_channel, quantize_weight_per_tensor)
from kvfit.models.quant.gemm import fp8_linear  # noqa: E402

if INTERPRET and bg.triton is not None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from triton_interpreter import apply_interpreter_fixes
    apply_interpreter_fixes()
    from triton.runtime.interpreter import InterpretedFunction
    if not isinstance(bg._block_fp8_gemm_kernel, InterpretedFunction):   # imported before TRITON_INTERPRET
        bg = importlib.reload(bg)

needs_triton = pytest.mark.skipif(bg.triton is None, reason="needs triton")


def test_weight_quantization_round_trips_within_fp8_precision():
    torch.manual_seed(0)
    w = torch.randn(200, 300)
    for wq, scale, block in ((*quantize_weight_per_channel(w), None), (*quantize_weight_per_tensor(w), None),
                             (*quantize_weight_blocks(w, (128, 128)), (128, 128))):
        assert wq.dtype == FP8_DTYPE and scale.dtype == torch.float32
        back = dequantize_weight(wq, scale, block)
        # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of each scale group's largest value
        assert (back - w).abs().max() <= w.abs().max() / 16
    _, block_scale = quantize_weight_blocks(w, (128, 128))
    assert block_scale.shape == (2, 3)         # ceil(200/128), ceil(300/128): the checkpoint's weight_scale_inv


def test_activation_quantization_per_token_and_group():
    x = torch.tensor([[1.0, -2.0, 0.5, 4.0], [0.0, 0.0, 0.0, 0.0]])
    xq, scale = quantize_activations(x, Fp8Weight(torch.empty(0), torch.empty(0), None))
    assert scale.shape == (2, 1) and scale[0, 0] == 4.0 / 448
    assert xq.float()[0, 3] == 448 and (xq.float()[1] == 0).all()          # an all-zero row stays zero
    xq, scale = quantize_groups(x, 2)
    assert scale.shape == (2, 2) and scale[0].tolist() == pytest.approx([2 / 448, 4 / 448])
    xq, scale = quantize_groups(torch.randn(3, 5), 4)                        # a partial last group
    assert xq.shape == (3, 5) and scale.shape == (3, 2)


def test_static_input_scale_is_used_as_given():
    w = Fp8Weight(torch.empty(0), torch.empty(0), None, input_scale=torch.tensor([0.5]))
    xq, scale = quantize_activations(torch.tensor([[1.0, 300.0]]), w)
    assert xq.float().tolist() == [[2.0, 448.0]] and scale.tolist() == [[0.5]]       # clipped at 448


@pytest.mark.parametrize("bias", [False, True])
def test_reference_equals_the_blockwise_sum(bias):
    """The reference (dequantize, one fp32 matmul) is the sum over K blocks of scaled fp8 products."""
    torch.manual_seed(1)
    m, n, k, blk = 5, 70, 200, (32, 64)
    wq, ws = quantize_weight_blocks(torch.randn(n, k), blk)
    w = Fp8Weight(wq, ws, blk)
    x, b = torch.randn(m, k), torch.randn(n) if bias else None
    xq, xs = quantize_groups(x, blk[1])
    want = torch.zeros(m, n)
    for kb in range(-(-k // blk[1])):
        cols = slice(kb * blk[1], (kb + 1) * blk[1])
        part = xq[:, cols].float() @ wq[:, cols].float().t()
        want += part * xs[:, kb:kb + 1] * ws[:, kb].repeat_interleave(blk[0])[:n][None, :]
    if b is not None:
        want += b
    assert torch.allclose(fp8_linear_reference(x, w, b), want, atol=1e-4, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("m,n,k,config", [(1, 256, 384, None), (19, 200, 300, (16, 64, 4, 1)),
                                          (70, 128, 128, (64, 128, 4, 1))])
def test_block_gemm_kernel_matches_the_reference(m, n, k, config):
    """Partial blocks along N and K, one row (decode) and several M tiles."""
    torch.manual_seed(2)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    wq, ws = quantize_weight_blocks(torch.randn(n, k), (128, 128))
    w = Fp8Weight(wq.to(device), ws.to(device), (128, 128))
    x, bias = torch.randn(m, k, device=device), torch.randn(n, device=device)
    xq, xs = quantize_groups(x, 128)
    got = bg.block_fp8_gemm(xq.contiguous(), xs, w, bias, torch.float32, config=config or (16, 64, 4, 1))
    want = fp8_linear_reference(x, w, bias)
    assert torch.allclose(got, want, atol=1e-3, rtol=1e-4), (got - want).abs().max()


def test_fp8_linear_on_cpu_is_the_reference():
    torch.manual_seed(3)
    wq, ws = quantize_weight_per_channel(torch.randn(48, 32))
    w = Fp8Weight(wq, ws, None)
    x = torch.randn(2, 3, 32, dtype=torch.bfloat16)
    y = fp8_linear(x, w)
    assert y.shape == (2, 3, 48) and y.dtype == torch.bfloat16
    assert torch.equal(y.reshape(6, 48), fp8_linear_reference(x.reshape(6, 32), w))


def _compile_check() -> None:
    """Compile the block GEMM for sm_90 as a launch specialises it (16-divisible pointers and strides, unit
    strides along K and N) with both configs and [128, 128] blocks; ptxas -v must report no register
    spills and shared memory must fit Hopper's 227 KiB. Whether Triton 3.6 software-pipelines the fp8 loads
    is printed, not asserted: it does not yet (no async copies in the TTGIR), a performance follow-up."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from triton_interpreter import compile_sm90
    kernel = bg._block_fp8_gemm_kernel
    types = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32",
             "c_ptr": "*bf16", "bias_ptr": "*bf16"}
    for block_m, block_n, warps, stages in (bg.SMALL_M_CONFIG, bg.LARGE_M_CONFIG):
        consts = dict(GROUP_N=128, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, HAS_BIAS=False, DOT_FP32=False,
                      stride_ak=1, stride_bk=1, stride_cn=1)
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kernel.arg_names}
        divisible = {n for n in kernel.arg_names if sig[n].startswith("*") or n.startswith("stride_")
                     and n not in consts}
        compiled, spills, report = compile_sm90(kernel, sig, consts, divisible,
                                                {"num_warps": warps, "num_stages": stages})
        pipelined = "async_copy_global_to_local" in compiled.asm["ttgir"]
        print(f"block_fp8_gemm {block_m}x{block_n}: shared {compiled.metadata.shared} B, spills {spills} B, "
              f"pipelined {pipelined}")
        assert spills == 0 and compiled.metadata.shared <= 227 * 1024, report
    print("ok: the block FP8 GEMM compiles for sm_90 without spills")


@needs_triton
def test_block_gemm_compiles_for_sm90_without_spills():
    from triton_interpreter import run_compile_check
    run_compile_check(__file__, "ok: the block FP8 GEMM compiles")


if COMPILE_CHECK:
    _compile_check()
