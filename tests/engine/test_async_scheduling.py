"""Async scheduling (--async-scheduling): the next all-decode round is scheduled and launched before the
current one's tokens are read, its first inputs the device's last tokens. Outputs must equal the
synchronous engine's token for token (stops, stop strings, seeded sampling, preemption, prefix caching,
aborts); a request that stops inside a round has its continued tokens dropped; every block comes back."""

from __future__ import annotations

import pytest
from scheduler_helpers import StepPlan, fake_token, make_request, make_scheduler

from kvfit import LLM, SamplingParams
from kvfit.errors import ConfigError

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17], [30] * 20, [40, 41], [50, 51, 52, 53]]


def _params():
    return [SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
            SamplingParams(temperature=0.8, top_k=30, top_p=0.9, seed=11, max_tokens=9, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=5, max_tokens=17, ignore_eos=True, presence_penalty=0.5),
            SamplingParams(temperature=0, max_tokens=11, min_tokens=4)]


def _llm(folder, async_scheduling, steps, **kw):
    kw = {"max_model_len": 128, "block_size": 4, **kw}
    if "num_gpu_blocks_override" not in kw:
        kw["kv_cache_memory"] = "16MiB"      # a memory-sized CPU cache takes ~30 s to allocate
    llm = LLM(folder, device="cpu", dtype="float32", num_scheduler_steps=steps, async_scheduling=async_scheduling,
              **kw)
    assert llm.engine.async_scheduling is async_scheduling
    return llm


def _count_continuations(llm) -> list[bool]:
    """Wrap the scheduler so the test sees whether each chance of a continuation was taken."""
    sched = llm.engine.scheduler
    inner, taken = sched.schedule_continuation, []

    def wrapped(prev, num_steps):
        delta = inner(prev, num_steps)
        taken.append(delta is not None)
        return delta
    sched.schedule_continuation = wrapped
    return taken


def _all_blocks_back(llm) -> None:
    stats = llm.engine.stats()
    assert stats["kv_blocks_used"] == 0
    assert stats["kv_blocks_free"] + stats["kv_blocks_cached"] == stats["kv_blocks_total"]
    llm.engine.kv.check_invariants()


def _tokens(outputs):
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outputs]


@pytest.mark.parametrize("steps", [1, 4])
@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3"])
def test_async_equals_sync(fixture, steps, request):
    folder = request.getfixturevalue(fixture)
    sync = _llm(folder, False, steps).generate(PROMPTS, _params(), use_tqdm=False)
    llm = _llm(folder, True, steps)
    taken = _count_continuations(llm)
    got = llm.generate(PROMPTS, _params(), use_tqdm=False)
    assert _tokens(got) == _tokens(sync)
    assert sum(taken) >= 3, taken            # the feature ran, not only the fallback
    _all_blocks_back(llm)


def test_stops_inside_a_continued_round_end_at_the_same_token(tiny_llama):
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = _llm(tiny_llama, False, 1).generate(["the quick brown fox"], greedy, use_tqdm=False)[0].outputs[0]
    stop_id = full.token_ids[7]
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id])]
    if len(full.text.strip()) > 5:
        params.append(SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[full.text.strip()[3:5]]))
    for p in params:
        for steps in (1, 3):
            sync = _llm(tiny_llama, False, steps).generate(["the quick brown fox"] * 3, p, use_tqdm=False)
            llm = _llm(tiny_llama, True, steps)
            got = llm.generate(["the quick brown fox"] * 3, p, use_tqdm=False)
            assert [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in got] == \
                [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in sync]
            assert got[0].outputs[0].finish_reason == "stop"
            _all_blocks_back(llm)


def test_preemption_and_prefix_caching(tiny_qwen2):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[7] * 16 + [i, i + 1] for i in range(8, 14)]
    sync = _llm(tiny_qwen2, False, 1).generate(prompts, params, use_tqdm=False)
    cached = _llm(tiny_qwen2, True, 4, enable_prefix_caching=True)
    assert _tokens(cached.generate(prompts, params, use_tqdm=False)) == _tokens(sync)
    assert _tokens(cached.generate(prompts, params, use_tqdm=False)) == _tokens(sync)
    assert cached.engine.stats()["prefix_cache_hits"] > 0
    _all_blocks_back(cached)
    small = _llm(tiny_qwen2, True, 4, enable_prefix_caching=False, num_gpu_blocks_override=24, max_num_seqs=6,
                 max_model_len=32)
    assert _tokens(small.generate(prompts, params, use_tqdm=False)) == _tokens(sync)
    assert small.engine.stats()["preemptions"] > 0
    _all_blocks_back(small)


def test_an_abort_while_a_round_is_in_flight(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    sync = _llm(tiny_llama, False, 2).generate(PROMPTS[:3], params, use_tqdm=False)
    llm = _llm(tiny_llama, True, 2)
    engine = llm.engine
    ids = [engine.add_request(p, params) for p in PROMPTS[:3]]
    outputs: dict[str, object] = {}
    while engine._inflight is None:
        for out in engine.step(stream=False):
            outputs[out.request_id] = out
    assert engine.abort(ids[1])
    while engine.has_unfinished():
        for out in engine.step(stream=False):
            outputs[out.request_id] = out
    assert ids[1] not in outputs and ids[1] not in engine.scheduler.requests     # offline aborts end silently
    for i in (0, 2):
        assert outputs[ids[i]].outputs[0].token_ids == sync[i].outputs[0].token_ids
    _all_blocks_back(llm)


def test_logprobs_and_n_samples_match_through_continued_rounds(tiny_llama):
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=8, ignore_eos=True)]
    prompts = PROMPTS[:2]
    sync = _llm(tiny_llama, False, 4).generate(prompts, params, use_tqdm=False)
    llm = _llm(tiny_llama, True, 4)
    taken = _count_continuations(llm)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert _tokens(got) == _tokens(sync)
    for g, s in zip(got[0].outputs[0].logprobs, sync[0].outputs[0].logprobs):
        assert g.keys() == s.keys()
        assert all(abs(g[t].logprob - s[t].logprob) < 1e-5 for t in g)
    assert any(taken)                       # logprobs ride continued rounds (read with the round's tokens)
    _all_blocks_back(llm)


def test_a_round_left_in_flight_is_read_by_the_next_generate(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm = _llm(tiny_llama, True, 1)
    first = llm.generate(PROMPTS, params, use_tqdm=False)
    again = llm.generate(PROMPTS, params, use_tqdm=False)
    assert _tokens(again) == _tokens(first)
    assert llm.engine._inflight is None or all(
        rid not in llm.engine.scheduler.requests for rid in llm.engine._inflight[0].request_ids)
    _all_blocks_back(llm)


def test_async_scheduling_flag_is_checked(tiny_llama):
    with pytest.raises(ConfigError, match="--async-scheduling must be true or false"):
        LLM(tiny_llama, device="cpu", async_scheduling="yes")
    with pytest.raises(ConfigError, match="--async-scheduling needs --tensor-parallel-size 1"):
        LLM(tiny_llama, device="cpu", async_scheduling=True, num_scheduler_steps=1, tensor_parallel_size=2)
    assert LLM(tiny_llama, device="cpu", max_model_len=64, kv_cache_memory="16MiB").engine.async_scheduling is True


# the scheduler's side ------------------------------------------------------------------------------
def _decode_round(sched, max_tokens=(10, 10), num_steps=3):
    for i, n in enumerate(max_tokens):
        sched.add(make_request(f"r{i}", [1, 2, 3], max_tokens=n))
    plan = sched.schedule()
    sched.update(plan, {s.request_id: fake_token(s.request_id, 0) for s in plan.seqs})
    return sched.schedule(num_steps=num_steps)


def test_continuation_grows_blocks_past_the_round_in_flight_and_drops_a_stopped_request():
    sched = make_scheduler(block_size=4)
    prev = _decode_round(sched, max_tokens=(3, 10))    # r0 ends by length in prev: left out
    delta = sched.schedule_continuation(prev.delta, 3)
    assert delta.continues and delta.request_ids == ("r1",) and delta.num_steps == (3,)
    # r1: 4 tokens known, prev computes positions 3..5, the continuation 6..8: 9 tokens, 3 blocks
    assert len(sched.block_ids("r1")) == 3
    for k in range(prev.num_steps):
        sched.update(prev, {s.request_id: fake_token(s.request_id, 1 + k) for s in prev.seqs if k < s.num_steps}, k)
    assert [r.request_id for r in sched.running] == ["r1"]
    sched.finish("r1", "stop")                          # stopped in prev: the continuation's tokens are dropped
    plan = StepPlan(delta, sched.mirror.apply(delta))
    assert sched.update(plan, {"r1": 99}, 0) == []
    sched.pool.check_invariants()
    assert sched.pool.num_used_blocks == 0


def test_a_continuation_admits_waiting_requests_and_continues_prefill_chunks():
    sched = make_scheduler(block_size=4, max_num_batched_tokens=8)
    prev = _decode_round(sched)
    sched.add(make_request("late", [1, 2] * 5))         # 10 tokens: 6 fit beside the two decodes
    delta = sched.schedule_continuation(prev.delta, 3)
    assert delta.continues and delta.request_ids == ("r0", "r1", "late")
    assert delta.num_scheduled_tokens == (1, 1, 6) and delta.num_steps == ()     # admitting: one step
    assert [n.request_id for n in delta.new_requests] == ["late"]
    assert len(sched.block_ids("late")) == 2
    # prev is applied, then a continuation of the continuation: the chunk goes on beside the decodes
    for k in range(prev.num_steps):
        sched.update(prev, {s.request_id: fake_token(s.request_id, 1 + k) for s in prev.seqs if k < s.num_steps}, k)
    after = sched.schedule_continuation(delta, 3)
    assert after.continues and after.request_ids == ("r0", "r1", "late") and after.num_scheduled_tokens == (1, 1, 4)
    assert after.new_requests == ()


def test_no_continuation_when_blocks_are_short_or_a_request_needs_the_host_each_token():
    sched = make_scheduler(num_blocks=3, block_size=4, max_model_len=32)
    prev = _decode_round(sched, max_tokens=(3, 3), num_steps=1)   # fills a block each: the next token needs a new one
    assert sched.pool.num_free_blocks == 1
    assert sched.schedule_continuation(prev.delta, 8) is None
    # blocks for one step but not for an 8-step round: a single step, holding only its own blocks
    sched = make_scheduler(num_blocks=5, block_size=4, max_model_len=32)
    prev = _decode_round(sched, num_steps=1)
    free = sched.pool.num_free_blocks
    delta = sched.schedule_continuation(prev.delta, 8)
    assert delta.num_steps == () and delta.num_scheduled_tokens == (1, 1)
    assert sched.pool.num_free_blocks == free - 2
    # a request with multi-token bad words (its first sample needs the host) is not admitted by a continuation:
    # behind a plain one, the continuation admits the plain one and stops at it; at the head of the queue with
    # a slot free, no continuation is made (the next schedule() admits it); once running, none at all
    sched = make_scheduler(block_size=4)
    prev = _decode_round(sched)
    host_each_token = make_request("bw", [1, 2])
    host_each_token.bad_words_token_ids = ((7, 8),)
    sched.add(make_request("plain", [3, 4]))
    sched.add(host_each_token)
    delta = sched.schedule_continuation(prev.delta, 3)
    assert delta.request_ids == ("r0", "r1", "plain") and [r.request_id for r in sched.waiting] == ["bw"]
    for k in range(prev.num_steps):
        sched.update(prev, {s.request_id: fake_token(s.request_id, 1 + k) for s in prev.seqs if k < s.num_steps}, k)
    assert sched.schedule_continuation(delta, 3) is None
    sched.update(StepPlan(delta, sched.mirror.apply(delta)), {"plain": 5}, 0)
    plan = sched.schedule()
    assert "bw" in plan.delta.request_ids
    assert sched.schedule_continuation(plan.delta, 3) is None
    # with every batch slot taken it could not be admitted anyway: rounds go on
    sched = make_scheduler(block_size=4, max_num_seqs=2)
    prev = _decode_round(sched)
    sched.add(make_request("bw", [1, 2]))
    sched.waiting[0].bad_words_token_ids = ((7, 8),)
    assert sched.schedule_continuation(prev.delta, 3).request_ids == ("r0", "r1")
