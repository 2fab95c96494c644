"""The Triton backend against the torch reference on a GPU, at realistic sizes.

Head dim 128 (and 64, 96), block sizes 16 and 64, bf16 (and fp16, fp32, an fp8 cache), GQA 32/8,
contexts up to 8k, prefill over cached prefixes, mixed batches, and a decode step captured in a
CUDA graph and replayed with new lengths. Caches are NaN outside the written slots and outputs are
fresh, so a stray read or a skipped row fails. Run: python -m pytest tests/gpu/test_triton_gpu.py -q -s
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
triton = pytest.importorskip("triton")

from kvfit.attention.base import AttentionMetadata  # noqa: E402
from kvfit.attention.torch_ref import TorchReferenceBackend  # noqa: E402
from kvfit.attention.triton_backend import TritonBackend  # noqa: E402
from kvfit.kv.spec import PADDING_SLOT_ID  # noqa: E402

DEVICE = torch.device("cuda")
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def make_step(q_lens, seq_lens, page, num_kv_heads, head_dim, cache_dtype, gen, spare_blocks=50):
    """NaN caches holding every context token at random, non-contiguous blocks; tables; metadata."""
    need = [-(-n // page) for n in seq_lens]
    num_blocks = sum(need) + spare_blocks
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros((len(seq_lens), max(need) + 3), dtype=torch.int32)
    slots = []
    for i, (n, blocks) in enumerate(zip(seq_lens, need)):
        table[i, :blocks] = torch.tensor(ids[:blocks], dtype=torch.int32)
        ids = ids[blocks:]
        slots += [int(table[i, p // page]) * page + p % page for p in range(n)]
    shape = (num_blocks, page, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), device=DEVICE).to(cache_dtype)
    v_cache = k_cache.clone()
    key = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(DEVICE)
    value = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(DEVICE)
    TorchReferenceBackend().write_kv(key, value, k_cache, v_cache, torch.tensor(slots, device=DEVICE))
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.full((starts[-1],), PADDING_SLOT_ID, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), block_tables=table.to(DEVICE),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), query_start_loc_host=starts,
        seq_lens_host=list(seq_lens))
    return k_cache, v_cache, meta


def check(backend, q_lens, seq_lens, num_q_heads=32, num_kv_heads=8, head_dim=128, page=16,
          dtype=torch.bfloat16, cache_dtype=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, meta = make_step(q_lens, seq_lens, page, num_kv_heads, head_dim, cache_dtype or dtype, gen)
    query = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen).to(DEVICE, dtype)
    scale = head_dim ** -0.5
    got = backend.attend(query, k_cache, v_cache, meta, scale)
    expected = TorchReferenceBackend().attend(query, k_cache, v_cache, meta, scale)
    assert got.dtype == dtype and not got.isnan().any()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    print(f"ok: q_lens={q_lens[:6]}.. seq_lens={seq_lens[:6]}.. heads={num_q_heads}/{num_kv_heads} d={head_dim} "
          f"page={page} {dtype} cache={cache_dtype or dtype}")


DECODE_LENS = [1, 17, 1000, 4096, 8192, 333, 2048, 65]


@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("num_splits", [None, 1, 16])
def test_decode_gqa_bf16_long_contexts(page, num_splits):
    check(TritonBackend(num_splits=num_splits), [1] * len(DECODE_LENS), DECODE_LENS, page=page, seed=page)


@pytest.mark.parametrize("dtype,head_dim", [(torch.float16, 64), (torch.float32, 128), (torch.bfloat16, 96)])
def test_decode_dtypes_and_head_dims(dtype, head_dim):
    check(TritonBackend(), [1] * 5, [5, 700, 3000, 64, 129], head_dim=head_dim, dtype=dtype, seed=1)


def test_decode_mqa_and_wide_groups():
    check(TritonBackend(), [1] * 4, [10, 2000, 513, 4000], num_q_heads=32, num_kv_heads=1, seed=2)
    check(TritonBackend(), [1] * 3, [10, 1500, 300], num_q_heads=128, num_kv_heads=1, head_dim=64, seed=3)


def test_decode_large_batch():
    gen = torch.Generator().manual_seed(4)
    lens = torch.randint(1, 2048, (96,), generator=gen).tolist()
    check(TritonBackend(), [1] * 96, lens, page=64, seed=4)


@pytest.mark.parametrize("page", [16, 64])
def test_prefill_over_cached_prefix_and_mixed(page):
    # fresh prompt, chunk over a long prefix, decode rows, a chunk ending at 8k
    q_lens = [512, 1, 300, 1, 1024, 7]
    seq_lens = [512, 5000, 1300, 64, 8192, 7]
    check(TritonBackend(), q_lens, seq_lens, page=page, seed=10 + page)


@pytest.mark.parametrize("dtype,head_dim", [(torch.float16, 64), (torch.float32, 128), (torch.bfloat16, 96)])
def test_prefill_dtypes_and_head_dims(dtype, head_dim):
    check(TritonBackend(), [200, 1, 65], [200, 900, 1065], head_dim=head_dim, dtype=dtype, seed=12)


def test_fp8_cache_write_and_attend():
    gen = torch.Generator().manual_seed(20)
    num_kv_heads, head_dim, page = 8, 128, 16
    key = torch.randn(300, num_kv_heads, head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    value = torch.randn(300, num_kv_heads, head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    slots = torch.randperm(40 * page, generator=gen)[:300].to(DEVICE)
    slots[::7] = PADDING_SLOT_ID
    k_cache = torch.zeros((40, page, num_kv_heads, head_dim), dtype=torch.float8_e4m3fn, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    TritonBackend().write_kv(key, value, k_cache, v_cache, slots)
    TorchReferenceBackend().write_kv(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))
    check(TritonBackend(), [1] * 4, [100, 3000, 17, 900], cache_dtype=torch.float8_e4m3fn, seed=21)
    check(TritonBackend(), [100, 1], [400, 50], cache_dtype=torch.float8_e4m3fn, seed=22)


@pytest.mark.parametrize("dots", ["query", "fp16", "pairs"])
@pytest.mark.parametrize("num_splits", [1, 8])
def test_fp8_cache_decode_launches(dots, num_splits):
    """Each of an fp8 cache's decode dots (bf16, fp16, and int16 pairs converted by sm_90's cvt.rn.f16x2.e4m3x2)
    at the probe's tiles, against the reference, split or not, over NaN-poisoned pages."""
    from kvfit.kernels.attention_decode import paged_decode_attention
    gen = torch.Generator().manual_seed(23)
    seq_lens = [1, 17, 1000, 4096, 333, 2048, 65]
    k_cache, v_cache, meta = make_step([1] * len(seq_lens), seq_lens, 16, 8, 128, torch.float8_e4m3fn, gen)
    query = torch.randn(len(seq_lens), 32, 128, generator=gen).to(DEVICE, torch.bfloat16)
    expected = TorchReferenceBackend().attend(query, k_cache, v_cache, meta, 128 ** -0.5).float()
    for block_n in (64, 128):
        got = paged_decode_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                     128 ** -0.5, num_splits, block_n=block_n, dots=dots).float()
        assert not got.isnan().any()
        torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dots", ["query", "pairs"])
def test_fp8_cache_prefill_dots(dots):
    """Each of an fp8 cache's prefill dots (bf16; int16 pairs converted by sm_90's cvt, fp16 wgmma) against the
    reference: fresh prompts, chunks over cached prefixes and decode rows in one mixed step, both grids (eager and
    a graph's tile map), over NaN-poisoned pages."""
    from kvfit.kernels.attention_prefill import paged_prefill_attention
    gen = torch.Generator().manual_seed(24)
    q_lens, seq_lens = [300, 1, 64, 1, 129], [300, 1000, 2112, 17, 129]
    k_cache, v_cache, meta = make_step(q_lens, seq_lens, 16, 8, 128, torch.float8_e4m3fn, gen)
    query = torch.randn(sum(q_lens), 32, 128, generator=gen).to(DEVICE, torch.bfloat16)
    expected = TorchReferenceBackend().attend(query, k_cache, v_cache, meta, 128 ** -0.5).float()
    for max_len, maps in ((max(q_lens), None), (sum(q_lens), {})):
        got = paged_prefill_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                      meta.query_start_loc, max_len, 128 ** -0.5, tile_maps=maps, dots=dots).float()
        assert not got.isnan().any()
        torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


def test_e4m3_pairs_convert_exactly_on_the_gpu():
    """cvt.rn.f16x2.e4m3x2 (the pairs launch's conversion) gives torch's values for every pair of e4m3 bytes."""
    from e4m3_pairs import check_every_e4m3_pair
    check_every_e4m3_pair(DEVICE, cvt_asm=True)


def test_write_kv_bf16_exact_with_padding():
    gen = torch.Generator().manual_seed(30)
    num_tokens, num_kv_heads, head_dim, page, num_blocks = 2000, 8, 128, 64, 64
    fused = torch.randn(num_tokens, 48, head_dim, generator=gen).to(DEVICE, torch.bfloat16)   # q | k | v
    key, value = fused[:, 32:40], fused[:, 40:48]
    slots = torch.randperm(num_blocks * page, generator=gen)[:num_tokens].to(DEVICE)
    slots[torch.arange(0, num_tokens, 5)] = PADDING_SLOT_ID
    got = [torch.full((num_blocks, page, num_kv_heads, head_dim), float("nan"), dtype=torch.bfloat16,
                      device=DEVICE) for _ in range(2)]
    expected = [t.clone() for t in got]
    TritonBackend().write_kv(key, value, *got, slots)
    TorchReferenceBackend().write_kv(key, value, *expected, slots)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=0, rtol=0, equal_nan=True)


def test_decode_in_a_cuda_graph_replays_with_new_lengths():
    """The runner captures decode with max_seq_len = max_model_len and replays with other lengths."""
    gen = torch.Generator().manual_seed(40)
    batch, max_model_len, page = 8, 8192, 16
    k_cache, v_cache, meta = make_step([1] * batch, [max_model_len] * batch, page, 8, 128, torch.bfloat16, gen)
    query = torch.randn(batch, 32, 128, generator=gen).to(DEVICE, torch.bfloat16)
    backend = TritonBackend()
    backend.attend(query, k_cache, v_cache, meta, 0.088)            # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.attend(query, k_cache, v_cache, meta, 0.088)
    for lens in ([8192] * batch, [1, 5, 100, 4000, 8192, 17, 64, 2222]):
        meta.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        query.copy_(torch.randn(batch, 32, 128, generator=gen).to(DEVICE, torch.bfloat16))
        graph.replay()
        replay_meta = AttentionMetadata(meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                        1, max(lens), meta.query_start_loc_host, lens)
        expected = TorchReferenceBackend().attend(query, k_cache, v_cache, replay_meta, 0.088)
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_step_dependent_ints_compile_no_new_kernel_variant():
    """The block-table width and the split count change from step to step; Triton would specialize an
    int that is 1 or a multiple of 16 into a new kernel, compiled in the middle of serving (it cost the
    first throughput repetition 30%). After one call per kernel, no other width compiles more, nor a
    split count of the same power-of-two bucket (S_PAD, a real constant of the reduce kernel)."""
    from kvfit.kernels.attention_decode import _decode_reduce_kernel, _decode_split_kernel
    from kvfit.kernels.attention_prefill import _prefill_kernel
    kernels = (_prefill_kernel, _decode_split_kernel, _decode_reduce_kernel)

    def compiled() -> list[int]:
        return [len(k.device_caches[DEVICE.index or 0][0]) for k in kernels]

    gen = torch.Generator().manual_seed(41)
    backend = TritonBackend()
    for q_lens in ([5, 1], [1, 1]):                       # a mixed (prefill kernel) step, then decode
        k_cache, v_cache, meta = make_step(q_lens, [20, 3], 16, 8, 128, torch.bfloat16, gen)
        query = torch.randn(sum(q_lens), 32, 128, generator=gen).to(DEVICE, torch.bfloat16)
        counts = []
        for width, num_splits in ((2, 3), (3, 4), (16, 3), (17, 4), (32, 3), (1 + 32, 4)):
            table = torch.zeros((2, width), dtype=torch.int32, device=DEVICE)
            table[:, :2] = meta.block_tables[:, :2]
            step = AttentionMetadata(meta.slot_mapping, meta.query_start_loc, meta.seq_lens, table,
                                     meta.max_query_len, meta.max_seq_len, meta.query_start_loc_host,
                                     meta.seq_lens_host)
            backend.num_splits = num_splits
            got = backend.attend(query, k_cache, v_cache, step, 0.088)
            assert not got.isnan().any()
            counts.append(compiled())
        assert counts == [counts[0]] * len(counts), (q_lens, counts)
