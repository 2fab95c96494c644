"""build_inputs: a StepDelta over the persistent batch -> flat input ids, positions, slot mapping,
block tables and sample rows.

The one slot-mapping rule: slot = block_ids[pos // block_size] * block_size + pos % block_size.
"""

from __future__ import annotations

import pytest
import torch

from kvfit.engine.request import Request
from kvfit.engine.scheduler import Scheduler
from kvfit.kv.manager import KVCacheManager
from kvfit.kv.pool import BlockPool
from kvfit.runner.batch import build_inputs, slot_mapping
from kvfit.runner.input_batch import InputBatch
from kvfit.sampling_params import SamplingParams
from kvfit.step import NewRequest, StepDelta

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0)


def seq(request_id, token_ids, start_pos, block_ids, sample, num_generated=0) -> tuple[NewRequest, int]:
    """A request the runner has not seen, whose next chunk is token_ids at start_pos (prefix tokens are 0)."""
    tokens = [0] * start_pos + list(token_ids) + ([] if sample else [0])
    num_prompt = len(tokens) - num_generated
    new = NewRequest(request_id=request_id, prompt_token_ids=tuple(tokens[:num_prompt]),
                     output_token_ids=tuple(tokens[num_prompt:]), params=GREEDY, block_ids=tuple(block_ids),
                     num_computed_tokens=start_pos)
    return new, len(token_ids)


def step_inputs(seqs, block_size, num_rows=8, max_blocks=2**27):
    batch = InputBatch(num_rows, min(max_blocks, 8), vocab_size=64, device=CPU)
    delta = StepDelta(request_ids=tuple(n.request_id for n, _ in seqs), num_scheduled_tokens=tuple(k for _, k in seqs),
                      new_block_ids=((),) * len(seqs), new_requests=tuple(n for n, _ in seqs))
    batch.apply(delta)
    return build_inputs(batch, delta, block_size)


def expected_slots(table, start_pos, num_tokens, block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in range(start_pos, start_pos + num_tokens)]


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
    seqs = [seq("prefill", [11, 12, 13, 14, 15], 0, [7, 2], sample=True),
            seq("chunk", [21, 22, 23], 6, [3, 9, 1], sample=False),     # positions 6, 7, 8: crosses a block
            seq("decode", [31], 10, [4, 5, 8], sample=True, num_generated=3)]
    inputs = step_inputs(seqs, bs)
    meta = inputs.meta
    assert inputs.input_ids.tolist() == [11, 12, 13, 14, 15, 21, 22, 23, 31]
    assert inputs.positions.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 10]
    assert meta.slot_mapping.tolist() == [28, 29, 30, 31, 8, 38, 39, 4, 34]
    assert meta.query_start_loc.tolist() == [0, 5, 8, 9] and meta.query_start_loc_host == [0, 5, 8, 9]
    assert meta.seq_lens.tolist() == [5, 9, 11] and meta.seq_lens_host == [5, 9, 11]
    assert meta.block_tables.tolist() == [[7, 2, 0], [3, 9, 1], [4, 5, 8]]   # gathered, padded to the widest
    assert meta.max_query_len == 5 and meta.max_seq_len == 11
    assert meta.num_seqs == 3 and not meta.decode_only
    # the last token of each sampled seq; the chunk that does not sample has no row
    assert inputs.sample_rows.tolist() == [4, 8] and inputs.sample_seqs == [0, 2]
    assert inputs.num_generated.tolist() == [0, 3] and inputs.batch_rows.tolist() == inputs.batch_rows_host
    assert inputs.input_ids.dtype == torch.int64 and inputs.positions.dtype == torch.int64
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.query_start_loc.dtype == torch.int32 and meta.seq_lens.dtype == torch.int32
    assert meta.block_tables.dtype == torch.int32 and meta.block_tables.shape == (3, 3)


def test_decode_only_batch():
    inputs = step_inputs([seq("a", [5], 3, [0], True), seq("b", [6], 8, [1, 2, 3], True)], 4)
    assert inputs.meta.decode_only and inputs.meta.max_query_len == 1
    assert inputs.meta.slot_mapping.tolist() == [3, 12]
    assert inputs.positions.tolist() == [3, 8]
    assert inputs.sample_rows.tolist() == [0, 1] and inputs.sample_seqs == [0, 1]


@pytest.mark.parametrize("num_seqs", [1, 2, 3, 4, 5, 7, 8])
def test_per_seq_vectors_start_16_byte_aligned_for_every_batch_size(num_seqs):
    # Triton specialises kernels on pointer alignment: seq_lens must not change it with the batch size
    inputs = step_inputs([seq(f"r{i}", [1, 2], 3 * i, [i], True) for i in range(num_seqs)], 64)
    meta = inputs.meta
    assert meta.seq_lens.data_ptr() % 16 == 0 and meta.query_start_loc.data_ptr() % 16 == 0
    assert meta.seq_lens.tolist() == [3 * i + 2 for i in range(num_seqs)] == meta.seq_lens_host
    assert meta.query_start_loc.tolist() == list(range(0, 2 * num_seqs + 1, 2))


def test_slots_past_int32_stay_exact():
    bs = 16
    big = 2**31 // bs + 5                             # slot ids above 2^31 - 1
    inputs = step_inputs([seq("a", [1, 2], 30, [0, big], True)], bs)
    assert inputs.meta.slot_mapping.tolist() == [big * bs + 14, big * bs + 15]
    assert inputs.meta.slot_mapping.tolist()[0] > 2**31


def test_block_size_one():
    assert step_inputs([seq("a", [1, 2, 3], 0, [9, 4, 6], True)], 1).meta.slot_mapping.tolist() == [9, 4, 6]


def test_tables_are_appended_to_and_rows_reused():
    batch = InputBatch(2, 4, vocab_size=64, device=CPU)
    a, _ = seq("a", [1, 2, 3], 0, [5], True)
    batch.apply(StepDelta(request_ids=("a",), num_scheduled_tokens=(3,), new_block_ids=((),), new_requests=(a,)))
    batch.advance(StepDelta(request_ids=("a",), num_scheduled_tokens=(3,)))
    batch.record_sampled({"a": [9]})
    batch.apply(StepDelta(request_ids=("a",), num_scheduled_tokens=(1,), new_block_ids=((6, 7),)))
    row = batch.requests["a"].row
    assert batch.block_table[row, :3].tolist() == [5, 6, 7] and batch.requests["a"].token_ids == [1, 2, 3, 9]
    b, _ = seq("b", [4], 0, [1], True)
    batch.apply(StepDelta(request_ids=("b",), num_scheduled_tokens=(1,), new_block_ids=((),), new_requests=(b,),
                          finished_ids=("a", "never-seen")))
    assert set(batch.requests) == {"b"} and batch.requests["b"].row == row      # a's row, reused
    assert batch.block_table[row, 0].item() == 1


def finish_step(sched: Scheduler, batch: InputBatch, delta: StepDelta, inputs, tokens: dict[int, int]) -> None:
    """What the engine does after a step: record the sampled tokens (by index into the delta) in the batch and
    the scheduler, end requests at their length, check the pool."""
    sampled = {delta.request_ids[i]: t for i, t in tokens.items()}
    batch.advance(delta)
    batch.record_sampled({rid: [t] for rid, t in sampled.items()})
    for req in sched.update(delta, sampled):
        if req.num_tokens >= req.max_total_tokens:
            sched.finish(req.request_id, "length")
    sched.pool.check_invariants()


def test_slot_mapping_matches_the_rule_for_scheduler_deltas():
    """Drive a real scheduler (chunked prefill, prefix caching, preemption) and check every step."""
    bs = 4
    pool = BlockPool(10, enable_prefix_caching=True)
    sched = Scheduler(KVCacheManager(pool, bs), max_model_len=24, max_num_seqs=4, max_num_batched_tokens=9)
    batch = InputBatch(4, 6, vocab_size=200, device=CPU)
    prompts = {"a": list(range(1, 14)), "b": list(range(1, 9)) + [40, 41], "c": [5, 6, 7], "d": list(range(1, 10))}
    for rid, prompt in prompts.items():
        sched.add(Request(request_id=rid, prompt_token_ids=prompt, params=SamplingParams(max_tokens=8),
                          max_total_tokens=len(prompt) + 8))
    steps = 0
    while sched.num_unfinished:
        steps += 1
        assert steps < 200
        delta = sched.schedule()
        batch.apply(delta)
        inputs = build_inputs(batch, delta, bs)
        meta = inputs.meta
        reqs = [sched.requests[rid] for rid in delta.request_ids]
        expected = []
        for req, n in zip(reqs, delta.num_scheduled_tokens):
            expected += expected_slots(sched.block_ids(req.request_id), req.num_computed_tokens, n, bs)
        assert meta.slot_mapping.tolist() == expected
        assert inputs.input_ids.tolist() == [t for req, n in zip(reqs, delta.num_scheduled_tokens)
                                             for t in req.token_ids[req.num_computed_tokens:req.num_computed_tokens + n]]
        assert len(set(meta.slot_mapping.tolist())) == delta.num_tokens       # no slot written twice
        for i, req in enumerate(reqs):
            table = list(sched.block_ids(req.request_id))
            assert meta.block_tables[i, :len(table)].tolist() == table
        finish_step(sched, batch, delta, inputs, {i: 100 + reqs[i].num_output_tokens for i in inputs.sample_seqs})
    assert pool.num_used_blocks == 0
    assert sched.num_preemptions > 0 and sched.num_prefix_hits > 0     # the steps covered both paths


def test_a_table_shorter_than_its_tokens_is_refused():
    # positions 4..5 need a second block of 4: the zero padding must not stand in for it
    with pytest.raises(AssertionError, match="block table too short"):
        step_inputs([seq("a", [1, 2], 4, [7], True), seq("b", [3], 0, [1, 2], True)], 4)


@pytest.mark.parametrize("with_sampling", [True, False])
@pytest.mark.parametrize("max_model_len", [None, 12, 40])     # counts per id; token ids (12 < 33); counts again
def test_num_bytes_is_what_the_tensors_hold(with_sampling, max_model_len):
    """planning.persistent_batch_bytes (what `kvfit plan` adds to its estimate) equals the allocation, in
    either form of the penalties' record (runner/token_counts.py)."""
    batch = InputBatch(5, 7, vocab_size=33, device=CPU, with_sampling=with_sampling, max_model_len=max_model_len)
    owners = [batch] + ([batch.sampling, batch.sampling.token_counts] if with_sampling else [])
    tensors = [t for owner in owners for t in vars(owner).values() if isinstance(t, torch.Tensor)]
    assert batch.num_bytes == sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("num_seqs", [1, 2, 3, 4, 5])
def test_a_decode_step_marks_its_shared_prefix_for_the_backend(num_seqs):
    # every request holds blocks 0, 1 first (prefix-cache hits); the shortest context has 9 tokens, so the
    # prefix is capped at 8 (every sequence must have a token after it); the vectors stay 16-byte aligned
    seqs = [seq(f"r{i}", [1], 8 + i % 3, [0, 1, 2 + i], True) for i in range(num_seqs)]
    batch = InputBatch(8, 8, vocab_size=64, device=CPU)
    delta = StepDelta(request_ids=tuple(n.request_id for n, _ in seqs), num_scheduled_tokens=(1,) * num_seqs,
                      new_block_ids=((),) * num_seqs, new_requests=tuple(n for n, _ in seqs),
                      num_common_prefix_blocks=3)
    batch.apply(delta)
    asked = []
    meta = build_inputs(batch, delta, 4, lambda shared, n: asked.append((shared, n)) or shared).meta
    assert asked == [(8, num_seqs)] and meta.prefix_len.tolist() == [8]
    assert meta.seq_lens.tolist() == [9 + i % 3 for i in range(num_seqs)]
    assert meta.query_start_loc.tolist() == list(range(num_seqs + 1))
    assert meta.seq_lens.data_ptr() % 16 == 0 and meta.query_start_loc.data_ptr() % 16 == 0
    assert meta.prefix_len.data_ptr() % 16 == 0
    assert build_inputs(batch, delta, 4, lambda shared, n: 0).meta.prefix_len is None      # declined
    assert build_inputs(batch, delta, 4).meta.prefix_len is None                              # no backend rule


def test_only_decode_steps_mark_a_shared_prefix_and_it_is_shared():
    """A real scheduler with prefix caching: every step with a prefix is all-decode, the prefix is whole blocks
    of the same tokens every running request has computed (hits or duplicates), each sequence has more tokens,
    and it is as long as that allows."""
    bs = 4
    pool = BlockPool(40, enable_prefix_caching=True)
    sched = Scheduler(KVCacheManager(pool, bs), max_model_len=40, max_num_seqs=6, max_num_batched_tokens=16)
    batch = InputBatch(6, 10, vocab_size=200, device=CPU)
    shared = list(range(1, 14))                                  # three full blocks and one token
    prompts = [shared + [40 + i] * (i % 3) for i in range(6)] + [[7, 8, 9]]
    marked = 0
    for i in range(len(prompts) + 60):
        if i < len(prompts):
            sched.add(Request(request_id=f"r{i}", prompt_token_ids=prompts[i], params=SamplingParams(max_tokens=9),
                              max_total_tokens=len(prompts[i]) + 9))
        if not sched.num_unfinished:
            break
        delta = sched.schedule()
        batch.apply(delta)
        inputs = build_inputs(batch, delta, bs, lambda shared_tokens, n: shared_tokens)
        meta = inputs.meta
        # blocks of the same tokens at the same positions, computed in every running request
        every = [r.token_ids[:r.num_computed_tokens // bs * bs] for r in sched.running]
        common = 0
        while all(len(t) >= (common + 1) * bs and t[common * bs:(common + 1) * bs] ==
                  every[0][common * bs:(common + 1) * bs] for t in every):
            common += 1
        if meta.prefix_len is not None:
            marked += 1
            prefix = meta.prefix_len.item()
            assert meta.decode_only and prefix % bs == 0 and prefix > 0
            assert all(n > prefix for n in meta.seq_lens_host)
            assert prefix == min(common, (min(meta.seq_lens_host) - 1) // bs) * bs
        else:
            assert not meta.decode_only or min(common, (min(meta.seq_lens_host) - 1) // bs) == 0 \
                or len(sched.running) < 2
        finish_step(sched, batch, delta, inputs, {j: 100 + j for j in inputs.sample_seqs})
    assert marked > 0 and pool.num_used_blocks == 0
