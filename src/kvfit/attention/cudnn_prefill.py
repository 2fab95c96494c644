"""A long prefill chunk's attention to its own tokens through cuDNN's fused attention (Hopper: ~1.6x the Triton
prefill kernel on fresh 8,000-token prompts, docs/benchmarks.md), merged with the Triton kernel's attention
to the cached prefix by log-sum-exp.

Why this shape (benchmarks/probe_cudnn_attention.py on the H200, torch 2.11 / cuDNN 9.19):
- torch's dense op (`aten._scaled_dot_product_cudnn_attention`) takes the step's q/k/v as strided views of
  the fused projection, grouped-query K/V as they are, and returns the natural-log LSE ([1, Hq, T, 1] fp32);
- it builds a cuDNN graph per shape (55-70 ms, in a cache local to the calling thread) and then runs from
  the cache; torch's ragged op rebuilt its graph on every call (60-80 ms), so it is not used;
- so a chunk of n tokens is padded to a bucket length (bucket_tokens: at most 1/8 more rows), every bucket
  up to the step's token budget is built at start-up (warm_up), and a thread that has not built them
  builds them before its first routed chunk.
Padding rows sit after the chunk's last token, so causal masking hides them from its queries; they are
zeros, so nothing non-finite reaches a real row. Only a chunk's own rows are read (no KV-cache offsets).

Off by default (MIN_TOKENS = 0). Measured on the H200 (2026-12-04, docs/benchmarks.md): the attention of a fresh
8,000-token prompt takes 0.58 ms this way against the Triton kernel's 0.78 ms (1.35x, pads and merge included),
but the long-context workload ran 1.7% *slower* end to end with chunks of >= 2,048 tokens routed here
(qwen3-0.6b shape, 2,396-2,409 tok/s against 2,434-2,449, interleaved runs in one device call) and start-up
took ~0.9 s longer (the graph builds). The profile of that workload with the route on and off (H100, 2026-12-05,
`run_h200.sh profile-long-ab`) says why: the big chunks' own attention took 0.301 s in cuDNN against 0.375 s in
the Triton kernel (padding included; the Triton kernel still attends the cached prefixes), the three pads
cost 0.10 s of fill and copy kernels, so the device time was 4.12 s against 4.08 s; and the run took 0.19 s
longer (4.32 vs 4.13 s unprofiled; device busy 86% against 98% under the profiler): the per-chunk host work
(pads, the cuDNN call, the merge; 1,484 cuDNN calls) leaves the GPU waiting in the mixed steps. So it stays
off; `KVFIT_CUDNN_PREFILL=<tokens>` (e.g. 2048) turns it on for chunks of at least that many tokens, read once
per process, for A/B measurements like KVFIT_PDL.
"""

from __future__ import annotations

import functools
import logging
import os
import threading

import torch
import triton
import triton.language as tl

from kvfit.errors import ConfigError

logger = logging.getLogger(__name__)

ENV = "KVFIT_CUDNN_PREFILL"
# 0: the route is off unless KVFIT_CUDNN_PREFILL sets a size (see the module docstring for why). When on, keep
# it at a few thousand tokens: per chunk the route adds ~8 launches of host work (pads, the cuDNN call with
# ~0.1 ms of host time, the merge), more than the attention it speeds up below that.
MIN_TOKENS = 0
SUGGESTED_MIN_TOKENS = 2048
# Buckets: a length rounds up to a multiple of 1/8 of its power of two (never under 128 rows).
BUCKETS_PER_OCTAVE = 8
MAX_HEAD_DIM = 128          # probed on the H200; larger head dims stay in the Triton kernel


@functools.lru_cache(maxsize=None)
def min_tokens_from_env() -> int:
    """The smallest chunk routed through cuDNN (0: none), from KVFIT_CUDNN_PREFILL or MIN_TOKENS."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return MIN_TOKENS
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(f"{ENV}={raw!r} is not a token count; set it to 0 (off, the default) or the smallest "
                          f"prefill chunk to attend through cuDNN (e.g. {SUGGESTED_MIN_TOKENS})")
    return value


def bucket_tokens(num_tokens: int) -> int:
    """The padded length a chunk of num_tokens runs at: rounded up to 1/8 of its power of two (>= 128)."""
    step = max(128, (1 << (max(num_tokens, 1).bit_length() - 1)) // BUCKETS_PER_OCTAVE)
    return -(-num_tokens // step) * step


def buckets_up_to(low: int, high: int) -> list[int]:
    """Every bucket a chunk of low..high tokens can take, ascending."""
    out, n = [], bucket_tokens(low)
    while n <= bucket_tokens(high):
        out.append(n)
        n = bucket_tokens(n + 1)
    return out


@functools.lru_cache(maxsize=None)
def op_available() -> bool:
    """torch has the dense cuDNN attention op and cuDNN is usable."""
    return (hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention")
            and torch.backends.cudnn.is_available() and torch.backends.cudnn.enabled)


def attend_chunk(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of one chunk to itself through cuDNN. query [n, Hq, D], key/value [n, Hkv, D] (any
    token stride) -> (out [n, Hq, D], lse [Hq, n] fp32 natural log), views of padded buffers."""
    n = query.shape[0]
    pad = (0, 0, 0, 0, 0, bucket_tokens(n) - n)
    q, k, v = (torch.nn.functional.pad(t, pad).transpose(0, 1).unsqueeze(0) for t in (query, key, value))
    # q, k, v: [1, H, bucket, D], token-major storage (the layout each bucket's graph was built for)
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=scale)
    return res[0][0].transpose(0, 1)[:n], res[1][0, :, :n, 0]


class ChunkAttention:
    """A prefill chunk's causal attention to itself through cuDNN, for chunks of >= min_tokens queries.

    torch keeps cuDNN graphs per thread, so each thread that runs steps builds every bucket of a shape
    (heads, kv heads, head dim, dtype, device) before the first chunk it attends (ready()); warm_up does
    it for the start-up thread. Shapes never registered are not routed; if a build fails, no shape is.
    Tests substitute a CPU reference by overriding supports() and attend().
    """

    def __init__(self, min_tokens: int | None = None):
        self.min_tokens = min_tokens_from_env() if min_tokens is None else min_tokens
        self._lock = threading.Lock()
        self._max_tokens: dict[tuple, int] = {}                # shape -> longest chunk registered
        self._local = threading.local()                        # .built: the shapes this thread built
        self.failed: str | None = None

    @staticmethod
    def shape(query: torch.Tensor, num_kv_heads: int) -> tuple:
        return (query.shape[1], num_kv_heads, query.shape[2], query.dtype, query.device)

    def supports(self, query: torch.Tensor, cache_dtype: torch.dtype) -> bool:
        """A CUDA fp16/bf16 query over a cache of the same dtype (the chunk's K/V are its own, unquantized),
        at a head dim cuDNN was probed at."""
        head_dim = query.shape[-1]
        return (self.min_tokens > 0 and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
                and cache_dtype == query.dtype and head_dim % 8 == 0 and head_dim <= MAX_HEAD_DIM
                and op_available())

    def attend(self, query, key, value, scale):
        return attend_chunk(query, key, value, scale)

    def warm_up(self, shape: tuple, max_tokens: int) -> None:
        """Register a shape for chunks of up to max_tokens and build its buckets in this thread."""
        with self._lock:
            self._max_tokens[shape] = max(max_tokens, self._max_tokens.get(shape, 0))
        self.ready(shape)

    def ready(self, shape: tuple) -> bool:
        """The shape is registered, built in this thread (now, if it was not) and cuDNN has not failed."""
        if shape not in self._max_tokens or self.failed is not None:
            return False
        built = getattr(self._local, "built", None)
        if built is None:
            built = self._local.built = set()
        if shape not in built:
            self._build(shape)
            built.add(shape)
        return self.failed is None

    def _build(self, shape: tuple) -> None:
        num_heads, num_kv_heads, head_dim, dtype, device = shape
        sizes = buckets_up_to(self.min_tokens, self._max_tokens[shape])
        try:
            for n in sizes:
                qkv = torch.zeros(n, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype, device=device)
                self.attend(qkv[:, :num_heads], qkv[:, num_heads:num_heads + num_kv_heads],
                            qkv[:, num_heads + num_kv_heads:], head_dim ** -0.5)
        except RuntimeError as exc:          # this build or device runs no cuDNN attention for the shape
            self.failed = str(exc).splitlines()[0][:200]
            logger.warning("cuDNN attention failed (%s); long prefill chunks use the Triton kernel", self.failed)
            return
        if sizes:
            logger.info("cuDNN attention: built %d chunk lengths (%d-%d tokens, %d/%d heads x %d) in thread %s",
                        len(sizes), sizes[0], sizes[-1], num_heads, num_kv_heads, head_dim,
                        threading.current_thread().name)


@triton.jit
def _merge_kernel(out_ptr, lse_ptr, chunk_ptr, chunk_lse_ptr, num_tokens,
                  stride_ot, stride_oh, stride_lt, stride_ct, stride_ch, stride_clh, stride_clt,
                  HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    # program (token tile, head): out = (out * e^lse + chunk * e^chunk_lse) / (e^lse + e^chunk_lse)
    toks = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    offs_d = tl.arange(0, D_PAD)
    t_mask = toks < num_tokens
    mask = t_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    lse = tl.load(lse_ptr + toks * stride_lt + head, mask=t_mask, other=0.0)
    chunk_lse = tl.load(chunk_lse_ptr + head * stride_clh + toks * stride_clt, mask=t_mask, other=0.0)
    m = tl.maximum(lse, chunk_lse)
    w = tl.exp(lse - m)
    chunk_w = tl.exp(chunk_lse - m)
    o_off = toks[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    o = tl.load(out_ptr + o_off, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(chunk_ptr + toks[:, None] * stride_ct + head * stride_ch + offs_d[None, :], mask=mask,
                other=0.0).to(tl.float32)
    merged = (o * w[:, None] + c * chunk_w[:, None]) / (w + chunk_w)[:, None]
    tl.store(out_ptr + o_off, merged.to(out_ptr.dtype.element_ty), mask=mask)


def merge_into(out: torch.Tensor, lse: torch.Tensor, chunk_out: torch.Tensor, chunk_lse: torch.Tensor) -> None:
    """out [n, Hq, D] (attention to the prefix, lse [n, Hq]) becomes the attention to prefix + chunk, given the
    chunk's own (chunk_out [n, Hq, D], chunk_lse [Hq, n]); all LSEs natural log and finite."""
    num_tokens, num_heads, head_dim = out.shape
    assert out.stride(2) == 1 and chunk_out.stride(2) == 1 and lse.stride(1) == 1, "head dim must be contiguous"
    assert chunk_out.shape == out.shape and lse.shape == (num_tokens, num_heads), (chunk_out.shape, lse.shape)
    assert chunk_lse.shape == (num_heads, num_tokens), chunk_lse.shape
    if num_tokens == 0:
        return
    block_t = 16 if not out.is_cuda else 32
    _merge_kernel[(triton.cdiv(num_tokens, block_t), num_heads)](
        out, lse, chunk_out, chunk_lse, num_tokens,
        out.stride(0), out.stride(1), lse.stride(0), chunk_out.stride(0), chunk_out.stride(1),
        chunk_lse.stride(0), chunk_lse.stride(1),
        HEAD_DIM=head_dim, D_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_T=block_t, num_warps=4)
