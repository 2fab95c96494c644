"""Tensor-parallel pieces: which slice of a checkpoint tensor a rank holds, the sharded layers' collectives.

Megatron-style: q/k/v and gate/up are split by output rows (heads, intermediate channels), o_proj and
down_proj by input columns, followed by one all-reduce each. The embedding and lm_head are split by
vocabulary rows: the embedding looks up the rows this rank holds and all-reduces, the lm_head computes
this rank's logit columns and all-gathers them, so every rank ends with the full logits. Norms are
replicated. KV heads are split when tp divides them, else each rank holds the one head its query
heads read (kvfit.kv.spec.kv_heads_per_rank). With tp_size == 1 every slice is the whole tensor and
no collective runs. Collectives use the default process group (NCCL on CUDA, gloo on CPU).
Every parameter carries `full_shape` (the checkpoint's shape) and `shard` (the slice it holds), so
the loader checks shapes against the checkpoint and reads only this rank's part. A fused parameter (q/k/v,
gate/up, built fused at construction) carries `parts` instead: one ParamPart per checkpoint tensor, which
says that tensor's shape, the slice of it this rank reads and the rows of the parameter it fills; the loader
maps each checkpoint name to (parameter, part index) from them (vLLM's and nano-vllm's packed modules).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from kvfit.errors import ConfigError
from kvfit.kernels.gemv import linear
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


def vocab_rows_per_rank(vocab_size: int, tp_size: int) -> int:
    """Vocabulary rows per rank (the last rank may hold fewer): ceil(vocab / tp)."""
    return -(-vocab_size // tp_size)


def vocab_range(vocab_size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """(first vocab row, count) on this rank; a vocabulary tp does not divide leaves the last rank short."""
    per_rank = vocab_rows_per_rank(vocab_size, tp_size)
    if (tp_size - 1) * per_rank >= vocab_size:
        raise ConfigError(f"--tensor-parallel-size {tp_size} leaves a rank with no rows of the model's "
                          f"{vocab_size}-token vocabulary; use at most {max(vocab_size // 2, 1)}")
    start = tp_rank * per_rank
    return start, min(per_rank, vocab_size - start)


def check_tensor_parallel(num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int,
                          tp_size: int) -> None:
    """ConfigError (one line, before any rank starts) when the model cannot be split tp_size ways."""
    kv_heads_per_rank(num_kv_heads, tp_size)
    split_evenly(num_heads, 0, tp_size, "attention heads")
    split_evenly(intermediate_size, 0, tp_size, "MLP channels (intermediate_size)")
    vocab_range(vocab_size, 0, tp_size)


def make_param(full_shape: tuple[int, ...], shard: Shard | None, dtype, device) -> torch.nn.Parameter:
    """An uninitialised parameter holding `shard` of a tensor of full_shape (the whole when None)."""
    local = list(full_shape)
    if shard is not None:
        local[shard.dim] = shard.size
    param = torch.nn.Parameter(torch.empty(local, dtype=dtype, device=device), requires_grad=False)
    param.full_shape = tuple(full_shape)
    param.shard = shard
    return param


@dataclass(frozen=True)
class OutputPart:
    """One checkpoint linear's output rows in a column-parallel layer (fused with others that read the same
    input: q/k/v, gate/up): rows [start, start + size) of its `rows` are on this rank."""

    name: str               # the checkpoint's module name, e.g. model.layers.0.self_attn.k_proj
    rows: int
    start: int
    size: int


@dataclass(frozen=True)
class ParamPart:
    """Where checkpoint tensor `name` goes in a fused parameter: its shape in the checkpoint, the slice of it
    this rank reads (None: all), and the rows of the parameter (dim 0) it fills."""

    name: str
    full_shape: tuple[int, ...]
    shard: Shard | None
    rows: slice


def column_parts(parts: Sequence[OutputPart], leaf: str, trailing: tuple[int, ...] = ()) -> list[ParamPart]:
    """The ParamParts of tensor `leaf` (weight, bias, ...) of a fused column-parallel layer: each part's rows on
    this rank, stacked in order; trailing: the tensor's shape after the rows (the weight's input columns)."""
    out, offset = [], 0
    for part in parts:
        shard = None if part.size == part.rows else Shard(0, part.start, part.size)
        out.append(ParamPart(f"{part.name}.{leaf}", (part.rows, *trailing), shard, slice(offset, offset + part.size)))
        offset += part.size
    return out


def make_fused_param(parts: Sequence[ParamPart], local_shape: tuple[int, ...], dtype, device) -> torch.nn.Parameter:
    """An uninitialised parameter of local_shape filled from the checkpoint tensors `parts` name."""
    param = torch.nn.Parameter(torch.empty(local_shape, dtype=dtype, device=device), requires_grad=False)
    param.parts = tuple(parts)
    return param


def check_source_shape(name: str, source, full_shape: tuple[int, ...]) -> None:
    """ConfigError naming checkpoint tensor `name` unless its shape is full_shape."""
    shape = source_shape(source)
    if shape != tuple(full_shape):
        raise ConfigError(f"checkpoint tensor {name} has shape {list(shape)} but config.json needs "
                          f"{list(full_shape)}; the weights do not match this config.json")


@torch.no_grad()
def load_part(param: torch.nn.Parameter, index: int, name: str, source) -> None:
    """Checkpoint tensor `name` into part `index` of a fused parameter (shape checked, only this rank's slice
    read); a parameter without parts takes the whole tensor (its full_shape, its shard)."""
    parts = getattr(param, "parts", None)
    if parts is None:
        check_source_shape(name, source, param.full_shape)
        param.copy_(read_shard(param, source))
        return
    part = parts[index]
    check_source_shape(name, source, part.full_shape)
    param[part.rows].copy_(read_slice(part.shard, source))


def source_shape(source) -> tuple[int, ...]:
    """Shape of a checkpoint tensor: a torch.Tensor or a lazy safetensors slice (safe_open().get_slice)."""
    return tuple(source.shape) if isinstance(source, torch.Tensor) else tuple(source.get_shape())


def read_shard(param: torch.nn.Parameter, source) -> torch.Tensor:
    """The part of checkpoint tensor `source` (already shape-checked) that `param` holds.

    A lazy safetensors slice reads only those rows/columns from the file, so no rank ever
    materialises a tensor it holds only a part of.
    """
    return read_slice(getattr(param, "shard", None), source)


def read_slice(shard: Shard | None, source) -> torch.Tensor:
    """Rows/columns `shard` of checkpoint tensor `source` (all of it for None), read lazily from a safetensors slice."""
    if shard is None:
        return source if isinstance(source, torch.Tensor) else source[:]
    index = (slice(None),) * shard.dim + (slice(shard.start, shard.start + shard.size),)
    return source[index]


def all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Sum partial results over the tensor-parallel ranks (the default process group), in place."""
    if tp_size > 1:
        torch.distributed.all_reduce(x)
    return x


def gather_vocab(local: torch.Tensor, vocab_size: int, tp_size: int) -> torch.Tensor:
    """local: [N, rows on this rank] logit columns -> [N, vocab_size] on every rank."""
    if tp_size == 1:
        return local
    per_rank = vocab_rows_per_rank(vocab_size, tp_size)
    # every rank sends the same width, so the last rank pads its (possibly shorter) part
    padded = F.pad(local, (0, per_rank - local.shape[1])).t().contiguous()          # [per_rank, N]
    out = torch.empty((tp_size * per_rank, local.shape[0]), dtype=local.dtype, device=local.device)
    _all_gather_single(out, padded)                                                 # [tp * per_rank, N]
    return out[:vocab_size].t().contiguous()                                        # [N, vocab]


def _all_gather_single(out: torch.Tensor, x: torch.Tensor) -> None:
    # all_gather_single is the name from torch 2.10 on; the older name still works but warns
    gather = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor
    gather(out, x)


class ColumnLinear(torch.nn.Module):
    """y = x W^T + b with W's output rows [out_start, out_start + out_size) on this rank."""

    # the 16-bit weight [out rows here, in] a fused kernel may read in place of this layer's GEMM (models/layers.py
    # silu_gate_up, the attention backend's one-token write); None for layers that are no single 16-bit matrix
    @property
    def dense_weight(self) -> torch.Tensor | None:
        return self.weight

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype, device,
                 out_start: int = 0, out_size: int | None = None):
        super().__init__()
        out_size = out_features if out_size is None else out_size
        shard = None if out_size == out_features else Shard(0, out_start, out_size)
        self.weight = make_param((out_features, in_features), shard, dtype, device)
        self.bias = make_param((out_features,), shard, dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)                   # [T, out_size]


class MergedColumnLinear(ColumnLinear):
    """Column-parallel linears that read the same input fused by output rows at construction (q/k/v, gate/up):
    one weight [sum of the parts' rows here, in], one GEMM; each part's checkpoint tensors fill their rows."""

    def __init__(self, in_features: int, parts: Sequence[OutputPart], bias: bool, dtype, device):
        torch.nn.Module.__init__(self)
        self.parts = tuple(parts)
        rows = sum(part.size for part in parts)
        self.weight = make_fused_param(column_parts(parts, "weight", (in_features,)), (rows, in_features), dtype,
                                       device)                                 # [sum(rows here), in]
        self.bias = make_fused_param(column_parts(parts, "bias"), (rows,), dtype, device) if bias else None


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
        y = all_reduce(linear(x, self.weight), self.tp_size)      # [T, out_features]
        return y if self.bias is None else y + self.bias


class VocabEmbedding(torch.nn.Module):
    """Token embedding with vocabulary rows [start, start + size) here; the rows are summed over ranks."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype, device, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.start, self.size = vocab_range(vocab_size, tp_rank, tp_size)
        self.tp_size = tp_size
        shard = None if tp_size == 1 else Shard(0, self.start, self.size)
        self.weight = make_param((vocab_size, hidden_size), shard, dtype, device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, hidden]
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        elsewhere = (local < 0) | (local >= self.size)                  # rows another rank holds
        x = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        # exactly one rank contributes each row and the others add zeros: the sum is exact
        return all_reduce(x.masked_fill_(elsewhere.unsqueeze(-1), 0.0), self.tp_size)
