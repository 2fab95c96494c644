"""The cache write folded into the kernels before it, for a backend whose write_kv is a plain cast copy of
token t's k and v to slot_mapping[t] (no scales, no layout of its own): the Triton backend's.

On CUDA with Triton:
- one token with a 16-bit fused q/k/v weight, no q/k norm (a norm needs a whole head in one program), RoPE
  over the whole head and no KV cache scales: projection, RoPE and the write in one GEMV launch (kernels/gemv.py);
- otherwise, q/k views of one projection's rows: q/k norm, RoPE and the write in one launch (kernels/fused_ops.py),
  with an fp8 cache's k/v scales too (k and v divided before the write, q multiplied), except on the step that
  calculates them (--calculate-kv-scales: the amax of this step's k and v comes first).
Anything else takes AttentionBackend's path: rotate, then write_kv. The outputs are the same either way.
"""

from __future__ import annotations

import torch

from kvfit.attention.base import AttentionHeads, KVCacheScales, QKVProjection, Rotary
from kvfit.kernels import fused_ops
from kvfit.kernels.gemv import gemv_applies, gemv_rope_write_kv


class FusedCacheWrite:
    """Mixed into an AttentionBackend (before it) whose write_kv is the plain write the fused kernels do."""

    def project_write_kv(self, x: torch.Tensor, projection: QKVProjection, heads: AttentionHeads, rotary: Rotary,
                         kv_cache, slot_mapping: torch.Tensor, kv_scales: KVCacheScales | None = None):
        weight = projection.dense_weight
        if (kv_cache is not None and kv_scales is None and weight is not None and rotary.q_norm_weight is None
                and 2 * rotary.inv_freq.numel() == heads.head_dim and gemv_applies(x, weight)):
            # one token (batch-1 decode): projection, RoPE and the cache write in one GEMV launch
            qkv = gemv_rope_write_kv(x, weight, projection.bias, rotary.positions, rotary.inv_freq, *kv_cache,
                                     slot_mapping, heads.num_q_heads, heads.num_kv_heads)  # [1, (Hq + 2 Hkv) D]
            return heads.split(qkv)
        return super().project_write_kv(x, projection, heads, rotary, kv_cache, slot_mapping, kv_scales)

    def rotate_write_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary: Rotary, kv_cache,
                        slot_mapping: torch.Tensor, kv_scales: KVCacheScales | None = None):
        # q/k norm and RoPE in place on the projection's rows, with the cache write (and q scaled), in one launch
        scaled = kv_scales is not None
        if (kv_cache is not None and not (scaled and kv_scales.calculate_next) and fused_ops.available(q)
                and fused_ops.qk_norm_rope_write_kv_(q, k, v, rotary.positions, rotary.inv_freq, rotary.q_norm_weight,
                                                     rotary.k_norm_weight, rotary.eps, *kv_cache, slot_mapping,
                                                     *((kv_scales.k_scale, kv_scales.v_scale) if scaled else ()))):
            return q, k, v
        return super().rotate_write_kv(q, k, v, rotary, kv_cache, slot_mapping, kv_scales)
