"""The incremental contract: what a StepDelta carries (kvfit/step.py).

A request's prompt, params and first blocks travel once; a decode step then carries ids, token counts
and only the blocks appended since, so its size does not grow with the contexts (tensor parallelism
pickles it to every rank every step).
"""

from __future__ import annotations

import pickle

from scheduler_helpers import fake_token, make_request, make_scheduler


def decode_delta(prompt_len: int, num_requests: int = 8):
    sched = make_scheduler(num_blocks=num_requests * (prompt_len // 4 + 4), max_model_len=prompt_len + 16,
                           max_num_seqs=num_requests, max_num_batched_tokens=num_requests * prompt_len)
    for i in range(num_requests):
        sched.add(make_request(f"r{i}", [1 + i] * prompt_len, max_tokens=8))
    first = sched.schedule()
    sched.update(first, {s.request_id: fake_token(s.request_id, 0) for s in first.seqs})
    return first.delta, sched.schedule().delta


def test_new_requests_travel_once_then_only_counts_and_new_blocks():
    first, second = decode_delta(prompt_len=30)
    assert [n.request_id for n in first.new_requests] == [f"r{i}" for i in range(8)]
    assert all(len(n.prompt_token_ids) == 30 and len(n.block_ids) == 8 for n in first.new_requests)
    assert second.new_requests == () and second.num_scheduled_tokens == (1,) * 8
    # position 30 is in block 7, already held: nothing to append
    assert second.new_block_ids == ((),) * 8 and second.finished_ids == () and second.preempted_ids == ()


def test_a_decode_delta_does_not_grow_with_the_context():
    _, short = decode_delta(prompt_len=30)
    _, long = decode_delta(prompt_len=1022)
    assert len(pickle.dumps(long)) == len(pickle.dumps(short))


def test_finished_and_aborted_ids_reach_the_runner_once():
    sched = make_scheduler(max_num_seqs=2)
    sched.add(make_request("a", [1, 2, 3], max_tokens=1))
    sched.add(make_request("b", [1, 2, 3], max_tokens=5))
    sched.add(make_request("never-run", [1, 2, 3], max_tokens=5))
    plan = sched.schedule()
    sched.update(plan, {s.request_id: fake_token(s.request_id, 0) for s in plan.seqs})   # a ends (length)
    sched.finish("b", "abort")
    sched.finish("never-run", "abort")            # still waiting: the runner never saw it, and ignores it
    assert sched.schedule().delta.finished_ids == ("a", "b", "never-run")
    assert sched.schedule().delta.finished_ids == ()


def test_an_empty_step_still_drops_ended_rows_in_the_runner(tiny_llama):
    """A step with nothing to run still hands the runner the ids that ended (else their rows leak)."""
    from kvfit import LLM, SamplingParams
    llm = LLM(tiny_llama, device="cpu", dtype="float32", max_num_seqs=2, kv_cache_memory="4MiB", block_size=4)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for _ in range(3):                           # more rounds than rows: a leak would run out of rows
        ids = [engine.add_request([5, 6, 7], params) for _ in range(2)]
        engine.step()
        for request_id in ids:
            engine.abort(request_id)
        assert engine.step() == []               # nothing to run: the delta only carries the ids
        assert engine.workers.runner.batch.requests == {}
