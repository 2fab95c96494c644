"""The pairs decode's conversion checked over every pair of e4m3 bytes (the CPU's bit arithmetic in the interpreter,
sm_90's cvt.rn.f16x2.e4m3x2 on a GPU): the two fp16 values torch's own conversion gives, NaN kept."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfit.kernels.attention_common import e4m3_pairs_to_f16     # a global: Triton resolves names from the module's


def check_every_e4m3_pair(device, cvt_asm: bool) -> None:
    """Import this module from inside a test: the kernel is decorated under the caller's TRITON_INTERPRET."""
    @triton.jit
    def convert(w_ptr, even_ptr, odd_ptr, N: tl.constexpr, CVT_ASM: tl.constexpr):
        offs = tl.arange(0, N)
        even, odd = e4m3_pairs_to_f16(tl.load(w_ptr + offs), CVT_ASM)
        tl.store(even_ptr + offs, even)
        tl.store(odd_ptr + offs, odd)

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)   # every code: no inf in e4m3; 0x7F, 0xFF are NaN
    lo, hi = torch.meshgrid(codes, codes, indexing="ij")
    pairs = torch.stack([lo.flatten(), hi.flatten()], 1).contiguous().to(device)   # [65,536, 2] bytes: even, odd
    even, odd = (torch.empty(pairs.shape[0], dtype=torch.float16, device=device) for _ in range(2))
    convert[(1,)](pairs.view(torch.int16).view(-1), even, odd, N=pairs.shape[0], CVT_ASM=cvt_asm)
    values = pairs.view(torch.float8_e4m3fn).to(torch.float16)
    for got, want in ((even, values[:, 0]), (odd, values[:, 1])):
        assert torch.equal(got.isnan(), want.isnan())                  # NaN stays NaN (a poisoned slot shows)
        assert torch.equal(got[~want.isnan()].view(torch.int16), want[~want.isnan()].view(torch.int16))
