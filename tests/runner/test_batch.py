"""build_inputs: StepPlan -> flat input ids, positions, slot mapping, block tables and sample rows.

The one slot-mapping rule: slot = block_ids[pos // block_size] * block_size + pos % block_size.
"""

from __future__ import annotations

import torch

from kvfit.engine.request import Request
from kvfit.engine.sampling_params import SamplingParams
from kvfit.engine.scheduler import Scheduler
from kvfit.engine.step_plan import ScheduledSeq, StepPlan
from kvfit.kv.pool import BlockPool
from kvfit.runner.batch import build_inputs, slot_mapping

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0)


def seq(request_id, token_ids, start_pos, block_ids, sample, num_generated=0) -> ScheduledSeq:
    return ScheduledSeq(request_id=request_id, token_ids=tuple(token_ids), start_pos=start_pos,
                        block_ids=tuple(block_ids), sample=sample, params=GREEDY, num_generated=num_generated)


def expected_slots(s: ScheduledSeq, block_size: int) -> list[int]:
    return [s.block_ids[p // block_size] * block_size + p % block_size
            for p in range(s.start_pos, s.start_pos + len(s.token_ids))]


def test_slot_mapping_rule():
    table = torch.tensor([[7, 2], [5, 0]], dtype=torch.int32)
    seq_index = torch.tensor([0, 0, 0, 0, 1])
    positions = torch.tensor([0, 3, 4, 7, 2])
    assert slot_mapping(table, seq_index, positions, 4).tolist() == [28, 31, 8, 11, 22]
    assert slot_mapping(table, torch.tensor([1]), torch.tensor([0]), 1).tolist() == [5]
    big = torch.tensor([[2**31 - 1]], dtype=torch.int32)        # the largest int32 block id
    slot = slot_mapping(big, torch.tensor([0]), torch.tensor([15]), 16)
    assert slot.dtype == torch.int64 and slot.item() == (2**31 - 1) * 16 + 15


def test_mixed_prefill_chunk_and_decode():
    bs = 4
    plan = StepPlan(seqs=(
        seq("prefill", [11, 12, 13, 14, 15], 0, [7, 2], sample=True),
        seq("chunk", [21, 22, 23], 6, [3, 9, 1], sample=False),     # positions 6, 7, 8: crosses a block
        seq("decode", [31], 10, [4, 5, 8], sample=True, num_generated=3),
    ))
    inputs = build_inputs(plan, bs, CPU)
    meta = inputs.meta
    assert inputs.input_ids.tolist() == [11, 12, 13, 14, 15, 21, 22, 23, 31]
    assert inputs.positions.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 10]
    assert meta.slot_mapping.tolist() == [28, 29, 30, 31, 8, 38, 39, 4, 34]
    assert meta.slot_mapping.tolist() == sum((expected_slots(s, bs) for s in plan.seqs), [])
    assert meta.query_start_loc.tolist() == [0, 5, 8, 9] and meta.query_start_loc_host == [0, 5, 8, 9]
    assert meta.seq_lens.tolist() == [5, 9, 11] and meta.seq_lens_host == [5, 9, 11]
    assert meta.block_tables.tolist() == [[7, 2, 0], [3, 9, 1], [4, 5, 8]]   # padded to the widest
    assert meta.max_query_len == 5 and meta.max_seq_len == 11
    assert meta.num_seqs == 3 and not meta.decode_only
    # the last token of each sampled seq; the chunk that does not sample has no row
    assert inputs.sample_rows == [4, 8] and inputs.sample_seqs == [0, 2]
    assert inputs.input_ids.dtype == torch.int64 and inputs.positions.dtype == torch.int64
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.query_start_loc.dtype == torch.int32 and meta.seq_lens.dtype == torch.int32
    assert meta.block_tables.dtype == torch.int32 and meta.block_tables.shape == (3, 3)


def test_decode_only_batch():
    plan = StepPlan(seqs=(seq("a", [5], 3, [0], True), seq("b", [6], 8, [1, 2, 3], True)))
    inputs = build_inputs(plan, 4, CPU)
    assert inputs.meta.decode_only and inputs.meta.max_query_len == 1
    assert inputs.meta.slot_mapping.tolist() == [3, 12]
    assert inputs.positions.tolist() == [3, 8]
    assert inputs.sample_rows == [0, 1] and inputs.sample_seqs == [0, 1]


def test_slots_past_int32_stay_exact():
    bs = 16
    big = 2**31 // bs + 5                             # slot ids above 2^31 - 1
    plan = StepPlan(seqs=(seq("a", [1, 2], 30, [0, big], True),))
    inputs = build_inputs(plan, bs, CPU)
    assert inputs.meta.slot_mapping.tolist() == [big * bs + 14, big * bs + 15]
    assert inputs.meta.slot_mapping.tolist()[0] > 2**31


def test_block_size_one():
    plan = StepPlan(seqs=(seq("a", [1, 2, 3], 0, [9, 4, 6], True),))
    assert build_inputs(plan, 1, CPU).meta.slot_mapping.tolist() == [9, 4, 6]


def test_slot_mapping_matches_the_rule_for_scheduler_plans():
    """Drive a real scheduler (chunked prefill, prefix caching, preemption) and check every plan."""
    bs = 4
    pool = BlockPool(10, enable_prefix_caching=True)
    sched = Scheduler(pool, bs, max_model_len=24, max_num_seqs=4, max_num_batched_tokens=9)
    prompts = {"a": list(range(1, 14)), "b": list(range(1, 9)) + [40, 41], "c": [5, 6, 7], "d": list(range(1, 10))}
    for rid, prompt in prompts.items():
        sched.add(Request(request_id=rid, prompt_token_ids=prompt, params=SamplingParams(max_tokens=8)))
    steps = 0
    while sched.num_unfinished:
        steps += 1
        assert steps < 200
        plan = sched.schedule()
        inputs = build_inputs(plan, bs, CPU)
        meta = inputs.meta
        assert meta.slot_mapping.tolist() == sum((expected_slots(s, bs) for s in plan.seqs), [])
        assert inputs.input_ids.tolist() == [t for s in plan.seqs for t in s.token_ids]
        assert len(set(meta.slot_mapping.tolist())) == plan.num_tokens       # no slot written twice
        for i, s in enumerate(plan.seqs):
            assert meta.block_tables[i, :len(s.block_ids)].tolist() == list(s.block_ids)
            assert meta.seq_lens_host[i] == s.start_pos + len(s.token_ids)
        assert [plan.seqs[i].sample for i in inputs.sample_seqs] == [True] * len(inputs.sample_seqs)
        assert len(inputs.sample_seqs) == sum(s.sample for s in plan.seqs)
        sched.update(plan, {s.request_id: 100 + s.num_generated for s in plan.seqs if s.sample})
        pool.check_invariants()
    assert pool.num_used_blocks == 0
    assert sched.num_preemptions > 0 and sched.num_prefix_hits > 0     # the plans covered both paths


def test_a_table_shorter_than_its_tokens_is_refused():
    # positions 4..5 need a second block of 4: the zero padding must not stand in for it
    import pytest
    plan = StepPlan(seqs=(seq("a", [1, 2], 4, [7], True), seq("b", [3], 0, [1, 2], True)))
    with pytest.raises(AssertionError, match="block table too short"):
        build_inputs(plan, 4, CPU)
