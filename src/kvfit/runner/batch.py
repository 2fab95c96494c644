"""Turn a StepPlan into the flat input tensors and AttentionMetadata. One slot-mapping rule."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfit.attention.base import AttentionMetadata
from kvfit.engine.step_plan import StepPlan


def slot_of(block_ids, position: int, block_size: int) -> int:
    """The cache slot of the token at `position` in a sequence with this block table."""
    return block_ids[position // block_size] * block_size + position % block_size


@dataclass
class ModelInputs:
    input_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64
    meta: AttentionMetadata
    sample_rows: list[int]         # row in the flat batch whose logits are sampled, per sampled seq
    sample_seqs: list[int]         # index into plan.seqs of each sampled row


def build_inputs(plan: StepPlan, block_size: int, device: torch.device) -> ModelInputs:
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    seq_lens: list[int] = []
    sample_rows, sample_seqs = [], []
    for i, seq in enumerate(plan.seqs):
        n = len(seq.token_ids)
        ids.extend(seq.token_ids)
        positions.extend(range(seq.start_pos, seq.start_pos + n))
        # slot = block * block_size + offset, computed in Python ints (no 32-bit overflow)
        slots.extend(slot_of(seq.block_ids, p, block_size) for p in range(seq.start_pos, seq.start_pos + n))
        starts.append(starts[-1] + n)
        seq_lens.append(seq.start_pos + n)
        if seq.sample:
            sample_rows.append(starts[-1] - 1)
            sample_seqs.append(i)
    width = max(len(s.block_ids) for s in plan.seqs)
    table = torch.zeros((len(plan.seqs), width), dtype=torch.int32)   # [B, max_blocks]
    for i, seq in enumerate(plan.seqs):
        table[i, :len(seq.block_ids)] = torch.tensor(seq.block_ids, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=table.to(device),
        max_query_len=max(len(s.token_ids) for s in plan.seqs), max_seq_len=max(seq_lens),
        query_start_loc_host=starts, seq_lens_host=seq_lens)
    return ModelInputs(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        meta=meta, sample_rows=sample_rows, sample_seqs=sample_seqs)
