"""Turn a StepDelta over the persistent batch into flat input tensors and AttentionMetadata.

One slot-mapping rule. Host work is one pass over the scheduled requests (their token slices and
lengths); the step's block tables are gathered from the persistent table on the device, never
rebuilt from Python lists. Everything from the host travels in two copies (int64 and int32).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Callable

import torch

from kvfit.attention.base import AttentionMetadata
from kvfit.runner.input_batch import InputBatch
from kvfit.step import StepDelta


def slot_mapping(block_tables: torch.Tensor, seq_index: torch.Tensor, positions: torch.Tensor,
                 block_size: int) -> torch.Tensor:
    """The cache slot of each token: block_tables[seq, pos // block_size] * block_size + pos % block_size.

    block_tables: [B, W] int32; seq_index, positions: [T] int64 -> [T] int64 (slot ids pass 2^31 on
    large caches, so the product is taken in int64). Host or device tensors: the runner uses this one
    rule to build a step's inputs and to advance multi-step decoding on the device.
    """
    block = block_tables[seq_index, positions // block_size].to(torch.int64)
    return block * block_size + positions % block_size


@dataclass
class ModelInputs:
    input_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor      # [N] int64: row in the flat batch whose logits are sampled
    sample_seqs: list[int]         # index into delta.request_ids of each sampled row
    batch_rows: torch.Tensor       # [N] int64: persistent-batch row of each sampled request
    batch_rows_host: list[int]
    num_generated: torch.Tensor    # [N] int64: tokens each sampled request generated before this step
    num_generated_host: list[int]
    # a `continues` delta: index (into delta.request_ids) of each request whose input is the token the device
    # sampled for it in the step still in flight (the runner puts it in); the rest read known tokens
    carried: list[int]


def shared_prefix_tokens(delta: StepDelta, seq_lens: list[int], block_size: int) -> int:
    """Tokens (whole blocks) whose K/V every sequence of a decode delta shares with the first sequence's blocks
    (StepDelta.num_common_prefix_blocks), each sequence having at least one token more."""
    if not delta.num_common_prefix_blocks or not seq_lens:
        return 0
    return min(delta.num_common_prefix_blocks, (min(seq_lens) - 1) // block_size) * block_size


def build_inputs(batch: InputBatch, delta: StepDelta, block_size: int,
                 cascade_tokens: Callable[[int, int], int] | None = None) -> ModelInputs:
    """cascade_tokens: the attention backend's (AttentionBackend.cascade_tokens), to mark a decode step's
    shared prefix in the metadata; None: never."""

    reqs = [batch.requests[request_id] for request_id in delta.request_ids]
    q_lens = list(delta.num_scheduled_tokens)
    num_seqs, device = len(reqs), batch.device
    starts = [0, *accumulate(q_lens)]
    num_tokens = starts[-1]
    seq_lens = [r.num_computed_tokens + n for r, n in zip(reqs, q_lens)]
    # a table shorter than its tokens would map them into block 0 of the padding: someone's block
    assert all(r.num_blocks * block_size >= n for r, n in zip(reqs, seq_lens)), "block table too short"
    width = max(r.num_blocks for r in reqs)
    ids: list[int] = []
    carried: list[int] = []
    for i, (r, n) in enumerate(zip(reqs, q_lens)):
        chunk = r.token_ids[r.num_computed_tokens:r.num_computed_tokens + n]
        if len(chunk) != n:             # continues: one decode token, sampled on the device, not yet recorded
            assert delta.continues and n == 1 and not chunk, "inputs beyond the request's known tokens"
            carried.append(i)
            chunk = [0]
        ids.extend(chunk)
    sample_seqs = [i for i, (r, n) in enumerate(zip(reqs, seq_lens)) if n == r.num_tokens]
    rows = [r.row for r in reqs]
    sampled = [reqs[i] for i in sample_seqs]
    host = torch.tensor(ids + [r.num_computed_tokens - st for r, st in zip(reqs, starts)] + rows
                        + [starts[i + 1] - 1 for i in sample_seqs] + [r.row for r in sampled]
                        + [r.num_generated for r in sampled], dtype=torch.int64)
    longs = host.to(device, non_blocking=True)
    # seq_lens starts 16-byte aligned whatever the batch size: Triton specialises a kernel on each pointer's
    # alignment, and an unaligned variant first met mid-run compiled there, in the timed region (the first
    # 0.6B throughput run: 16.1k tok/s against 24.8k, one _prefill_kernel compile inside it)
    pad = -(num_seqs + 1) % 4
    prefix = 0
    if cascade_tokens is not None and num_tokens == num_seqs:
        prefix = cascade_tokens(shared_prefix_tokens(delta, seq_lens, block_size), num_seqs)
    head = [prefix, 0, 0, 0] if prefix else []          # 16 bytes: the rest stays aligned
    ints = torch.tensor(head + starts + [0] * pad + seq_lens, dtype=torch.int32).to(device, non_blocking=True)
    prefix_len, ints = (ints[:1], ints[4:]) if prefix else (None, ints)
    ids_d, first, rows_d, tail = longs.split([num_tokens, num_seqs, num_seqs, 3 * len(sample_seqs)])
    if num_tokens == num_seqs:                                              # one token each (decode)
        seq_index = torch.arange(num_seqs, device=device)
        positions = first + seq_index
    else:
        seq_index = torch.repeat_interleave(torch.arange(num_seqs, device=device), ints[1:num_seqs + 1] - ints[:num_seqs],
                                            output_size=num_tokens)                         # [T]
        positions = first[seq_index] + torch.arange(num_tokens, device=device)
    tables = batch.block_table[rows_d, :width]                              # [B, width] gathered
    meta = AttentionMetadata(
        slot_mapping=slot_mapping(tables, seq_index, positions, block_size),
        query_start_loc=ints[:num_seqs + 1], seq_lens=ints[num_seqs + 1 + pad:],
        block_tables=tables, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_start_loc_host=starts, seq_lens_host=seq_lens, prefix_len=prefix_len)
    sample_rows, batch_rows, num_generated = tail.view(3, -1)
    return ModelInputs(input_ids=ids_d, positions=positions, meta=meta, sample_rows=sample_rows,
                       sample_seqs=sample_seqs, batch_rows=batch_rows, batch_rows_host=[r.row for r in sampled],
                       num_generated=num_generated, num_generated_host=[r.num_generated for r in sampled],
                       carried=carried)
