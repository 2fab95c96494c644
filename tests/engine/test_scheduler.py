"""Scheduler unit tests: admission, token budget, chunked prefill, block tables, prefix caching,
preemption by recompute, stop conditions, aborts and rejections. No model: a fake runner returns a
token that depends only on (request_id, num_generated), so a recomputed request must end with the
same tokens as an undisturbed one.
"""

from __future__ import annotations

import pytest

from kvfit.engine.request import RequestStatus
from scheduler_helpers import (assert_all_blocks_back, fake_token, make_request, make_scheduler, run_to_end, shape,
                               step, tiny_scheduler)


# admission --------------------------------------------------------------------------------------
def test_empty_scheduler_plans_nothing():
    sched = make_scheduler()
    plan = sched.schedule()
    assert plan.empty and plan.preempted_ids == () and plan.num_tokens == 0
    assert sched.update(plan, {}) == []


def test_requests_are_admitted_in_arrival_order_up_to_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        sched.add(make_request(rid, [1, 2, 3], max_tokens=2))
    plan, _ = step(sched)
    assert [s.request_id for s in plan.seqs] == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c"]
    assert [r.status for r in sched.running] == [RequestStatus.RUNNING] * 2
    plan, finished = step(sched)                      # a and b decode their second (last) token
    assert [s.request_id for s in plan.seqs] == ["a", "b"]
    assert [r.request_id for r in finished] == ["a", "b"]
    plan, _ = step(sched)
    assert shape(plan) == [("c", 0, 3, True)]


def test_running_requests_come_before_new_ones():
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add(make_request("old", [1, 2, 3], max_tokens=5))
    step(sched)
    sched.add(make_request("new", list(range(20)), max_tokens=1))
    plan, _ = step(sched)
    # the decode of "old" is scheduled first and the new prompt gets what is left of the budget
    assert shape(plan) == [("old", 3, 1, True), ("new", 0, 7, False)]


def test_token_budget_and_max_num_seqs_hold_every_step():
    sched = make_scheduler(num_blocks=40, max_num_seqs=3, max_num_batched_tokens=10)
    for i in range(7):
        sched.add(make_request(f"r{i}", [i + 1] * (3 + 4 * i), max_tokens=3 + i))
    plans = run_to_end(sched)
    for plan in plans:
        assert 0 < plan.num_tokens <= 10
        assert len(plan.seqs) <= 3
        assert len({s.request_id for s in plan.seqs}) == len(plan.seqs)
    assert max(p.num_tokens for p in plans) == 10    # the budget is actually used up
    assert max(len(p.seqs) for p in plans) == 3
    assert_all_blocks_back(sched)


def test_decodes_beyond_the_token_budget_wait_for_the_next_step():
    sched = make_scheduler(max_num_batched_tokens=3)
    for rid in "abc":
        sched.add(make_request(rid, [1], max_tokens=4))
    plan, _ = step(sched)
    assert shape(plan) == [("a", 0, 1, True), ("b", 0, 1, True), ("c", 0, 1, True)]
    sched.max_num_batched_tokens = 2
    plan, _ = step(sched)
    assert shape(plan) == [("a", 1, 1, True), ("b", 1, 1, True)]      # oldest first; c skips a step
    assert len(sched.requests["c"].output_token_ids) == 1


# chunked prefill and decode ---------------------------------------------------------------------
def test_chunked_prefill_splits_a_long_prompt_and_samples_only_the_last_chunk():
    sched = make_scheduler(block_size=4, max_num_batched_tokens=4)
    prompt = list(range(1, 11))                       # 10 tokens
    sched.add(make_request("a", prompt, max_tokens=2))
    plans = [step(sched)[0] for _ in range(3)]
    assert [shape(p) for p in plans] == [[("a", 0, 4, False)], [("a", 4, 4, False)], [("a", 8, 2, True)]]
    assert [p.seqs[0].token_ids for p in plans] == [tuple(prompt[0:4]), tuple(prompt[4:8]), tuple(prompt[8:])]
    assert [p.seqs[0].block_ids for p in plans] == [(0,), (0, 1), (0, 1, 2)]
    assert [p.seqs[0].num_generated for p in plans] == [0, 0, 0]
    req = sched.requests["a"]
    assert req.num_computed_tokens == 10 and len(req.output_token_ids) == 1
    plan, finished = step(sched)
    assert shape(plan) == [("a", 10, 1, True)] and plan.seqs[0].num_generated == 1
    assert finished == [req] and req.finish_reason == "length"


def test_a_chunk_without_sampling_adds_no_token_even_if_the_runner_returns_one():
    sched = make_scheduler(max_num_batched_tokens=4)
    sched.add(make_request("a", list(range(1, 9)), max_tokens=2))
    plan = sched.schedule()
    assert not plan.seqs[0].sample
    sched.update(plan, {"a": 123})
    assert sched.requests["a"].output_token_ids == [] and sched.requests["a"].num_computed_tokens == 4


def test_decode_steps_schedule_one_token_each():
    sched = make_scheduler()
    sched.add(make_request("a", [1, 2, 3, 4, 5], max_tokens=4))
    sched.add(make_request("b", [1, 2], max_tokens=4))
    reqs = dict(sched.requests)
    step(sched)
    for k in range(3):
        plan, _ = step(sched)
        assert shape(plan) == [("a", 5 + k, 1, True), ("b", 2 + k, 1, True)]
        for seq in plan.seqs:
            # the one new token is the one sampled last step
            assert seq.token_ids == (fake_token(seq.request_id, k),)
            assert seq.num_generated == k + 1
            assert reqs[seq.request_id].num_computed_tokens == seq.start_pos + 1


def test_block_tables_grow_append_only_as_tokens_cross_block_boundaries():
    sched = make_scheduler(block_size=4, max_model_len=32)
    sched.add(make_request("a", [1, 2, 3], max_tokens=8))
    sched.add(make_request("b", [4, 5, 6, 7, 8], max_tokens=8))
    tables = {"a": [], "b": []}
    for _ in range(7):
        plan, _ = step(sched)
        for seq in plan.seqs:
            old = tables[seq.request_id]
            assert list(seq.block_ids[:len(old)]) == old          # append-only
            end = seq.start_pos + len(seq.token_ids)
            assert len(seq.block_ids) == -(-end // 4)             # covers exactly the tokens computed
            tables[seq.request_id] = list(seq.block_ids)
    # a computes position 4 in step 2 and 8 in step 6; b's prompt takes two blocks, position 8 in step 4
    assert tables == {"a": [0, 3, 5], "b": [1, 2, 4]}
    assert list(sched.block_ids("a")) == [0, 3, 5]
    assert all(sched.pool.ref_count(b) == 1 for b in range(6))


def test_a_block_is_allocated_exactly_when_a_token_needs_it():
    sched = make_scheduler(block_size=4)
    sched.add(make_request("a", [1, 2, 3], max_tokens=8))
    counts = []
    for _ in range(6):
        step(sched)
        counts.append(len(list(sched.block_ids("a"))))
    # computed tokens after each step: 3, 4, 5, 6, 7, 8 -> blocks 1, 1, 2, 2, 2, 2
    assert counts == [1, 1, 2, 2, 2, 2]
    assert sched.pool.num_used_blocks == 2


# prefix caching ---------------------------------------------------------------------------------
def test_prefix_hit_shares_full_blocks_with_ref_count_two():
    sched = make_scheduler(block_size=4, prefix_caching=True)
    shared = list(range(1, 9))                        # two full blocks
    sched.add(make_request("a", shared + [50, 51], max_tokens=8))
    step(sched)
    a = sched.requests["a"]
    assert list(sched.block_ids(a.request_id)) == [0, 1, 2] and a.num_cached_prompt_tokens == 0
    sched.add(make_request("b", shared + [60, 61, 62], max_tokens=8))
    plan, _ = step(sched)
    b = sched.requests["b"]
    assert shape(plan) == [("a", 10, 1, True), ("b", 8, 3, True)]
    assert plan.seqs[1].token_ids == (60, 61, 62)
    assert list(sched.block_ids(b.request_id))[:2] == [0, 1] and list(sched.block_ids(b.request_id))[2] not in list(sched.block_ids(a.request_id))
    assert b.num_cached_prompt_tokens == 8
    assert [sched.pool.ref_count(x) for x in (0, 1)] == [2, 2]
    assert sched.pool.ref_count(2) == 1 and sched.pool.ref_count(list(sched.block_ids(b.request_id))[2]) == 1
    assert (sched.num_prefix_queries, sched.num_prefix_hits) == (10 + 11, 8)


def test_prefix_hit_of_a_partial_match_stops_at_the_first_differing_block():
    sched = make_scheduler(block_size=4, prefix_caching=True)
    sched.add(make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=4))
    step(sched)
    sched.add(make_request("b", [1, 2, 3, 4, 5, 6, 0, 8, 9], max_tokens=4))   # second block differs
    plan, _ = step(sched)
    assert shape(plan)[1] == ("b", 4, 5, True)
    assert list(sched.block_ids("b"))[0] == 0 and sched.pool.ref_count(0) == 2
    assert sched.pool.ref_count(1) == 1


def test_whole_prompt_cached_still_recomputes_at_least_one_token():
    sched = make_scheduler(block_size=4, prefix_caching=True)
    prompt = list(range(1, 10))                       # 9 tokens: two full blocks and one token
    sched.add(make_request("a", prompt, max_tokens=2))
    step(sched)
    sched.add(make_request("b", prompt, max_tokens=2))
    plan, _ = step(sched)
    assert shape(plan)[1] == ("b", 8, 1, True)        # the last token is computed to get logits
    # a prompt of exactly two full blocks: only the first is reused, the second is recomputed
    sched.add(make_request("c", prompt[:8], max_tokens=2))
    plan, _ = step(sched)
    assert ("c", 4, 4, True) in shape(plan)
    assert sched.requests["c"].num_cached_prompt_tokens == 4
    # a one-block prompt cannot hit at all
    sched.add(make_request("d", prompt[:4], max_tokens=2))
    plan, _ = step(sched)
    assert ("d", 0, 4, True) in shape(plan)


def test_cached_blocks_of_a_finished_request_are_reused():
    sched = make_scheduler(num_blocks=8, block_size=4, prefix_caching=True)
    prompt = list(range(1, 10))
    sched.add(make_request("a", prompt, max_tokens=1))
    plan, finished = step(sched)
    assert [r.request_id for r in finished] == ["a"]
    assert_all_blocks_back(sched)
    assert sched.pool.num_cached_blocks == 2          # the two full prompt blocks
    sched.add(make_request("b", prompt, max_tokens=1))
    plan, _ = step(sched)
    assert plan.seqs[0].block_ids[:2] == (0, 1) and plan.seqs[0].start_pos == 8
    assert sched.requests.get("b") is None            # finished in that step
    assert_all_blocks_back(sched)


def test_prefix_blocks_include_generated_tokens():
    sched = make_scheduler(block_size=4, prefix_caching=True)
    sched.add(make_request("a", [1, 2, 3], max_tokens=3))
    run_to_end(sched)
    out = [fake_token("a", n) for n in range(3)]
    # a computed 3 prompt + 2 generated tokens: the first block [1, 2, 3, out0] is full and cached
    sched.add(make_request("b", [1, 2, 3, out[0], out[1]], max_tokens=1))
    plan, _ = step(sched)
    assert shape(plan) == [("b", 4, 1, True)]


def test_no_prefix_hits_with_prefix_caching_off():
    sched = make_scheduler(prefix_caching=False)
    prompt = list(range(1, 10))
    sched.add(make_request("a", prompt, max_tokens=3))
    step(sched)
    sched.add(make_request("b", prompt, max_tokens=3))
    plan, _ = step(sched)
    assert shape(plan)[1] == ("b", 0, 9, True)
    assert all(sched.pool.ref_count(x) <= 1 for x in range(10))
    assert sched.num_prefix_hits == 0


def test_two_requests_with_one_prefix_in_the_same_step_share_it_at_once():
    # blocks are cached when scheduled (vLLM's allocate_slots): b, admitted after a in the same step, hits
    # the blocks a computes in it (each layer writes the step's K/V before attending) instead of a copy
    sched = make_scheduler(block_size=4, prefix_caching=True)
    prompt = list(range(1, 10))
    sched.add(make_request("a", prompt, max_tokens=2))
    sched.add(make_request("b", prompt, max_tokens=2))
    plan, _ = step(sched)
    assert shape(plan) == [("a", 0, 9, True), ("b", 8, 1, True)]
    assert plan.seqs[0].block_ids[:2] == plan.seqs[1].block_ids[:2]
    assert plan.seqs[0].block_ids[2] != plan.seqs[1].block_ids[2]      # the last, partial block is each one's
    assert sched.requests["b"].num_cached_prompt_tokens == 8
    run_to_end(sched)
    assert_all_blocks_back(sched)


def test_a_prompt_chunk_caches_its_blocks_when_scheduled():
    # a's prompt (13 tokens) goes in chunks of the 10-token budget; its second chunk, scheduled from the
    # running list, caches a's third block at once, so b, admitted behind it in the same step, hits all three
    sched = make_scheduler(block_size=4, prefix_caching=True, max_num_batched_tokens=10)
    prompt = list(range(1, 14))
    sched.add(make_request("a", prompt, max_tokens=2))
    sched.add(make_request("b", prompt, max_tokens=2))
    plan, _ = step(sched)                      # a: 10 tokens (two full blocks); no budget left for b
    assert shape(plan) == [("a", 0, 10, False)]
    plan, _ = step(sched)                      # a: its last 3 tokens; b: the one token past a's three blocks
    assert shape(plan) == [("a", 10, 3, True), ("b", 12, 1, True)]
    assert plan.seqs[0].block_ids[:3] == plan.seqs[1].block_ids[:3]
    run_to_end(sched)
    assert_all_blocks_back(sched)


# preemption -------------------------------------------------------------------------------------


def test_preemption_takes_the_newest_running_request_and_frees_its_blocks():
    sched = tiny_scheduler(num_blocks=4)
    plan, _ = step(sched)
    assert [s.block_ids for s in plan.seqs] == [(0, 1), (2, 3)]
    step(sched)                                       # both decode within their blocks
    a, b = sched.requests["a"], sched.requests["b"]
    assert len(b.output_token_ids) == 2
    plan, _ = step(sched)                             # a needs a third block: none free
    assert plan.preempted_ids == ("b",)
    assert shape(plan) == [("a", 4, 1, True)] and plan.seqs[0].block_ids == (0, 1, 2)
    assert b.status is RequestStatus.WAITING and list(sched.block_ids(b.request_id)) == [] and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and sched.num_preemptions == 1
    assert list(sched.waiting) == [b] and sched.running == [a]
    assert sched.pool.num_used_blocks == 3 and sched.pool.ref_count(3) == 0
    assert len(b.output_token_ids) == 2               # generated tokens are kept


def test_preempted_request_is_recomputed_with_its_generated_tokens():
    sched = tiny_scheduler(num_blocks=4)
    for _ in range(3):
        step(sched)
    b = sched.requests["b"]
    generated = list(b.output_token_ids)
    plans = run_to_end(sched)
    recompute = next(s for p in plans for s in p.seqs if s.request_id == "b")
    assert recompute.start_pos == 0 and recompute.sample
    assert recompute.token_ids == (1, 2, 3, *generated)
    assert recompute.num_generated == len(generated)
    assert b.finish_reason == "length"
    assert_all_blocks_back(sched)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preempted_requests_finish_with_the_same_tokens_as_without_preemption(prefix_caching):
    results = {}
    for num_blocks in (4, 100):
        sched = tiny_scheduler(num_blocks, prefix_caching)
        reqs = dict(sched.requests)
        run_to_end(sched)
        results[num_blocks] = {rid: (r.output_token_ids, r.finish_reason) for rid, r in reqs.items()}
        assert sched.num_preemptions == (1 if num_blocks == 4 else 0)
        assert_all_blocks_back(sched)
    assert results[4] == results[100]
    assert results[4]["a"] == ([fake_token("a", n) for n in range(5)], "length")


def test_victims_are_newest_first_and_wait_in_arrival_order():
    # block_size 1: every token is a block; three requests fill the pool after their prefills
    sched = make_scheduler(num_blocks=6, block_size=1, max_model_len=6)
    for rid in "abc":
        sched.add(make_request(rid, [1, 2], max_tokens=4))
    step(sched)
    plan, _ = step(sched)
    assert plan.preempted_ids == ("c",) and [s.request_id for s in plan.seqs] == ["a", "b"]
    plan, _ = step(sched)
    assert plan.preempted_ids == ("b",) and [s.request_id for s in plan.seqs] == ["a"]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    run_to_end(sched)
    assert_all_blocks_back(sched)


def test_several_victims_in_one_step_keep_arrival_order():
    sched = make_scheduler(num_blocks=4, block_size=1, max_model_len=4)
    for rid in "abcd":
        sched.add(make_request(rid, [1], max_tokens=3))
    step(sched)
    assert sched.pool.num_used_blocks == 4
    # a now has two uncomputed tokens, as after a chunk, so it needs two more blocks at once
    sched.requests["a"].append_output(5)
    sched.mirror.record("a", 5)          # the runner holds the same token
    plan, _ = step(sched)
    # d and c make room for a; then b, the newest left, finds no block and preempts itself
    assert shape(plan) == [("a", 1, 2, True)] and plan.preempted_ids == ("d", "c", "b")
    assert [r.request_id for r in sched.waiting] == ["b", "c", "d"]


def test_a_request_that_cannot_grow_and_is_newest_preempts_itself():
    sched = make_scheduler(num_blocks=4, block_size=1, max_model_len=4)
    sched.add(make_request("a", [1, 2], max_tokens=2))
    sched.add(make_request("b", [1], max_tokens=3))
    a, b = sched.requests["a"], sched.requests["b"]
    step(sched)                                       # a: 2 blocks, b: 1 block
    plan, _ = step(sched)                             # a takes the last block; b finds none
    assert shape(plan) == [("a", 2, 1, True)] and plan.preempted_ids == ("b",)
    assert a.finish_reason == "length" and list(sched.waiting) == [b] and list(sched.block_ids(b.request_id)) == []
    run_to_end(sched)
    assert_all_blocks_back(sched)


def test_no_admission_in_a_step_that_preempts():
    sched = tiny_scheduler(num_blocks=5)
    sched.add(make_request("c", [1], max_tokens=1))
    sched.max_num_seqs = 2
    step(sched)
    step(sched)
    plan, _ = step(sched)                             # a takes the fifth block, b takes none left
    assert plan.preempted_ids == ("b",)
    assert "c" not in [s.request_id for s in plan.seqs]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]


def test_preempting_a_request_that_shares_prefix_blocks_drops_only_its_references():
    sched = make_scheduler(num_blocks=6, block_size=2, max_model_len=12, prefix_caching=True)
    sched.add(make_request("a", [1, 2, 3, 4, 5], max_tokens=7))
    step(sched)                                       # a: blocks 0, 1, 2; 0 and 1 registered
    sched.add(make_request("b", [1, 2, 3, 4, 9], max_tokens=7))
    step(sched)
    a, b = sched.requests["a"], sched.requests["b"]
    assert list(sched.block_ids(b.request_id))[:2] == [0, 1] and sched.pool.ref_count(0) == 2
    preempted = []
    while "b" not in preempted:
        preempted.extend(step(sched)[0].preempted_ids)
    assert sched.pool.ref_count(0) == 1 and sched.pool.ref_count(1) == 1
    assert list(sched.block_ids(b.request_id)) == [] and list(sched.block_ids(a.request_id))[:2] == [0, 1]
    run_to_end(sched)
    assert a.output_token_ids == [fake_token("a", n) for n in range(7)]
    assert b.output_token_ids == [fake_token("b", n) for n in range(7)]
    assert_all_blocks_back(sched)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_deltas_carry_the_blocks_every_running_request_shares(prefix_caching):
    sched = make_scheduler(block_size=4, prefix_caching=prefix_caching)
    shared = list(range(1, 9))                                   # two full blocks
    sched.add(make_request("a", shared + [50], max_tokens=12))
    plan, _ = step(sched)
    assert plan.delta.num_common_prefix_blocks == 0              # one request: nothing to share
    for rid, tail in (("b", [60, 61]), ("c", [70])):
        sched.add(make_request(rid, shared + tail, max_tokens=12))
    plan, _ = step(sched)                                        # b and c hit a's two blocks
    plan, _ = step(sched)                                        # all three decode
    assert plan.delta.num_tokens == 3
    assert plan.delta.num_common_prefix_blocks == (2 if prefix_caching else 0)
    if prefix_caching:
        tables = [list(sched.block_ids(r)) for r in "abc"]
        assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    sched.add(make_request("d", [90, 91, 92], max_tokens=12))    # a request sharing nothing joins
    plan, _ = step(sched)
    assert plan.delta.num_common_prefix_blocks == 0


def test_requests_admitted_together_share_their_duplicate_prefix_by_content():
    # requests asking for prompt logprobs compute every prompt position (no prefix hit, as in vLLM): b and c
    # each compute the prompt into their own blocks, which hold the same content as a's
    sched = make_scheduler(block_size=4, prefix_caching=True)
    shared = list(range(1, 9))
    sched.add(make_request("a", shared + [50], max_tokens=6))
    for rid, tail in (("b", [60, 61]), ("c", [70])):
        sched.add(make_request(rid, shared + tail, max_tokens=6, prompt_logprobs=1))
    step(sched)
    plan, _ = step(sched)
    assert plan.delta.num_tokens == 3
    tables = [list(sched.block_ids(r)) for r in "abc"]
    assert len({t[0] for t in tables}) == 3                      # three copies of the first block
    assert plan.delta.num_common_prefix_blocks == 2
