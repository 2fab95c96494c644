"""Greedy tokens and the finite-logits check in one read of the logits (Triton, CUDA).

The all-greedy step needs, per row, argmax(logits) and whether every logit is finite (a row that is not
gets NONFINITE_TOKEN). In torch that is an argmax, an isfinite, an all-reduce: three reads of [N, V]
fp32 logits and a [N, V] bool written and read back, and at one row torch's argmax over a 128k
vocabulary runs in one thread block (27 us on the H200, in a 4.4 ms decode step). Here stage 1 splits
each row into chunks of CHUNK logits, one program each ((max, first index of it, any non-finite)),
and stage 2 combines a row's chunks. For a finite row the token is torch.argmax's: the largest value,
the first index among equal ones; a row with any non-finite logit is flagged, and its token is some id
in [0, V) (replaced by the caller, after indexing the output-token counts with it).
"""

from __future__ import annotations

import torch

from kvfit.kernels import pdl
from kvfit.platforms.gate import triton_applies

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # CPU-only installs
    triton = None

CHUNK = 4096      # logits per stage-1 program: a 152k vocabulary is 38 programs per row


def applies(logits: torch.Tensor) -> bool:
    """Use the kernels for these logits: [N, V] fp32/bf16/fp16 on CUDA with Triton, unit stride along V."""
    return (triton_applies(logits) and logits.dim() == 2 and logits.stride(1) == 1
            and logits.dtype in (torch.float32, torch.bfloat16, torch.float16))


if triton is not None:
    @triton.jit
    def _chunk_kernel(logits_ptr, part_max_ptr, part_idx_ptr, part_bad_ptr, stride_row, vocab, num_chunks,
                      CHUNK: tl.constexpr, PDL: tl.constexpr):
        # program (row, chunk): the chunk's max, the first index holding it, whether any logit is non-finite
        if PDL:     # see pdl.py
            gdc_wait()
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        cols = chunk * CHUNK + tl.arange(0, CHUNK)
        in_row = cols < vocab
        x = tl.load(logits_ptr + row * stride_row + cols, mask=in_row, other=float("-inf")).to(tl.float32)
        if PDL:
            gdc_launch_dependents()
        bad = tl.max(((x != x) | (tl.abs(x) == float("inf"))) & in_row, 0)
        best, where = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
        part = row * num_chunks + chunk
        tl.store(part_max_ptr + part, best)
        # within the row even when NaNs lead the max to a masked lane (the row is flagged non-finite then)
        tl.store(part_idx_ptr + part, tl.minimum(chunk * CHUNK + where, vocab - 1))
        tl.store(part_bad_ptr + part, bad.to(tl.int8))

    @triton.jit
    def _combine_kernel(part_max_ptr, part_idx_ptr, part_bad_ptr, tokens_ptr, finite_ptr, num_chunks,
                        P_PAD: tl.constexpr, PDL: tl.constexpr):
        # program (row): the largest chunk max, and the smallest index among the chunks that hold it
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, P_PAD)
        mask = offs < num_chunks
        part = row * num_chunks + offs
        best = tl.load(part_max_ptr + part, mask=mask, other=float("-inf"))
        idx = tl.load(part_idx_ptr + part, mask=mask, other=2**31 - 1)
        bad = tl.load(part_bad_ptr + part, mask=mask, other=0)
        top = tl.max(best, 0)
        token = tl.min(tl.where(mask & (best == top), idx, 2**31 - 1), 0)
        # no chunk matches when NaNs are the maxima (a non-finite row): any id in range will do, its
        # token is replaced, but the counts are indexed by it first
        token = tl.where(token == 2**31 - 1, 0, token)
        tl.store(tokens_ptr + row, token.to(tl.int64))
        tl.store(finite_ptr + row, tl.max(bad, 0) == 0)


def greedy_tokens(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [N, V] (unit stride along V) -> (tokens [N] int64, finite [N] bool): torch.argmax(logits, -1)
    wherever finite[i] (elsewhere some id in [0, V)), and torch.isfinite(logits).all(-1)."""
    assert logits.dim() == 2 and logits.stride(1) == 1, (logits.shape, logits.stride())
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    finite = torch.empty(rows, dtype=torch.bool, device=logits.device)
    if rows == 0:
        return tokens, finite
    num_chunks = triton.cdiv(vocab, CHUNK)
    part_max = torch.empty((rows, num_chunks), dtype=torch.float32, device=logits.device)
    part_idx = torch.empty((rows, num_chunks), dtype=torch.int32, device=logits.device)
    part_bad = torch.empty((rows, num_chunks), dtype=torch.int8, device=logits.device)
    launch = pdl.launch_args(logits)
    _chunk_kernel[(rows, num_chunks)](logits, part_max, part_idx, part_bad, logits.stride(0), vocab, num_chunks,
                                      CHUNK=CHUNK, num_warps=8, **launch)
    _combine_kernel[(rows,)](part_max, part_idx, part_bad, tokens, finite, num_chunks,
                             P_PAD=triton.next_power_of_2(num_chunks), num_warps=1, **launch)
    return tokens, finite
