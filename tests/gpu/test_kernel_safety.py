"""Kernel offsets past 2^32 elements: the bug this project exists to prevent, checked on a real GPU.

One layer's K and V caches of up to 80,000 blocks x 64 tokens x 8 KV heads x 128 dims = 5.2e9 elements each
(bf16, 10.5 GB each; fp8, 5.2 GB; fewer blocks where the device has less free memory, never fewer than
reach past 2^32). Tokens are written through the real write kernel into the highest block ids (and a few
just past the 2^31- and 2^32-element marks), then read through decode, split-K decode, prefill + mixed and
cascade (a shared prefix attended once for all sequences) attention with block tables pointing there, and
the fused one-token cache writes (qk_norm_rope_write_kv_, gemv_rope_write_kv) write more slots up there.
Checks: exactly the written elements changed (the rest of the NaN-filled cache is untouched), they hold the
exact values, and attention matches the reference computed on the small gathered slice. An int32 offset
would wrap and write elsewhere or fault. Then an engine: prompts sharing a long prefix (prefix caching on,
the cascade decode active) served from blocks past 2^32 elements per cache tensor, greedy fp32 outputs equal
to each prompt alone.

Run: python -m pytest tests/gpu/test_kernel_safety.py -q -s
 or: compute-sanitizer --tool memcheck python tests/gpu/test_kernel_safety.py [--kv-cache-dtype fp8]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NUM_BLOCKS = 80_000
PAGE, NUM_KV_HEADS, HEAD_DIM, NUM_Q_HEADS = 64, 8, 128, 32
ELEMENTS_PER_BLOCK = PAGE * NUM_KV_HEADS * HEAD_DIM          # 65,536: block 32,768 starts at 2^31
# the fewest blocks whose layout (below) has its blocks past 2^31 and 2^32 elements, fused-write slots included
MIN_BLOCKS = 2**32 // ELEMENTS_PER_BLOCK + 32
RESERVE_BYTES = 4 * 2**30      # left free beside the caches: the reference's slice, partials, the counting chunks
CACHE_DTYPES = {"bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def blocks_that_fit(cache_dtype: torch.dtype, free_bytes: int) -> int:
    """Blocks of a K and a V cache that fit in free_bytes less RESERVE_BYTES, at most NUM_BLOCKS."""
    per_block = 2 * ELEMENTS_PER_BLOCK * torch.empty((), dtype=cache_dtype).element_size()
    return max(0, min(NUM_BLOCKS, (free_bytes - RESERVE_BYTES) // per_block))


def _metadata(q_lens, seq_lens, table, device):
    from kvfit.attention.base import AttentionMetadata
    from kvfit.kv.spec import PADDING_SLOT_ID
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    return AttentionMetadata(
        slot_mapping=torch.full((starts[-1],), PADDING_SLOT_ID, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), block_tables=table,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), query_start_loc_host=starts,
        seq_lens_host=list(seq_lens))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _nan_caches(num_blocks: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches [num_blocks, PAGE, Hkv, D] of NaN; fp8 filled as bytes (0x7F is e4m3fn's NaN)."""
    shape = (num_blocks, PAGE, NUM_KV_HEADS, HEAD_DIM)
    if dtype == torch.float8_e4m3fn:
        return tuple(torch.full(shape, 0x7F, dtype=torch.uint8, device=device).view(dtype) for _ in range(2))
    return tuple(torch.full(shape, float("nan"), dtype=dtype, device=device) for _ in range(2))


def _rows(cache: torch.Tensor, index) -> torch.Tensor:
    """cache[index], gathered as bytes (no fp8 indexing kernel needed) and viewed in the cache's dtype."""
    return cache.view(torch.uint8)[index].view(cache.dtype)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _count_written(cache: torch.Tensor) -> int:
    # chunked so the temporary stays small next to a 10 GB cache
    return sum(int((~chunk.float().isnan()).sum()) for chunk in cache.split(1024))


def _layout(num_blocks: int) -> tuple[list[int], list[list[int]]]:
    """Four sequences on the highest blocks, out of order, plus blocks just past 2^31 and 2^32 elements."""
    seq_lens = [6 * PAGE - 10, PAGE, 1, 3 * PAGE + 7]
    marks = [b for b in (2**31 // ELEMENTS_PER_BLOCK + 1, 2**32 // ELEMENTS_PER_BLOCK + 2) if b < num_blocks - 16]
    highest = list(range(num_blocks - 1, num_blocks - 13, -1))
    marks += highest[9:11]              # stand-ins when the cache is too small to have both marks
    block_lists = [[highest[0], marks[1], highest[2], highest[1], marks[0], highest[3]],
                   [highest[4]], [highest[11]], [highest[6], highest[5], highest[8], highest[7]]]
    return seq_lens, block_lists


def _fused_slots(num_blocks: int) -> list[int]:
    """Four slots in blocks no sequence uses, for the fused one-token writes: just past 2^31 and 2^32 elements,
    and near the top."""
    taken = {b for blocks in _layout(num_blocks)[1] for b in blocks}
    marks = [b for b in (2**31 // ELEMENTS_PER_BLOCK + 4, 2**32 // ELEMENTS_PER_BLOCK + 4) if b < num_blocks - 16]
    spare = [b for b in range(num_blocks - 13, num_blocks - 40, -1) if b not in taken and b not in marks]
    blocks = (marks + spare)[:4]
    return [b * PAGE + (PAGE - 1 - 5 * i) for i, b in enumerate(blocks)]


def _table(block_lists: list[list[int]], device: torch.device) -> torch.Tensor:
    table = torch.zeros((len(block_lists), max(len(b) for b in block_lists)), dtype=torch.int32)
    for i, blocks in enumerate(block_lists):
        table[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    return table.to(device)


def _attention_matches(k_cache, v_cache, seq_lens, block_lists, gen) -> list[str]:
    """Decode, split-K decode, prefill + mixed (both grids) and cascade over the written sequences, each against the reference
    on the gathered slice (its own small bf16 cache, exact for fp8 too; block ids renumbered 0..n-1)."""
    from kvfit.attention.torch_ref import TorchReferenceBackend
    from kvfit.attention.triton_backend import TritonBackend
    device = k_cache.device
    used = sorted({b for blocks in block_lists for b in blocks})
    small_k, small_v = (_rows(c, torch.tensor(used, device=device)).to(torch.bfloat16) for c in (k_cache, v_cache))
    renumber = {b: i for i, b in enumerate(used)}
    # cascade: every sequence starts with seq 0's first two blocks (past 2^32 and at the top), then its own
    shared = block_lists[0][:2]
    cascade = ([shared + blocks for blocks in block_lists], [2 * PAGE + n for n in seq_lens], 2 * PAGE)
    plain = (block_lists, seq_lens, None)
    steps = (("decode", [1, 1, 1, 1], 1, plain), ("decode split-K", [1, 1, 1, 1], 4, plain),
             ("prefill+mixed", [seq_lens[0] // 3, seq_lens[1], 1, seq_lens[3] - PAGE], None, plain),
             ("prefill+mixed, tile-mapped grid", [seq_lens[0] // 3, seq_lens[1], 1, seq_lens[3] - PAGE], None, plain),
             ("cascade", [1, 1, 1, 1], 2, cascade))
    tested = []
    for name, q_lens, splits, (lists, lens, prefix) in steps:
        table = _table(lists, device)
        small_table = _table([[renumber[b] for b in blocks] for blocks in lists], device)
        prefix_len = None if prefix is None else torch.tensor([prefix], dtype=torch.int32, device=device)
        query = torch.randn(sum(q_lens), NUM_Q_HEADS, HEAD_DIM, generator=gen).to(device, torch.bfloat16)
        meta = dataclasses.replace(_metadata(q_lens, lens, table, device), prefix_len=prefix_len)
        if "tile-mapped" in name:       # a CUDA graph's grid (runner/cuda_graphs.py MixedGraphs)
            meta = dataclasses.replace(meta, tile_maps={}, max_query_len=sum(q_lens))
        got = TritonBackend(num_splits=splits).attend(query, k_cache, v_cache, meta, HEAD_DIM ** -0.5)
        expected = TorchReferenceBackend().attend(query, small_k, small_v, _metadata(q_lens, lens, small_table, device),
                                                  HEAD_DIM ** -0.5)
        _sync(device)
        torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2,
                                   msg=lambda m, name=name: f"{name}: {m}")
        tested.append(name)
    return tested


def _fused_writes(k_cache: torch.Tensor, v_cache: torch.Tensor, gen: torch.Generator) -> int:
    """The fused one-token cache writes at _fused_slots: qk_norm_rope_write_kv_ (two tokens) and
    gemv_rope_write_kv (one token, twice). Each slot's row must hold its token's k and v as torch casts and
    indexes them (the plain write). Returns the elements written to each cache."""
    from kvfit.kernels import fused_ops, gemv
    device = k_cache.device
    slots = torch.tensor(_fused_slots(k_cache.shape[0]), dtype=torch.int64, device=device)
    rows, hidden = (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, 512
    freqs = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, device=device).float() / HEAD_DIM))

    def heads(row: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # row: [T, rows] -> q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], views of it
        parts = row.split([NUM_Q_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], dim=1)
        return tuple(p.view(row.shape[0], -1, HEAD_DIM) for p in parts)

    qkv = torch.randn(2, rows, generator=gen).to(device, torch.bfloat16)
    norms = [torch.randn(HEAD_DIM, generator=gen).to(device, torch.bfloat16) for _ in range(2)]
    positions = torch.tensor([3, 70_000], device=device)
    _, k, v = views = heads(qkv)                   # after the call: the k and v it wrote
    assert fused_ops.qk_norm_rope_write_kv_(*views, positions, freqs, *norms, 1e-6, k_cache, v_cache, slots[:2])
    written = [(k, v)]
    x = torch.randn(1, hidden, generator=gen).to(device, torch.bfloat16)
    weight = (torch.randn(rows, hidden, generator=gen) / hidden ** 0.5).to(device, torch.bfloat16)
    for i, pos in ((2, 5), (3, 4095)):
        out = gemv.gemv_rope_write_kv(x, weight, None, torch.tensor([pos], device=device), freqs, k_cache, v_cache,
                                      slots[i:i + 1], NUM_Q_HEADS, NUM_KV_HEADS)
        written.append(heads(out)[1:])             # the projection after RoPE: its k and v
    _sync(device)
    where = (slots // PAGE, slots % PAGE)
    k_written, v_written = torch.cat([w[0] for w in written]), torch.cat([w[1] for w in written])   # [4, Hkv, D]
    for cache, expected in ((k_cache, k_written), (v_cache, v_written)):
        assert _same_bytes(_rows(cache, where), expected.to(cache.dtype)), "a fused write went elsewhere"
    return len(slots) * NUM_KV_HEADS * HEAD_DIM


def run_check(num_blocks: int = NUM_BLOCKS, device: str = "cuda", cache_dtype: torch.dtype = torch.bfloat16) -> str:
    """Write at the top of the cache (> 2^32 elements by default), attend there, compare; says what it tested."""
    from kvfit.attention.triton_backend import TritonBackend
    from kvfit.kernels.attention_common import largest_element_offset
    device = torch.device(device)
    need = 2 * num_blocks * ELEMENTS_PER_BLOCK * torch.empty((), dtype=cache_dtype).element_size()
    free = torch.cuda.mem_get_info()[0] if device.type == "cuda" else need + RESERVE_BYTES
    if free < need + RESERVE_BYTES:
        raise MemoryError(f"needs {need / 2**30:.1f} GiB free for the caches, have {free / 2**30:.1f} GiB")
    k_cache, v_cache = _nan_caches(num_blocks, cache_dtype, device)
    top = largest_element_offset(k_cache)

    seq_lens, block_lists = _layout(num_blocks)
    slots = torch.tensor([block_lists[i][p // PAGE] * PAGE + p % PAGE for i, n in enumerate(seq_lens)
                          for p in range(n)], device=device)
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM, generator=gen).to(device, torch.bfloat16)
    value = torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM, generator=gen).to(device, torch.bfloat16)

    TritonBackend().write_kv(key, value, k_cache, v_cache, slots)
    _sync(device)
    written = len(slots) * NUM_KV_HEADS * HEAD_DIM
    assert _count_written(k_cache) == written and _count_written(v_cache) == written, "a write landed elsewhere"
    where = (slots // PAGE, slots % PAGE)
    assert _same_bytes(_rows(k_cache, where), key.to(cache_dtype))
    assert _same_bytes(_rows(v_cache, where), value.to(cache_dtype))
    tested = _attention_matches(k_cache, v_cache, seq_lens, block_lists, gen)
    written += _fused_writes(k_cache, v_cache, gen)
    assert _count_written(k_cache) == written and _count_written(v_cache) == written, "a fused write landed elsewhere"
    used = sorted({b for blocks in block_lists for b in blocks} | {s // PAGE for s in _fused_slots(num_blocks)})
    return (f"ok ({str(cache_dtype).removeprefix('torch.')} cache): {num_blocks} blocks x {ELEMENTS_PER_BLOCK} "
            f"elements = {num_blocks * ELEMENTS_PER_BLOCK:,} per cache (largest offset {top:,}; 2^32 = {2**32:,}); "
            f"wrote {len(slots)} tokens and 4 through the fused one-token writes to blocks {used} (element offsets "
            f"up to {(max(used) + 1) * ELEMENTS_PER_BLOCK - 1:,}) exactly, nothing else changed; "
            f"{', '.join(tested)} match the reference")


@pytest.mark.parametrize("cache_dtype", list(CACHE_DTYPES))
def test_offsets_past_2_to_the_32(cache_dtype):
    dtype = CACHE_DTYPES[cache_dtype]
    gc.collect()
    torch.cuda.empty_cache()            # an earlier test's caches, still cached by the allocator, are free
    num_blocks = blocks_that_fit(dtype, torch.cuda.mem_get_info()[0])
    if num_blocks < MIN_BLOCKS:
        pytest.skip(f"a {cache_dtype} cache past 2^32 elements needs {MIN_BLOCKS} blocks of {ELEMENTS_PER_BLOCK} "
                    f"elements (K and V) and {RESERVE_BYTES / 2**30:.0f} GiB beside them; this GPU's free memory "
                    f"holds {num_blocks}")
    assert num_blocks * ELEMENTS_PER_BLOCK > 2**32
    try:
        print("\n" + run_check(num_blocks, cache_dtype=dtype))
    except MemoryError as exc:
        pytest.skip(str(exc))


# ---- an engine past 2^32: prefix caching and the cascade decode ------------------------------------------

# a tiny fp32 llama (no q/k norm, so a one-token decode takes the fused GEMV cache write) with one layer of 4 KV
# heads x 64 dims: 4,096 elements a 16-token block, so a cache tensor passes 2^32 elements at 2^20 blocks
# (2 x 16 GiB in fp32)
ENGINE_MODEL = dict(arch="llama", num_layers=1, hidden_size=512, num_heads=8, num_kv_heads=4,
                    intermediate_size=256, max_position_embeddings=4096, seed=32)
ENGINE_BLOCK_SIZE, ENGINE_ELEMENTS_PER_BLOCK, ENGINE_BYTES_PER_BLOCK = 16, 16 * 4 * 64, 2 * 16 * 4 * 64 * 4
ENGINE_TOP_BLOCKS = 8192           # the blocks left to the requests, all past 2^32 elements (the rest are held)
ENGINE_NUM_BLOCKS = 2**32 // ENGINE_ELEMENTS_PER_BLOCK + ENGINE_TOP_BLOCKS
# 32 prompts share 2,048 tokens: sequences x shared tokens pass the cascade rule's 32,000 (CASCADE_MIN_SHARED_READS)
# while at least 16 of them decode
SHARED_TOKENS, NUM_PROMPTS, MAX_TOKENS = 2048, 32, 8


def _engine_prompts() -> list[list[int]]:
    """The warm-up prompt (it puts the shared prefix in the prefix cache, alone), then NUM_PROMPTS sharing it."""
    gen = torch.Generator().manual_seed(5)
    shared = (torch.randint(3, 300, (SHARED_TOKENS,), generator=gen)).tolist()
    return [shared + [7]] + [shared + torch.randint(3, 300, (1 + i % 40,), generator=gen).tolist()
                             for i in range(NUM_PROMPTS)]


def _greedy(llm, prompts, alone: bool) -> list[list[int]]:
    from kvfit import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    if alone:
        return [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _release(llm) -> None:
    llm.shutdown()
    gc.collect()          # wrappers around the runner's methods are reference cycles that hold its KV cache
    torch.cuda.empty_cache()


def test_prefix_caching_engine_past_2_to_the_32(tmp_path):
    """Held-out style: prompts sharing a long prefix (prefix caching on, the cascade decode active) served from
    blocks past 2^32 elements per cache tensor (the blocks below are held for the whole run, so every request's
    blocks lie past the mark), greedy fp32 outputs equal to each prompt alone on a small cache. The warm-up
    prompt, alone, decodes through the one-token fused GEMV cache write up there."""
    from tiny_models import make_tiny_model

    from kvfit import LLM
    gc.collect()
    torch.cuda.empty_cache()
    kv_bytes = ENGINE_NUM_BLOCKS * ENGINE_BYTES_PER_BLOCK
    free = torch.cuda.mem_get_info()[0]
    if free < kv_bytes + RESERVE_BYTES:
        pytest.skip(f"a KV cache past 2^32 elements per tensor for the tiny fp32 model needs "
                    f"{kv_bytes / 2**30:.1f} GiB and {RESERVE_BYTES / 2**30:.0f} GiB beside it; this GPU has "
                    f"{free / 2**30:.1f} GiB free")
    folder = make_tiny_model(tmp_path, **ENGINE_MODEL)
    prompts = _engine_prompts()
    common = dict(device="cuda", dtype="float32", max_model_len=4096, max_num_seqs=64)
    small = LLM(folder, kv_cache_memory="2GiB", enable_prefix_caching=False, **common)
    expected = _greedy(small, prompts, alone=True)
    _release(small)
    del small

    llm = LLM(folder, kv_cache_memory=kv_bytes, enable_prefix_caching=True, **common)
    try:
        _serve_past_2_to_the_32(llm, prompts, expected)
    finally:
        _release(llm)


def _serve_past_2_to_the_32(llm, prompts: list[list[int]], expected: list[list[int]]) -> None:
    engine, runner = llm.engine, llm.engine.workers.runner
    assert engine.plan.num_blocks == ENGINE_NUM_BLOCKS, engine.plan.num_blocks
    k_cache = runner.kv_caches[0][0]
    assert k_cache.numel() > 2**32 and k_cache.shape[0] == ENGINE_NUM_BLOCKS
    attn = runner.model.model.layers[0].self_attn     # what the backend's one-token fused write asks of the model
    assert attn.q_norm is None and attn.qkv_proj.dense_weight is not None and attn.head_dim == 64
    held = engine.pool.allocate(ENGINE_NUM_BLOCKS - ENGINE_TOP_BLOCKS)     # fresh ids, lowest first
    assert held == list(range(ENGINE_NUM_BLOCKS - ENGINE_TOP_BLOCKS))
    assert len(held) * ENGINE_ELEMENTS_PER_BLOCK >= 2**32        # what the requests get starts past 2^32
    seen = _watch_cascade(runner)
    got = _greedy(llm, prompts[:1], alone=True) + _greedy(llm, prompts[1:], alone=False)
    assert any(seen), "no decode step took the cascade path"
    differ = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    assert not differ, f"prompts {differ} (0: the warm-up, alone) differ past 2^32 elements from the same alone"
    engine.pool.free(held)
    assert engine.stats()["kv_blocks_used"] == 0
    print(f"\nok: {NUM_PROMPTS} prompts sharing {SHARED_TOKENS} tokens, cascade in {sum(seen)} of {len(seen)} "
          f"decode launches, blocks {len(held):,}..{ENGINE_NUM_BLOCKS - 1:,} of a cache of {k_cache.numel():,} "
          "elements per tensor: fp32 outputs equal to each prompt alone")


def _watch_cascade(runner) -> list[bool]:
    """Per decode launch, whether it attended a shared prefix through the cascade (graph replays, or eager
    attention calls without CUDA graphs)."""
    seen: list[bool] = []
    if runner.graphs is None:
        attend = runner.backend.attend
        runner.backend.attend = lambda q, k, v, meta, scale, *rest, **kw: (
            seen.append(meta.prefix_len is not None) if meta.decode_only else None,
            attend(q, k, v, meta, scale, *rest, **kw))[1]
        return seen
    graphs = runner.graphs
    replay = graphs.replay

    def replay_seen(*args, **kwargs):
        prefix_len = kwargs.get("prefix_len", args[5] if len(args) > 5 else None)
        seen.append(prefix_len is not None and graphs.bucket_for(args[0].shape[0]) in graphs.cascade_graphs)
        return replay(*args, **kwargs)
    graphs.replay = replay_seen
    return seen


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=NUM_BLOCKS)
    parser.add_argument("--kv-cache-dtype", choices=list(CACHE_DTYPES), default="bfloat16")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        sys.exit(0)
    if args.blocks * ELEMENTS_PER_BLOCK <= 2**32:
        print(f"warning: {args.blocks} blocks stay below 2^32 elements per cache")
    print(run_check(args.blocks, cache_dtype=CACHE_DTYPES[args.kv_cache_dtype]))
