"""Long prefill chunks attending themselves outside the Triton kernel (attention/cudnn_prefill.py), on the CPU.

cuDNN needs a GPU (tests/gpu/test_triton_gpu.py runs it); here a float64 reference stands in for it (the same
contract: a chunk's causal attention to itself -> out and natural-log LSE), so the Triton kernel's prefix-only
mode, the LSE merge and the backend's routing run in Triton's interpreter against the torch reference
backend. The caches are NaN-poisoned outside every context, as in test_triton_backend.py.
"""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, strategies as st

from test_triton_backend import (DEVICE, TOLERANCE, TritonBackend, filled_caches,  # noqa: E402
                                 make_meta)
from kvfit.attention import cudnn_prefill  # noqa: E402
from kvfit.attention.cudnn_prefill import ChunkAttention, bucket_tokens, buckets_up_to  # noqa: E402
from kvfit.attention.torch_ref import TorchReferenceBackend, step_kv  # noqa: E402
from kvfit.attention.triton_prefill import paged_prefill_attention  # noqa: E402
from kvfit.errors import ConfigError  # noqa: E402


def reference_chunk(query, key, value, scale):
    """A chunk's causal attention to itself in float64: query [n, Hq, D], key/value [n, Hkv, D] ->
    (out [n, Hq, D] in query's dtype, lse [Hq, n] fp32)."""
    group = query.shape[1] // key.shape[1]
    q, k, v = (t.double().transpose(0, 1) for t in (query, key, value))
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scores = q @ k.transpose(1, 2) * scale                                      # [Hq, n, n]
    n = query.shape[0]
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=query.device).tril(), float("-inf"))
    out = torch.softmax(scores, -1) @ v
    return out.transpose(0, 1).to(query.dtype), torch.logsumexp(scores, -1).float()


class ReferenceChunks(ChunkAttention):
    """ChunkAttention with the float64 reference for cuDNN, on any device; counts what it attends."""

    def __init__(self, min_tokens: int):
        super().__init__(min_tokens)
        self.calls: list[int] = []

    def supports(self, query, cache_dtype):
        return self.min_tokens > 0 and cache_dtype == query.dtype

    def attend(self, query, key, value, scale):
        self.calls.append(query.shape[0])
        return reference_chunk(query, key, value, scale)


# ---- buckets --------------------------------------------------------------------------------------------

@given(st.integers(1, 1 << 20))
def test_a_bucket_holds_the_chunk_and_wastes_at_most_an_eighth(n):
    b = bucket_tokens(n)
    assert n <= b and bucket_tokens(b) == b
    assert b - n < max(128, n / 8)


def test_buckets_up_to_lists_every_length_a_chunk_can_take():
    sizes = buckets_up_to(2048, 8192)
    assert sizes[0] == 2048 and sizes[-1] == 8192 and sizes == sorted(set(sizes))
    assert {bucket_tokens(n) for n in range(2048, 8193)} == set(sizes)
    assert len(sizes) == 17
    assert buckets_up_to(2048, 1000) == []


def test_the_env_sets_the_smallest_routed_chunk(monkeypatch):
    cudnn_prefill.min_tokens_from_env.cache_clear()
    try:
        monkeypatch.delenv(cudnn_prefill.ENV, raising=False)
        assert cudnn_prefill.min_tokens_from_env() == cudnn_prefill.MIN_TOKENS
        cudnn_prefill.min_tokens_from_env.cache_clear()
        monkeypatch.setenv(cudnn_prefill.ENV, "0")
        assert cudnn_prefill.min_tokens_from_env() == 0 and not ChunkAttention().supports(
            torch.empty(0, 4, 64, dtype=torch.bfloat16), torch.bfloat16)
        cudnn_prefill.min_tokens_from_env.cache_clear()
        monkeypatch.setenv(cudnn_prefill.ENV, "lots")
        with pytest.raises(ConfigError, match="KVFIT_CUDNN_PREFILL='lots' is not a token count"):
            cudnn_prefill.min_tokens_from_env()
    finally:
        cudnn_prefill.min_tokens_from_env.cache_clear()


def test_cudnn_is_not_used_off_the_gpu_or_for_other_dtypes():
    chunks = ChunkAttention(2048)
    assert not chunks.supports(torch.empty(0, 4, 64, dtype=torch.bfloat16), torch.bfloat16)      # CPU
    if torch.cuda.is_available():
        q = torch.empty(0, 4, 64, dtype=torch.bfloat16, device="cuda")
        assert not chunks.supports(q, torch.float8_e4m3fn)                   # a quantized cache: its own K/V
        assert not chunks.supports(q.float(), torch.float32)
        assert not chunks.supports(torch.empty(0, 4, 256, dtype=torch.bfloat16, device="cuda"), torch.bfloat16)


# ---- the kernel's prefix-only mode and the merge ---------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefix_only_rows_attend_the_cached_prefix_and_store_its_lse(dtype):
    # sequences: long chunk over a prefix, short chunk (whole), decode (whole), long chunk without prefix
    q_lens, seq_lens, threshold = [20, 5, 1, 18], [33, 12, 9, 18], 16
    num_q_heads, num_kv_heads, head_dim, page = 4, 2, 32, 4
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache, table = filled_caches(seq_lens, page, num_kv_heads, head_dim, dtype, gen)
    meta = make_meta(q_lens, seq_lens, table)
    query = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen).to(DEVICE, dtype)
    scale = head_dim ** -0.5
    lse = torch.full((sum(q_lens), num_q_heads), float("nan"), device=DEVICE)
    out = torch.full_like(query, float("nan"))
    paged_prefill_attention(query, k_cache, v_cache, table, meta.seq_lens, meta.query_start_loc,
                            max_query_len=max(q_lens), scale=scale, out=out, prefix_only_tokens=threshold, lse=lse)
    full = TorchReferenceBackend().attend(query, k_cache, v_cache, meta, scale)
    # sequence 0's 13 cached tokens alone, attended by its 20 queries (all of them see every one)
    keys = torch.stack([k_cache[table[0, p // page].long(), p % page] for p in range(13)])      # [13, Hkv, D]
    values = torch.stack([v_cache[table[0, p // page].long(), p % page] for p in range(13)])
    ref_q = query[:20].double().transpose(0, 1)                                                 # [Hq, 20, D]
    k, v = (t.double().transpose(0, 1).repeat_interleave(2, 0) for t in (keys, values))       # [Hq, 13, D]
    scores = ref_q @ k.transpose(1, 2) * scale
    expected_out = (torch.softmax(scores, -1) @ v).transpose(0, 1)
    expected_lse = torch.logsumexp(scores, -1).transpose(0, 1)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out[:20].double(), expected_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse[:20].double(), expected_lse, atol=tol, rtol=tol)
    torch.testing.assert_close(out[20:26].float(), full[20:26].float(), atol=tol, rtol=tol)   # whole: unchanged
    assert lse[20:26].isnan().all()                                                           # no lse for them
    assert out[26:].isnan().all() and lse[26:].isnan().all()       # no prefix: nothing written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merging_prefix_and_chunk_by_lse_is_attention_to_both(dtype):
    gen = torch.Generator().manual_seed(5)
    n, prefix, heads, head_dim = 37, 50, 3, 48
    q = torch.randn(n, heads, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(prefix + n, heads, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(prefix + n, heads, head_dim, generator=gen, dtype=torch.float64)
    qs, ks, vs = (t.transpose(0, 1) for t in (q, k, v))
    scores = qs @ ks.transpose(1, 2)                                              # [H, n, prefix + n]
    causal = torch.ones(n, prefix + n, dtype=torch.bool).tril(prefix)
    scores = scores.masked_fill(~causal, float("-inf"))

    def part(cols):
        s = scores[:, :, cols]
        return (torch.softmax(s, -1) @ vs[:, cols]).transpose(0, 1), torch.logsumexp(s, -1)   # [n,H,D], [H,n]
    expected = (torch.softmax(scores, -1) @ vs).transpose(0, 1)
    out, lse = part(slice(0, prefix))
    chunk_out, chunk_lse = part(slice(prefix, prefix + n))
    out = out.to(DEVICE, dtype).contiguous()
    merged_into = torch.zeros(n + 4, heads, head_dim, dtype=dtype, device=DEVICE)
    merged_into[2:2 + n] = out
    lse_rows = torch.zeros(n + 4, heads, device=DEVICE)
    lse_rows[2:2 + n] = lse.T.float().to(DEVICE)
    cudnn_prefill.merge_into(merged_into[2:2 + n], lse_rows[2:2 + n], chunk_out.to(DEVICE, dtype),
                             chunk_lse.float().to(DEVICE))
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(merged_into[2:2 + n].double(), expected.to(DEVICE), atol=tol, rtol=tol)
    assert not merged_into[:2].any() and not merged_into[2 + n:].any()            # rows outside: untouched


# ---- the backend routes long chunks ------------------------------------------------------------------------

STEPS = [
    # (q_lens, seq_lens): a mixed step, every kind of sequence
    ([20, 5, 1, 18, 1], [33, 12, 9, 18, 40]),
    ([17], [17]),                     # one fresh long chunk: the Triton kernel has nothing to do
    ([16, 30], [16, 31]),             # all long, one with a one-token prefix
    ([3, 15, 2], [3, 30, 40]),        # nothing long enough
]


@pytest.mark.parametrize("q_lens,seq_lens", STEPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_backend_attends_long_chunks_through_chunk_attention(q_lens, seq_lens, dtype):
    num_q_heads, num_kv_heads, head_dim, page = 4, 2, 32, 4
    gen = torch.Generator().manual_seed(11)
    k_cache, v_cache, table = filled_caches(seq_lens, page, num_kv_heads, head_dim, dtype, gen)
    meta = make_meta(q_lens, seq_lens, table)
    query = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen).to(DEVICE, dtype)
    key, value = step_kv(k_cache, v_cache, meta)                 # this step's own K/V, as write_kv stored them
    chunks = ReferenceChunks(min_tokens=16)
    backend = TritonBackend(chunk_attention=chunks)
    backend.warm_up([(num_q_heads, num_kv_heads, head_dim)], 64, dtype, DEVICE)
    built = list(chunks.calls)
    assert built == buckets_up_to(16, 64)                         # every bucket, once, at warm-up
    scale = head_dim ** -0.5
    got = backend.attend(query, k_cache, v_cache, meta, scale, key=key, value=value)
    expected = TorchReferenceBackend().attend(query, k_cache, v_cache, meta, scale)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    assert chunks.calls[len(built):] == [n for n in q_lens if n >= 16]
    # without the step's K/V (a caller that passes none) nothing is routed, and the answer is the same
    again = backend.attend(query, k_cache, v_cache, meta, scale)
    assert chunks.calls[len(built):] == [n for n in q_lens if n >= 16]
    torch.testing.assert_close(again.float(), expected.float(), atol=tol, rtol=tol)


def test_chunks_are_routed_only_for_registered_shapes_and_each_thread_builds_its_own():
    chunks = ReferenceChunks(min_tokens=16)
    shape = (4, 2, 32, torch.float32, DEVICE)
    assert not chunks.ready(shape) and chunks.calls == []          # never registered: not routed
    chunks.warm_up(shape, 300)
    first = list(chunks.calls)
    assert first == buckets_up_to(16, 300) and chunks.ready(shape) and chunks.calls == first
    seen = []
    worker = threading.Thread(target=lambda: seen.append(chunks.ready(shape)))
    worker.start()
    worker.join()
    assert seen == [True] and chunks.calls == first + first        # the other thread built them again


def test_a_failed_cudnn_build_turns_the_route_off(caplog):
    class Failing(ReferenceChunks):
        def attend(self, query, key, value, scale):
            raise RuntimeError("cuDNN Frontend error: no engine for this graph\nmore detail")
    chunks = Failing(min_tokens=16)
    shape = (4, 2, 32, torch.float32, DEVICE)
    with caplog.at_level("WARNING"):
        chunks.warm_up(shape, 64)
    assert not chunks.ready(shape) and chunks.failed == "cuDNN Frontend error: no engine for this graph"
    assert "long prefill chunks use the Triton kernel" in caplog.text
