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

from kvfit.kernels import fp8_block_gemm as bg  # noqa: E402
from kvfit.kernels.fp8 import (FP8_DTYPE, Fp8Weight, dequantize_weight, fp8_linear_reference,  # noqa: E402
                               quantize_activations, quantize_groups, quantize_weight_blocks,
                               quantize_weight_per_channel, quantize_weight_per_tensor)
from kvfit.kernels.fp8_gemm import fp8_linear  # noqa: E402

from kvfit.kernels import fp8_fused_experts as fe  # noqa: E402
from kvfit.kernels import fp8_gemv as gv  # noqa: E402
from kvfit.kernels import fp8_quantize as qk  # noqa: E402

if INTERPRET and bg.triton is not None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from triton_interpreter import apply_interpreter_fixes
    apply_interpreter_fixes()
    from triton.runtime.interpreter import InterpretedFunction
    if not isinstance(bg._block_fp8_gemm_kernel, InterpretedFunction):   # imported before TRITON_INTERPRET
        bg = importlib.reload(bg)
    if not isinstance(qk._quantize_kernel, InterpretedFunction):         # first: fe's kernel calls its helpers
        qk = importlib.reload(qk)
    if not isinstance(fe._gate_up_fp8_kernel, InterpretedFunction):
        fe = importlib.reload(fe)
    if not isinstance(gv._fp8_gemv_kernel, InterpretedFunction):
        gv = importlib.reload(gv)

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
                                          (70, 128, 128, (64, 128, 4, 1)), (5, 200, 512, (16, 64, 4, 1, 4)),
                                          (19, 136, 300, (16, 32, 4, 1, 3)), (33, 256, 512, (16, 128, 4, 1, 2))])
def test_block_gemm_kernel_matches_the_reference(m, n, k, config):
    """Partial blocks along N and K, one row (decode) and several M tiles; K split over 2-4 programs (a partial
    last K step in the last split; BLOCK_N under the scale's 128 rows), the bias added after the sum."""
    torch.manual_seed(2)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    wq, ws = quantize_weight_blocks(torch.randn(n, k), (128, 128))
    w = Fp8Weight(wq.to(device), ws.to(device), (128, 128))
    x, bias = torch.randn(m, k, device=device), torch.randn(n, device=device)
    xq, xs = quantize_groups(x, 128)
    got = bg.block_fp8_gemm(xq.contiguous(), xs, w, bias, torch.float32, config=config or (16, 64, 4, 1))
    want = fp8_linear_reference(x, w, bias)
    # the interpreter's fp32 dot is exact; Hopper's fp8 tensor-core MMA adds its products with about 14
    # mantissa bits, not fp32's 23 (DeepSeek-V3 report, 3.3.2): measured 6e-4 of the output's magnitude
    tol = 2e-3 * float(want.abs().max()) if got.is_cuda else 1e-3
    assert float((got - want).abs().max()) <= tol, (got - want).abs().max()


def test_block_gemm_config_follows_the_h100_sweep():
    """config_for: 64-column tiles below 1,024 rows (16 rows a tile up to 16), split-K where the tiles are few and
    the K steps divide; the wide tile from 1,024 rows (the sweep in fp8_block_gemm.py's comment)."""
    assert bg.config_for(1, 5120, 16) == bg.SMALL_M_CONFIG                       # qkv: 80 tiles
    assert bg.config_for(64, 5120, 16) == bg.MID_M_CONFIG
    assert bg.config_for(16, 2048, 32) == (*bg.SMALL_M_CONFIG, bg.SPLIT_K)       # o_proj: 32 tiles
    assert bg.config_for(64, 2048, 32) == (*bg.MID_M_CONFIG, bg.SPLIT_K)
    assert bg.config_for(256, 2048, 32) == bg.MID_M_CONFIG                       # 128 tiles
    assert bg.config_for(16, 2048, 6) == bg.SMALL_M_CONFIG                       # 6 K steps: 4 does not divide
    assert bg.config_for(4096, 2048, 32) == bg.LARGE_M_CONFIG


def test_block_gemm_split_k_must_divide_the_k_steps():
    wq, ws = quantize_weight_blocks(torch.randn(64, 384), (128, 128))
    w = Fp8Weight(wq, ws, (128, 128))
    xq, xs = quantize_groups(torch.randn(2, 384), 128)
    with pytest.raises(ValueError, match="SPLIT_K 2 does not divide the 3 K steps"):
        bg.block_fp8_gemm(xq.contiguous(), xs, w, None, torch.float32, config=(16, 64, 4, 1, 2))


@needs_triton
@pytest.mark.parametrize("n,k,block,config", [(300, 520, None, None), (260, 384, (128, 128), None),
                                              (64, 4096, None, (1, 4096, 4)), (40, 200, (32, 32), (4, 16, 4))])
def test_fp8_gemv_equals_the_dequantized_product(n, k, block, config):
    """One token against the FP8 weight read in 8 bits: per channel and block scales, partial row and K tiles."""
    torch.manual_seed(3)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    wq, ws = quantize_weight_blocks(torch.randn(n, k), block) if block else quantize_weight_per_channel(
        torch.randn(n, k))
    w = Fp8Weight(wq.to(device), ws.to(device), block)
    x, bias = torch.randn(1, k, device=device), torch.randn(n, device=device)
    got = gv.fp8_gemv(x, w, bias, config)
    want = x @ w.dequantize().t() + bias        # x not quantized: the dequantized model's product
    assert got.shape == (1, n) and torch.allclose(got, want, atol=1e-3, rtol=1e-4), (got - want).abs().max()


def test_fp8_linear_on_cpu_is_the_reference():
    torch.manual_seed(3)
    wq, ws = quantize_weight_per_channel(torch.randn(48, 32))
    w = Fp8Weight(wq, ws, None)
    x = torch.randn(2, 3, 32, dtype=torch.bfloat16)
    y = fp8_linear(x, w)
    assert y.shape == (2, 3, 48) and y.dtype == torch.bfloat16
    assert torch.equal(y.reshape(6, 48), fp8_linear_reference(x.reshape(6, 32), w))


@needs_triton
@pytest.mark.parametrize("k,group", [(300, None), (5000, None), (300, 128), (256, 64), (768, 128), (2048, 128),
                                     (4096, None), (96, 32), (14336, None)])
def test_quantize_kernel_equals_the_torch_path(k, group):
    """One launch per quantization gives the torch path's fp8 values and scales exactly (rows past one
    program's block take two passes; a partial last group; an all-zero row)."""
    torch.manual_seed(5)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = (torch.randn(6, k) * torch.logspace(-3, 2, 6)[:, None]).to(device)
    x[2] = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        got_q, got_s = qk.quantize_rows(xd, group)
        want_q, want_s = (quantize_groups(xd.cpu(), group) if group else
                          quantize_activations(xd.cpu(), Fp8Weight(torch.empty(0), torch.empty(0), None)))
        assert torch.equal(got_s.cpu(), want_s)
        got_q, want_q = got_q.cpu().float(), want_q.float()
        if INTERPRET:
            # the interpreter's emulated fp8 cast loses the carry when rounding up to a power of two (126.1 ->
            # 64, not 128) and rounds some subnormals apart; the GPU's cvt does neither (exact below)
            wrong = got_q != want_q
            assert wrong.float().mean() < 0.05 and ((got_q - want_q).abs() <= want_q.abs() / 2).all()
        else:
            assert torch.equal(got_q, want_q)


@needs_triton
@pytest.mark.parametrize("k", [300, 5000])
def test_quantize_kernel_caps_each_rows_amax_as_the_torch_path(k):
    """fbgemm_fp8's activation_scale_ub: each token's amax capped before its scale (rows past it saturate at 448),
    in the one-program and the two-pass kernel, the torch path's scales exactly."""
    torch.manual_seed(6)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = (torch.randn(6, k) * torch.logspace(-3, 2, 6)[:, None]).to(device)
    ub = 3.0                                   # under the loud rows' amax, over the quiet ones'
    capped = Fp8Weight(torch.empty(0), torch.empty(0), None, None, ub)
    got_q, got_s = qk.quantize_rows(x, None, ub)
    want_q, want_s = quantize_activations(x.cpu(), capped)
    assert torch.equal(got_s.cpu(), want_s) and float(want_s.max()) == pytest.approx(ub / 448)
    loud = x.abs().amax(1).cpu() > ub
    assert loud.any() and (~loud).any()
    assert (want_q[loud].float().abs().amax(1) == 448).all()             # saturated
    if not INTERPRET:
        assert torch.equal(got_q.cpu().float(), want_q.float())


@needs_triton
@pytest.mark.parametrize("block,config", [
    (None, fe.fm.make_config(16, 32, 32, 1, 4, 1)),
    ((32, 32), fe.fm.make_config(16, 32, 32, 1, 4, 1)),                        # a tile is one scale block
    ((32, 32), fe.fm.make_config(16, 16, 32, 1, 4, 1)),                        # two tiles share a scale row
    ((32, 32), {**fe.fm.make_config(16, 64, 32, 1, 4, 1), fe.DOWN_BLOCK_N_KEY: 16}),   # a tile spans two rows
    ((32, 32), {**fe.fm.make_config(16, 16, 32, 1, 4, 1), fe.DOWN_BLOCK_N_KEY: 64}),   # down wider than gate/up
])
def test_fused_fp8_experts_match_the_reference_loop(block, config):
    """The grouped-GEMM FP8 experts against Fp8Experts' per-expert loop (interpreter on CPU): partial M
    blocks, experts with no tokens, per-channel and block scales; tiles inside one scale block (one weight
    scale per K step) and across two, the down launch's own BLOCK_N."""
    from kvfit.models.quant.experts import Fp8Experts
    from kvfit.quant_scheme import Fp8Scheme
    torch.manual_seed(4)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    num_experts, hidden, inter, num_tokens, top_k = 4, 64, 64, 9, 2
    scheme = (Fp8Scheme(method="fp8", weight_strategy="block", activation="group", block_size=block,
                        scale_name="weight_scale_inv") if block else
              Fp8Scheme(method="compressed-tensors", weight_strategy="channel", activation="token"))
    experts = Fp8Experts(num_experts, hidden, inter, 0, inter, scheme, "cpu", "experts")
    experts.init_dummy("gate_up", torch.randn(num_experts, 2 * inter, hidden) * 0.1)
    experts.init_dummy("down", torch.randn(num_experts, hidden, inter) * 0.1)
    experts.to(device)
    x = torch.randn(num_tokens, hidden, device=device, dtype=torch.float32)
    ids = torch.randint(0, num_experts - 1, (num_tokens, top_k), device=device)     # the last expert: no tokens
    weights = torch.rand(num_tokens, top_k, device=device)
    got = fe.fused_fp8_experts(x, experts.gate_up_proj, experts.gate_up_proj_scale, experts.down_proj,
                               experts.down_proj_scale, block, weights, ids, config)
    from kvfit.kernels.fused_moe import experts_by_group
    from kvfit.kernels.fp8 import fp8_linear_reference

    def expert_mlp(e, rows):
        gate_up, down = experts.expert_weights(e)
        gate, up = fp8_linear_reference(rows, gate_up).chunk(2, dim=-1)
        return fp8_linear_reference(torch.nn.functional.silu(gate) * up, down)
    want = experts_by_group(x, weights, ids, num_experts, expert_mlp)
    # fp32 throughout: the same fp8 values, sums in another order (an activation may round one step apart)
    assert torch.allclose(got, want, atol=2e-2, rtol=1e-3), (got - want).abs().max()
    # x quantized ahead (a fused norm's PreQuantized) in the gate/up GEMM's group: the same launch's numbers
    from kvfit.kernels.fp8 import PreQuantized
    group = block[1] if block else hidden
    pre = PreQuantized(x, *quantize_activations(x, experts.expert_weights(0)[0]), group)
    again = fe.fused_fp8_experts(x, experts.gate_up_proj, experts.gate_up_proj_scale, experts.down_proj,
                                 experts.down_proj_scale, block, weights, ids, config, pre=pre)
    assert torch.equal(again, got)
    zero = PreQuantized(x, torch.zeros_like(pre.xq), pre.scale, group)          # taken, not recomputed from x
    assert not fe.fused_fp8_experts(x, experts.gate_up_proj, experts.gate_up_proj_scale, experts.down_proj,
                                    experts.down_proj_scale, block, weights, ids, config, pre=zero).any()


@needs_triton
@pytest.mark.parametrize("down_n", [32, 16])
def test_act_quantized_in_gate_up_equals_the_quantize_launch(down_n):
    """QUANT_IN_GATE_UP: the down launch reads the same fp8 act and scales as when act is written in x's dtype and
    quantized by quantize_activations (the scales exactly; the fp8 values exactly on a GPU, within the
    interpreter's emulated fp8 cast on the CPU), and the experts' output stays that of the reference loop."""
    from kvfit.models.quant.experts import Fp8Experts
    from kvfit.quant_scheme import Fp8Scheme
    torch.manual_seed(5)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    block, num_experts, hidden, inter, num_tokens, top_k = (32, 32), 4, 64, 64, 9, 2
    scheme = Fp8Scheme(method="fp8", weight_strategy="block", activation="group", block_size=block,
                       scale_name="weight_scale_inv")
    experts = Fp8Experts(num_experts, hidden, inter, 0, inter, scheme, "cpu", "experts")
    experts.init_dummy("gate_up", torch.randn(num_experts, 2 * inter, hidden) * 0.1)
    experts.init_dummy("down", torch.randn(num_experts, hidden, inter) * 0.1)
    experts.to(device)
    x = torch.randn(num_tokens, hidden, device=device, dtype=torch.float32)
    ids = torch.randint(0, num_experts - 1, (num_tokens, top_k), device=device)
    weights = torch.rand(num_tokens, top_k, device=device)
    real_down = fe._down_fp8_kernel

    class Capture:                       # the down launch's fp8 act and its scales
        def __getitem__(self, grid):
            def launch(aq, a_scale, *args, **kwargs):
                seen.append((aq.clone(), a_scale.clone()))
                return real_down[grid](aq, a_scale, *args, **kwargs)
            return launch
    base = {**fe.fm.make_config(16, 32, 32, 1, 4, 1), fe.DOWN_BLOCK_N_KEY: down_n}
    outs, seen = [], []
    fe._down_fp8_kernel = Capture()
    try:
        for config in (base, {**base, fe.QUANT_IN_GATE_UP_KEY: 1}):
            outs.append(fe.fused_fp8_experts(x, experts.gate_up_proj, experts.gate_up_proj_scale, experts.down_proj,
                                             experts.down_proj_scale, block, weights, ids, config))
    finally:
        fe._down_fp8_kernel = real_down
    (want_q, want_s), (got_q, got_s) = seen
    assert got_q.dtype == want_q.dtype == fe.FP8_DTYPE and torch.equal(got_s, want_s)
    got_q, want_q = got_q.float(), want_q.float()
    if INTERPRET:      # as test_quantize_kernel's: the interpreter's fp8 cast drops a carry now and then
        assert (got_q != want_q).float().mean() < 0.05 and ((got_q - want_q).abs() <= want_q.abs() / 2).all()
    else:
        assert torch.equal(got_q, want_q)
        assert torch.equal(outs[0], outs[1])


def test_act_quantized_in_gate_up_needs_a_tile_per_group():
    """QUANT_IN_GATE_UP: only with block scales and BLOCK_SIZE_N their columns (one group per tile row)."""
    base = fe.fm.make_config(16, 32, 32, 1, 4, 1)
    fe.check_fp8_config({**base, fe.QUANT_IN_GATE_UP_KEY: 1}, (32, 32))
    for config, block in (({**base, fe.QUANT_IN_GATE_UP_KEY: 1}, None),
                          ({**fe.fm.make_config(16, 16, 32, 1, 4, 1), fe.QUANT_IN_GATE_UP_KEY: 1}, (32, 32)),
                          ({**base, fe.QUANT_IN_GATE_UP_KEY: 2}, (32, 32))):
        with pytest.raises(ValueError, match=fe.QUANT_IN_GATE_UP_KEY):
            fe.check_fp8_config(config, block)


def _compile_block_gemm(compile_sm90, kernel, types: dict, consts: dict, warps: int, stages: int) -> None:
    if consts["SPLIT_K"] > 1:
        types = {**types, "c_ptr": "*fp32", "bias_ptr": "*fp32"}
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kernel.arg_names}
    divisible = {n for n in kernel.arg_names if sig[n].startswith("*") or n.startswith("stride_")
                 and n not in consts}
    compiled, spills, report = compile_sm90(kernel, sig, consts, divisible, {"num_warps": warps, "num_stages": stages})
    pipelined = "async_copy_global_to_local" in compiled.asm["ttgir"]
    print(f"block_fp8_gemm {consts['BLOCK_M']}x{consts['BLOCK_N']}x{consts['BLOCK_K']} split-K {consts['SPLIT_K']} "
          f"per channel {consts['PER_CHANNEL']}: shared {compiled.metadata.shared} B, spills {spills} B, "
          f"pipelined {pipelined}")
    assert spills == 0 and compiled.metadata.shared <= 227 * 1024 and pipelined, report


def _compile_check() -> None:
    """Compile the block GEMM for sm_90 as a launch specialises it (16-divisible pointers and strides, unit
    strides along K and N) with both configs and [128, 128] blocks; ptxas -v must report no register
    spills, shared memory must fit Hopper's 227 KiB and the loads must be software-pipelined (they are not
    when K is a runtime value)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from triton_interpreter import compile_sm90
    kernel = bg._block_fp8_gemm_kernel
    types = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32",
             "c_ptr": "*bf16", "bias_ptr": "*bf16"}
    for block_m, block_n, warps, stages, split in ((*bg.SMALL_M_CONFIG, 1), (*bg.MID_M_CONFIG, 1), (*bg.LARGE_M_CONFIG, 1),
                                                   (*bg.SMALL_M_CONFIG, bg.SPLIT_K), (*bg.MID_M_CONFIG, bg.SPLIT_K)):
        consts = dict(K=4096, GROUP_N=128, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, SPLIT_K=split,
                      HAS_BIAS=False, DOT_FP32=False, PER_CHANNEL=False, stride_ak=1, stride_bk=1, stride_cn=1)
        _compile_block_gemm(compile_sm90, kernel, types, consts, warps, stages)
    # the per-channel GEMM (scales once, after the K loop) in configs the tuning sweep tries, at an 8B's K
    for (block_m, block_n, warps, stages, split, block_k), k in (((16, 64, 4, 4, 4, 128), 4096),
                                                                 ((64, 128, 4, 4, 1, 128), 14336),
                                                                 ((64, 128, 4, 3, 1, 256), 4096),
                                                                 ((128, 128, 8, 3, 1, 128), 14336),
                                                                 ((64, 256, 8, 3, 1, 128), 4096), ((128, 128, 8, 3, 1, 256), 4096)):
        consts = dict(K=k, GROUP_N=1, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
                      HAS_BIAS=False, DOT_FP32=False, PER_CHANNEL=True, stride_ak=1, stride_bk=1, stride_cn=1,
                      stride_ask=0, stride_bsk=0)
        _compile_block_gemm(compile_sm90, kernel, types, consts, warps, stages)
    _compile_check_fused_experts(compile_sm90)
    for group, block, ub in ((4096, 4096, 0.0), (14336, 4096, 1200.0), (128, 128, 0.0)):   # per token and group;
        sig = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "stride_x": "i32", "stride_q": "i32",  # ub:
               "stride_s": "i32", "K": "constexpr", "GROUP": "constexpr", "BLOCK": "constexpr",       # fbgemm's cap
               "FP8_MAX_C": "constexpr", "MIN_AMAX_C": "constexpr", "UB": "constexpr"}
        consts = dict(K=group if group > 128 else 4096, GROUP=group, BLOCK=block, FP8_MAX_C=448.0, MIN_AMAX_C=1e-10,
                      UB=ub)
        compiled, spills, report = compile_sm90(qk._quantize_kernel, sig, consts, {"x_ptr", "q_ptr", "scale_ptr"},
                                                {"num_warps": 4 if block <= 1024 else 8, "num_stages": 1})
        print(f"quantize K={consts['K']} group={group}: spills {spills} B")
        assert spills == 0, report
    for k, group in ((4096, 4096), (8192, 8192), (2048, 2048), (2048, 128), (768, 128), (4096, 128)):   # tiled
        group_p2, groups, rows = qk.tile_shape(group, -(-k // group))
        sig = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "num_rows": "i32", "stride_x": "i32",
               "stride_q": "i32", "stride_s": "i32", "K": "i32", "NUM_GROUPS": "i32"}
        consts = dict(GROUP=group, GROUP_P2=group_p2, GROUPS=groups, ROWS=rows, FP8_MAX_C=448.0, MIN_AMAX_C=1e-10,
                      UB=1200.0 if group == k == 4096 else 0.0)
        sig.update({name: "constexpr" for name in consts})
        compiled, spills, report = compile_sm90(qk._quantize_tile_kernel, sig, consts, {"x_ptr", "q_ptr", "scale_ptr"},
                                                {"num_warps": qk.tile_warps(group_p2, groups, rows), "num_stages": 1})
        print(f"quantize tile K={k} group={group} ({rows} rows x {groups} groups): spills {spills} B")
        assert spills == 0, report
    for n, k, block_k in ((4096, 4096, None), (28672, 4096, None), (4096, 14336, None), (6144, 4096, 128)):
        bn, bk, warps = gv.config_for(k, block_k)       # the FP8 GEMV at llama-3.1-8b's shapes
        sig = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16",
               "N": "i32", "stride_wn": "i32", "stride_sn": "i32"}
        consts = dict(K=k, BLOCK_N=bn, BLOCK_K=bk, SCALE_BN=128 if block_k else 1, SCALE_BK=block_k or 1,
                      BLOCKWISE=block_k is not None, HAS_BIAS=False, PDL=True)
        sig.update({name: "constexpr" for name in consts})
        compiled, spills, report = compile_sm90(gv._fp8_gemv_kernel, sig, consts, {"x_ptr", "w_ptr", "out_ptr"},
                                                {"num_warps": warps, "num_stages": 1})
        print(f"fp8 gemv n={n} k={k} block_k={block_k}: spills {spills} B")
        assert spills == 0, report
    print("ok: the block FP8 GEMM compiles for sm_90 without spills")


def _compile_check_fused_experts(compile_sm90) -> None:
    """The FP8 experts' two kernels at Qwen3-30B-A3B's shape ([128, 128] blocks, and per channel) for decode,
    the widest prefill configs and every TUNED_FP8_CONFIGS entry: no spills, shared memory within Hopper's."""
    types = {"x_ptr": "*fp8e4nv", "a_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "x_scale_ptr": "*fp32",
             "a_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "act_ptr": "*bf16", "out_ptr": "*bf16",
             "weights_ptr": "*fp32", "sorted_pair_ids_ptr": "*i32", "block_experts_ptr": "*i32",
             "act_scale_ptr": "*fp32"}
    import triton.language as tl
    num_experts, top_k, hidden, inter = 128, 8, 2048, 768
    cases = [(m, group_n, fe.fp8_config(m, num_experts, hidden, inter, top_k, (group_n, 128) if group_n else None))
             for m in (1, 8192) for group_n in (128, 0)]
    for group_n in (128, 0):        # every tuned entry of this shape (the sweep pasted them; distinct ones once)
        block = (group_n, 128) if group_n else None
        tuned = fe.TUNED_FP8_CONFIGS.get((num_experts, hidden, inter, top_k, fe.fp8_scales_name(block)), {})
        cases += [(m, group_n, cfg) for m, cfg in tuned.items() if cfg not in [c for _, _, c in cases]]
    # act quantized in the gate/up epilogue (QUANT_IN_GATE_UP), where a tile row is one group: the widest tuned tile
    cases += [(m, 128, {**cfg, fe.QUANT_IN_GATE_UP_KEY: 1}) for m, cfg in fe.TUNED_FP8_CONFIGS.get(
        (num_experts, hidden, inter, top_k, fe.fp8_scales_name((128, 128))), {}).items()
        if cfg["BLOCK_SIZE_N"] == 128][:1]
    for m, group_n, cfg in cases:
        consts = dict(HIDDEN=hidden, INTER=inter, NUM_EXPERTS=num_experts, BLOCK_M=cfg["BLOCK_SIZE_M"],
                      BLOCK_K=cfg["BLOCK_SIZE_K"], GROUP_M=cfg["GROUP_SIZE_M"], GROUP_N=group_n, DOT_FP32=False)
        down_n = cfg.get(fe.DOWN_BLOCK_N_KEY, cfg["BLOCK_SIZE_N"])
        quant_out = bool(cfg.get(fe.QUANT_IN_GATE_UP_KEY, 0))
        gate_up = {"TOP_K": top_k, "BLOCK_N": cfg["BLOCK_SIZE_N"], "QUANT_OUT": quant_out, "ACT_DTYPE": tl.bfloat16,
                   "FP8_MAX_C": 448.0, "MIN_AMAX_C": 1e-10}
        for kernel, extra in ((fe._gate_up_fp8_kernel, gate_up), (fe._down_fp8_kernel, {"BLOCK_N": down_n})):
            sig = {n: "constexpr" if n in {**consts, **extra} else types.get(n, "i32") for n in kernel.arg_names}
            if quant_out and kernel is fe._gate_up_fp8_kernel:
                sig["act_ptr"] = "*fp8e4nv"
            divisible = {n for n in kernel.arg_names if sig[n].startswith("*") or n.startswith("stride_")}
            options = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
            compiled, spills, report = compile_sm90(kernel, sig, {**consts, **extra}, divisible, options)
            print(f"{kernel.__name__} m={m} group_n={group_n} quant_out={quant_out}: shared {compiled.metadata.shared} B, "
                  f"spills {spills} B")
            assert spills == 0 and compiled.metadata.shared <= 227 * 1024, report


@needs_triton
def test_block_gemm_compiles_for_sm90_without_spills():
    from triton_interpreter import run_compile_check
    run_compile_check(__file__, "ok: the block FP8 GEMM compiles")


if COMPILE_CHECK:
    _compile_check()


@needs_triton
def test_fused_fp8_experts_with_static_input_scales_match_the_reference_loop():
    """Static activations (AutoFP8 / compressed-tensors static experts): the fused launches quantize with the
    layer's largest gate/up and down input scales, as the per-expert reference loop does (interpreter on CPU)."""
    from kvfit.kernels.fp8 import fp8_linear_reference
    from kvfit.kernels.fused_moe import experts_by_group
    from kvfit.models.quant.experts import Fp8Experts
    from kvfit.quant_scheme import Fp8Scheme
    torch.manual_seed(5)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    num_experts, hidden, inter, num_tokens, top_k = 4, 64, 64, 9, 2
    scheme = Fp8Scheme(method="compressed-tensors", weight_strategy="tensor", activation="static")
    experts = Fp8Experts(num_experts, hidden, inter, 0, inter, scheme, "cpu", "experts")
    experts.init_dummy("gate_up", torch.randn(num_experts, 2 * inter, hidden) * 0.1)
    experts.init_dummy("down", torch.randn(num_experts, hidden, inter) * 0.1)
    experts.gate_up_proj_input_scale.copy_(torch.rand(num_experts, 2) * 0.01 + 0.005)
    experts.down_proj_input_scale.copy_(torch.rand(num_experts, 1) * 0.001 + 0.0005)
    experts.to(device)
    experts.finalize()
    x = torch.randn(num_tokens, hidden, device=device, dtype=torch.float32)
    ids = torch.randint(0, num_experts, (num_tokens, top_k), device=device)
    weights = torch.rand(num_tokens, top_k, device=device)
    scales = experts.input_scales()
    assert scales[0].item() == experts.gate_up_proj_input_scale.max().item()
    got = fe.fused_fp8_experts(x, experts.gate_up_proj, experts.gate_up_proj_scale, experts.down_proj,
                               experts.down_proj_scale, None, weights, ids, input_scales=scales)

    def expert_mlp(e, rows):
        gate_up, down = experts.expert_weights(e)          # their input_scale: the layer's largest
        gate, up = fp8_linear_reference(rows, gate_up).chunk(2, dim=-1)
        return fp8_linear_reference(torch.nn.functional.silu(gate) * up, down)
    want = experts_by_group(x, weights, ids, num_experts, expert_mlp)
    assert torch.allclose(got, want, atol=2e-2, rtol=1e-3), (got - want).abs().max()
    dynamic = fe.fused_fp8_experts(x, experts.gate_up_proj, experts.gate_up_proj_scale, experts.down_proj,
                                   experts.down_proj_scale, None, weights, ids)
    assert not torch.allclose(got, dynamic, atol=1e-3)        # the static scales are what ran


def test_prequantized_input_is_used_only_where_it_is_the_weights_quantization():
    """A PreQuantized x hands its (xq, scale) to a GEMM whose dynamic group it was made in, and x itself to
    every other path (a static input scale, another group); on the CPU nothing asks for one."""
    from kvfit.kernels.fp8 import PreQuantized, activation_group
    from kvfit.kernels.fp8_gemm import prequantize_group
    torch.manual_seed(3)
    x = torch.randn(4, 64)
    wq, s = quantize_weight_per_channel(torch.randn(32, 64))
    channel = Fp8Weight(wq, s, None)
    bq, bs = quantize_weight_blocks(torch.randn(32, 64), (32, 32))
    block = Fp8Weight(bq, bs, (32, 32))
    static = Fp8Weight(wq, s, None, torch.tensor([0.05]))
    assert (activation_group(channel, 64), activation_group(block, 64), activation_group(static, 64)) == (64, 32, None)
    xq, scale = quantize_activations(x, channel)
    pre = PreQuantized(x, xq, scale, 64)
    assert pre.quantized_for(channel) == (xq, scale)
    for other in (block, static):
        got, want = pre.quantized_for(other), quantize_activations(x, other)
        assert torch.equal(got[0].float(), want[0].float()) and torch.equal(got[1], want[1])
    assert torch.equal(fp8_linear(pre, channel), fp8_linear(x, channel))          # the CPU's reference reads x
    assert prequantize_group(x, channel) is None and prequantize_group(x, block) is None


def test_blockwise_scaled_mm_gate_admits_only_shapes_cublas_reads_right(monkeypatch):
    """The blockwise _scaled_mm path (on a GPU whose torch passes the probe; both stand-ins here) takes bf16 rows
    from 1,024 with [128, 128] blocks, K and N multiples of 128 and K / 128 a multiple of 4 (cuBLASLt pads the
    weight scales' K-block stride to 4: qwen2.5-0.5b's K=896 or K=384 would read wrong scales), never fp16."""
    from kvfit.kernels import fp8_gemm as fg
    monkeypatch.setattr(fg, "on_gpu", lambda t: True)
    monkeypatch.setattr(fg, "_blockwise_supported", lambda device: True)

    def gate(m, n, k, dtype=torch.bfloat16, block=(128, 128)):
        bn, bk = block
        w = Fp8Weight(torch.empty(n, k, dtype=FP8_DTYPE), torch.ones(-(-n // bn), -(-k // bk)), block)
        return fg.block_scaled_mm_applies(torch.empty(m, k, dtype=dtype), w)
    assert gate(1024, 5120, 2048) and gate(8192, 2048, 4096) and gate(1025, 256, 512)
    assert not gate(1023, 5120, 2048)                                   # below the rows the Triton GEMM keeps
    assert not gate(2048, 256, 384) and not gate(2048, 896, 896)        # K / 128 = 3, 7
    assert not gate(2048, 5120, 2048, dtype=torch.float16)              # bf16 out only: no second rounding
    assert not gate(2048, 5120, 2048, block=(64, 64)) and not gate(2048, 200, 2048)


@needs_triton
@pytest.mark.parametrize("m,n,k,config,static", [
    (19, 200, 300, (16, 64, 4, 1, 1, 128), False),         # partial tiles along M, N and K
    (5, 136, 512, (16, 32, 4, 1, 4, 128), False),          # K split over 4 programs, the bias after the sum
    (33, 256, 384, (16, 128, 4, 1, 3, 64), False),         # BLOCK_K 64: 6 steps over 3 programs
    (7, 64, 256, (16, 64, 4, 1, 1, 256), True),            # a static input scale (expanded: stride 0)
    (8, 64, 14336, (16, 64, 4, 4, 4, 128), False)])        # llama-3.1-8b's down K with its H100 entry at 8 rows
def test_channel_gemm_kernel_matches_the_reference(m, n, k, config, static):
    """The per-channel Triton GEMM (one scale per row and output column, applied once after the K loop) against
    the fp32 reference of the same quantized operands."""
    torch.manual_seed(4)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    wq, ws = quantize_weight_per_channel(torch.randn(n, k))
    input_scale = torch.tensor([0.02]) if static else None
    w = Fp8Weight(wq.to(device), ws.to(device), None,
                  input_scale.to(device) if static else None)
    x, bias = torch.randn(m, k, device=device), torch.randn(n, device=device)
    xq, xs = quantize_activations(x, w)
    got = bg.channel_fp8_gemm(xq.contiguous(), xs, w, bias, torch.float32, config)
    want = fp8_linear_reference(x, w, bias)
    tol = 2e-3 * float(want.abs().max()) if got.is_cuda else 1e-3
    assert float((got - want).abs().max()) <= tol, (got - want).abs().max()


def test_channel_gemm_split_k_must_divide_the_k_steps():
    wq, ws = quantize_weight_per_channel(torch.randn(64, 384))
    xq, xs = quantize_activations(torch.randn(2, 384), Fp8Weight(wq, ws, None))
    with pytest.raises(ValueError, match="SPLIT_K 2 does not divide the 3 K steps"):
        bg.channel_fp8_gemm(xq, xs, Fp8Weight(wq, ws, None), None, torch.float32, (16, 64, 4, 1, 2, 128))


def test_channel_configs_serve_the_rows_up_to_each_entry(tmp_path, monkeypatch):
    """A tuned file's entry [M, config] serves batches of more rows than the entry before and at most M; past the
    last, for another shape or device, on the CPU, or with KVFIT_FP8_GEMM_CONFIGS=off: None (_scaled_mm)."""
    from kvfit.kernels import fp8_channel_configs as cc
    path = tmp_path / "tuned.json"
    path.write_text('{"GPU X": {"4096x4096": [[64, [16, 64, 4, 4, 4, 128]], [16, [16, 128, 4, 4, 1, 128]],'
                    ' [256, null], [512, [64, 128, 4, 4, 1, 128]]]}}')
    monkeypatch.setattr(cc, "CONFIG_PATH", str(path))
    monkeypatch.setattr(cc, "_device_name", lambda index: "GPU X")
    cuda = torch.device("cuda", 0)
    assert cc.channel_config(cuda, 1, 4096, 4096) == (16, 128, 4, 4, 1, 128)
    assert cc.channel_config(cuda, 16, 4096, 4096) == (16, 128, 4, 4, 1, 128)
    assert cc.channel_config(cuda, 17, 4096, 4096) == (16, 64, 4, 4, 4, 128)
    assert cc.channel_config(cuda, 100, 4096, 4096) is None
    assert cc.channel_config(cuda, 512, 4096, 4096) == (64, 128, 4, 4, 1, 128)
    assert cc.channel_config(cuda, 513, 4096, 4096) is None
    assert cc.channel_config(cuda, 16, 4096, 14336) is None
    assert cc.channel_config(torch.device("cpu"), 16, 4096, 4096) is None
    monkeypatch.setattr(cc, "_device_name", lambda index: "GPU Y")
    assert cc.channel_config(cuda, 16, 4096, 4096) is None
    monkeypatch.setattr(cc, "CONFIG_PATH", "off")
    assert cc.config_file() is None


def test_packaged_channel_configs_are_well_formed():
    """Every entry of the packaged file is [M, null] or [M, 6 positive ints] whose SPLIT_K is 1 or its K's
    steps divide (the launch would refuse it)."""
    import json

    from kvfit.kernels import fp8_channel_configs as cc
    with open(cc.CONFIG_FILE) as f:
        data = json.load(f)
    for device, shapes in data.items():
        for shape, entries in shapes.items():
            n, k = (int(v) for v in shape.split("x"))
            for m, config in entries:
                assert isinstance(m, int) and m > 0, (device, shape, m)
                if config is not None:
                    assert len(config) == 6 and all(isinstance(v, int) and v > 0 for v in config), config
                    assert -(-k // config[5]) % config[4] == 0, (device, shape, config)
