"""The fused decoder kernels against their plain-torch definitions (Triton's interpreter on CPU), and these
kernels and the GEMV compiled for sm_90 with programmatic dependent launch (no GPU needed)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

COMPILE_CHECK = __name__ == "__main__" and sys.argv[1:] == ["--compile-check"]
if not torch.cuda.is_available() and not COMPILE_CHECK:
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from kvfit.kernels import fused_ops  # noqa: E402

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


@pytest.mark.parametrize("cols,group", [(256, 256), (96, 96), (256, 64), (512, 128), (384, 128)])
# the interpreter multiplies bfloat16 elementwise as raw bits (NumPy has no bf16): fp16 stands in for it on the CPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16 if DEVICE == "cuda" else torch.float16])
def test_add_rms_norm_quant_equals_norm_then_quantize(cols, group, dtype):
    """The norm's FP8 epilogue quantizes what add_rms_norm stores (per token, or per group of columns) with the
    numbers of fp8.quantize_activations; an all-zero row gets the floor scale; no rows is no launch."""
    from kvfit.kernels.fp8 import Fp8Weight, quantize_activations, quantize_groups
    g = torch.Generator().manual_seed(cols + group)
    x = (torch.randn(6, cols, generator=g) * torch.logspace(-2, 2, 6)[:, None]).to(dtype).to(DEVICE)
    res = torch.randn(6, cols, generator=g).to(dtype).to(DEVICE)
    x[3], res[3] = 0.0, 0.0
    w = torch.randn(cols, generator=g).to(dtype).to(DEVICE)
    assert fused_ops.norm_quant_applies(cols, group)
    out, new_res, xq, scale = fused_ops.add_rms_norm_quant(x, res, w, 1e-6, group)
    want_out, want_res = fused_ops.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(out, want_out) and torch.equal(new_res, want_res)
    per_token = Fp8Weight(torch.empty(0), torch.empty(0), None)
    want_q, want_s = (quantize_activations(out.cpu(), per_token) if group == cols else
                      quantize_groups(out.cpu(), group))
    assert scale.shape == want_s.shape and torch.equal(scale.cpu(), want_s)
    got_q, want_q = xq.cpu().float(), want_q.float()
    if DEVICE == "cpu":       # the interpreter's emulated fp8 cast (see test_fp8_gemm's quantize test)
        assert (got_q != want_q).float().mean() < 0.05 and ((got_q - want_q).abs() <= want_q.abs() / 2).all()
    else:
        assert torch.equal(got_q, want_q)
    # against the quantize kernel on the same device (the interpreter's cast on both sides): exact
    from kvfit.kernels.fp8_quantize import quantize_rows
    same_q, same_s = quantize_rows(out, group)
    assert torch.equal(xq.float(), same_q.float()) and torch.equal(scale, same_s)
    empty = fused_ops.add_rms_norm_quant(x[:0], res[:0], w, 1e-6, group)
    assert [t.shape[0] for t in empty] == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="norm_quant_applies"):
        fused_ops.add_rms_norm_quant(x[:, :cols - 1], res[:, :cols - 1], w[:cols - 1], 1e-6, group)


@pytest.mark.parametrize("cols,group", [(96, 96), (3000, 3000), (256, 64), (2048, 128), (1536, 512)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16 if DEVICE == "cuda" else torch.float16])
def test_silu_mul_quant_equals_silu_mul_then_quantize(cols, group, dtype):
    """The SiLU kernel's FP8 epilogue quantizes what silu_mul stores, per token (one program a row) or per
    group of columns across several programs, with fp8.quantize_activations' numbers; an all-zero row."""
    from kvfit.kernels.fp8 import Fp8Weight, quantize_activations, quantize_groups
    g = torch.Generator().manual_seed(cols + group)
    gate_up = (torch.randn(5, 2 * cols, generator=g) * torch.logspace(-2, 1, 5)[:, None]).to(dtype).to(DEVICE)
    gate_up[2] = 0.0
    assert fused_ops.silu_quant_applies(cols, group)
    out, xq, scale = fused_ops.silu_mul_quant(gate_up, group)
    assert torch.equal(out, fused_ops.silu_mul(gate_up))
    per_token = Fp8Weight(torch.empty(0), torch.empty(0), None)
    want_q, want_s = (quantize_activations(out.cpu(), per_token) if group == cols else
                      quantize_groups(out.cpu(), group))
    assert scale.shape == want_s.shape and torch.equal(scale.cpu(), want_s)
    got_q, want_q = xq.cpu().float(), want_q.float()
    if DEVICE == "cpu":       # the interpreter's emulated fp8 cast (see test_fp8_gemm's quantize test), subnormals
        assert (got_q != want_q).float().mean() < 0.05
        assert ((got_q - want_q).abs() <= want_q.abs() / 2 + 2 ** -6).all()
    else:
        assert torch.equal(got_q, want_q)
    # against the quantize kernel on the same device (the interpreter's cast on both sides): exact
    from kvfit.kernels.fp8_quantize import quantize_rows
    same_q, same_s = quantize_rows(out, group)
    assert torch.equal(xq.float(), same_q.float()) and torch.equal(scale, same_s)
    assert fused_ops.silu_mul_quant(gate_up[:0], group)[0].shape == (0, cols)
    with pytest.raises(ValueError, match="silu_quant_applies"):
        fused_ops.silu_mul_quant(gate_up[:, 2:], group)


def test_silu_quant_applies_per_token_up_to_a_row_a_program():
    assert fused_ops.silu_quant_applies(14336, 14336) and fused_ops.silu_quant_applies(3072, 128)
    assert not fused_ops.silu_quant_applies(20000, 20000)        # a row wider than one program holds
    assert not fused_ops.silu_quant_applies(3000, 2048)          # a group past the program's 1,024 columns
    assert not fused_ops.silu_quant_applies(200, 128)            # a partial last group


def test_norm_quant_applies_to_whole_power_of_two_groups():
    assert fused_ops.norm_quant_applies(2048, 128) and fused_ops.norm_quant_applies(4096, 4096)
    assert fused_ops.norm_quant_applies(5120, 5120)              # per token: any width
    assert fused_ops.norm_quant_applies(5120, 128)               # 5120's block is 8192: groups past the row masked
    assert not fused_ops.norm_quant_applies(300, 96)             # not a power of two
    assert not fused_ops.norm_quant_applies(200, 128)            # a partial last group


def test_rope_matches_rotate_half():
    from kvfit.models.rope import apply_rope
    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, 4, 32, generator=g).to(DEVICE)
    k = torch.randn(6, 2, 32, generator=g).to(DEVICE)
    pos = torch.tensor([0, 1, 5, 17, 300, 4095]).to(DEVICE)
    freqs = 1.0 / (10000 ** (torch.arange(0, 32, 2).float() / 32)).to(DEVICE)
    ref_q, ref_k = apply_rope(q.clone(), k.clone(), pos, freqs)
    got_q, got_k = fused_ops.qk_norm_rope_(q.clone(), k.clone(), pos, freqs)      # no norm weights: RoPE only
    torch.testing.assert_close(got_q, ref_q, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_k, ref_k, rtol=1e-4, atol=1e-4)


def test_rope_on_a_strided_view_of_fused_qkv():
    from kvfit.models.rope import apply_rope
    qkv = torch.randn(3, (4 + 2 + 2) * 16).to(DEVICE)
    q = qkv[:, :64].view(3, 4, 16)
    k = qkv[:, 64:96].view(3, 2, 16)
    pos = torch.tensor([3, 9, 40]).to(DEVICE)
    freqs = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)).to(DEVICE)
    ref_q, ref_k = apply_rope(q.clone(), k.clone(), pos, freqs)
    v_before = qkv[:, 96:].clone()
    fused_ops.qk_norm_rope_(q, k, pos, freqs)
    torch.testing.assert_close(q, ref_q, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(k, ref_k, rtol=1e-4, atol=1e-4)
    assert torch.equal(qkv[:, 96:], v_before)


def test_silu_mul():
    gu = torch.randn(4, 2 * 1500).to(DEVICE)
    ref = torch.nn.functional.silu(gu[:, :1500]) * gu[:, 1500:]
    torch.testing.assert_close(fused_ops.silu_mul(gu), ref, rtol=1e-5, atol=1e-5)


def _qk_reference(q, k, pos, freqs, qw, kw, eps):
    from kvfit.models.layers import RMSNorm
    from kvfit.models.rope import apply_rope
    if qw is not None:
        qn, kn = RMSNorm(q.shape[-1], eps, q.dtype, q.device), RMSNorm(k.shape[-1], eps, k.dtype, k.device)
        qn.weight.data.copy_(qw)
        kn.weight.data.copy_(kw)
        q, k = qn(q), kn(k)
    return apply_rope(q, k, pos, freqs)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("adjacent", [True, False])
@pytest.mark.parametrize("heads", [(4, 2), (20, 4), (3, 3)])
def test_qk_norm_rope_matches_norm_then_rope(norm, adjacent, heads):
    num_q, num_kv = heads
    dim, tokens = 32, 7
    g = torch.Generator().manual_seed(num_q * 10 + num_kv + 100 * norm)
    qkv = torch.randn(tokens, (num_q + 2 * num_kv) * dim, generator=g).to(DEVICE)
    if adjacent:    # views of one fused projection, as the decoder has them
        q = qkv[:, :num_q * dim].view(tokens, num_q, dim)
        k = qkv[:, num_q * dim:(num_q + num_kv) * dim].view(tokens, num_kv, dim)
    else:
        q = qkv[:, :num_q * dim].reshape(tokens, num_q, dim).clone()
        k = qkv[:, num_q * dim:(num_q + num_kv) * dim].reshape(tokens, num_kv, dim).clone()
    qw = torch.randn(dim, generator=g).to(DEVICE) if norm else None
    kw = torch.randn(dim, generator=g).to(DEVICE) if norm else None
    pos = torch.tensor([0, 1, 2, 31, 500, 4095, 70000]).to(DEVICE)
    freqs = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)).to(DEVICE)
    ref_q, ref_k = _qk_reference(q.clone(), k.clone(), pos, freqs, qw, kw, 1e-6)
    v_before = qkv[:, (num_q + num_kv) * dim:].clone()
    out_q, out_k = fused_ops.qk_norm_rope_(q, k, pos, freqs, qw, kw, 1e-6)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()     # in place
    torch.testing.assert_close(q, ref_q, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(k, ref_k, rtol=1e-4, atol=1e-4)
    assert torch.equal(qkv[:, (num_q + num_kv) * dim:], v_before)                     # v untouched


def _qkv_views(qkv, num_q, num_kv, dim):
    tokens = qkv.shape[0]
    return (qkv[:, :num_q * dim].view(tokens, num_q, dim),
            qkv[:, num_q * dim:(num_q + num_kv) * dim].view(tokens, num_kv, dim),
            qkv[:, (num_q + num_kv) * dim:].view(tokens, num_kv, dim))


@pytest.mark.parametrize("heads", [(4, 2), (10, 3), (14, 3), (1, 1)], ids=["4-2", "one-tile", "straddle", "mha1"])
@pytest.mark.parametrize("dtype,cache_dtype,norm", [(torch.float32, torch.float32, True),
                                                    (torch.bfloat16, torch.bfloat16, False),
                                                    (torch.bfloat16, torch.float8_e4m3fn, True)],
                         ids=["fp32-norm", "bf16", "bf16-fp8-cache-norm"])
def test_fused_cache_write_equals_rope_then_write_kv(heads, dtype, cache_dtype, norm):
    # the one-launch path must leave q, k, v and both caches bit-identical to qk_norm_rope_ + write_kv_cache
    from kvfit.kernels.attention_common import write_kv_cache
    from kvfit.kv.spec import PADDING_SLOT_ID
    num_q, num_kv = heads
    dim, tokens, page, num_blocks = 32, 6, 4, 5
    g = torch.Generator().manual_seed(num_q * 7 + num_kv)
    qkv = torch.randn(tokens, (num_q + 2 * num_kv) * dim, generator=g).to(DEVICE, dtype)
    qw = torch.randn(dim, generator=g).to(DEVICE, dtype) if norm else None
    kw = torch.randn(dim, generator=g).to(DEVICE, dtype) if norm else None
    pos = torch.tensor([0, 5, 17, 300, 4095, 9]).to(DEVICE)
    freqs = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)).to(DEVICE)
    slots = torch.tensor([13, PADDING_SLOT_ID, 2, 19, 7, PADDING_SLOT_ID], dtype=torch.int64).to(DEVICE)
    k_start = torch.randn(num_blocks, page, num_kv, dim, generator=g).to(DEVICE, cache_dtype)
    v_start = torch.randn(num_blocks, page, num_kv, dim, generator=g).to(DEVICE, cache_dtype)
    ref_qkv, ref_k_cache, ref_v_cache = qkv.clone(), k_start.clone(), v_start.clone()
    q, k, v = _qkv_views(ref_qkv, num_q, num_kv, dim)
    fused_ops.qk_norm_rope_(q, k, pos, freqs, qw, kw, 1e-6)
    write_kv_cache(k, v, ref_k_cache, ref_v_cache, slots)
    k_cache, v_cache = k_start.clone(), v_start.clone()
    assert fused_ops.qk_norm_rope_write_kv_(*_qkv_views(qkv, num_q, num_kv, dim), pos, freqs, qw, kw, 1e-6,
                                            k_cache, v_cache, slots)
    assert torch.equal(qkv, ref_qkv)
    assert torch.equal(k_cache.view(torch.uint8), ref_k_cache.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), ref_v_cache.view(torch.uint8))


@pytest.mark.parametrize("heads", [(4, 2), (12, 3), (1, 1)], ids=["4-2", "straddle", "mha1"])
@pytest.mark.parametrize("norm", [False, True], ids=["rope", "norm-rope"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_cache_write_with_kv_scales_equals_the_scaled_torch_path(heads, norm, dtype):
    # an fp8 cache with k/v scales (one per KV head): the launch divides k and v before the write and multiplies q
    # in place; bit-identical to KVScales.for_cache + scale_query + write_kv_cache on the rotated rows
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("the Triton interpreter rounds fp32 -> bf16 by truncation, torch to nearest: bf16 runs on a GPU")
    from kvfit.kernels.attention_common import write_kv_cache
    from kvfit.kv.spec import PADDING_SLOT_ID
    from kvfit.models.kv_scales import KVScales
    num_q, num_kv = heads
    dim, tokens, page, num_blocks = 32, 6, 4, 5
    g = torch.Generator().manual_seed(num_q * 11 + num_kv)
    qkv = (torch.randn(tokens, (num_q + 2 * num_kv) * dim, generator=g) * 30).to(DEVICE, dtype)
    qw = torch.randn(dim, generator=g).to(DEVICE, dtype) if norm else None
    kw = torch.randn(dim, generator=g).to(DEVICE, dtype) if norm else None
    pos = torch.tensor([0, 5, 17, 300, 4095, 9]).to(DEVICE)
    freqs = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)).to(DEVICE)
    slots = torch.tensor([13, PADDING_SLOT_ID, 2, 19, 7, PADDING_SLOT_ID], dtype=torch.int64).to(DEVICE)
    start = torch.randn(2, num_blocks, page, num_kv, dim, generator=g).to(DEVICE, torch.float8_e4m3fn)
    scales = KVScales(num_kv, 0, num_kv, num_q, DEVICE)
    scales.k_scale.copy_(torch.rand(num_kv, generator=g) * 0.3 + 0.01)
    scales.v_scale.copy_(torch.rand(num_kv, generator=g) * 0.3 + 0.01)
    ref_qkv, ref_k_cache, ref_v_cache = qkv.clone(), start[0].clone(), start[1].clone()
    q, k, v = _qkv_views(ref_qkv, num_q, num_kv, dim)
    fused_ops.qk_norm_rope_(q, k, pos, freqs, qw, kw, 1e-6)
    (ks, vs), ref_q = scales.for_cache(k, v), scales.scale_query(q)
    write_kv_cache(ks, vs, ref_k_cache, ref_v_cache, slots)
    k_cache, v_cache = start[0].clone(), start[1].clone()
    views = _qkv_views(qkv, num_q, num_kv, dim)
    assert fused_ops.qk_norm_rope_write_kv_(*views, pos, freqs, qw, kw, 1e-6, k_cache, v_cache, slots,
                                            scales.k_scale, scales.v_scale)
    assert torch.equal(views[0], ref_q)                                      # q scaled in place
    assert torch.equal(views[1], k) and torch.equal(views[2], v)             # k rotated, v as it was
    assert torch.equal(k_cache.view(torch.uint8), ref_k_cache.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), ref_v_cache.view(torch.uint8))


def test_fused_cache_write_declines_views_that_are_not_one_row():
    qkv = torch.randn(2, 4 * 16).to(DEVICE)
    q, k, v = _qkv_views(qkv, 2, 1, 16)
    cache = torch.zeros(2, 4, 1, 16).to(DEVICE)
    slots = torch.tensor([0, 1]).to(DEVICE)
    pos, freqs = torch.tensor([0, 1]).to(DEVICE), torch.ones(8).to(DEVICE)
    before = qkv.clone()
    assert not fused_ops.qk_norm_rope_write_kv_(q, k, v.clone(), pos, freqs, None, None, 0.0, cache, cache, slots)
    assert not cache.any() and torch.equal(qkv, before)                        # nothing written, nothing rotated


def test_qk_norm_rope_bf16_close_to_torch():
    dim, tokens, num_q, num_kv = 64, 5, 8, 2
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(tokens, (num_q + 2 * num_kv) * dim, generator=g).to(DEVICE, torch.bfloat16)
    q = qkv[:, :num_q * dim].view(tokens, num_q, dim)
    k = qkv[:, num_q * dim:(num_q + num_kv) * dim].view(tokens, num_kv, dim)
    qw = torch.randn(dim, generator=g).to(DEVICE, torch.bfloat16)
    kw = torch.randn(dim, generator=g).to(DEVICE, torch.bfloat16)
    pos = torch.tensor([0, 3, 100, 1000, 9000]).to(DEVICE)
    freqs = 1.0 / (1e6 ** (torch.arange(0, dim, 2).float() / dim)).to(DEVICE)
    ref_q, ref_k = _qk_reference(q.clone(), k.clone(), pos, freqs, qw, kw, 1e-6)
    fused_ops.qk_norm_rope_(q, k, pos, freqs, qw, kw, 1e-6)
    # the kernel rotates in fp32; torch rotates in bf16: within bf16 rounding of the operands
    for got, ref in ((q, ref_q), (k, ref_k)):
        err = (got.float() - ref.float()).norm() / ref.float().norm()
        assert err < 1e-2, err


def test_one_token_views_of_fused_qkv_are_adjacent():
    # a [1, X] row viewed as heads reports a stride(0) of its own; it must still take one launch
    qkv = torch.randn(1, (4 + 2 + 2) * 16).to(DEVICE)
    q, k, _ = qkv.split([64, 32, 32], dim=1)
    q, k = q.view(1, 4, 16), k.view(1, 2, 16)
    assert fused_ops._adjacent_heads(q, k)
    assert not fused_ops._adjacent_heads(q, k.clone())


def _huge_slot_check() -> None:
    """The one-token fused cache writes at slots whose element offsets pass 2^31, in caches that are virtual
    memory (torch.empty on CPU commits only the pages touched): qk_norm_rope_write_kv_ (two tokens) and
    gemv_rope_write_kv (one token, twice). An int32 offset would wrap and write elsewhere (or fault): each
    slot's row must hold its token's k and v, read back by torch's indexing (the plain write), and nothing
    else in its NaN-filled block may change."""
    from kvfit.kernels import gemv
    num_q, num_kv, dim, page, hidden = 4, 2, 16, 16, 32
    block_elements = page * num_kv * dim                          # 512: block 2^22 starts at element 2^31
    mark = 2**31 // block_elements
    num_blocks = mark + 64                                        # 2.15e9 elements: 4.3 GB virtual each
    k_cache = torch.empty((num_blocks, page, num_kv, dim), dtype=torch.bfloat16)
    v_cache = torch.empty_like(k_cache)
    slots = torch.tensor([num_blocks * page - 1, (mark + 5) * page + 3, mark * page, (num_blocks - 9) * page + 8])
    blocks, within = slots // page, slots % page
    k_cache[blocks] = float("nan")
    v_cache[blocks] = float("nan")
    g = torch.Generator().manual_seed(60)
    freqs = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    rows = (num_q + 2 * num_kv) * dim
    qkv = torch.randn(2, rows, generator=g).bfloat16()
    _, k, v = views = _qkv_views(qkv, num_q, num_kv, dim)         # k and v after the call: what it wrote
    qw, kw = torch.randn(dim, generator=g).bfloat16(), torch.randn(dim, generator=g).bfloat16()
    assert fused_ops.qk_norm_rope_write_kv_(*views, torch.tensor([3, 70000]), freqs, qw, kw, 1e-6, k_cache,
                                            v_cache, slots[:2])
    written = [(k, v)]
    x = torch.randn(1, hidden, generator=g).bfloat16()
    w = (torch.randn(rows, hidden, generator=g) / hidden ** 0.5).bfloat16()
    for i, pos in ((2, 5), (3, 4095)):
        out = gemv.gemv_rope_write_kv(x, w, None, torch.tensor([pos]), freqs, k_cache, v_cache, slots[i:i + 1],
                                      num_q, num_kv)
        written.append(_qkv_views(out, num_q, num_kv, dim)[1:])  # the projection after RoPE: its k and v
    for cache, expected in ((k_cache, torch.cat([kv[0] for kv in written])),
                            (v_cache, torch.cat([kv[1] for kv in written]))):
        assert torch.equal(cache[blocks, within], expected), "a fused write went elsewhere"
        assert int((~cache[blocks].isnan()).sum()) == expected.numel(), "a stray fused write"
    print(f"ok: qk_norm_rope_write_kv_ and gemv_rope_write_kv at element offsets up to "
          f"{int(slots.max()) * num_kv * dim + num_kv * dim - 1:,}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU variant of test_kernel_safety.py's fused writes")
def test_fused_cache_writes_past_2_to_the_31_in_the_interpreter():
    # a subprocess, so a wrapped offset that faults fails this test instead of killing pytest
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, __file__, "--huge-slot-check"], env=env, capture_output=True, text=True,
                          timeout=300)
    if done.returncode != 0 and "DefaultCPUAllocator" in done.stderr:
        pytest.skip("cannot reserve 8.6 GB of virtual memory here")
    assert done.returncode == 0, f"rc={done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    assert "ok: qk_norm_rope_write_kv_ and gemv_rope_write_kv" in done.stdout


def _compile_check() -> None:
    """Compile the fused kernels and the GEMV for sm_90 with PDL on (griddepcontrol in the PTX) as a
    launch specialises them, assemble with ptxas -v: no errors, no register spills."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))      # tests/ (a script here)
    from triton_interpreter import compile_sm90

    from kvfit.kernels import gemv
    ptr_types = {"pos_ptr": "*i64", "freq_ptr": "*fp32", "slot_ptr": "*i64", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32",
                 "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    quant = dict(FP8_MAX_C=448.0, MIN_AMAX_C=1e-10)

    def build(kernel, consts, warps=4, stages=3):
        sig = {n: "constexpr" if n in consts else ptr_types.get(n, "*bf16") if n.endswith("_ptr")
               else "fp32" if n == "eps" else "i32" for n in kernel.arg_names}
        divisible = {n for n in kernel.arg_names if sig[n].startswith("*") or n.startswith("stride_")}
        compiled, spills, report = compile_sm90(kernel, sig, consts, divisible,
                                                {"num_warps": warps, "num_stages": stages})
        assert "griddepcontrol.wait" in compiled.asm["ptx"], kernel.__name__
        print(f"{kernel.__name__} {consts}: spills {spills} B")
        assert spills == 0, report


    for block, group in ((4096, 0), (4096, 4096), (2048, 128), (4096, 128)):     # with the FP8 epilogue: per token, 128
        build(fused_ops._add_rms_norm_kernel, dict(HAS_RES=True, BLOCK=block, PDL=True, QUANT_GROUP=group, **quant),
              warps=4 if block <= 4096 else 8)
    for write_kv, scaled in ((False, False), (True, False), (True, True)):      # scaled: an fp8 cache's k/v scales
        build(fused_ops._norm_rope_kernel, dict(HALF=64, BLOCK_H=16, BLOCK_D=64, NORM=True, WRITE_KV=write_kv,
                                                SCALED=scaled, PAGE=16, PAD_SLOT=-1, PDL=True))
    for block, group in ((1024, 0), (1024, 128), (16384, 16384), (4096, 4096)):     # FP8 epilogue: per group, token
        build(fused_ops._silu_mul_kernel, dict(BLOCK=block, PDL=True, QUANT_GROUP=group, **quant),
              warps=max(4, min(16, block // 512)))
    for n, k in ((6144, 4096), (4096, 14336), (28672, 4096), (4096, 1024)):     # each of config_for's choices
        block_n, block_k, warps, stages = gemv.config_for(n, k)
        build(gemv._gemv_kernel, dict(K=k, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=False, PDL=True), warps, stages)
    # the one-token kernels with fused epilogues, at the 8B shapes' configs (two weight rows a program)
    _, block_k, warps, stages = gemv.config_for(28672, 4096)
    build(gemv._gemv_silu_mul_kernel, dict(K=4096, BLOCK_N=1, BLOCK_K=block_k, HAS_BIAS=False, PDL=True), warps, stages)
    _, block_k, warps, stages = gemv.config_for(6144, 4096)
    build(gemv._gemv_rope_write_kernel, dict(NUM_Q=32, NUM_KV=8, HALF=64, K=4096, BLOCK_P=1, BLOCK_K=block_k,
                                             HAS_BIAS=True, PAGE=16, PAD_SLOT=-1, PDL=True), warps, stages)
    print("ok: fused kernels and GEMV compile for sm_90 with PDL")


def test_kernels_compile_for_sm90_with_pdl():
    from triton_interpreter import run_compile_check
    run_compile_check(__file__, "ok: fused kernels and GEMV compile")


if COMPILE_CHECK:
    _compile_check()
if __name__ == "__main__" and sys.argv[1:] == ["--huge-slot-check"]:
    _huge_slot_check()


def test_an_attention_layer_with_kv_scales_takes_the_scaled_one_launch_write(monkeypatch):
    # llama.Attention over an fp8 cache with k/v scales: the fused write (opened for CPU tensors here) gives the same
    # output and cache bytes as the torch path, and is not taken on the step that calculates the scales
    from kvfit.attention import fused_write
    from kvfit.attention.base import AttentionMetadata
    from kvfit.attention.torch_ref import TorchReferenceBackend
    from kvfit.kernels.attention_common import write_kv_cache
    from kvfit.models import llama
    from kvfit.models.rope import inv_freq
    from tiny_models import tiny_decoder_config

    class PlainWriteReference(fused_write.FusedCacheWrite, TorchReferenceBackend):
        """As the Triton backend: its plain write kernel, so the fused one may stand in (the same fp8 cast: the
        interpreter's differs from torch's on a few values)."""

        def write_kv(self, key, value, k_cache, v_cache, slot_mapping):
            write_kv_cache(key, value, k_cache, v_cache, slot_mapping)

    num_q, num_kv, dim, hidden, page = 4, 2, 16, 64, 4
    cfg = tiny_decoder_config(num_q, num_kv, dim, hidden, qk_norm=True)
    torch.manual_seed(5)
    attn = llama.Attention(cfg, PlainWriteReference(), torch.float32, DEVICE, 0, 1)
    for p in attn.parameters():
        p.data.normal_(0, 0.5)
    # in range after the division (past 448 the interpreter's fp8 cast gives NaN where torch's and the GPU's saturate)
    attn.kv_scales.k_scale.copy_(torch.tensor([0.2, 0.5]))
    attn.kv_scales.v_scale.copy_(torch.tensor([0.3, 0.1]))
    attn.kv_scales.applies = True
    freqs = inv_freq(cfg.rope, DEVICE)
    tokens, context = 3, 11                      # 8 cached tokens and these 3
    cache_init = [(torch.randn(4, page, num_kv, dim) * 4).to(DEVICE, torch.float8_e4m3fn) for _ in range(2)]
    meta = AttentionMetadata(slot_mapping=torch.tensor([8, 9, 10], dtype=torch.int64, device=DEVICE),
                             query_start_loc=torch.tensor([0, tokens], dtype=torch.int32, device=DEVICE),
                             seq_lens=torch.tensor([context], dtype=torch.int32, device=DEVICE),
                             block_tables=torch.tensor([[0, 1, 2]], dtype=torch.int32, device=DEVICE),
                             max_query_len=tokens, max_seq_len=context, query_start_loc_host=[0, tokens],
                             seq_lens_host=[context])
    x, positions = torch.randn(tokens, hidden).to(DEVICE), torch.arange(8, 11).to(DEVICE)
    calls = []
    inner = fused_ops.qk_norm_rope_write_kv_
    monkeypatch.setattr(fused_ops, "qk_norm_rope_write_kv_", lambda *a, **k: (calls.append(len(a)), inner(*a, **k))[1])
    results = {}
    for fused in (False, True):
        monkeypatch.setattr(fused_ops, "available", lambda t, fused=fused: fused)
        caches = tuple(c.clone() for c in cache_init)
        results[fused] = (attn(x, positions, caches, meta, freqs), caches)
    (out, caches), (f_out, f_caches) = results[False], results[True]
    assert calls == [13]                                  # the fused run, with the two scales (11 + 2 arguments)
    for got, expected in zip(f_caches, caches):
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    torch.testing.assert_close(f_out, out, rtol=1e-5, atol=1e-5)
    attn.kv_scales.calculate_next = True                  # --calculate-kv-scales' first batch: the torch path
    attn(x, positions, tuple(c.clone() for c in cache_init), meta, freqs)
    assert calls == [13] and not attn.kv_scales.calculate_next
