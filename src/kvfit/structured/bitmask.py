"""Token bitmasks: one bit per vocabulary id, 1 = allowed; applied to logits as -inf where 0.

Layout (llguidance's and xgrammar's): int32 [rows, ceil(vocab_size / 32)], token t is bit t % 32 of
word t // 32. The matchers fill rows on the CPU; apply_bitmask runs on the logits' device.

llguidance's own apply kernel is a torch.compile'd function: its first call on the CPU took 32 s
(inductor compiling C++), so kvfit applies the mask with plain torch ops that run the same on every
device: the words are read as bytes (little-endian, as CPUs and GPUs store them), so unpacking
bytes in order gives the bits in token order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

BITS_PER_WORD = 32


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


def allocate_bitmask(rows: int, vocab_size: int, pin_memory: bool = False) -> torch.Tensor:
    """A CPU bitmask of `rows` rows, every token allowed (-1 = all bits set)."""
    # bitmask: [rows, words] int32
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32, pin_memory=pin_memory)


def _apply(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int | None) -> None:
    # logits: [n, width] float, bitmask: [n, words] int32, both on one device
    n, width = logits.shape
    limit = min(width, bitmask.shape[1] * BITS_PER_WORD, width if vocab_size is None else vocab_size)
    shifts = torch.arange(8, dtype=torch.uint8, device=logits.device)
    as_bytes = bitmask.contiguous().view(torch.uint8)                            # [n, words * 4]
    allowed = ((as_bytes.unsqueeze(-1) >> shifts) & 1).view(n, -1)[:, :limit]   # [n, limit] in token order
    logits[:, :limit].masked_fill_(allowed == 0, float("-inf"))
    if limit < width:                     # ids past the vocabulary or the mask are never allowed
        logits[:, limit:] = float("-inf")


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | torch.Tensor | None = None,
                  vocab_size: int | None = None) -> None:
    """Set logits[i, t] = -inf wherever bit t of bitmask[i] is 0, in place (CPU or CUDA logits).

    logits: [batch, width] float; bitmask: [>= batch, words] int32 (copied to logits' device).
    rows: the row indices to mask (the same index in logits and bitmask); None masks every row.
    vocab_size: ids from it on are masked too (default: as far as the bitmask reaches).
    """
    assert bitmask.dtype == torch.int32 and bitmask.dim() == 2 and logits.dim() == 2, "bad bitmask or logits"
    if rows is None:
        _apply(logits, bitmask[:logits.shape[0]].to(logits.device, non_blocking=True), vocab_size)
        return
    index = torch.as_tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
    if index.numel() == 0:
        return
    picked = logits.index_select(0, index)
    _apply(picked, bitmask.to(logits.device, non_blocking=True).index_select(0, index), vocab_size)
    logits.index_copy_(0, index, picked)
