"""Turn a StepPlan into the flat input tensors and AttentionMetadata. One slot-mapping rule.

Everything is packed into two host tensors (int64 and int32) and moved to the device in two
copies, so a step's set-up cost does not grow with the number of tensors.
"""

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
    width = max(len(s.block_ids) for s in plan.seqs)
    table: list[int] = []                                  # [B * width], row-major, zero padded
    for i, seq in enumerate(plan.seqs):
        n, start = len(seq.token_ids), seq.start_pos
        ids.extend(seq.token_ids)
        positions.extend(range(start, start + n))
        # slot = block * block_size + offset, in Python ints (no 32-bit overflow)
        slots.extend(slot_of(seq.block_ids, p, block_size) for p in range(start, start + n))
        starts.append(starts[-1] + n)
        seq_lens.append(start + n)
        table.extend(seq.block_ids)
        table.extend([0] * (width - len(seq.block_ids)))
        if seq.sample:
            sample_rows.append(starts[-1] - 1)
            sample_seqs.append(i)
    num_tokens, num_seqs = len(ids), len(plan.seqs)
    longs = torch.tensor(ids + positions + slots, dtype=torch.int64).to(device, non_blocking=True)
    ints = torch.tensor(starts + seq_lens + table, dtype=torch.int32).to(device, non_blocking=True)
    meta = AttentionMetadata(
        slot_mapping=longs[2 * num_tokens:],
        query_start_loc=ints[:num_seqs + 1],
        seq_lens=ints[num_seqs + 1:2 * num_seqs + 1],
        block_tables=ints[2 * num_seqs + 1:].view(num_seqs, width),
        max_query_len=max(len(s.token_ids) for s in plan.seqs), max_seq_len=max(seq_lens),
        query_start_loc_host=starts, seq_lens_host=seq_lens)
    return ModelInputs(input_ids=longs[:num_tokens], positions=longs[num_tokens:2 * num_tokens], meta=meta,
                       sample_rows=sample_rows, sample_seqs=sample_seqs)
