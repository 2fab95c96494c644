"""The Triton backend against the torch reference, in Triton's CPU interpreter (or on CUDA if present).

Tiny shapes: the interpreter runs every program in Python. Caches are poisoned with NaN, so a kernel
that reads an unwritten slot or a position past a sequence's length fails loudly; outputs are
poisoned too, so a kernel that skips a row fails. Run: python -m pytest tests/attention -q
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys

import pytest
import torch

# run as a script with --compile-check, this file compiles the kernels for sm_90 (no interpreter)
COMPILE_CHECK = __name__ == "__main__" and sys.argv[1:] == ["--compile-check"]
if not torch.cuda.is_available() and not COMPILE_CHECK:
    # must precede the first import of triton and of the kernel modules (@triton.jit reads it)
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from kvfit.attention.base import AttentionMetadata  # noqa: E402
from kvfit.attention.torch_ref import TorchReferenceBackend  # noqa: E402
from kvfit.errors import ConfigError  # noqa: E402
from kvfit.kv.spec import PADDING_SLOT_ID  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = torch.device("cpu" if INTERPRET or not torch.cuda.is_available() else "cuda")
if DEVICE.type == "cpu" and not INTERPRET and not COMPILE_CHECK:
    pytest.skip("no CUDA device and TRITON_INTERPRET=0", allow_module_level=True)


def _interpreter_fixes() -> None:
    import sys
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))    # also when run as a script
    if tests_dir not in sys.path:
        sys.path.insert(0, tests_dir)
    from triton_interpreter import apply_interpreter_fixes
    apply_interpreter_fixes()


def _import_backend():
    """The kernel modules, re-imported if something imported them before TRITON_INTERPRET was set."""
    from kvfit.attention import triton_backend
    from kvfit.kernels import attention_common as triton_kernels, attention_decode as triton_decode
    from kvfit.kernels import attention_prefill as triton_prefill
    if INTERPRET:
        from triton.runtime.interpreter import InterpretedFunction
        if not isinstance(triton_kernels._write_kv_kernel, InterpretedFunction):
            for module in (triton_kernels, triton_decode, triton_prefill, triton_backend):
                importlib.reload(module)
    return triton_backend, triton_decode, triton_kernels


if INTERPRET:
    _interpreter_fixes()
triton_backend, triton_decode, triton_kernels = _import_backend()
TritonBackend = triton_backend.TritonBackend

TOLERANCE = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


# ---- building a step: block tables, slots, caches, metadata -------------------------------------------

def make_tables(seq_lens: list[int], page: int, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """Random, non-contiguous, disjoint block tables; [B, max_blocks] int32 padded with 0."""
    need = [-(-n // page) for n in seq_lens]
    assert sum(need) < num_blocks
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()   # block 0 stays unused
    table = torch.zeros((len(seq_lens), max(need) + 1), dtype=torch.int32)
    for i, n in enumerate(need):
        table[i, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    return table


def slots_of(table: torch.Tensor, seq: int, positions, page: int) -> list[int]:
    return [int(table[seq, p // page]) * page + p % page for p in positions]


def poisoned_caches(num_blocks, page, num_kv_heads, head_dim, dtype):
    shape = (num_blocks, page, num_kv_heads, head_dim)
    k = torch.full(shape, float("nan"), dtype=torch.float32, device=DEVICE).to(dtype)
    return k, k.clone()


def filled_caches(seq_lens, page, num_kv_heads, head_dim, dtype, gen, num_blocks=None):
    """Caches holding every context token (written by the reference), the rest NaN; and the tables."""
    num_blocks = num_blocks or sum(-(-n // page) for n in seq_lens) + 5
    table = make_tables(seq_lens, page, num_blocks, gen)
    k_cache, v_cache = poisoned_caches(num_blocks, page, num_kv_heads, head_dim, dtype)
    slots = [s for i, n in enumerate(seq_lens) for s in slots_of(table, i, range(n), page)]
    key = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(DEVICE)
    value = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(DEVICE)
    TorchReferenceBackend().write_kv(key, value, k_cache, v_cache, torch.tensor(slots, device=DEVICE))
    return k_cache, v_cache, table.to(DEVICE)


def make_meta(q_lens: list[int], seq_lens: list[int], table: torch.Tensor) -> AttentionMetadata:
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.full((starts[-1],), PADDING_SLOT_ID, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=table, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_start_loc_host=starts, seq_lens_host=list(seq_lens))


def check_attend(backend, q_lens, seq_lens, num_q_heads, num_kv_heads, head_dim, page, dtype, seed,
                 cache_dtype=None):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, table = filled_caches(seq_lens, page, num_kv_heads, head_dim, cache_dtype or dtype, gen)
    meta = make_meta(q_lens, seq_lens, table)
    query = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen).to(DEVICE, dtype)
    scale = head_dim ** -0.5
    expected = TorchReferenceBackend().attend(query, k_cache, v_cache, meta, scale)
    got = backend.attend(query, k_cache, v_cache, meta, scale)
    assert got.dtype == dtype and got.shape == query.shape
    assert not got.isnan().any()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


# ---- KV write ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_matches_reference_and_skips_padding(dtype):
    gen = torch.Generator().manual_seed(1)
    num_tokens, num_kv_heads, head_dim, page, num_blocks = 9, 2, 48, 4, 7
    # key/value are views into a fused qkv-like buffer: token stride != Hkv * D
    fused = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    key, value = fused[:, 1], fused[:, 2]
    slots = torch.randperm(num_blocks * page, generator=gen)[:num_tokens]
    slots[[2, 5]] = PADDING_SLOT_ID
    slots = slots.to(DEVICE)
    expected = poisoned_caches(num_blocks, page, num_kv_heads, head_dim, dtype)
    got = poisoned_caches(num_blocks, page, num_kv_heads, head_dim, dtype)
    TorchReferenceBackend().write_kv(key, value, *expected, slots)
    TritonBackend().write_kv(key, value, *got, slots)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=0, rtol=0, equal_nan=True)
    assert int((~got[0].isnan()).any(-1).any(-1).sum()) == num_tokens - 2   # padding rows untouched


def test_write_kv_fp8_cache():
    if INTERPRET:
        pytest.skip("Triton 3.6's interpreter rounds to float8_e4m3fn wrongly (e.g. -1.945 -> -1.0); "
                    "fp8 writes are checked on the GPU")
    gen = torch.Generator().manual_seed(2)
    key = torch.randn(6, 2, 32, generator=gen).to(DEVICE, torch.bfloat16)
    value = torch.randn(6, 2, 32, generator=gen).to(DEVICE, torch.bfloat16)
    slots = torch.tensor([3, 0, PADDING_SLOT_ID, 9, 14, 7], device=DEVICE)
    k_cache = torch.zeros((4, 4, 2, 32), dtype=torch.float8_e4m3fn, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    TritonBackend().write_kv(key, value, k_cache, v_cache, slots)
    keep = slots != PADDING_SLOT_ID
    s = slots[keep]
    assert torch.equal(k_cache.view(-1, 2, 32)[s].float(), key[keep].to(torch.float8_e4m3fn).float())
    assert torch.equal(v_cache.view(-1, 2, 32)[s].float(), value[keep].to(torch.float8_e4m3fn).float())


# ---- decode ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(8, 2), (4, 1), (2, 2)], ids=["gqa", "mqa", "mha"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference(dtype, heads, num_splits):
    num_q_heads, num_kv_heads = heads
    seq_lens = [1, 19, 45, 33]          # 1 token, and contexts over several 8-token blocks
    check_attend(TritonBackend(num_splits=num_splits), [1] * len(seq_lens), seq_lens, num_q_heads,
                 num_kv_heads, 16, 8, dtype, seed=10 + num_splits)


@pytest.mark.parametrize("head_dim,seq_lens", [(32, [300, 40]), (48, [40, 13])])
def test_decode_head_dims_and_chosen_splits(head_dim, seq_lens):
    # num_splits=None: chosen from max_seq_len; the interpreter assumes 4 SMs, so 300 tokens -> 2 splits
    backend = TritonBackend()
    meta = make_meta([1, 1], seq_lens, torch.zeros((2, 1), dtype=torch.int32))
    assert backend.decode_num_splits(meta, torch.empty(2, 4, head_dim), 2) == (2 if max(seq_lens) > 256 else 1)
    check_attend(backend, [1, 1], seq_lens, 4, 2, head_dim, 16, torch.float16, seed=20)


def test_decode_many_splits_leave_some_empty():
    # 8 splits of 16-token tiles over contexts of 5..70 tokens: short contexts leave splits empty
    check_attend(TritonBackend(num_splits=8), [1, 1, 1], [5, 70, 16], 4, 2, 16, 4, torch.float32, seed=21)


def test_decode_reads_fp8_cache():
    # the reference writes the fp8 cache (torch's cast); the kernel reads it and converts to bf16
    check_attend(TritonBackend(num_splits=2), [1, 1], [23, 9], 4, 2, 16, 8, torch.bfloat16, seed=22,
                 cache_dtype=torch.float8_e4m3fn)


def test_decode_group_wider_than_one_program():
    # 128 query heads on one KV head: two head chunks of 64 rows per (seq, kv head)
    check_attend(TritonBackend(num_splits=2), [1, 1], [7, 20], 128, 1, 16, 8, torch.float32, seed=23)


def test_choose_num_splits():
    choose = triton_decode.choose_num_splits
    assert choose(max_seq_len=100, num_seqs=1, num_kv_head_programs=8, num_sms=132) == 1     # short
    assert choose(max_seq_len=32768, num_seqs=1, num_kv_head_programs=8, num_sms=132) == 64  # capped
    assert choose(max_seq_len=32768, num_seqs=64, num_kv_head_programs=8, num_sms=132) == 1  # one wave already
    assert choose(max_seq_len=32768, num_seqs=32, num_kv_head_programs=8, num_sms=132) == 2  # 512 of 528 slots
    assert choose(max_seq_len=32768, num_seqs=48, num_kv_head_programs=8, num_sms=132) == 1  # 2 would be 1.45 waves
    assert choose(max_seq_len=32768, num_seqs=512, num_kv_head_programs=8, num_sms=132) == 1  # several waves
    assert choose(max_seq_len=1024, num_seqs=2, num_kv_head_programs=8, num_sms=132) == 4    # by length


def test_reduce_heads_per_program():
    heads = triton_decode.reduce_heads_per_program
    assert heads(32, 8, 128) == 8 and heads(32, 64, 128) == 1 and heads(4, 2, 128) == 4    # register bound
    assert heads(32, 8, 128, num_seqs=256) == 8            # batch 256 x 32 heads: 1,024 programs of 8 heads
    assert heads(32, 8, 128, num_seqs=1) == 1              # batch 1: one head a program (32 programs)
    for num_seqs in (1, 2, 16, 32, 64, 100, 128, 512):
        h = heads(32, 4, 128, num_seqs)
        assert h == 1 or num_seqs * -(-32 // h) >= triton_decode.REDUCE_MIN_PROGRAMS
        assert h <= heads(32, 4, 128) and h & (h - 1) == 0


@pytest.mark.parametrize("min_programs,heads_per_program", [(32, 2), (16, 4), (8, 8)])
def test_decode_reduce_of_several_heads_a_program(min_programs, heads_per_program, monkeypatch):
    # 32 query heads: the rule gives the reduce several heads a program at batches of 32 to 128 and more; a
    # lower program floor makes two sequences take each variant (the interpreter stays quick)
    monkeypatch.setattr(triton_decode, "REDUCE_MIN_PROGRAMS", min_programs)
    seen = []
    rule = triton_decode.reduce_heads_per_program
    monkeypatch.setattr(triton_decode, "reduce_heads_per_program", lambda *a: seen.append(rule(*a)) or seen[-1])
    check_attend(TritonBackend(num_splits=3), [1, 1], [11, 26], 32, 8, 16, 4, torch.float32, seed=24)
    assert seen == [heads_per_program]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,prefix_blocks,q_lens,seq_lens,splits", [
    ((4, 2), 3, [1, 1, 1], [13, 20, 14], (2, 1)),          # prefix of 12 tokens; one suffix token for seq 0
    ((6, 2), 2, [1, 1, 1, 1, 1], [9, 31, 17, 10, 25], (1, 3)),   # group 3 (not a power of two), 3 splits
    ((2, 2), 0, [1, 1], [5, 7], (3, 2)),                   # no shared prefix: the prefix kernel writes nothing
    ((32, 2), 1, [1, 0, 1], [6, 9, 30], (2, 2)),           # group 16 (rows span sequences), a seq with no query
], ids=["g2", "g3-many-seqs", "empty-prefix", "g16-no-query"])
def test_cascade_decode_matches_reference(dtype, heads, prefix_blocks, q_lens, seq_lens, splits):
    # every sequence's first prefix_blocks blocks are row 0's (prefix-cache hits); the shared-prefix kernel
    # attends them once for all sequences, the split kernel the rest, the reduce merges both
    num_q, num_kv = heads
    prefix_splits, num_splits = splits
    page, head_dim = 4, 16
    gen = torch.Generator().manual_seed(sum(seq_lens) + num_q)
    num_blocks = sum(-(-n // page) for n in seq_lens) + 5
    table = make_tables(seq_lens, page, num_blocks, gen)
    table[:, :prefix_blocks] = table[0, :prefix_blocks].clone()
    k_cache, v_cache = poisoned_caches(num_blocks, page, num_kv, head_dim, dtype)
    slots = [s for i, n in enumerate(seq_lens) for s in slots_of(table, i, range(n), page)]
    key = torch.randn(len(slots), num_kv, head_dim, generator=gen).to(DEVICE)
    value = torch.randn(len(slots), num_kv, head_dim, generator=gen).to(DEVICE)
    TorchReferenceBackend().write_kv(key, value, k_cache, v_cache, torch.tensor(slots, device=DEVICE))
    meta = make_meta(q_lens, seq_lens, table.to(DEVICE))
    query = torch.randn(sum(q_lens), num_q, head_dim, generator=gen).to(DEVICE, dtype)
    scale = head_dim ** -0.5
    expected = TorchReferenceBackend().attend(query, k_cache, v_cache, meta, scale)
    prefix_len = torch.tensor([prefix_blocks * page], dtype=torch.int32, device=DEVICE)
    got = triton_decode.paged_decode_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                               meta.query_start_loc, scale, num_splits=num_splits,
                                               prefix_len=prefix_len, prefix_splits=prefix_splits)
    assert not got.isnan().any()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    # through the backend: the metadata's prefix_len picks cascade, its own split counts
    via_backend = TritonBackend().attend(query, k_cache, v_cache, dataclasses.replace(meta, prefix_len=prefix_len),
                                         scale)
    torch.testing.assert_close(via_backend.float(), expected.float(), atol=tol, rtol=tol)


def _fp8_cache_step(seq_lens, q_lens, num_kv, head_dim, seed, shared_blocks=0, edit=None, page=4):
    """An fp8 cache holding random K/V for seq_lens (edit(key, value) may change them before the write; the first
    shared_blocks blocks of every sequence are row 0's) -> (k_cache, v_cache, meta, generator)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // page) for n in seq_lens) + 3
    table = make_tables(seq_lens, page, num_blocks, gen)
    table[:, :shared_blocks] = table[0, :shared_blocks].clone()
    k_cache, v_cache = poisoned_caches(num_blocks, page, num_kv, head_dim, torch.float8_e4m3fn)
    slots = [s for i, n in enumerate(seq_lens) for s in slots_of(table, i, range(n), page)]
    key = torch.randn(len(slots), num_kv, head_dim, generator=gen).to(DEVICE)
    value = torch.randn(len(slots), num_kv, head_dim, generator=gen).to(DEVICE)
    if edit is not None:
        edit(key, value)
    TorchReferenceBackend().write_kv(key, value, k_cache, v_cache, torch.tensor(slots, device=DEVICE))
    return k_cache, v_cache, make_meta(q_lens, seq_lens, table.to(DEVICE)), gen


@pytest.mark.parametrize("dots", ["fp16", "pairs"])
@pytest.mark.parametrize("loud", [1.0, 2e6, 1e-7], ids=["plain", "query-past-fp16", "query-under-fp16"])
def test_fp8_cache_decode_with_fp16_dots_matches_the_bf16_dots(loud, dots):
    """DOT_F16 (an fp8 cache's decode dots in fp16; "pairs": K/V read as 16-bit words of two e4m3, the even and
    odd columns' dots apart): the same output as the bf16 dots, within bf16's rounding, split or not; a query
    past fp16's range (65,504) is scaled by a power of two into it, not overflowed, one under fp16's normals (a
    tiny query under a large score scale) up into them, not flushed."""
    num_q, num_kv, head_dim = 8, 2, 32
    seq_lens = [13, 30, 7]
    k_cache, v_cache, meta, gen = _fp8_cache_step(seq_lens, [1] * len(seq_lens), num_kv, head_dim, seed=5)
    query = (torch.randn(len(seq_lens), num_q, head_dim, generator=gen) * loud / head_dim).to(DEVICE, torch.bfloat16)
    scale = head_dim ** -0.5 / loud
    assert (query.abs().max() > 65504) == (loud > 1)
    expected = TorchReferenceBackend().attend(query, k_cache, v_cache, meta, scale).float()
    for splits in (1, 3):
        args = (query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale)
        f16 = triton_decode.paged_decode_attention(*args, num_splits=splits, dots=dots).float()
        bf16 = triton_decode.paged_decode_attention(*args, num_splits=splits, dots="query").float()
        assert torch.isfinite(f16).all()
        torch.testing.assert_close(f16, expected, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(f16, bf16, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("split", [True, False], ids=["split", "masked-only"])
@pytest.mark.parametrize("loud", [1.0, 2e6, 1e-7], ids=["plain", "query-past-fp16", "query-under-fp16"])
def test_fp8_cache_prefill_with_pairs_matches_the_bf16_dots(loud, split):
    """dots="pairs" in the prefill kernel (an fp8 cache read as int16 words of two e4m3, fp16 dots over the even and
    odd columns): a fresh prompt, a chunk over a cached prefix, a decode row and a prompt longer than a row tile, as
    the bf16 dots and the reference give them, through both loops (whole tiles below the diagonal and the causal
    ones), both grids (eager and a graph's tile map); a query past fp16's range, or under its normals, is scaled
    into them."""
    from kvfit.kernels.attention_prefill import paged_prefill_attention
    num_q, num_kv, head_dim = 4, 2, 32
    q_lens, seq_lens = [7, 5, 1, 21], [7, 40, 12, 26]
    k_cache, v_cache, meta, gen = _fp8_cache_step(seq_lens, q_lens, num_kv, head_dim, seed=9)
    query = (torch.randn(sum(q_lens), num_q, head_dim, generator=gen) * loud / head_dim).to(DEVICE, torch.bfloat16)
    scale = head_dim ** -0.5 / loud
    expected = TorchReferenceBackend().attend(query, k_cache, v_cache, meta, scale).float()
    args = (query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc)
    out_scale = torch.tensor([0.5, 2.0], device=DEVICE)
    for max_len, maps in ((max(q_lens), None), (sum(q_lens), {})):
        pairs = paged_prefill_attention(*args, max_len, scale, split=split, tile_maps=maps, dots="pairs").float()
        bf16 = paged_prefill_attention(*args, max_len, scale, split=split, tile_maps=maps, dots="query").float()
        assert torch.isfinite(pairs).all()
        torch.testing.assert_close(pairs, expected, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(pairs, bf16, atol=2e-2, rtol=2e-2)
        scaled = paged_prefill_attention(*args, max_len, scale, split=split, tile_maps=maps, dots="pairs",
                                         out_scale=out_scale).float()
        heads_scale = out_scale.repeat_interleave(num_q // num_kv)[None, :, None]
        torch.testing.assert_close(scaled, pairs * heads_scale, atol=2e-2, rtol=2e-2)


def test_pairs_are_refused_where_they_do_not_fit():
    """pairs read whole rows of int16 words of an fp8 cache under a 16-bit query: a padded head_dim (48), one
    under 32, a bf16 cache or an fp32 query is an assertion, not a wrong read."""
    from kvfit.kernels.attention_prefill import paged_prefill_attention
    for head_dim, cache_dtype, query_dtype in ((48, torch.float8_e4m3fn, torch.bfloat16),
                                               (16, torch.float8_e4m3fn, torch.bfloat16),
                                               (32, torch.bfloat16, torch.bfloat16),
                                               (32, torch.float8_e4m3fn, torch.float32)):
        k_cache = torch.zeros(4, 4, 1, head_dim, device=DEVICE).to(cache_dtype)
        meta = make_meta([2], [2], torch.tensor([[1]], dtype=torch.int32, device=DEVICE))
        query = torch.zeros(2, 2, head_dim, device=DEVICE, dtype=query_dtype)
        with pytest.raises(AssertionError):
            paged_prefill_attention(query, k_cache, k_cache.clone(), meta.block_tables, meta.seq_lens,
                                    meta.query_start_loc, 2, 0.1, dots="pairs")


def test_e4m3_pairs_convert_exactly():
    """Every pair of e4m3 bytes (subnormals, zeros of both signs, 448, NaN) as an int16 word converts to
    the two fp16 values torch's own conversion gives (the interpreter's bit arithmetic; sm_90's cvt is the
    GPU tests')."""
    from e4m3_pairs import check_every_e4m3_pair
    check_every_e4m3_pair(DEVICE, cvt_asm=False)


def test_fp8_dots_come_close_to_the_reference():
    """dots="fp8" (FlashAttention-3's scheme: each query row and the probabilities quantized to e4m3): close to the
    reference (3 mantissa bits: a mean error of about 1% of the values here), split or not; the probabilities'
    scale keeps the small weights of a long context (1,000 equal ones) from flushing to zero."""
    num_q, num_kv, head_dim = 8, 2, 32
    seq_lens = [13, 1000, 7]

    def edit(key, value):
        key[13:1013] = 0     # the long context's scores are all equal: each probability is 1/1000, under e4m3's
        value += 1           # smallest (2^-9) unless scaled

    k_cache, v_cache, meta, gen = _fp8_cache_step(seq_lens, [1] * len(seq_lens), num_kv, head_dim, seed=6, edit=edit)
    query = torch.randn(len(seq_lens), num_q, head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    scale = head_dim ** -0.5
    expected = TorchReferenceBackend().attend(query, k_cache, v_cache, meta, scale).float()
    for splits in (1, 3):
        got = triton_decode.paged_decode_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                                   meta.query_start_loc, scale, num_splits=splits, dots="fp8").float()
        assert torch.isfinite(got).all()
        # e4m3 keeps 3 mantissa bits: each query element and probability rounds by up to 1/16 of itself
        diff = (got - expected).abs()
        assert diff.mean() < 0.03 and diff.max() < 0.3, (diff.mean(), diff.max())
    with pytest.raises(AssertionError):          # fp8 dots need an fp8 cache
        bf_cache = k_cache.to(torch.bfloat16)
        triton_decode.paged_decode_attention(query, bf_cache, bf_cache, meta.block_tables, meta.seq_lens,
                                             meta.query_start_loc, scale, num_splits=1, dots="fp8")


@pytest.mark.parametrize("step", ["decode", "decode-split", "cascade", "prefill"])
def test_the_kernels_scale_the_output_per_kv_head(step):
    """out_scale (an fp8 cache's v scales, one per KV head): every kernel multiplies its output, or its partial
    sums, by its KV head's scale before the output's rounding, as the torch reference does; the same as the
    unscaled output times the scale, within bf16's rounding."""
    num_q, num_kv, page, head_dim = 6, 2, 4, 16
    seq_lens = [13, 22, 9]
    q_lens = [5, 3, 9] if step == "prefill" else [1, 1, 1]
    k_cache, v_cache, meta, gen = _fp8_cache_step(seq_lens, q_lens, num_kv, head_dim, seed=11,
                                                  shared_blocks=2 if step == "cascade" else 0, page=page)
    query = torch.randn(sum(q_lens), num_q, head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    out_scale = torch.tensor([0.037, 3.3], device=DEVICE)
    scale = head_dim ** -0.5
    if step == "prefill":
        def run(out_scale=None):
            return TritonBackend().attend(query, k_cache, v_cache, meta, scale, out_scale)
    else:
        prefix = torch.tensor([2 * page], dtype=torch.int32, device=DEVICE)
        kwargs = dict(num_splits=3 if step == "decode-split" else 1, prefix_len=prefix if step == "cascade" else None,
                      prefix_splits=2 if step == "cascade" else 0)

        def run(out_scale=None):
            return triton_decode.paged_decode_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                                        meta.query_start_loc, scale, out_scale=out_scale, **kwargs)
    expected = TorchReferenceBackend().attend(query, k_cache, v_cache, meta, scale, out_scale).float()
    plain = TorchReferenceBackend().attend(query, k_cache, v_cache, meta, scale).float()
    per_head = out_scale.repeat_interleave(num_q // num_kv)[None, :, None]
    torch.testing.assert_close(expected, plain * per_head, atol=2e-2, rtol=2e-2)
    got = run(out_scale).float()
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, run().float() * per_head, atol=2e-2, rtol=2e-2)


def test_cascade_rule_and_prefix_splits():
    backend = TritonBackend()
    # the H200 in CUDA graphs (benchmarks/run_gpu_steps.sh cascade-rule): faster from about 32,000 sequences x tokens
    assert backend.cascade_tokens(shared_tokens=2000, num_seqs=16) == 2000     # 1.27-1.33x
    assert backend.cascade_tokens(shared_tokens=256, num_seqs=128) == 256      # 1.06x
    assert backend.cascade_tokens(shared_tokens=2000, num_seqs=8) == 0         # 1.03x: not worth the launches
    assert backend.cascade_tokens(shared_tokens=512, num_seqs=32) == 0         # 0.96x
    assert backend.cascade_tokens(shared_tokens=8192, num_seqs=7) == 0         # too few sequences
    assert backend.cascade_tokens(shared_tokens=255, num_seqs=256) == 0        # too short a prefix
    splits = triton_decode.choose_prefix_splits
    # the measured shapes (H200, 132 SMs, bf16): 4 splits was best at batch 64 and 256, group 2 and 4
    assert splits(num_seqs=256, group=2, num_kv_heads=8, elem_bytes=2, num_sms=132) == 4
    assert splits(num_seqs=256, group=4, num_kv_heads=8, elem_bytes=2, num_sms=132) == 4
    assert splits(num_seqs=64, group=4, num_kv_heads=8, elem_bytes=2, num_sms=132) == 4
    assert splits(num_seqs=8, group=2, num_kv_heads=8, elem_bytes=2, num_sms=132) == 16   # few programs: more
    assert splits(num_seqs=8, group=2, num_kv_heads=2, elem_bytes=2, num_sms=4) == 4


# ---- prefill and mixed -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_prefill_with_cached_prefix_and_mixed_decode(dtype):
    # seq 0: fresh prompt; 1: chunk over a prefix; 2: decode; 3: prompt longer than one row tile
    q_lens, seq_lens = [7, 5, 1, 21], [7, 30, 12, 26]
    check_attend(TritonBackend(), q_lens, seq_lens, 4, 2, 16, 8, dtype, seed=30)


@pytest.mark.parametrize("heads,head_dim", [((3, 1), 32), ((2, 2), 48)], ids=["group3-d32", "mha-d48"])
def test_prefill_head_layouts(heads, head_dim):
    check_attend(TritonBackend(), [4, 9, 1], [4, 17, 3], heads[0], heads[1], head_dim, 4, torch.float32,
                 seed=31)


@pytest.mark.parametrize("split", [True, False])
def test_prefill_unmasked_tiles_below_the_diagonal_match_the_reference(split):
    # long prefixes and row tiles starting mid-tile: several whole key tiles below the causal diagonal go
    # through the unmasked loop (split), the rest through the masked one; both walks give the reference
    from kvfit.kernels.attention_prefill import paged_prefill_attention
    gen = torch.Generator().manual_seed(34)
    q_lens, seq_lens = [19, 3, 40], [70, 50, 40]
    k_cache, v_cache, table = filled_caches(seq_lens, 8, 2, 16, torch.float32, gen)
    meta = make_meta(q_lens, seq_lens, table)
    query = torch.randn(sum(q_lens), 4, 16, generator=gen).to(DEVICE)
    expected = TorchReferenceBackend().attend(query, k_cache, v_cache, meta, 0.25)
    got = paged_prefill_attention(query, k_cache, v_cache, table, meta.seq_lens, meta.query_start_loc,
                                  max(q_lens), 0.25, split=split)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


def test_sequences_without_queries_are_skipped():
    # q_len 0 rows occur in padded batches: their seq writes nothing, the others are unaffected
    check_attend(TritonBackend(num_splits=2), [1, 0, 1], [9, 4, 17], 4, 2, 16, 8, torch.float32, seed=32)
    check_attend(TritonBackend(), [3, 0, 1], [9, 4, 17], 4, 2, 16, 8, torch.float32, seed=33)


@pytest.mark.parametrize("q_lens,seq_lens", [([7, 5, 1, 21], [7, 30, 12, 26]), ([1, 0, 40, 0, 1, 3], [9, 4, 70, 2, 17, 3]),
                                              ([33], [33]), ([1, 1, 1], [5, 9, 2])],
                         ids=["mixed", "empty-seqs", "one-prefill", "decodes"])
def test_prefill_with_a_tile_map_matches_the_reference(q_lens, seq_lens):
    # a CUDA graph's grid: programs over tiles numbered across sequences (meta.tile_maps), not (seq, row tile);
    # the map is built once and reused by the next call (the next layer)
    gen = torch.Generator().manual_seed(35)
    k_cache, v_cache, table = filled_caches(seq_lens, 8, 2, 16, torch.float32, gen)
    # as a graph sets it: max_query_len is the step's token count (so decodes alone take this kernel too)
    meta = dataclasses.replace(make_meta(q_lens, seq_lens, table), tile_maps={}, max_query_len=sum(q_lens))
    query = torch.randn(sum(q_lens), 4, 16, generator=gen).to(DEVICE)
    expected = TorchReferenceBackend().attend(query, k_cache, v_cache, meta, 0.25)
    for _ in range(2):
        got = TritonBackend().attend(query, k_cache, v_cache, meta, 0.25)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
    assert len(meta.tile_maps) == 1


@pytest.mark.parametrize("seed", range(8))
def test_tile_mapped_grid_equals_the_eager_grid_on_random_steps(seed):
    # random group sizes, head dims, pages and steps (empty sequences, decodes, chunks over prefixes, a fresh
    # padding prompt at the end as MixedGraphs makes it): both grids give the same output, bit for bit
    from kvfit.kernels.attention_prefill import paged_prefill_attention
    gen = torch.Generator().manual_seed(100 + seed)
    pick = lambda options: options[int(torch.randint(len(options), (1,), generator=gen))]   # noqa: E731
    num_kv_heads, group, head_dim, page = pick([1, 2]), pick([1, 2, 3, 4, 8]), pick([16, 32, 48]), pick([4, 8, 16])
    num_seqs = int(torch.randint(1, 7, (1,), generator=gen))
    q_lens, seq_lens = [], []
    for _ in range(num_seqs):
        q = pick([0, 1, 1, 2, 5, 17, 40])
        q_lens.append(q)
        seq_lens.append(q + pick([0, 3, 9, 30]) if q else pick([0, 4]))
    q_lens.append(pick([0, 3, 11]))              # the padding sequence: a fresh prompt of the spare rows
    seq_lens.append(q_lens[-1])
    if sum(q_lens) == 0:
        q_lens[0], seq_lens[0] = 1, 1
    k_cache, v_cache, table = filled_caches([max(n, 1) for n in seq_lens], page, num_kv_heads, head_dim,
                                            torch.float32, gen)
    meta = make_meta(q_lens, seq_lens, table)
    query = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen).to(DEVICE)
    eager = paged_prefill_attention(query, k_cache, v_cache, table, meta.seq_lens, meta.query_start_loc,
                                    max(q_lens), 0.3)
    mapped = paged_prefill_attention(query, k_cache, v_cache, table, meta.seq_lens, meta.query_start_loc,
                                     sum(q_lens), 0.3, tile_maps={})
    rows = torch.tensor([i for i, n in enumerate(q_lens) for _ in range(n)])
    assert not mapped.isnan().any(), (q_lens, seq_lens)
    assert torch.equal(mapped, eager), (q_lens, seq_lens, group, head_dim, page, rows)


def test_tile_map_numbers_each_sequences_row_tiles():
    from kvfit.kernels.attention_prefill import mapped_tiles, prefill_tile_map
    starts = torch.tensor([0, 3, 3, 20, 21], dtype=torch.int32)         # q_lens 3, 0, 17, 1; group 2, 8 rows a tile
    num_tiles = mapped_tiles(21, 4, 2, 8)
    assert num_tiles == 6 + 4
    seqs, rows = prefill_tile_map(starts, 2, 8, num_tiles)
    # seq 0: 6 rows, one tile; seq 1: none; seq 2: 34 rows, 5 tiles; seq 3: one
    assert seqs.tolist() == [0, 2, 2, 2, 2, 2, 3, -1, -1, -1]
    assert rows.tolist() == [0, 0, 8, 16, 24, 32, 0, 0, 0, 0]
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):     # the bound holds for any split of T tokens among B sequences
        q = torch.randint(0, 40, (6,), generator=gen)
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), q.cumsum(0)]).to(torch.int32)
        seqs, _ = prefill_tile_map(starts, 3, 16, mapped_tiles(int(q.sum()), 6, 3, 16))
        assert int((seqs >= 0).sum()) == sum(-(-int(n) * 3 // 16) for n in q)


def test_write_then_attend_end_to_end():
    gen = torch.Generator().manual_seed(40)
    num_q_heads, num_kv_heads, head_dim, page = 4, 2, 16, 8
    q_lens, seq_lens = [6, 1, 4], [6, 20, 12]
    table = make_tables(seq_lens, page, 12, gen).to(DEVICE)
    slots = [s for i, (q, n) in enumerate(zip(q_lens, seq_lens)) for s in slots_of(table, i, range(n - q, n), page)]
    slots = torch.tensor(slots, device=DEVICE)
    prefix = [(i, range(n - q)) for i, (q, n) in enumerate(zip(q_lens, seq_lens))]
    prefix_slots = torch.tensor([s for i, r in prefix for s in slots_of(table, i, r, page)], device=DEVICE)
    caches = {name: poisoned_caches(12, page, num_kv_heads, head_dim, torch.bfloat16) for name in ("ref", "tri")}
    pk = torch.randn(len(prefix_slots), num_kv_heads, head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    pv = torch.randn(len(prefix_slots), num_kv_heads, head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    key = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    value = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    query = torch.randn(len(slots), num_q_heads, head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    meta = make_meta(q_lens, seq_lens, table)
    outs = {}
    for name, backend in (("ref", TorchReferenceBackend()), ("tri", TritonBackend())):
        backend.write_kv(pk, pv, *caches[name], prefix_slots)
        backend.write_kv(key, value, *caches[name], slots)
        outs[name] = backend.attend(query, *caches[name], meta, 0.25)
    torch.testing.assert_close(caches["tri"][0], caches["ref"][0], atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(outs["tri"].float(), outs["ref"].float(), atol=2e-2, rtol=2e-2)


# ---- 64-bit offsets ----------------------------------------------------------------------------------

def test_largest_element_offset():
    cache = torch.empty((70_000, 64, 8, 128), dtype=torch.bfloat16, device="meta")   # no memory
    assert triton_kernels.largest_element_offset(cache) == 70_000 * 64 * 8 * 128 - 1 > 2**32
    assert TritonBackend.max_element_offset == 2**63 - 1


def test_backend_refuses_cpu_tensors_outside_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.zeros(1, 1, 16)
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        TritonBackend().write_kv(x, x, torch.zeros(1, 4, 1, 16), torch.zeros(1, 4, 1, 16), torch.zeros(1).long())


def _huge_offset_check(cache_dtype: torch.dtype) -> None:
    """Write and attend at blocks whose element offsets exceed 2^31, in a cache that is virtual memory
    (torch.empty on CPU commits only the pages touched). An int32 offset would wrap and write or read
    elsewhere (or fault), so the write is checked by torch's indexing and every kernel that reads the cache
    (decode, split-K decode, prefill + mixed, cascade) against the reference reading the same cache.
    Three sequences share a two-block prefix (a prefix-cache hit: the cascade's shared blocks), then have
    blocks of their own; shared and own blocks lie past 2^31 elements, and a few below."""
    page, num_kv_heads, head_dim = 16, 2, 16
    block_elements = page * num_kv_heads * head_dim               # 512: block 2^22 starts at element 2^31
    num_blocks = 3 * 2**21                                        # 3.2e9 elements: 6.4 GB virtual in bf16
    k_cache = torch.empty((num_blocks, page, num_kv_heads, head_dim), dtype=cache_dtype)
    v_cache = torch.empty_like(k_cache)
    assert triton_kernels.largest_element_offset(k_cache) == 3 * 2**30 - 1
    mark = 2**31 // block_elements
    shared, own = [num_blocks - 1, mark + 3], [[5, num_blocks - 7], [mark], [num_blocks - 4, mark + 1]]
    seq_lens, shared_len = [55, 41, 61], 2 * page                 # last blocks part full
    used = shared + [b for blocks in own for b in blocks]
    for b in used:                                                # a read of an unwritten row gives NaN
        k_cache[b].fill_(float("nan"))
        v_cache[b].fill_(float("nan"))
    table = torch.tensor([shared + blocks + [0] * (2 - len(blocks)) for blocks in own], dtype=torch.int32)
    slots = torch.tensor(slots_of(table, 0, range(shared_len), page) + [
        s for i, n in enumerate(seq_lens) for s in slots_of(table, i, range(shared_len, n), page)])
    gen = torch.Generator().manual_seed(50)
    # values the cache dtype holds exactly (Triton 3.6's interpreter rounds to fp8 wrongly: test_write_kv_fp8_cache)
    key, value = (torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(cache_dtype).bfloat16()
                  for _ in range(2))
    TritonBackend().write_kv(key, value, k_cache, v_cache, slots)
    for cache, written in ((k_cache, key), (v_cache, value)):
        assert torch.equal(cache[slots // page, slots % page].float(), written.float()), "a write went elsewhere"
        assert int((~cache[torch.tensor(used)].float().isnan()).sum()) == written.numel(), "a stray write"
    ref = TorchReferenceBackend()
    prefix_len = torch.tensor([shared_len], dtype=torch.int32)
    for name, q_lens, splits, prefix in (("decode", [1, 1, 1], 1, None), ("split-K decode", [1, 1, 1], 3, None),
                                         ("prefill+mixed", [7, 1, 13], None, None),
                                         ("prefill+mixed, a graph's tile-mapped grid", [7, 1, 13], None, None),
                                         ("cascade", [1, 1, 1], 2, prefix_len)):
        meta = dataclasses.replace(make_meta(q_lens, seq_lens, table), prefix_len=prefix)
        if "tile-mapped" in name:       # as MixedGraphs sets it
            meta = dataclasses.replace(meta, tile_maps={}, max_query_len=sum(q_lens))
        query = torch.randn(sum(q_lens), 4, head_dim, generator=gen).bfloat16()
        got = TritonBackend(num_splits=splits).attend(query, k_cache, v_cache, meta, 0.25).float()
        expected = ref.attend(query, k_cache, v_cache, meta, 0.25).float()
        torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2, msg=lambda m, name=name: f"{name}: {m}")
    print(f"ok ({str(cache_dtype).removeprefix('torch.')} cache): write, decode, split-K decode, prefill+mixed "
          f"(both grids) and cascade at element offsets up to {triton_kernels.largest_element_offset(k_cache):,}")


@pytest.mark.skipif(not INTERPRET, reason="the CPU variant of tests/gpu/test_kernel_safety.py")
@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float8_e4m3fn"])
def test_offsets_past_2_to_the_31_in_the_interpreter(cache_dtype):
    # a subprocess, so a wrapped offset that faults fails this test instead of killing pytest
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, __file__, "--huge-offset-check", cache_dtype], env=env,
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0 and "DefaultCPUAllocator" in done.stderr:
        pytest.skip("cannot reserve 6.4 to 12.8 GB of virtual memory here")
    assert done.returncode == 0, f"rc={done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    assert f"ok ({cache_dtype} cache): write, decode, split-K decode, prefill+mixed (both grids) and cascade" in done.stdout


# ---- the kernels compile for the H200 (sm_90) -----------------------------------------------------------

def _compile_check() -> None:
    """Compile each kernel for sm_90 ahead of time, as a real launch would specialise it (pointers and
    strides 16-divisible), and assemble with ptxas -v: catches GPU-only compile errors the interpreter
    cannot see, and register spills. Needs no GPU. Runs without TRITON_INTERPRET (a subprocess)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))      # tests/ (a script here)
    from triton_interpreter import compile_sm90
    from kvfit.kernels import attention_common as ker, attention_decode as dec, attention_prefill as pre
    types = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8e4nv"}

    def build(kernel, qd, cd, consts, warps=4):
        ptr = {"q": qd, "out": qd, "key": qd, "value": qd, "k_cache": cd, "v_cache": cd, "slot": "i64",
               "prefix_len": "i32", "block_tables": "i32", "seq_lens": "i32", "query_start_loc": "i32",
               "tile_seqs": "i32", "tile_rows": "i32"}
        sig = {n: "constexpr" if n in consts else f"*{ptr.get(n[:-4], 'fp32')}" if n.endswith("_ptr")
               else "fp32" if n == "scale_log2" else "i32" for n in kernel.arg_names}
        divisible = {n for n in kernel.arg_names
                     if sig[n].startswith("*") or (n.startswith("stride_") and n != "stride_bt")}
        compiled, spills, report = compile_sm90(kernel, sig, consts, divisible, {"num_warps": warps})
        print(f"{kernel.__name__} q={qd} cache={cd}: shared {compiled.metadata.shared} B, spills {spills} B")
        assert spills == 0, report

    bf, f32 = types[torch.bfloat16], types[torch.float32]
    for cache in (bf, types[torch.float8_e4m3fn]):
        build(ker._write_kv_kernel, bf, cache, dict(NUM_KV_HEADS=8, HEAD_DIM=128, H_PAD=8, D_PAD=128, PAGE=16,
                                                    PAD_SLOT=PADDING_SLOT_ID, PDL=True))
    for qd, cache, head_dim, page in ((bf, bf, 128, 16), (bf, types[torch.float8_e4m3fn], 128, 64), (f32, f32, 48, 16)):
        elem, d_pad = (2 if qd == bf else 4), ker.padded_head_dim(head_dim)
        tile = ker.kv_tile_tokens(elem, d_pad, gpu=True)
        for cascade in (False, True):
            build(dec._decode_split_kernel, qd, cache, dict(
                NUM_Q_HEADS=32, GROUP=4, HEAD_CHUNKS=1, G_PAD=dec.heads_per_program(4), HEAD_DIM=head_dim,
                D_PAD=d_pad, PAGE=page, BLOCK_N=tile, DIRECT_OUT=False, IEEE=qd == f32, CASCADE=cascade,
                PDL=True, DOT_F16=False, DOT_FP8=False, OUT_SCALED=cache != bf, PAIRS=False, CVT_ASM=False))
        build(dec._shared_prefix_kernel, qd, cache, dict(
            NUM_Q_HEADS=32, GROUP=4, HEAD_DIM=head_dim, D_PAD=d_pad, PAGE=page, BLOCK_N=tile,
            ROWS=dec.shared_prefix_rows(elem), IEEE=qd == f32, PDL=True, OUT_SCALED=cache != bf))
        for mapped in (False, True):        # the grid of an eager step, and a CUDA graph's tile-mapped one
            build(pre._prefill_kernel, qd, cache, dict(
                GROUP=4, HEAD_DIM=head_dim, D_PAD=d_pad, PAGE=page, BLOCK_M=pre.prefill_tile_rows(elem, gpu=True),
                BLOCK_N=tile, IEEE=qd == f32, SPLIT=qd != f32, MAPPED=mapped, OUT_SCALED=cache != bf, PAIRS=False,
                CVT_ASM=False))
    fp8 = types[torch.float8_e4m3fn]
    for mapped in (False, True):          # an fp8 cache's prefill with the pairs dots (FP8_PREFILL_DOTS)
        build(pre._prefill_kernel, bf, "i16", dict(
            GROUP=4, HEAD_DIM=128, D_PAD=128, PAGE=16, BLOCK_M=pre.prefill_tile_rows(2, gpu=True),
            BLOCK_N=ker.kv_tile_tokens(2, 128, gpu=True), IEEE=False, SPLIT=True, MAPPED=mapped, OUT_SCALED=True,
            PAIRS=True, CVT_ASM=True))
    tile, warps, _, default_dots = dec.FP8_DECODE_CONFIG                 # an fp8 cache's launch, both outputs
    default_pairs = default_dots == "pairs"
    for direct, cascade in ((True, False), (False, False), (False, True)):
        build(dec._decode_split_kernel, bf, "i16" if default_pairs else fp8, dict(
            NUM_Q_HEADS=32, GROUP=4, HEAD_CHUNKS=1, G_PAD=16, HEAD_DIM=128, D_PAD=128, PAGE=16, BLOCK_N=tile,
            DIRECT_OUT=direct, IEEE=False, CASCADE=cascade, PDL=True, DOT_F16=default_dots in ("fp16", "pairs"),
            DOT_FP8=default_dots == "fp8", OUT_SCALED=True, PAIRS=default_pairs, CVT_ASM=default_pairs), warps)
    for tile, warps, dots in ((64, 4, "fp16"), (128, 4, "query"), (128, 8, "fp16"), (128, 4, "fp8"),
                              (64, 4, "fp8"), (128, 4, "pairs"), (64, 4, "pairs"), (128, 8, "pairs")):  # the probe's
        pairs = dots == "pairs"                 # the caches as int16 words, converted by cvt.rn.f16x2.e4m3x2
        build(dec._decode_split_kernel, bf, "i16" if pairs else fp8, dict(
            NUM_Q_HEADS=32, GROUP=4, HEAD_CHUNKS=1, G_PAD=16, HEAD_DIM=128, D_PAD=128, PAGE=16, BLOCK_N=tile,
            DIRECT_OUT=True, IEEE=False, CASCADE=False, PDL=True, DOT_F16=dots in ("fp16", "pairs"),
            DOT_FP8=dots == "fp8", OUT_SCALED=True, PAIRS=pairs, CVT_ASM=pairs), warps)
    for s_pad in (64, 32, 8, 2):      # the most splits (one head a program) to the fewest (the most heads)
        heads = dec.reduce_heads_per_program(32, s_pad, 128)
        build(dec._decode_reduce_kernel, bf, bf, dict(NUM_Q_HEADS=32, HEAD_DIM=128, D_PAD=128, S_PAD=s_pad,
                                                      HEADS=heads, PDL=True))
    print("ok: all kernels compile for sm_90 without spills")


def test_kernels_compile_for_sm90_without_spills():
    from triton_interpreter import run_compile_check
    run_compile_check(__file__, "ok: all kernels compile")


if __name__ == "__main__" and sys.argv[1:2] == ["--huge-offset-check"]:
    _huge_offset_check(getattr(torch, sys.argv[2]))
if COMPILE_CHECK:
    _compile_check()
