"""Kernel offsets past 2^32 elements: the bug this project exists to prevent, checked on a real GPU.

One layer's K and V caches of 80,000 blocks x 64 tokens x 8 KV heads x 128 dims = 5.2e9 elements each
(bf16, 10.5 GB each). Tokens are written through the real write kernel into the highest block ids (and
a few just past the 2^31- and 2^32-element marks), then read through decode and prefill attention with
block tables pointing there. Checks: exactly the written elements changed (the rest of the NaN-filled
cache is untouched), they hold the exact values, and attention matches the reference computed on the
small gathered slice. An int32 offset would wrap and write elsewhere or fault.

Run: python -m pytest tests/gpu/test_kernel_safety.py -q -s
 or: compute-sanitizer --tool memcheck python tests/gpu/test_kernel_safety.py
"""

from __future__ import annotations

import argparse
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NUM_BLOCKS = 80_000
PAGE, NUM_KV_HEADS, HEAD_DIM, NUM_Q_HEADS = 64, 8, 128, 32
ELEMENTS_PER_BLOCK = PAGE * NUM_KV_HEADS * HEAD_DIM          # 65,536: block 32,768 starts at 2^31


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


def _count_written(cache: torch.Tensor) -> int:
    # chunked so the temporary stays small next to a 10 GB cache
    return sum(int((~chunk.isnan()).sum()) for chunk in cache.split(4096))


def _layout(num_blocks: int) -> tuple[list[int], list[list[int]]]:
    """Four sequences on the highest blocks, out of order, plus blocks just past 2^31 and 2^32 elements."""
    seq_lens = [6 * PAGE - 10, PAGE, 1, 3 * PAGE + 7]
    marks = [b for b in (2**31 // ELEMENTS_PER_BLOCK + 1, 2**32 // ELEMENTS_PER_BLOCK + 2) if b < num_blocks - 16]
    highest = list(range(num_blocks - 1, num_blocks - 13, -1))
    marks += highest[9:11]              # stand-ins when the cache is too small to have both marks
    block_lists = [[highest[0], marks[1], highest[2], highest[1], marks[0], highest[3]],
                   [highest[4]], [highest[11]], [highest[6], highest[5], highest[8], highest[7]]]
    return seq_lens, block_lists


def run_check(num_blocks: int = NUM_BLOCKS, device: str = "cuda") -> str:
    """Write at the top of the cache (> 2^32 elements by default), attend there, compare; says what it tested."""
    from kvfit.attention.torch_ref import TorchReferenceBackend
    from kvfit.attention.triton_backend import TritonBackend
    from kvfit.attention.triton_kernels import largest_element_offset
    device = torch.device(device)
    shape = (num_blocks, PAGE, NUM_KV_HEADS, HEAD_DIM)
    need = 2 * num_blocks * ELEMENTS_PER_BLOCK * 2
    free = torch.cuda.mem_get_info()[0] if device.type == "cuda" else need + 4 * 2**30
    if free < need + 4 * 2**30:
        raise MemoryError(f"needs {need / 2**30:.1f} GiB free for the caches, have {free / 2**30:.1f} GiB")
    k_cache = torch.full(shape, float("nan"), dtype=torch.bfloat16, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=torch.bfloat16, device=device)
    top = largest_element_offset(k_cache)

    seq_lens, block_lists = _layout(num_blocks)
    table = torch.zeros((4, 6), dtype=torch.int32)
    for i, blocks in enumerate(block_lists):
        table[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    table = table.to(device)
    slots = torch.tensor([block_lists[i][p // PAGE] * PAGE + p % PAGE for i, n in enumerate(seq_lens)
                          for p in range(n)], device=device)
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM, generator=gen).to(device, torch.bfloat16)
    value = torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM, generator=gen).to(device, torch.bfloat16)

    backend = TritonBackend()
    backend.write_kv(key, value, k_cache, v_cache, slots)
    _sync(device)
    written = len(slots) * NUM_KV_HEADS * HEAD_DIM
    assert _count_written(k_cache) == written and _count_written(v_cache) == written, "a write landed elsewhere"
    blocks, within = slots // PAGE, slots % PAGE
    assert torch.equal(k_cache[blocks, within], key) and torch.equal(v_cache[blocks, within], value)

    # the reference runs on the gathered slice: its own small cache, tables renumbered 0..n-1
    used = sorted({b for blocks in block_lists for b in blocks})
    small_k = k_cache[torch.tensor(used, device=device)]
    small_v = v_cache[torch.tensor(used, device=device)]
    small_table = torch.zeros_like(table)
    for i, blocks in enumerate(block_lists):
        small_table[i, :len(blocks)] = torch.tensor([used.index(b) for b in blocks], dtype=torch.int32)
    ref = TorchReferenceBackend()
    tested = []
    for name, q_lens, splits in (("decode", [1, 1, 1, 1], None), ("decode split-K", [1, 1, 1, 1], 4),
                                 ("prefill+mixed", [seq_lens[0] // 3, seq_lens[1], 1, seq_lens[3] - PAGE], None)):
        query = torch.randn(sum(q_lens), NUM_Q_HEADS, HEAD_DIM, generator=gen).to(device, torch.bfloat16)
        got = TritonBackend(num_splits=splits).attend(query, k_cache, v_cache,
                                                      _metadata(q_lens, seq_lens, table, device), HEAD_DIM ** -0.5)
        expected = ref.attend(query, small_k, small_v, _metadata(q_lens, seq_lens, small_table, device),
                              HEAD_DIM ** -0.5)
        _sync(device)
        torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
        tested.append(name)
    return (f"ok: {num_blocks} blocks x {ELEMENTS_PER_BLOCK} elements = {num_blocks * ELEMENTS_PER_BLOCK:,} per "
            f"cache (largest offset {top:,}; 2^32 = {2**32:,}); wrote {len(slots)} tokens to blocks "
            f"{used} (element offsets up to {(max(used) + 1) * ELEMENTS_PER_BLOCK - 1:,}) exactly, nothing else "
            f"changed; {', '.join(tested)} match the reference")


def test_offsets_past_2_to_the_32():
    assert NUM_BLOCKS * ELEMENTS_PER_BLOCK > 2**32
    try:
        print("\n" + run_check())
    except MemoryError as exc:
        pytest.skip(str(exc))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=NUM_BLOCKS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        sys.exit(0)
    if args.blocks * ELEMENTS_PER_BLOCK <= 2**32:
        print(f"warning: {args.blocks} blocks stay below 2^32 elements per cache")
    print(run_check(args.blocks))
