"""The attention backend interface and the per-step metadata every backend reads.

One step is a flat batch of T query tokens from B sequences. Sequence i owns query tokens
``query_start_loc[i]:query_start_loc[i+1]``; those are the *last* tokens of its context of
``seq_lens[i]`` tokens (cached prefix + new), so query j of sequence i sits at position
``seq_lens[i] - q_len_i + j`` and attends causally to keys at positions <= its own. Decode is the
case q_len_i == 1; prefill over a cached prefix is q_len_i < seq_lens[i].

A model's attention layer makes two calls per step: `project_write_kv` (q, k, v from the layer input, RoPE,
and the cache write) and `attend_step`. The backend owns the cache write, so a backend whose write is a plain
cast copy may fold RoPE, and for one token the projection too, into its write kernel (attention/fused_write.py);
the layer does not know which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Per-step tensors, built by the runner and passed to every layer (never stored globally)."""

    slot_mapping: torch.Tensor      # [T] int64; PADDING_SLOT_ID (-1) = do not write
    query_start_loc: torch.Tensor   # [B + 1] int32
    seq_lens: torch.Tensor          # [B] int32, context length including this step's tokens
    block_tables: torch.Tensor      # [B, max_blocks_per_seq] int32
    max_query_len: int
    max_seq_len: int
    # host copies, so the reference backend and launch-size decisions need no device sync
    query_start_loc_host: list[int] | None = None
    seq_lens_host: list[int] | None = None
    # cascade (decode steps only): the first prefix_len[0] tokens ([1] int32, a multiple of the block size) of
    # every sequence have the K/V that block_tables[0]'s blocks hold (the same blocks, or copies equal up to the
    # rounding of the batch that computed them, as with a prefix-cache hit), and every
    # sequence has more tokens than that; a backend may attend them once for all sequences through row 0's
    # blocks. None: no such prefix (or the backend declined it).
    prefix_len: torch.Tensor | None = None
    # a step inside a CUDA graph (runner/cuda_graphs.py MixedGraphs): launch grids may depend on the tensors'
    # shapes only, never on this step's lengths (max_query_len is the graph's token count); a backend keeps
    # per-step tensors it derives once for all layers here (the prefill kernel's tile map). None: eager.
    tile_maps: dict | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclass(frozen=True)
class AttentionHeads:
    """One layer's heads on this rank: the q/k/v projection's rows are q heads, then k heads, then v heads."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [T, (Hq + 2 Hkv) D] -> views q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]."""
        d, num_tokens = self.head_dim, qkv.shape[0]
        q, k, v = qkv.split([self.num_q_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=1)
        return (q.view(num_tokens, self.num_q_heads, d), k.view(num_tokens, self.num_kv_heads, d),
                v.view(num_tokens, self.num_kv_heads, d))


class QKVProjection(Protocol):
    """The layer's fused q/k/v projection: called on x [T, hidden] -> [T, (Hq + 2 Hkv) D]."""

    dense_weight: torch.Tensor | None   # its 16-bit weight [(Hq + 2 Hkv) D, hidden], or None (FP8, split parts)
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class Rotary(Protocol):
    """This step's RoPE (after an optional per-head RMSNorm of q and k), called on (q, k) -> (q, k)."""

    positions: torch.Tensor             # [T] int64
    inv_freq: torch.Tensor              # [D' / 2] fp32 (D' = D: RoPE over the whole head)
    q_norm_weight: torch.Tensor | None  # [D], with k_norm_weight; None: no q/k norm
    k_norm_weight: torch.Tensor | None
    eps: float

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class KVCacheScales(Protocol):
    """The scales of an fp8 cache (models/kv_scales.py): k, v divided on the way in, q scaled, and the output
    scaled by the attention kernels (attend's out_scale)."""

    k_scale: torch.Tensor            # fp32 [Hkv]: a kernel that writes the cache may divide by them itself
    v_scale: torch.Tensor
    calculate_next: bool             # this step's k and v set the scales first (for_cache)

    def for_cache(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def scale_query(self, q: torch.Tensor) -> torch.Tensor: ...


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start_loc: list[int],
                     scale: float) -> torch.Tensor:
    """Causal attention of each sequence over its own tokens of this step, with no KV cache.

    q: [T, Hq, D], k/v: [T, Hkv, D]; sequence i is rows query_start_loc[i]:query_start_loc[i+1].
    Used when the model runs without a cache (a profile run): every sequence is a fresh prefill.
    """
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for start, end in zip(query_start_loc[:-1], query_start_loc[1:]):
        if end == start:
            continue
        qs = q[start:end].transpose(0, 1)                                    # [Hq, L, D]
        ks = k[start:end].repeat_interleave(group, dim=1).transpose(0, 1)    # [Hq, L, D]
        vs = v[start:end].repeat_interleave(group, dim=1).transpose(0, 1)
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out


class AttentionBackend:
    """A backend declares the largest element offset its kernels compute (the planner's index limit)."""

    name: str = "abstract"
    max_element_offset: int = 2**63 - 1
    # whether attend takes any step in a CUDA graph, given AttentionMetadata.tile_maps (prefill and mixed
    # steps too, not only decode)
    graphs_any_step: bool = False

    def cascade_tokens(self, shared_tokens: int, num_seqs: int) -> int:
        """Of the shared_tokens every one of a decode step's num_seqs sequences has in the same blocks, how
        many this backend attends once for all of them (AttentionMetadata.prefix_len); 0: none, it reads
        each sequence's context whole."""
        return 0

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """key, value: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D]; writes token t to slot t."""
        raise NotImplementedError

    def attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, out_scale: torch.Tensor | None = None) -> torch.Tensor:
        """query: [T, Hq, D] -> output [T, Hq, D] in query's dtype. out_scale: fp32 [Hkv] (an fp8 cache's v
        scales): query head h's output times out_scale[h // group], in fp32 before the output's rounding."""
        raise NotImplementedError

    # what a model's attention layer calls ----------------------------------------------------------
    def project_write_kv(self, x: torch.Tensor, projection: QKVProjection, heads: AttentionHeads, rotary: Rotary,
                         kv_cache, slot_mapping: torch.Tensor, kv_scales: KVCacheScales | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This step's q [T, Hq, D], k, v [T, Hkv, D] from x [T, hidden]: projected, q and k rotated, and with a
        cache ((k_cache, v_cache) or None) k and v written at slot_mapping (divided by kv_scales, q multiplied by
        them, when given). A backend may fold the projection, RoPE and the write into fewer kernels."""
        q, k, v = heads.split(projection(x))
        return self.rotate_write_kv(q, k, v, rotary, kv_cache, slot_mapping, kv_scales)

    def rotate_write_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary: Rotary, kv_cache,
                        slot_mapping: torch.Tensor, kv_scales: KVCacheScales | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """project_write_kv after the projection: RoPE of q and k, then (with a cache) the write of k and v."""
        q, k = rotary(q, k)
        if kv_cache is not None:
            if kv_scales is not None:
                (k, v), q = kv_scales.for_cache(k, v), kv_scales.scale_query(q)
            self.write_kv(k, v, *kv_cache, slot_mapping)
        return q, k, v

    def attend_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache, meta: AttentionMetadata,
                    scale: float, kv_scales: KVCacheScales | None = None) -> torch.Tensor:
        """The output [T, Hq, D] of project_write_kv's q over the cache; with no cache (a profile run) each
        sequence attends causally to its own k, v of this step."""
        if kv_cache is None:
            return causal_attention(q, k, v, meta.query_start_loc_host or meta.query_start_loc.tolist(), scale)
        if kv_scales is None:
            return self.attend(q, *kv_cache, meta, scale)
        return self.attend(q, *kv_cache, meta, scale, out_scale=kv_scales.v_scale)
