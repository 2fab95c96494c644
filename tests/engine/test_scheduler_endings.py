"""Scheduler tests: stop conditions, aborts and rejections (the rest is in test_scheduler.py)."""

from __future__ import annotations

import pytest

from kvfit.engine.request import RequestStatus
from kvfit.errors import RequestError
from scheduler_helpers import (EOS, assert_all_blocks_back, fake_token, make_request, make_scheduler, run_to_end,
                               step, tiny_scheduler)


# stop conditions --------------------------------------------------------------------------------
def test_eos_stops_unless_ignore_eos():
    def token(rid, n):
        return EOS if n == 1 else 200 + n
    for ignore_eos, expected in ((False, ([200, EOS], "stop")), (True, ([200, EOS, 202, 203], "length"))):
        sched = make_scheduler()
        sched.add(make_request("a", [1, 2], eos=(EOS,), ignore_eos=ignore_eos, max_tokens=4))
        req = sched.requests["a"]
        run_to_end(sched, token)
        assert (req.output_token_ids, req.finish_reason) == expected
        assert req.status is RequestStatus.FINISHED
        assert_all_blocks_back(sched)


def test_stop_token_ids_stop_even_with_ignore_eos():
    sched = make_scheduler()
    sched.add(make_request("a", [1, 2], stop_token_ids=[202], ignore_eos=True, max_tokens=8))
    req = sched.requests["a"]
    run_to_end(sched, lambda rid, n: 200 + n)
    assert req.output_token_ids == [200, 201, 202] and req.finish_reason == "stop"


@pytest.mark.parametrize("stop", ["eos", "stop_token_id"])
def test_a_stop_token_at_the_length_limit_still_ends_by_stop(stop):
    """As vLLM 0.26's check_stop (EOS, then stop_token_ids, then the length): the token that reaches max_tokens and
    the context is EOS or a stop token id: the request ends as "stop"."""
    sched = make_scheduler(max_model_len=6)
    kwargs = dict(eos=(EOS,)) if stop == "eos" else dict(stop_token_ids=[99], ignore_eos=True)
    sched.add(make_request("a", [1, 2, 3], max_tokens=3, **kwargs))
    req = sched.requests["a"]
    last = EOS if stop == "eos" else 99
    run_to_end(sched, lambda rid, n: last if n == 2 else 200 + n)
    assert (req.output_token_ids, req.finish_reason) == ([200, 201, last], "stop")
    assert_all_blocks_back(sched)


def test_max_tokens_finishes_with_length():
    sched = make_scheduler()
    sched.add(make_request("a", [1, 2, 3], max_tokens=3))
    req = sched.requests["a"]
    plans = run_to_end(sched)
    assert len(plans) == 3 and len(req.output_token_ids) == 3 and req.finish_reason == "length"
    assert req.max_total_tokens == 6
    assert "a" not in sched.requests and not sched.running


@pytest.mark.parametrize("max_tokens", [None, 100])
def test_max_model_len_caps_the_output(max_tokens):
    sched = make_scheduler(max_model_len=10)
    sched.add(make_request("a", [1, 2, 3, 4], max_tokens=max_tokens))
    req = sched.requests["a"]
    assert req.max_total_tokens == 10
    plans = run_to_end(sched)
    assert req.num_tokens == 10 and len(req.output_token_ids) == 6 and req.finish_reason == "length"
    # the last sampled token is never fed back, so no step computes position max_model_len - 1
    assert max(s.start_pos + len(s.token_ids) for p in plans for s in p.seqs) == 9


def test_finish_reports_only_the_requests_that_ended():
    sched = make_scheduler()
    sched.add(make_request("a", [1], max_tokens=1))
    sched.add(make_request("b", [1], max_tokens=2))
    _, finished = step(sched)
    assert [r.request_id for r in finished] == ["a"] and finished[0].finish_reason == "length"
    _, finished = step(sched)
    assert [r.request_id for r in finished] == ["b"]


# aborts -----------------------------------------------------------------------------------------
def test_abort_a_running_request_frees_its_blocks_at_once():
    sched = make_scheduler(block_size=4)
    sched.add(make_request("a", list(range(1, 10)), max_tokens=4))
    sched.add(make_request("b", [1, 2], max_tokens=4))
    step(sched)
    assert sched.pool.num_used_blocks == 4
    req = sched.finish("a", "abort")
    assert req is not None and req.finish_reason == "abort" and req.status is RequestStatus.FINISHED
    assert list(sched.block_ids(req.request_id)) == [] and sched.pool.num_used_blocks == 1
    assert [r.request_id for r in sched.running] == ["b"] and "a" not in sched.requests
    sched.pool.check_invariants()
    assert sched.finish("a", "abort") is None         # already gone
    run_to_end(sched)
    assert_all_blocks_back(sched)


def test_abort_a_waiting_request():
    sched = make_scheduler(max_num_seqs=1)
    sched.add(make_request("a", [1, 2], max_tokens=2))
    sched.add(make_request("b", [1, 2], max_tokens=2))
    step(sched)
    req = sched.finish("b", "abort")
    assert req is not None and req.finish_reason == "abort"
    assert not sched.waiting and sched.num_unfinished == 1
    plans = run_to_end(sched)
    assert all(s.request_id == "a" for p in plans for s in p.seqs)
    assert sched.finish("never-added", "abort") is None


def test_abort_a_preempted_request():
    sched = tiny_scheduler(num_blocks=4)
    for _ in range(3):
        step(sched)
    assert sched.requests["b"].status is RequestStatus.WAITING
    used = sched.pool.num_used_blocks
    assert sched.finish("b", "abort").finish_reason == "abort"
    assert sched.pool.num_used_blocks == used and not sched.waiting
    run_to_end(sched)
    assert_all_blocks_back(sched)


def test_abort_of_a_prefix_sharer_leaves_the_other_table_intact():
    sched = make_scheduler(block_size=4, prefix_caching=True)
    prompt = list(range(1, 10))
    sched.add(make_request("a", prompt, max_tokens=4))
    step(sched)
    sched.add(make_request("b", prompt, max_tokens=4))
    step(sched)
    assert sched.pool.ref_count(0) == 2
    sched.finish("a", "abort")
    assert sched.pool.ref_count(0) == 1 and sched.pool.ref_count(1) == 1
    assert list(sched.block_ids("b"))[:2] == [0, 1]
    sched.pool.check_invariants()
    run_to_end(sched)
    assert_all_blocks_back(sched)


def test_abort_while_the_step_runs_is_skipped_by_update():
    sched = make_scheduler()
    sched.add(make_request("a", [1, 2, 3], max_tokens=4))
    sched.add(make_request("b", [1, 2, 3], max_tokens=4))
    plan = sched.schedule()
    sched.finish("a", "abort")
    finished = sched.update(plan, {"a": 300, "b": 301})
    assert finished == []
    assert sched.requests["b"].output_token_ids == [301]
    assert sched.pool.num_used_blocks == 1
    sched.pool.check_invariants()


def test_an_id_reused_while_the_step_runs_does_not_inherit_the_old_step():
    sched = make_scheduler()
    sched.add(make_request("a", [1, 2, 3], max_tokens=4))
    plan = sched.schedule()
    sched.finish("a", "abort")
    sched.add(make_request("a", [9, 9], max_tokens=4))   # the id is free again
    sched.update(plan, {"a": 300})
    fresh = sched.requests["a"]
    assert fresh.output_token_ids == [] and fresh.num_computed_tokens == 0


# rejection --------------------------------------------------------------------------------------
def test_empty_prompt_is_rejected():
    sched = make_scheduler()
    with pytest.raises(RequestError, match="empty"):
        sched.add(make_request("a", []))
    assert sched.num_unfinished == 0 and not sched.requests


@pytest.mark.parametrize("prompt_len", [16, 17, 40])
def test_prompt_at_or_over_max_model_len_is_rejected(prompt_len):
    sched = make_scheduler(max_model_len=16)
    with pytest.raises(RequestError, match="--max-model-len is 16"):
        sched.add(make_request("a", [1] * prompt_len))
    assert not sched.requests and not sched.waiting


def test_prompt_one_below_max_model_len_is_accepted():
    sched = make_scheduler(max_model_len=16)
    sched.add(make_request("a", [1] * 15, max_tokens=8))
    req = sched.requests["a"]
    assert req.max_total_tokens == 16
    run_to_end(sched)
    assert req.output_token_ids == [fake_token("a", 0)] and req.finish_reason == "length"


def test_request_needing_more_blocks_than_the_pool_is_rejected():
    sched = make_scheduler(num_blocks=3, block_size=4, max_model_len=64)
    with pytest.raises(RequestError, match="needs 4 KV blocks but the cache has 3"):
        sched.add(make_request("a", [1] * 10, max_tokens=6))          # 16 tokens -> 4 blocks
    with pytest.raises(RequestError, match="KV blocks"):
        sched.add(make_request("b", [1], max_tokens=None))            # up to max_model_len
    sched.add(make_request("c", [1] * 10, max_tokens=2))              # 12 tokens -> 3 blocks: fits
    assert list(sched.requests) == ["c"]


def test_duplicate_request_id_is_rejected_while_active_and_reusable_after():
    sched = make_scheduler()
    sched.add(make_request("a", [1, 2], max_tokens=2))
    with pytest.raises(RequestError, match="already in use"):
        sched.add(make_request("a", [3, 4], max_tokens=2))
    step(sched)                                       # now running
    with pytest.raises(RequestError, match="already in use"):
        sched.add(make_request("a", [3, 4], max_tokens=2))
    run_to_end(sched)
    sched.add(make_request("a", [3, 4], max_tokens=2))
    assert sched.requests["a"].prompt_token_ids == [3, 4]
