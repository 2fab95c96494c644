"""Turn a StepPlan into the flat input tensors and AttentionMetadata. One slot-mapping rule.

Everything is packed into two host tensors (int64 and int32) and moved to the device in two
copies, so a step's set-up cost does not grow with the number of tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate, chain

import torch

from kvfit.attention.base import AttentionMetadata
from kvfit.engine.step_plan import StepPlan


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
    sample_rows: list[int]         # row in the flat batch whose logits are sampled, per sampled seq
    sample_seqs: list[int]         # index into plan.seqs of each sampled row


def build_inputs(plan: StepPlan, block_size: int, device: torch.device) -> ModelInputs:
    seqs = plan.seqs
    num_seqs = len(seqs)
    q_lens = [len(s.token_ids) for s in seqs]
    starts = [0, *accumulate(q_lens)]
    seq_lens = [s.start_pos + n for s, n in zip(seqs, q_lens)]
    width = max(len(s.block_ids) for s in seqs)
    # a table shorter than its tokens would map them into block 0 of the padding: someone's block
    assert all(len(s.block_ids) * block_size >= n for s, n in zip(seqs, seq_lens)), "block table too short"
    table = torch.tensor([s.block_ids + (0,) * (width - len(s.block_ids)) for s in seqs],
                         dtype=torch.int32)                                 # [B, width], zero padded
    num_tokens = starts[-1]
    ids = torch.tensor(list(chain.from_iterable(s.token_ids for s in seqs)), dtype=torch.int64)
    if num_tokens == num_seqs:                                              # one token each (decode)
        seq_index = torch.arange(num_seqs)
        positions = torch.tensor([s.start_pos for s in seqs], dtype=torch.int64)
    else:
        seq_index = torch.repeat_interleave(torch.arange(num_seqs), torch.tensor(q_lens))     # [T]
        first = torch.tensor([s.start_pos - st for s, st in zip(seqs, starts)], dtype=torch.int64)
        positions = first[seq_index] + torch.arange(num_tokens)
    slots = slot_mapping(table, seq_index, positions, block_size)
    sample_seqs = [i for i, s in enumerate(seqs) if s.sample]
    sample_rows = [starts[i + 1] - 1 for i in sample_seqs]
    # two host-to-device copies per step, whatever the number of tensors
    longs = torch.cat((ids, positions, slots)).to(device, non_blocking=True)
    ints = torch.cat((torch.tensor(starts + seq_lens, dtype=torch.int32), table.view(-1))).to(device,
                                                                                             non_blocking=True)
    meta = AttentionMetadata(
        slot_mapping=longs[2 * num_tokens:],
        query_start_loc=ints[:num_seqs + 1],
        seq_lens=ints[num_seqs + 1:2 * num_seqs + 1],
        block_tables=ints[2 * num_seqs + 1:].view(num_seqs, width),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_start_loc_host=starts, seq_lens_host=seq_lens)
    return ModelInputs(input_ids=longs[:num_tokens], positions=longs[num_tokens:2 * num_tokens], meta=meta,
                       sample_rows=sample_rows, sample_seqs=sample_seqs)
