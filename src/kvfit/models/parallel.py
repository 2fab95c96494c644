"""Tensor-parallel pieces: which slice of a checkpoint tensor a rank holds, and the sharded linears.

Megatron-style: q/k/v and gate/up are split by output rows (heads, intermediate channels), o_proj and
down_proj by input columns, followed by one all-reduce each. Embeddings, lm_head and norms are
replicated. With tp_size == 1 every slice is the whole tensor and no collective runs.
Every parameter carries `full_shape` (the checkpoint's shape) and `shard` (the slice it holds), so
the loader checks shapes against the checkpoint and copies only this rank's part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvfit.errors import ConfigError
from kvfit.kv.spec import kv_heads_per_rank


@dataclass(frozen=True)
class Shard:
    """This rank's slice of a checkpoint tensor: rows/columns [start, start + size) along dim."""

    dim: int
    start: int
    size: int


def split_evenly(total: int, tp_rank: int, tp_size: int, what: str) -> tuple[int, int]:
    """(start, count) of this rank's part of `total` items split tp_size ways."""
    if total % tp_size:
        raise ConfigError(f"--tensor-parallel-size {tp_size} does not divide the model's {total} {what}; "
                          f"use a divisor of {total}")
    count = total // tp_size
    return tp_rank * count, count


def kv_head_range(num_kv_heads: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """(first kv head, count) on this rank: split when divisible, else one replicated head per rank."""
    count = kv_heads_per_rank(num_kv_heads, tp_size)
    if num_kv_heads % tp_size == 0:
        return tp_rank * count, count
    # tp is a multiple of the kv heads: ranks tp/kv*h .. tp/kv*(h+1)-1 share kv head h,
    # which is the head their query heads (a contiguous block of one GQA group) read
    return tp_rank * num_kv_heads // tp_size, count


def make_param(full_shape: tuple[int, ...], shard: Shard | None, dtype, device) -> torch.nn.Parameter:
    """An uninitialised parameter holding `shard` of a tensor of full_shape (the whole when None)."""
    local = list(full_shape)
    if shard is not None:
        local[shard.dim] = shard.size
    param = torch.nn.Parameter(torch.empty(local, dtype=dtype, device=device), requires_grad=False)
    param.full_shape = tuple(full_shape)
    param.shard = shard
    return param


def shard_of(param: torch.nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    """The part of checkpoint tensor `full` (already shape-checked) that `param` holds."""
    shard = getattr(param, "shard", None)
    return full if shard is None else full.narrow(shard.dim, shard.start, shard.size)


def all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Sum partial results over the tensor-parallel ranks (the default process group)."""
    if tp_size > 1:
        torch.distributed.all_reduce(x)
    return x


class ColumnLinear(torch.nn.Module):
    """y = x W^T + b with W's output rows [out_start, out_start + out_size) on this rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype, device,
                 out_start: int = 0, out_size: int | None = None):
        super().__init__()
        out_size = out_features if out_size is None else out_size
        shard = None if out_size == out_features else Shard(0, out_start, out_size)
        self.weight = make_param((out_features, in_features), shard, dtype, device)
        self.bias = make_param((out_features,), shard, dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)                 # [T, out_size]


class RowLinear(torch.nn.Module):
    """y = all_reduce(x_part W_part^T) + b, with W's input columns [in_start, in_start + in_size) here."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype, device,
                 in_start: int = 0, in_size: int | None = None, tp_size: int = 1):
        super().__init__()
        in_size = in_features if in_size is None else in_size
        shard = None if in_size == in_features else Shard(1, in_start, in_size)
        self.tp_size = tp_size
        self.weight = make_param((out_features, in_features), shard, dtype, device)
        # the bias is added once, after the sum over ranks
        self.bias = make_param((out_features,), None, dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(F.linear(x, self.weight), self.tp_size)    # [T, out_features]
        return y if self.bias is None else y + self.bias
