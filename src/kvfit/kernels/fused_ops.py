"""Fused Triton kernels for the decoder's small ops on CUDA: residual add + RMSNorm, q/k RMSNorm + RoPE,
SiLU x mul.

At decode batch sizes each torch op is a separate tiny kernel (RMSNorm alone is five); these cut a
layer to a handful of launches. Every row/token index is cast to int64 before it meets a stride.
On CPU (and wherever Triton is missing) the callers keep their plain-torch path.
"""

from __future__ import annotations

import torch

from kvfit.kernels import pdl
from kvfit.kernels.fp8_quantize import FP8_DTYPE
from kvfit.kv.spec import PADDING_SLOT_ID
from kvfit.platforms.gate import triton_applies
from kvfit.quant_scheme import FP8_MAX, MIN_AMAX

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    from kvfit.kernels.fp8_quantize import fp8_scale, fp8_values
except ImportError:  # CPU-only installs
    triton = None


def available(t: torch.Tensor) -> bool:
    """Use the fused kernels for this tensor (CUDA with Triton)."""
    return triton_applies(t)


if triton is not None:
    # the math a fused epilogue shares with these kernels (gemv.py's one-token GEMVs), written once so
    # the fused and unfused paths stay bit-identical
    @triton.jit
    def silu_times(gate, up):
        """silu(gate) * up in fp32."""
        return gate / (1.0 + tl.exp(-gate)) * up

    @triton.jit
    def rotate_halves(a, b, angle):
        """RoPE of a head's two halves (fp32) at angle = position * inverse frequency."""
        cos, sin = tl.cos(angle), tl.sin(angle)
        return a * cos - b * sin, b * cos + a * sin

    @triton.jit
    def store_kv_halves(cache_ptr, slot, head, num_heads, col, first, second, mask, stride_b, stride_s, stride_h,
                        PAGE: tl.constexpr, HALF: tl.constexpr, PAD_SLOT: tl.constexpr):
        """The plain cache write of a head's two halves at cache slot `slot` (int64), cast to the cache dtype;
        nothing for heads outside 0..num_heads-1 or the padding slot."""
        keep = mask & (head >= 0) & (head < num_heads) & (slot != PAD_SLOT)
        row = cache_ptr + (slot // PAGE) * stride_b + (slot % PAGE) * stride_s + head * stride_h + col
        tl.store(row, first.to(cache_ptr.dtype.element_ty), mask=keep)
        tl.store(row + HALF, second.to(cache_ptr.dtype.element_ty), mask=keep)

    @triton.jit
    def quantize_store(y, q_ptrs, scale_row_ptr, mask, first_group, n_cols, BLOCK: tl.constexpr,
                       QUANT_GROUP: tl.constexpr, FP8_MAX_C: tl.constexpr, MIN_AMAX_C: tl.constexpr):
        """The dynamic FP8 quantization of y [BLOCK] (the values a kernel just stored, so the numbers are
        fp8_quantize's of them): one scale per QUANT_GROUP columns (a power of two dividing BLOCK), the fp8
        values at q_ptrs, the scales of groups first_group.. at scale_row_ptr."""
        y32 = tl.reshape(y.to(tl.float32), (BLOCK // QUANT_GROUP, QUANT_GROUP))
        scale = fp8_scale(tl.max(tl.abs(y32), 1), FP8_MAX_C, MIN_AMAX_C)                          # [groups]
        q = fp8_values(y32, scale[:, None], FP8_MAX_C)
        tl.store(q_ptrs, tl.reshape(q, (BLOCK,)).to(q_ptrs.dtype.element_ty), mask=mask)
        groups = first_group + tl.arange(0, BLOCK // QUANT_GROUP)
        tl.store(scale_row_ptr + groups, scale, mask=groups * QUANT_GROUP < n_cols)

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, scale_ptr, stride_x, stride_res,
                             stride_out, stride_res_out, stride_q, stride_s, n_cols, eps, HAS_RES: tl.constexpr,
                             BLOCK: tl.constexpr, PDL: tl.constexpr, QUANT_GROUP: tl.constexpr,
                             FP8_MAX_C: tl.constexpr, MIN_AMAX_C: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        if PDL:     # see pdl.py
            gdc_wait()
            gdc_launch_dependents()
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RES:
            # the sum is rounded to the model dtype, as `x + residual` in torch would be
            x = x + tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
            tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
        x32 = x.to(tl.float32)
        var = tl.sum(x32 * x32, axis=0) / n_cols
        normed = (x32 * tl.rsqrt(var + eps)).to(x.dtype)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        y = normed * w
        tl.store(out_ptr + row * stride_out + cols, y, mask=mask)
        if QUANT_GROUP > 0:
            quantize_store(y, q_ptr + row * stride_q + cols, scale_ptr + row * stride_s, mask, 0, n_cols,
                           BLOCK, QUANT_GROUP, FP8_MAX_C, MIN_AMAX_C)

    @triton.jit
    def _norm_rope_kernel(x_ptr, pos_ptr, freq_ptr, w_first_ptr, w_rest_ptr, stride_tok, stride_head, num_heads,
                          num_first, eps,
                          k_cache_ptr, v_cache_ptr, slot_ptr, num_kv, stride_kcb, stride_kcs, stride_kch,
                          stride_vcb, stride_vcs, stride_vch, k_scale_ptr, v_scale_ptr, group,
                          HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr,
                          WRITE_KV: tl.constexpr, SCALED: tl.constexpr, PAGE: tl.constexpr, PAD_SLOT: tl.constexpr,
                          PDL: tl.constexpr):
        # program (token, head tile): heads [BLOCK_H] x the two halves [BLOCK_D] of each head. Heads
        # < num_first are q's, the rest k's; with WRITE_KV the rows are q, k then v (num_kv each of k and v):
        # k goes to its cache slot after RoPE, v unchanged to its slot, as the backend's write_kv would.
        # SCALED (an fp8 cache's k/v scales, fp32 per KV head; models/kv_scales.py): q is multiplied by its KV
        # head's k scale, k and v divided by theirs before the write, each rounded to the model dtype as torch
        # rounds `(x * s).to(dtype)` and `(x / s).to(dtype)`
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        tok = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        i = tl.arange(0, BLOCK_D)
        d_mask = i < HALF
        mask = (heads < num_heads)[:, None] & d_mask[None, :]
        base = x_ptr + tok * stride_tok + heads.to(tl.int64)[:, None] * stride_head + i[None, :]
        x1 = tl.load(base, mask=mask, other=0.0)
        x2 = tl.load(base + HALF, mask=mask, other=0.0)
        v1, v2 = x1, x2
        if NORM:
            # RMSNorm as the torch module computes it: fp32 statistics, normed value rounded to the
            # model dtype, then times the weight (rounded again); heads < num_first use w_first
            a32, b32 = x1.to(tl.float32), x2.to(tl.float32)
            r = tl.rsqrt((tl.sum(a32 * a32, 1) + tl.sum(b32 * b32, 1)) / (2 * HALF) + eps)
            first = (heads < num_first)[:, None]
            w1 = tl.where(first, tl.load(w_first_ptr + i, mask=d_mask, other=0.0)[None, :],
                          tl.load(w_rest_ptr + i, mask=d_mask, other=0.0)[None, :]).to(tl.float32)
            w2 = tl.where(first, tl.load(w_first_ptr + HALF + i, mask=d_mask, other=0.0)[None, :],
                          tl.load(w_rest_ptr + HALF + i, mask=d_mask, other=0.0)[None, :]).to(tl.float32)
            x1 = ((a32 * r[:, None]).to(x1.dtype).to(tl.float32) * w1).to(x1.dtype)
            x2 = ((b32 * r[:, None]).to(x2.dtype).to(tl.float32) * w2).to(x2.dtype)
        pos = tl.load(pos_ptr + tok).to(tl.float32)
        angle = pos * tl.load(freq_ptr + i, mask=d_mask, other=0.0)
        o1, o2 = rotate_halves(x1.to(tl.float32), x2.to(tl.float32), angle[None, :])
        dtype = x_ptr.dtype.element_ty
        o1, o2 = o1.to(dtype), o2.to(dtype)
        if WRITE_KV:
            rotated = mask & (heads < num_first + num_kv)[:, None]
        else:
            rotated = mask
        k1, k2 = o1, o2
        if SCALED:
            is_q = heads < num_first
            # the KV head each row reads: a q head its group's, a k or v row (or the tile's padding) its own
            kv_of = tl.where(is_q, heads // group, (heads - num_first) % num_kv)        # 0..num_kv-1
            ks = tl.load(k_scale_ptr + kv_of)[:, None]
            vs = tl.load(v_scale_ptr + kv_of)[:, None]
            # one product and one division a value, each row its own: a q row times its k scale (divided by 1:
            # exact), a k row (after RoPE) divided by its k scale, a v row (as projected) by its v scale (times 1)
            rotated_row = (heads < num_first + num_kv)[:, None]
            times = tl.where(is_q[:, None], ks, 1.0)
            by = tl.where(is_q[:, None], 1.0, tl.where(rotated_row, ks, vs))
            r1 = tl.math.div_rn(tl.where(rotated_row, o1, v1).to(tl.float32) * times, by).to(dtype)
            r2 = tl.math.div_rn(tl.where(rotated_row, o2, v2).to(tl.float32) * times, by).to(dtype)
            o1 = tl.where(is_q[:, None], r1, o1)
            o2 = tl.where(is_q[:, None], r2, o2)
            k1, k2, v1, v2 = r1, r2, r1, r2          # the writes below take the k rows' and the v rows' own
        tl.store(base, o1, mask=rotated)
        tl.store(base + HALF, o2, mask=rotated)
        if WRITE_KV:
            slot = tl.load(slot_ptr + tok).to(tl.int64)
            kv_head = (heads - num_first).to(tl.int64)[:, None]                  # k rows: 0..num_kv-1
            store_kv_halves(k_cache_ptr, slot, kv_head, num_kv, i[None, :], k1, k2, mask,
                            stride_kcb, stride_kcs, stride_kch, PAGE, HALF, PAD_SLOT)
            store_kv_halves(v_cache_ptr, slot, kv_head - num_kv, num_kv, i[None, :], v1, v2, mask,   # v rows
                            stride_vcb, stride_vcs, stride_vch, PAGE, HALF, PAD_SLOT)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, q_ptr, scale_ptr, stride_gu, stride_out, stride_q, stride_s, n_cols,
                         BLOCK: tl.constexpr, PDL: tl.constexpr, QUANT_GROUP: tl.constexpr,
                         FP8_MAX_C: tl.constexpr, MIN_AMAX_C: tl.constexpr):
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = col < n_cols
        g = tl.load(gu_ptr + row * stride_gu + col, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * stride_gu + n_cols + col, mask=mask, other=0.0).to(tl.float32)
        y = silu_times(g, u).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * stride_out + col, y, mask=mask)
        if QUANT_GROUP > 0:     # BLOCK with one program a row: per token
            quantize_store(y, q_ptr + row * stride_q + col, scale_ptr + row * stride_s, mask,
                           tl.program_id(1) * (BLOCK // QUANT_GROUP), n_cols, BLOCK, QUANT_GROUP, FP8_MAX_C, MIN_AMAX_C)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual); x, residual: [T, hidden]."""
    out, res_out, _ = _add_rms_norm_launch(x, residual, weight, eps, None)
    return out, res_out


def norm_quant_applies(cols: int, group: int) -> bool:
    """add_rms_norm_quant can quantize a row of `cols` in groups of `group` columns (`cols`: per token): the
    group a power of two dividing the row's power-of-two block, or the whole row."""
    block = triton.next_power_of_2(cols)
    return group == cols or (group & (group - 1) == 0 and block % group == 0 and cols % group == 0)


def add_rms_norm_quant(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                       group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """add_rms_norm and, in the same launch, its output's dynamic FP8 quantization (fp8_quantize's numbers):
    (out, x + residual, out in fp8 [T, hidden], scales fp32 [T, hidden / group]); group == hidden: per token.
    norm_quant_applies(hidden, group) must hold."""
    if not norm_quant_applies(x.shape[1], group):
        raise ValueError(f"add_rms_norm_quant cannot quantize {x.shape[1]} columns in groups of {group} "
                         "(norm_quant_applies)")
    out, res_out, quant = _add_rms_norm_launch(x, residual, weight, eps, group)
    return out, res_out, *quant


def _fp8_outputs(rows: int, cols: int, group: int | None, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused FP8 epilogue's buffers: fp8 [rows, cols] and fp32 scales [rows, cols / group]; without one
    (group None), `out` for both (pointers the kernel never touches)."""
    if group is None:
        return out, out
    return (torch.empty((rows, cols), dtype=FP8_DTYPE, device=out.device),
            torch.empty((rows, cols // group), dtype=torch.float32, device=out.device))


def _add_rms_norm_launch(x, residual, weight, eps, group):
    rows, cols = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    block = triton.next_power_of_2(cols)
    quant_group = 0 if group is None else (block if group == cols else group)
    xq, scale = _fp8_outputs(rows, cols, group, out)
    if rows:
        _add_rms_norm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, out, res_out, xq, scale, x.stride(0),
            (residual if residual is not None else x).stride(0), out.stride(0), res_out.stride(0), xq.stride(0),
            scale.stride(0), cols, eps, HAS_RES=residual is not None, BLOCK=block, QUANT_GROUP=quant_group,
            FP8_MAX_C=FP8_MAX, MIN_AMAX_C=MIN_AMAX, num_warps=4 if block <= 4096 else 8, **pdl.launch_args(x))
    return out, res_out, (None if group is None else (xq, scale))


def _norm_rope_launch(x: torch.Tensor, positions, freqs, w_first, w_rest, num_first: int, eps: float,
                      cache=None, scales=None) -> None:
    """x: [T, H, D] rows; cache: None, or (k_cache, v_cache, slot_mapping, num_kv) with x = q, k, v rows;
    scales: None, or (k_scale, v_scale) fp32 [num_kv] with a cache."""
    tokens, heads, dim = x.shape
    assert x.stride(2) == 1 and dim % 2 == 0, (x.shape, x.stride())
    if not tokens:
        return
    norm = w_first is not None
    w_first = w_first if norm else freqs           # unread without NORM; any pointer will do
    w_rest = w_rest if w_rest is not None else w_first
    if cache is None:
        k_cache = v_cache = slots = x                 # unread without WRITE_KV
        num_kv, page, kv_strides = 0, 1, (0,) * 6
    else:
        k_cache, v_cache, slots, num_kv = cache
        page, kv_strides = k_cache.shape[1], (*k_cache.stride()[:3], *v_cache.stride()[:3])
    k_scale, v_scale = scales if scales is not None else (freqs, freqs)     # unread without SCALED
    group = num_first // num_kv if scales is not None else 1
    block_h = min(triton.next_power_of_2(heads), 16)
    _norm_rope_kernel[(tokens, triton.cdiv(heads, block_h))](
        x, positions, freqs, w_first, w_rest, x.stride(0), x.stride(1), heads, num_first, eps,
        k_cache, v_cache, slots, num_kv, *kv_strides, k_scale, v_scale, group,
        HALF=dim // 2, BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(dim // 2), NORM=norm,
        WRITE_KV=cache is not None, SCALED=scales is not None, PAGE=page, PAD_SLOT=PADDING_SLOT_ID, num_warps=4,
        **pdl.launch_args(x))


def _adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> bool:
    """k's heads follow q's in memory with the same strides (q and k are views of one fused qkv row)."""
    same_strides = q.stride()[1:] == k.stride()[1:] and (q.shape[0] <= 1 or q.stride(0) == k.stride(0))
    return (same_strides and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2]
            and k.data_ptr() == q.data_ptr() + q.shape[1] * q.stride(1) * q.element_size())


def qk_norm_rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor,
                  q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                  eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: optional per-head RMSNorm (q_weight, k_weight [D]), then RoPE, of q [T, Hq, D], k [T, Hkv, D].

    positions [T]; freqs [D // 2] float32. One launch when k's heads follow q's (a fused qkv
    projection), else one each.
    """
    if _adjacent_heads(q, k):
        both = q.as_strided((q.shape[0], q.shape[1] + k.shape[1], q.shape[2]), q.stride())
        _norm_rope_launch(both, positions, freqs, q_weight, k_weight, q.shape[1], eps)
    else:
        _norm_rope_launch(q, positions, freqs, q_weight, None, q.shape[1], eps)
        _norm_rope_launch(k, positions, freqs, k_weight, None, k.shape[1], eps)
    return q, k


def qk_norm_rope_write_kv_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                           freqs: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                           eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> bool:
    """qk_norm_rope_ of q, k, and the KV-cache write of k (after RoPE) and v, in one launch -> True; False
    (nothing done) unless q, k, v are adjacent views of one fused qkv row.

    The write is the attention backend's plain one (attention/fused_write.py): token t's k and v
    cast to the cache dtype at slot slot_mapping[t] of caches [num_blocks, block_size, Hkv, D];
    PADDING_SLOT_ID rows are skipped. With k_scale, v_scale (fp32 [Hkv], an fp8 cache's scales) k and v are
    divided by their KV head's scale before the write and q is multiplied by its KV head's k scale in place,
    as KVScales.for_cache and scale_query compute them.
    """
    if not (_adjacent_heads(q, k) and _adjacent_heads(k, v)):
        return False
    from kvfit.kernels.attention_common import check_cache_pair    # (needs Triton, as this path does)
    num_kv = k.shape[1]
    check_cache_pair(k_cache, v_cache)
    assert v.shape == k.shape and k_cache.shape[2:] == k.shape[1:], (k.shape, v.shape, k_cache.shape)
    assert slot_mapping.shape == (q.shape[0],), (slot_mapping.shape, q.shape)
    rows = q.as_strided((q.shape[0], q.shape[1] + 2 * num_kv, q.shape[2]), q.stride())
    scales = None
    if k_scale is not None:
        assert v_scale is not None and k_scale.shape == v_scale.shape == (num_kv,) and q.shape[1] % num_kv == 0
        scales = (k_scale, v_scale)
    _norm_rope_launch(rows, positions, freqs, q_weight, k_weight, q.shape[1], eps,
                      (k_cache, v_cache, slot_mapping.to(torch.int64), num_kv), scales)
    return True


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * I] (gate then up) -> silu(gate) * up: [T, I]."""
    return _silu_mul_launch(gate_up, None)[0]


SILU_BLOCK = 1024                 # columns a program (without a per-token quantization)
MAX_SILU_QUANT_ROW = 16384        # per-token quantization: one program holds the whole row


def silu_quant_applies(cols: int, group: int) -> bool:
    """silu_mul_quant can quantize an output row of `cols` in groups of `group` columns: per token (group ==
    cols) up to MAX_SILU_QUANT_ROW columns, or a power-of-two group dividing SILU_BLOCK and the row."""
    if group == cols:
        return triton.next_power_of_2(cols) <= MAX_SILU_QUANT_ROW
    return group & (group - 1) == 0 and SILU_BLOCK % group == 0 and cols % group == 0


def silu_mul_quant(gate_up: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """silu_mul and, in the same launch, its output's dynamic FP8 quantization (fp8_quantize's numbers):
    (out [T, I], out in fp8, scales fp32 [T, I / group]); group == I: per token. silu_quant_applies must hold."""
    if not silu_quant_applies(gate_up.shape[1] // 2, group):
        raise ValueError(f"silu_mul_quant cannot quantize {gate_up.shape[1] // 2} columns in groups of {group} "
                         "(silu_quant_applies)")
    out, quant = _silu_mul_launch(gate_up, group)
    return out, *quant


def _silu_mul_launch(gate_up, group):
    rows, double = gate_up.shape
    cols = double // 2
    out = torch.empty((rows, cols), dtype=gate_up.dtype, device=gate_up.device)
    xq, scale = _fp8_outputs(rows, cols, group, out)
    block, quant_group = SILU_BLOCK, 0
    if group is not None:
        block = triton.next_power_of_2(cols) if group == cols else SILU_BLOCK
        quant_group = block if group == cols else group
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(cols, block))](
            gate_up, out, xq, scale, gate_up.stride(0), out.stride(0), xq.stride(0), scale.stride(0), cols,
            BLOCK=block, QUANT_GROUP=quant_group, FP8_MAX_C=FP8_MAX, MIN_AMAX_C=MIN_AMAX,
            num_warps=max(4, min(16, block // 512)), **pdl.launch_args(out))
    return out, (None if group is None else (xq, scale))
