"""Multi-step decoding (--num-scheduler-steps): several decode steps per scheduling round, tokens kept
on the device between them. Outputs must equal single-step decoding's token for token; blocks are
allocated for the round up front and all come back when requests end."""

from __future__ import annotations

import pytest
from scheduler_helpers import assert_all_blocks_back, fake_token, make_request, make_scheduler

from kvfit import LLM, SamplingParams
from kvfit.errors import ConfigError


# scheduler ------------------------------------------------------------------------------------------
def _decoding(sched, num_requests=2, prompt_len=3, max_tokens=10):
    for i in range(num_requests):
        sched.add(make_request(f"r{i}", range(1, prompt_len + 1), max_tokens=max_tokens))
    plan = sched.schedule()                      # the prefill
    sched.update(plan, {s.request_id: fake_token(s.request_id, 0) for s in plan.seqs})
    return plan


def test_decode_round_gets_blocks_for_every_step():
    sched = make_scheduler(block_size=4)
    _decoding(sched)                             # 3 prompt tokens + 1 sampled: position 3 is next
    plan = sched.schedule(num_steps=5)
    assert plan.num_steps == 5
    for seq in plan.seqs:
        assert (seq.start_pos, len(seq.token_ids), seq.num_steps) == (3, 1, 5)
        # positions 3..7 computed in the round: 8 tokens in the cache, 2 blocks of 4
        assert len(seq.block_ids) == 2
    tokens = {s.request_id: [fake_token(s.request_id, 1 + k) for k in range(5)] for s in plan.seqs}
    for k in range(5):
        sched.update(plan, {rid: t[k] for rid, t in tokens.items()}, k)
    for req in sched.running:
        assert req.num_computed_tokens == 8 and req.num_tokens == 9
        assert req.output_token_ids[1:] == tokens[req.request_id]
    sched.pool.check_invariants()


def test_round_never_runs_past_max_tokens():
    sched = make_scheduler()
    sched.add(make_request("short", [1, 2], max_tokens=3))
    sched.add(make_request("long", [1, 2], max_tokens=20))
    plan = sched.schedule()
    sched.update(plan, {s.request_id: fake_token(s.request_id, 0) for s in plan.seqs})
    plan = sched.schedule(num_steps=8)
    steps = {s.request_id: s.num_steps for s in plan.seqs}
    assert steps == {"short": 2, "long": 8}
    for k in range(plan.num_steps):
        sampled = {s.request_id: fake_token(s.request_id, 1 + k) for s in plan.seqs if k < s.num_steps}
        finished = sched.update(plan, sampled, k)
        if k == 1:
            assert [r.request_id for r in finished] == ["short"]
    assert [r.request_id for r in sched.running] == ["long"]
    sched.finish("long", "abort")
    assert_all_blocks_back(sched)


def test_round_stays_one_step_while_a_request_waits_for_admission():
    sched = make_scheduler(max_num_batched_tokens=4)
    _decoding(sched, num_requests=1)
    sched.add(make_request("late", range(1, 9)))           # 8 tokens: admitted over two steps
    plan = sched.schedule(num_steps=4)
    assert plan.num_steps == 1 and {s.request_id for s in plan.seqs} == {"r0", "late"}


def test_round_stays_one_step_when_blocks_are_short():
    # 2 requests x (4 tokens in 1 block of 4) = 2 blocks; a round of 8 steps needs 3 blocks each
    sched = make_scheduler(num_blocks=5, block_size=4, max_model_len=32)
    _decoding(sched)
    free_before = sched.pool.num_free_blocks
    plan = sched.schedule(num_steps=8)
    assert plan.num_steps == 1
    assert sched.pool.num_free_blocks == free_before      # nothing allocated for the refused round


def test_prefill_steps_are_never_multi_step():
    sched = make_scheduler()
    sched.add(make_request("a", [1, 2, 3]))
    plan = sched.schedule(num_steps=4)
    assert plan.num_steps == 1 and len(plan.seqs[0].token_ids) == 3


# engine (CPU, tiny models) ---------------------------------------------------------------------------
def _run(folder, steps, prompts, params, **kw):
    kw = {"max_model_len": 128, **kw}
    llm = LLM(folder, device="cpu", dtype="float32", block_size=4, num_scheduler_steps=steps, **kw)
    assert llm.engine.num_scheduler_steps == steps
    out = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats["kv_blocks_used"] == 0
    assert stats["kv_blocks_free"] + stats["kv_blocks_cached"] == stats["kv_blocks_total"]
    return out, llm


PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17], [30] * 20, [40, 41]]


def _mixed_params():
    return [SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
            SamplingParams(temperature=0.8, top_k=30, top_p=0.9, seed=11, max_tokens=9, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=5, max_tokens=17, ignore_eos=True)]


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3"])
def test_multi_step_equals_single_step(fixture, request):
    folder = request.getfixturevalue(fixture)
    single, _ = _run(folder, 1, PROMPTS, _mixed_params())
    for steps in (2, 5):
        multi, _ = _run(folder, steps, PROMPTS, _mixed_params())
        assert [o.outputs[0].token_ids for o in multi] == [o.outputs[0].token_ids for o in single]
        assert [o.outputs[0].finish_reason for o in multi] == [o.outputs[0].finish_reason for o in single]
        assert [len(o.outputs[0].token_ids) for o in multi] == [13, 3, 9, 17]


def test_multi_step_stops_at_the_same_token(tiny_llama):
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    full, _ = _run(tiny_llama, 1, ["the quick brown fox"], greedy)
    full = full[0]
    stop_id = full.outputs[0].token_ids[5]
    by_id = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_id])
    for steps in (1, 4):
        out = _run(tiny_llama, steps, ["the quick brown fox"], by_id)[0][0]
        assert out.outputs[0].token_ids == full.outputs[0].token_ids[:full.outputs[0].token_ids.index(stop_id) + 1]
        assert out.outputs[0].finish_reason == "stop"
    if len(full.outputs[0].text.strip()) > 3:
        stop = full.outputs[0].text.strip()[2:4]
        by_text = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])
        one = _run(tiny_llama, 1, ["the quick brown fox"], by_text)[0][0]
        many = _run(tiny_llama, 6, ["the quick brown fox"], by_text)[0][0]
        assert (many.outputs[0].text, many.outputs[0].token_ids, many.outputs[0].finish_reason) == (one.outputs[0].text, one.outputs[0].token_ids, one.outputs[0].finish_reason)


def test_multi_step_with_prefix_caching_and_a_small_cache(tiny_qwen2):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[7] * 16 + [i, i + 1] for i in range(8, 14)]
    single, _ = _run(tiny_qwen2, 1, prompts, params, enable_prefix_caching=True)
    multi, llm = _run(tiny_qwen2, 4, prompts, params, enable_prefix_caching=True)
    assert [o.outputs[0].token_ids for o in multi] == [o.outputs[0].token_ids for o in single]
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in single]
    assert llm.engine.stats()["prefix_cache_hits"] > 0
    # 24 blocks of 4: rounds fall back to single steps (and preemption) when blocks run short
    small, llm = _run(tiny_qwen2, 4, prompts, params, enable_prefix_caching=False,
                      num_gpu_blocks_override=24, max_num_seqs=6, max_model_len=32)
    assert [o.outputs[0].token_ids for o in small] == [o.outputs[0].token_ids for o in single]
    assert llm.engine.stats()["preemptions"] > 0


def test_streamed_outputs_are_cumulative_and_end_once(tiny_llama):
    llm = LLM(tiny_llama, device="cpu", dtype="float32", max_model_len=128, num_scheduler_steps=4)
    engine = llm.engine
    engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), "s")
    seen = []
    while engine.has_unfinished():
        seen.extend(engine.step())
    lengths = [len(o.outputs[0].token_ids) for o in seen]
    assert lengths == sorted(lengths) and lengths[-1] == 10
    assert [o.finished for o in seen].count(True) == 1 and seen[-1].finished


def test_bad_num_scheduler_steps(tiny_llama):
    with pytest.raises(ConfigError, match="--num-scheduler-steps"):
        LLM(tiny_llama, device="cpu", num_scheduler_steps=0)
    with pytest.raises(ConfigError, match="tensor-parallel-size"):
        LLM(tiny_llama, device="cpu", num_scheduler_steps=4, tensor_parallel_size=2)


def test_cpu_default_is_one_step(tiny_llama):
    llm = LLM(tiny_llama, device="cpu", dtype="float32", max_model_len=64)
    assert llm.engine.num_scheduler_steps == 1


def test_offline_steps_report_finished_requests_only(tiny_llama):
    llm = LLM(tiny_llama, device="cpu", dtype="float32", max_model_len=128, num_scheduler_steps=3)
    engine = llm.engine
    for i, n in enumerate((4, 9)):
        engine.add_request([5, 6, 7 + i], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), f"q{i}")
    seen = []
    while engine.has_unfinished():
        seen.extend(engine.step(stream=False))
    assert sorted((o.request_id, len(o.outputs[0].token_ids)) for o in seen) == [("q0", 4), ("q1", 9)]
    assert all(o.finished for o in seen)
