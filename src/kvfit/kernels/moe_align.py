"""moe_align: the (token, slot) pairs of a fused MoE step grouped by expert, each group padded to
BLOCK_SIZE_M rows, and each block's expert, in Triton launches with no host sync (CUDA graphs capture it).

One program for small batches (decode); above ALIGN_ONE_PROGRAM_MAX_PAIRS, per-program expert counts
(with each program's share of the padding fill), then a scatter whose programs each sum those counts
themselves (no scan launch, no zeroed scratch). fused_moe.py's grouped GEMMs read the result.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

MAX_FUSED_EXPERTS = 1024     # the align kernels hold one counter per expert in registers
# moe_align: up to ALIGN_ONE_PROGRAM_MAX_PAIRS one program does it all in one launch; above, two launches of
# one program per ALIGN_ROWS_PER_PROGRAM output rows, as many as keep the counts each scatter program reads
# (programs * E_PAD) within ALIGN_MAX_COUNTS. H200, as CUDA graphs (bench_fused_moe.py --align): one program
# 3-4 us at 512 pairs, 7.2 (128 experts) / 3.8 us (8) at 1,024, 10.6 / 5.5 us at 2,048, 162 us at 65,536;
# two launches 5.5-6.8 us up to 2,048 pairs, 10.2 us at 65,536. 1,024 is where they cross (E = 128 first).
ALIGN_ONE_PROGRAM_MAX_PAIRS = 1024
ALIGN_ROWS_PER_PROGRAM = 1024
ALIGN_MAX_COUNTS = 8192
ALIGN_TILE = 1024            # pairs or rows a program handles per loop step


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows after moe_align at most: each expert hit (at most min(E, pairs) of them) pads < block_m rows."""
    return num_pairs + min(num_experts, num_pairs) * (block_m - 1)


if triton is not None:
    @triton.jit
    def _align_histogram(ids_ptr, first, end, E_PAD: tl.constexpr, TILE: tl.constexpr):
        """[E_PAD] int32: how many of the pairs [first, end) each expert has."""
        offs = tl.arange(0, TILE)
        counts = tl.zeros([E_PAD], dtype=tl.int32)
        for start in range(first, end, TILE):
            mask = start + offs < end
            ids = tl.load(ids_ptr + (start + offs).to(tl.int64), mask=mask, other=0).to(tl.int32)
            counts += tl.histogram(ids, E_PAD, mask=mask)
        return counts

    @triton.jit
    def _align_group_ends(counts, block_m):
        """Expert counts [E_PAD] -> (inclusive ends, sizes) of the groups, each padded to a multiple of block_m."""
        padded = (counts + block_m - 1) // block_m * block_m
        return tl.cumsum(padded, 0), padded

    @triton.jit
    def _align_fill(sorted_pair_ids_ptr, first, end, num_pairs, TILE: tl.constexpr):
        """Rows [first, end) start as padding (the value num_pairs)."""
        for start in range(first, end, TILE):
            rows = start + tl.arange(0, TILE)
            tl.store(sorted_pair_ids_ptr + rows.to(tl.int64), num_pairs, mask=rows < end)

    @triton.jit
    def _align_block_experts(block_experts_ptr, group_ends, first, end, block_m, BLOCKS_PER_ITER: tl.constexpr):
        """Blocks [first, end): expert = searchsorted(group_ends, block's first row, right); >= E: unused."""
        for start in range(first, end, BLOCKS_PER_ITER):
            blocks = start + tl.arange(0, BLOCKS_PER_ITER)
            expert = tl.sum((group_ends[None, :] <= (blocks * block_m)[:, None]).to(tl.int32), axis=1)
            tl.store(block_experts_ptr + blocks.to(tl.int64), expert, mask=blocks < end)

    @triton.jit
    def _align_scatter(ids_ptr, cursor_ptr, sorted_pair_ids_ptr, first, end, TILE: tl.constexpr):
        """Pairs [first, end) to their rows: row = cursor[expert]++. The cursors are this program's alone
        (written by it before a barrier), so a relaxed CTA-scope atomic orders enough."""
        for start in range(first, end, TILE):
            pairs = start + tl.arange(0, TILE)
            mask = pairs < end
            ids = tl.load(ids_ptr + pairs.to(tl.int64), mask=mask, other=0)
            rows = tl.atomic_add(cursor_ptr + ids, 1, mask=mask, sem="relaxed", scope="cta").to(tl.int64)
            tl.store(sorted_pair_ids_ptr + rows, pairs, mask=mask)

    # block_m and the sizes are runtime ints: one compile per E_PAD, whatever the config or batch
    @triton.jit(do_not_specialize=["num_pairs", "num_blocks", "block_m"])
    def _align_kernel(ids_ptr, sorted_pair_ids_ptr, block_experts_ptr, cursor_ptr, num_pairs, num_blocks, block_m,
                      E_PAD: tl.constexpr, TILE: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr):
        # one program, one launch (small batches): histogram -> group starts -> padding -> block experts -> scatter
        group_ends, padded = _align_group_ends(_align_histogram(ids_ptr, 0, num_pairs, E_PAD, TILE), block_m)
        tl.store(cursor_ptr + tl.arange(0, E_PAD), group_ends - padded)      # next free row of each group
        _align_fill(sorted_pair_ids_ptr, 0, num_blocks * block_m, num_pairs, TILE)
        _align_block_experts(block_experts_ptr, group_ends, 0, num_blocks, block_m, BLOCKS_PER_ITER)
        tl.debug_barrier()              # the padding fill and the cursors are written before the scatter
        _align_scatter(ids_ptr, cursor_ptr, sorted_pair_ids_ptr, 0, num_pairs, TILE)

    @triton.jit(do_not_specialize=["num_pairs", "num_rows", "pairs_per_program", "rows_per_program"])
    def _align_count_kernel(ids_ptr, counts_ptr, sorted_pair_ids_ptr, num_pairs, num_rows, pairs_per_program,
                            rows_per_program, E_PAD: tl.constexpr, TILE: tl.constexpr):
        # parallel step 1, program p: counts[p] = the histogram of its pairs; its share of the rows -> padding
        pid = tl.program_id(0)
        first = pid * pairs_per_program
        counts = _align_histogram(ids_ptr, first, tl.minimum(first + pairs_per_program, num_pairs), E_PAD, TILE)
        tl.store(counts_ptr + pid * E_PAD + tl.arange(0, E_PAD), counts)
        first_row = pid * rows_per_program
        _align_fill(sorted_pair_ids_ptr, first_row, tl.minimum(first_row + rows_per_program, num_rows), num_pairs,
                    TILE)

    @triton.jit(do_not_specialize=["num_pairs", "num_blocks", "block_m", "num_programs", "pairs_per_program",
                                   "blocks_per_program"])
    def _align_scatter_kernel(ids_ptr, counts_ptr, cursor_ptr, sorted_pair_ids_ptr, block_experts_ptr, num_pairs,
                              num_blocks, block_m, num_programs, pairs_per_program, blocks_per_program,
                              E_PAD: tl.constexpr, TILE: tl.constexpr, PROGRAMS_PER_ITER: tl.constexpr,
                              BLOCKS_PER_ITER: tl.constexpr):
        # parallel step 2, program p: every program's counts [num_programs, E_PAD] -> the group ends (each
        # program sums them itself: no scan launch) and its first row in each group (after the pairs of
        # programs < p); its share of block_experts; its pairs scattered through its own row of cursors
        pid = tl.program_id(0)
        experts = tl.arange(0, E_PAD)
        totals = tl.zeros([E_PAD], dtype=tl.int32)
        before = tl.zeros([E_PAD], dtype=tl.int32)                            # pairs of programs < p
        for start in range(0, num_programs, PROGRAMS_PER_ITER):
            programs = start + tl.arange(0, PROGRAMS_PER_ITER)
            tile = tl.load(counts_ptr + programs[:, None] * E_PAD + experts[None, :],
                           mask=(programs < num_programs)[:, None], other=0)  # [PROGRAMS_PER_ITER, E_PAD]
            totals += tl.sum(tile, axis=0)
            before += tl.sum(tl.where((programs < pid)[:, None], tile, 0), axis=0)
        group_ends, padded = _align_group_ends(totals, block_m)
        cursor_ptr += pid * E_PAD
        tl.store(cursor_ptr + experts, group_ends - padded + before)
        first_block = pid * blocks_per_program
        _align_block_experts(block_experts_ptr, group_ends, first_block,
                             tl.minimum(first_block + blocks_per_program, num_blocks), block_m, BLOCKS_PER_ITER)
        tl.debug_barrier()              # this program's cursors are written before its scatter
        first = pid * pairs_per_program
        _align_scatter(ids_ptr, cursor_ptr, sorted_pair_ids_ptr, first,
                       tl.minimum(first + pairs_per_program, num_pairs), TILE)


def expert_pad(num_experts: int) -> int:
    """Experts rounded up to a power of two >= 16: the align kernels' histogram width."""
    return max(16, 1 << (num_experts - 1).bit_length())


def align_num_programs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Programs moe_align runs: 1 (one launch) up to ALIGN_ONE_PROGRAM_MAX_PAIRS, else parallel_align_programs."""
    if num_pairs <= ALIGN_ONE_PROGRAM_MAX_PAIRS:
        return 1
    return parallel_align_programs(num_pairs, num_experts, block_m)


def parallel_align_programs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Programs of the two-launch align: one per ALIGN_ROWS_PER_PROGRAM rows (rows >= pairs: each program
    fills and scatters at most that many), at least 2, at most ALIGN_MAX_COUNTS // E_PAD (every scatter
    program reads all programs' counts)."""
    num_rows = max_padded_pairs(num_pairs, num_experts, block_m)
    return max(2, min(-(-num_rows // ALIGN_ROWS_PER_PROGRAM), ALIGN_MAX_COUNTS // expert_pad(num_experts)))


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int,
              num_programs: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs grouped by expert, each group padded to a multiple of block_m: Triton launches, no host sync.

    -> sorted_pair_ids [P] int32: pair index t*k + j, groups in expert order, padding rows = T*k;
       block_experts [P // block_m] int32: each block's expert, >= num_experts for blocks past the last group.
    P = max_padded_pairs rounded up to block_m, fixed by the shapes alone (CUDA graphs capture it). The
    order of pairs inside a group is whatever the atomics give; no result depends on it (rows are independent).
    num_programs: None = align_num_programs; 1 = one program, one launch; more = that many programs in two
    launches (counts and the padding fill, then block_experts and the scatter; the stream orders them).
    """
    flat_ids = topk_ids.reshape(-1)                                           # [T*k] pair -> expert
    num_pairs = flat_ids.numel()
    num_blocks = triton.cdiv(max_padded_pairs(num_pairs, num_experts, block_m), block_m)
    num_rows = num_blocks * block_m
    if num_experts > MAX_FUSED_EXPERTS:
        raise ValueError(f"fused_moe takes at most {MAX_FUSED_EXPERTS} experts, got {num_experts}; use moe_reference")
    if num_rows >= 2**31:               # rows and pair ids are int32 inside the align kernels
        raise ValueError(f"{num_pairs} (token, expert) pairs is too many for one fused_moe call; split the batch")
    if num_programs is None:
        num_programs = align_num_programs(num_pairs, num_experts, block_m)
    if num_programs < 1:
        raise ValueError(f"moe_align num_programs={num_programs} must be >= 1 (or None to pick by the batch)")
    num_programs = min(num_programs, max(1, num_pairs))
    e_pad = expert_pad(num_experts)
    device = flat_ids.device
    sorted_pair_ids = torch.empty(num_rows, dtype=torch.int32, device=device)
    block_experts = torch.empty(num_blocks, dtype=torch.int32, device=device)
    tiles = dict(E_PAD=e_pad, TILE=ALIGN_TILE)
    blocks_per_iter = max(16, 8192 // e_pad)
    if num_programs == 1:
        cursor = torch.empty(e_pad, dtype=torch.int32, device=device)        # scratch: next free row per group
        _align_kernel[(1,)](flat_ids, sorted_pair_ids, block_experts, cursor, num_pairs, num_blocks, block_m,
                            BLOCKS_PER_ITER=blocks_per_iter, num_warps=8, **tiles)
        return sorted_pair_ids, block_experts
    # scratch, never zeroed (each entry is written before it is read): per-program counts and cursors
    counts, cursors = torch.empty((2, num_programs, e_pad), dtype=torch.int32, device=device)
    pairs_per_program = triton.cdiv(num_pairs, num_programs)
    _align_count_kernel[(num_programs,)](flat_ids, counts, sorted_pair_ids, num_pairs, num_rows, pairs_per_program,
                                         triton.cdiv(num_rows, num_programs), num_warps=4, **tiles)
    _align_scatter_kernel[(num_programs,)](flat_ids, counts, cursors, sorted_pair_ids, block_experts, num_pairs,
                                           num_blocks, block_m, num_programs, pairs_per_program,
                                           triton.cdiv(num_blocks, num_programs),
                                           PROGRAMS_PER_ITER=min(32, 4096 // e_pad), BLOCKS_PER_ITER=blocks_per_iter,
                                           num_warps=4, **tiles)
    return sorted_pair_ids, block_experts
