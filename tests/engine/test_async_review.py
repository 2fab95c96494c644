"""Review of async scheduling (--async-scheduling): corner cases around a continued round still in flight.

Each test compares the async engine with the synchronous one on the same tiny random-weight model:
a request id re-added while a stale round holding the old id is in flight, a failed step (its read or its
token application raises) followed by the next generate, every request aborted with a round in flight,
prefix-cache hits on blocks written around a stop inside a continued round, sampling state (seeds,
penalties, min_tokens, logit bias, n > 1) across continuations, continuations while requests wait for a
batch slot, max_tokens / max_model_len boundaries, one-token prefills joining a continued decode batch,
streamed outputs, an abort from the server's engine thread between launch and read, grammar and logprobs
requests joining, and the device carry of rows that end early in a round."""

from __future__ import annotations

import pytest

from kvfit import LLM, SamplingParams

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17], [30] * 20, [40, 41], [50, 51, 52, 53]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _llm(folder, async_scheduling, steps, **kw):
    kw = {"max_model_len": 128, "block_size": 4, "kv_cache_memory": "16MiB", **kw}
    llm = LLM(folder, device="cpu", dtype="float32", num_scheduler_steps=steps, async_scheduling=async_scheduling,
              **kw)
    assert llm.engine.async_scheduling is async_scheduling
    return llm


def _tokens(outputs):
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outputs]


def _all_blocks_back(llm) -> None:
    stats = llm.engine.stats()
    assert stats["kv_blocks_used"] == 0
    assert stats["kv_blocks_free"] + stats["kv_blocks_cached"] == stats["kv_blocks_total"]
    llm.engine.kv.check_invariants()


def _stop_inside_a_round(folder, prompt, at=5):
    """Greedy params that stop prompt's output at its token `at` or earlier (that token's id is a stop id)."""
    full = _llm(folder, False, 1).generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    return SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[full[at]])


def _run_until_finished(engine, request_id):
    """Step until request_id finishes; return its output (stream=False)."""
    while True:
        for out in engine.step(stream=False):
            if out.request_id == request_id:
                return out


def _watch_continuations(llm) -> list:
    """Every continuation the scheduler returns (None where it declined), appended as it is made."""
    sched, taken = llm.engine.scheduler, []
    inner = sched.schedule_continuation
    sched.schedule_continuation = lambda prev, n: taken.append(inner(prev, n)) or taken[-1]
    return taken


def _drain(engine) -> dict:
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step(stream=False):
            outputs[out.request_id] = out
    return outputs


# a request id re-added while the round that continued the old request is still on the device -------------
def test_reused_id_while_its_old_round_is_in_flight_passes(tiny_llama):
    """PASSES (pins the Scheduler.update status check and the waiting guard of schedule_continuation)."""
    stop = _stop_inside_a_round(tiny_llama, PROMPTS[1])
    other = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    sync = _llm(tiny_llama, False, 1).generate([PROMPTS[3]], other, use_tqdm=False)[0].outputs[0].token_ids
    llm = _llm(tiny_llama, True, 3)
    engine = llm.engine
    engine.add_request(PROMPTS[0], GREEDY, request_id="keep")
    engine.add_request(PROMPTS[1], stop, request_id="x")
    out = _run_until_finished(engine, "x")
    assert out.outputs[0].finish_reason == "stop"
    assert engine._inflight is not None and "x" in engine._inflight[0].request_ids     # the stale round holds "x"
    engine.add_request(PROMPTS[3], other, request_id="x")                               # the id again, new prompt
    outputs = _drain(engine)
    assert outputs["x"].outputs[0].token_ids == sync
    assert outputs["x"].outputs[0].finish_reason == "length"
    _all_blocks_back(llm)


# a failed step ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["read", "apply"])
def test_a_failed_step_with_a_round_in_flight_leaves_the_next_generate_right(tiny_llama, where):
    """PASSES: a step whose read (pending()) or token application raises after the next round was launched
    leaves _inflight set; LLM.generate aborts its requests, and the next generate reads the stale round,
    drops its tokens, and computes the right inputs (runner num_pending/_carry of the aborted rows go with them)."""
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=14, ignore_eos=True, presence_penalty=0.4)
    sync = _llm(tiny_llama, False, 1).generate(PROMPTS, params, use_tqdm=False)
    llm = _llm(tiny_llama, True, 2)
    engine = llm.engine
    calls = {"n": 0}
    if where == "read":
        launch = engine.workers.launch

        def failing_launch(delta):
            read = launch(delta)
            calls["n"] += 1
            if calls["n"] != 3:
                return read

            def broken():
                assert engine._inflight is not None, "the next round is launched before this read"
                raise RuntimeError("injected read failure")
            return broken
        engine.workers.launch = failing_launch
    else:
        finish_reason = engine.outputs.finish_reason

        def failing_finish_reason(req):
            calls["n"] += 1
            if calls["n"] == 12:
                assert engine._inflight is not None
                raise RuntimeError("injected apply failure")
            return finish_reason(req)
        engine.outputs.finish_reason = failing_finish_reason
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(PROMPTS, params, use_tqdm=False)
    assert not engine.has_unfinished()
    assert _tokens(llm.generate(PROMPTS, params, use_tqdm=False)) == _tokens(sync)
    _all_blocks_back(llm)


def test_every_request_aborted_while_a_round_is_in_flight(tiny_llama):
    """PASSES: the server aborts every request between steps (client gone) with a round in flight; it stops
    stepping (has_unfinished is False) and the stale round is read by the step of the next request."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    sync = _llm(tiny_llama, False, 2).generate(PROMPTS[:2], params, use_tqdm=False)
    llm = _llm(tiny_llama, True, 2)
    engine = llm.engine
    ids = [engine.add_request(p, params) for p in PROMPTS[:3]]
    while engine._inflight is None:
        engine.step()
    for rid in ids:
        assert engine.abort(rid)
    assert not engine.has_unfinished()
    assert engine.stats()["kv_blocks_used"] == 0            # the in-flight round's blocks came back too
    again = [engine.add_request(p, params) for p in PROMPTS[:2]]
    outputs = _drain(engine)
    assert [outputs[r].outputs[0].token_ids for r in again] == [o.outputs[0].token_ids for o in sync]
    _all_blocks_back(llm)


# prefix caching: stale continued steps write past a stop, never into committed blocks ------------------
def test_prefix_hits_on_blocks_around_a_stop_inside_a_continued_round(tiny_qwen2):
    """PASSES: requests stop inside rounds while the next round (continuing them) is in flight; their full
    blocks are committed, and requests that extend those outputs hit them and equal the synchronous engine
    without prefix caching."""
    prompts = [[7] * 6 + [i] for i in range(8, 12)]
    full = _llm(tiny_qwen2, False, 1).generate(prompts, GREEDY, use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                             stop_token_ids=[o.outputs[0].token_ids[5 + i]]) for i, o in enumerate(full)]
    sync = _llm(tiny_qwen2, False, 1)
    cached = _llm(tiny_qwen2, True, 3, enable_prefix_caching=True)
    first_sync = sync.generate(prompts, params, use_tqdm=False)
    first = cached.generate(prompts, params, use_tqdm=False)
    assert _tokens(first) == _tokens(first_sync)
    assert all(o.outputs[0].finish_reason == "stop" for o in first)
    extended = [p + o.outputs[0].token_ids + [3, 4] for p, o in zip(prompts, first)]
    hits = cached.engine.stats()["prefix_cache_hits"]
    assert _tokens(cached.generate(extended, GREEDY, use_tqdm=False)) == \
        _tokens(sync.generate(extended, GREEDY, use_tqdm=False))
    assert cached.engine.stats()["prefix_cache_hits"] > hits
    _all_blocks_back(cached)


# sampling state across continuations ---------------------------------------------------------------------
def test_sampling_state_across_continuations(tiny_llama):
    """PASSES: seeded sampling, penalties, min_tokens held-back stop ids, logit bias, min_p, top-k and
    n > 1 give the synchronous engine's tokens when rounds continue on the device (num_generated counts the
    tokens still on the device)."""
    sync_llm = _llm(tiny_llama, False, 1)
    full = sync_llm.generate([PROMPTS[4]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    params = [SamplingParams(temperature=0.9, seed=7, max_tokens=15, ignore_eos=True, frequency_penalty=0.6,
                             repetition_penalty=1.3, logit_bias={full[1]: 3.0}),
              SamplingParams(temperature=0, max_tokens=15, min_tokens=6, stop_token_ids=[full[2]]),
              SamplingParams(temperature=1.0, seed=2, n=3, max_tokens=12, ignore_eos=True, top_k=20, min_p=0.05),
              SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, presence_penalty=1.5),
              SamplingParams(temperature=0, max_tokens=15, ignore_eos=True, min_tokens=8,
                             stop_token_ids=[full[3]], logit_bias={full[3]: 5.0})]
    sync = sync_llm.generate(PROMPTS, params, use_tqdm=False)
    llm = _llm(tiny_llama, True, 4)
    taken = _watch_continuations(llm)
    assert _tokens(llm.generate(PROMPTS, params, use_tqdm=False)) == _tokens(sync)
    assert sum(d is not None for d in taken) >= 2, taken
    _all_blocks_back(llm)


def test_continuations_while_requests_wait_for_a_batch_slot(tiny_llama):
    """PASSES: with max_num_seqs full, rounds continue while requests wait; the waiting ones are admitted
    after a request ends (no continuation that step) and every output equals the synchronous engine's."""
    prompts = PROMPTS + [[60 + i, 61, 62] for i in range(3)]
    params = [SamplingParams(temperature=0, max_tokens=5 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    sync = _llm(tiny_llama, False, 1, max_num_seqs=3).generate(prompts, params, use_tqdm=False)
    llm = _llm(tiny_llama, True, 3, max_num_seqs=3)
    taken = _watch_continuations(llm)
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == _tokens(sync)
    assert sum(d is not None for d in taken) >= 3, taken
    _all_blocks_back(llm)


# max_tokens / max_model_len boundaries of `left` ---------------------------------------------------------
def test_length_boundaries_of_continued_rounds(tiny_llama):
    """PASSES: max_tokens 1..11 against 3-step rounds (a request ends by length inside, at the end of, or one
    past a round) and requests bounded by max_model_len instead of max_tokens end at the synchronous
    engine's token, by length, never past their limit."""
    prompts = [[20 + i, 21, 22] for i in range(11)] + [[70] * 19, [71] * 22]
    params = ([SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in range(1, 12)]
              + [SamplingParams(temperature=0, ignore_eos=True)] * 2)       # up to max_model_len
    sync = _llm(tiny_llama, False, 1, max_model_len=32).generate(prompts, params, use_tqdm=False)
    llm = _llm(tiny_llama, True, 3, max_model_len=32)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert _tokens(got) == _tokens(sync)
    assert [len(o.outputs[0].token_ids) for o in got] == list(range(1, 12)) + [13, 10]
    _all_blocks_back(llm)


def test_one_token_prefills_join_a_decode_batch_and_are_continued(tiny_llama):
    """PASSES: a one-token prompt, and a prompt whose prefix-cache hit leaves one token, make an all-decode
    step together with running requests; that step is continued on the device (the new rows' carry) and
    every output equals the synchronous engine's."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    late = [[33], PROMPTS[1]]          # PROMPTS[1]: 9 tokens, 8 cached (two blocks of 4) after the first run

    def run(async_scheduling):
        llm = _llm(tiny_llama, async_scheduling, 3, enable_prefix_caching=True)
        engine = llm.engine
        inner = engine.scheduler.schedule_continuation
        engine.scheduler.schedule_continuation = lambda prev, n: continued.append(
            (len(prev.new_requests), inner(prev, n))) or continued[-1][1]
        llm.generate([PROMPTS[1]], params, use_tqdm=False)         # fills the prefix cache
        first = [engine.add_request(p, params) for p in PROMPTS[:1] + PROMPTS[3:]]
        outputs = {}
        for _ in range(2):
            for out in engine.step(stream=False):
                outputs[out.request_id] = out
        ids = first + [engine.add_request(p, params) for p in late]
        outputs.update(_drain(engine))
        return llm, [outputs[r].outputs[0].token_ids for r in ids]

    continued = []
    _, sync = run(False)
    llm, got = run(True)
    assert got == sync
    assert any(num_new == 2 and after is not None for num_new, after in continued), continued
    _all_blocks_back(llm)


# streaming and the server's engine thread ----------------------------------------------------------------
def test_streamed_outputs_grow_in_order_and_end_once(tiny_llama):
    """PASSES: stream=True with rounds continued on the device: each request's outputs only ever extend
    its tokens, the finished output comes once and nothing follows it (a stale round's tokens for a
    request that stopped inside the previous round make no output)."""
    stop = _stop_inside_a_round(tiny_llama, PROMPTS[1])
    params = [GREEDY, stop, SamplingParams(temperature=0.8, seed=4, max_tokens=11, ignore_eos=True)]
    sync = _llm(tiny_llama, False, 1).generate(PROMPTS[:3], params, use_tqdm=False)
    llm = _llm(tiny_llama, True, 3)
    engine = llm.engine
    ids = [engine.add_request(p, q) for p, q in zip(PROMPTS[:3], params)]
    seen: dict[str, list] = {rid: [] for rid in ids}
    while engine.has_unfinished() or engine._inflight is not None:
        for out in engine.step(stream=True):
            assert not seen[out.request_id] or not seen[out.request_id][-1].finished, out.request_id
            seen[out.request_id].append(out)
        if not engine.has_unfinished():
            engine.step(stream=True)            # reads a stale round left in flight: no outputs
            assert engine._inflight is None
    for rid, want in zip(ids, sync):
        tokens = [o.outputs[0].token_ids for o in seen[rid]]
        assert all(a == b[:len(a)] and len(a) < len(b) for a, b in zip(tokens, tokens[1:])), tokens
        assert seen[rid][-1].finished and tokens[-1] == want.outputs[0].token_ids
    _all_blocks_back(llm)


def test_server_engine_thread_abort_between_launch_and_read(tiny_llama):
    """PASSES: the AsyncEngine thread aborts a client's request between steps while a continued round holding
    it is in flight; the others' streams equal the synchronous engine's and every block comes back."""
    import asyncio

    from kvfit.server.async_engine import AsyncEngine
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    sync = _llm(tiny_llama, False, 1).generate(PROMPTS[:3], params, use_tqdm=False)
    llm = _llm(tiny_llama, True, 2)
    engine, in_flight = llm.engine, []
    abort = engine.abort

    def watched_abort(request_id):       # on the engine thread, between steps
        in_flight.append(engine._inflight is not None and request_id in engine._inflight[0].request_ids)
        return abort(request_id)
    engine.abort = watched_abort

    async def main():
        server = AsyncEngine(llm.engine)
        server.start(asyncio.get_running_loop())
        try:
            streams = [await server.add(f"s{i}", p, params) for i, p in enumerate(PROMPTS[:3])]
            out = await streams[1].next(timeout=60)
            while len(out.outputs[0].token_ids) < 3:
                out = await streams[1].next(timeout=60)
            server.abort("s1")
            finals = []
            for s in (streams[0], streams[2]):
                out = await s.next(timeout=60)
                while not out.finished:
                    out = await s.next(timeout=60)
                finals.append(out.outputs[0].token_ids)
            return finals
        finally:
            server.stop()

    finals = asyncio.run(main())
    assert finals == [sync[0].outputs[0].token_ids, sync[2].outputs[0].token_ids]
    assert in_flight == [True]
    assert "s1" not in llm.engine.scheduler.requests
    assert llm.engine.stats()["kv_blocks_used"] == 0


def test_grammar_and_logprobs_requests_join_while_rounds_continue(tiny_llama):
    """PASSES: with the batch full, rounds continue while a grammar request and a logprobs request wait; once
    admitted, no round is continued while the grammar request runs (its tokens need the host; logprobs ride
    continued rounds), and every output (and the logprobs) equals the synchronous engine's."""
    pytest.importorskip("llguidance")
    from kvfit.structured_params import StructuredOutputsParams
    plain = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    late = [SamplingParams(temperature=0.9, seed=5, max_tokens=20,
                           structured_outputs=StructuredOutputsParams(regex=r"[0-9]{2}-[a-c]{1,3}")),
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)]
    prompts = [PROMPTS[0], PROMPTS[3], [5, 9, 23], PROMPTS[4]]

    def run(async_scheduling):
        llm = _llm(tiny_llama, async_scheduling, 3, max_num_seqs=2)
        engine, log = llm.engine, []
        inner = engine.scheduler.schedule_continuation

        def watched(prev, n):
            after = inner(prev, n)
            host_bound = [r for r in engine.scheduler.running if r.matcher is not None]
            log.append((bool(host_bound), after is not None))
            return after
        engine.scheduler.schedule_continuation = watched
        ids = [engine.add_request(p, plain) for p in prompts[:2]]
        outputs = {}
        for _ in range(2):
            for out in engine.step(stream=False):
                outputs[out.request_id] = out
        ids += [engine.add_request(p, q) for p, q in zip(prompts[2:], late)]
        outputs.update(_drain(engine))
        return [outputs[r].outputs[0] for r in ids], log, llm

    sync, _, _ = run(False)
    got, log, llm = run(True)
    assert [(o.token_ids, o.text, o.finish_reason) for o in got] == [(o.token_ids, o.text, o.finish_reason)
                                                                     for o in sync]
    for g, w in zip(got[3].logprobs, sync[3].logprobs):
        assert g.keys() == w.keys() and all(abs(g[t].logprob - w[t].logprob) < 1e-5 for t in g)
    assert any(taken for _, taken in log) and not any(bound and taken for bound, taken in log), log
    _all_blocks_back(llm)


def test_carry_is_each_rows_last_token_when_rows_end_early_in_a_round(tiny_llama):
    """PASSES: in a round where rows run fewer steps than the longest (steps_of(i) < max), the device carry
    left for a continuation holds each row's token of its own last step, not the round's last."""
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (12, 6, 8, 7)]
    llm = _llm(tiny_llama, True, 4)
    runner = llm.engine.workers.runner
    inner, checked = runner._execute_steps, []

    def watched(delta, inputs):
        finish = inner(delta, inputs)
        index, last = runner._carry
        last = last.tolist()

        def read():
            tokens = finish()
            for rid, i in index.items():
                assert last[i] == tokens.tokens[rid][-1], (rid, last[i], tokens.tokens[rid])
            checked.append(sorted({delta.steps_of(i) for i in range(len(delta.request_ids))}))
            return tokens
        return read
    runner._execute_steps = watched
    sync = _llm(tiny_llama, False, 1).generate(PROMPTS[:4], params, use_tqdm=False)
    assert _tokens(llm.generate(PROMPTS[:4], params, use_tqdm=False)) == _tokens(sync)
    assert any(len(steps) > 1 for steps in checked), checked       # some round had rows of fewer steps
    _all_blocks_back(llm)


def test_nonfinite_token_of_a_stale_round_ends_a_reused_id(tiny_llama):
    """A round read late names an id that stopped and was re-added since; a non-finite token sampled for
    the old request's row must not end the new request (found in review; fixed in LLMEngine._apply)."""
    from kvfit.step import SampledTokens
    stop = _stop_inside_a_round(tiny_llama, PROMPTS[1])
    other = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = _llm(tiny_llama, True, 3)
    engine = llm.engine
    engine.add_request(PROMPTS[0], GREEDY, request_id="keep")
    engine.add_request(PROMPTS[1], stop, request_id="x")
    _run_until_finished(engine, "x")
    assert engine._inflight is not None and "x" in engine._inflight[0].request_ids
    delta, read = engine._inflight

    def poisoned():
        tokens = read()
        out = SampledTokens({rid: list(t) for rid, t in tokens.tokens.items()}, tokens.logprobs,
                            tokens.prompt_logprobs, {"x"})
        out.tokens["x"] = []                      # not finite at the round's first step
        return out
    engine._inflight = (delta, poisoned)
    engine.add_request(PROMPTS[3], other, request_id="x")
    outputs = _drain(engine)
    assert outputs["x"].outputs[0].finish_reason == "length"


def test_a_round_whose_requests_all_ended_is_read_before_the_next_schedule(tiny_llama):
    """With every request of the round in flight ended (a stop inside the round), the next step reads that
    round and schedules in the same call: a new request's prefill is not one step late."""
    stop = _stop_inside_a_round(tiny_llama, PROMPTS[1])
    llm = _llm(tiny_llama, True, 3)
    engine = llm.engine
    engine.add_request(PROMPTS[1], stop, request_id="x")
    _run_until_finished(engine, "x")
    assert not engine.has_unfinished() and engine._inflight is not None
    engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), request_id="y")
    first = engine.step()
    assert [o.request_id for o in first] == ["y"] and len(first[0].outputs[0].token_ids) == 1
    _drain(engine)
    _all_blocks_back(llm)


def _prompt_logprobs(output):
    return [None if entry is None else sorted((t, round(v.logprob, 4)) for t, v in entry.items())
            for entry in output.prompt_logprobs]


def test_prompt_logprobs_of_a_stale_round_do_not_reach_a_reused_id(tiny_llama):
    """Found in review (was an IndexError in OutputProcessor.add_prompt_logprobs): a continuation now carries
    prefill chunks, so the round in flight can hold a prompt-logprobs chunk of a request aborted since; its id
    added again (a shorter prompt, prompt logprobs too), LLMEngine.step gives the stale chunk's entries to the
    new request (scheduler.requests.get finds it, WAITING) at positions past its prompt. Now only a RUNNING
    request takes prompt logprobs, as only a running one takes a non-finite token."""
    plp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    sync = _llm(tiny_llama, False, 1).generate([PROMPTS[3]], plp, use_tqdm=False)[0]
    llm = _llm(tiny_llama, True, 1, max_num_batched_tokens=8)
    engine = llm.engine
    engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), request_id="keep")
    engine.step()
    engine.add_request(list(range(20, 50)), plp, request_id="x")     # 30 prompt tokens: chunks of 7 beside a decode
    while not (engine._inflight is not None and "x" in engine._inflight[0].request_ids):
        engine.step()
    assert engine._inflight[0].num_scheduled_tokens[engine._inflight[0].request_ids.index("x")] > 1
    assert engine.abort("x")
    engine.add_request(PROMPTS[3], plp, request_id="x")
    outputs = _drain(engine)
    assert outputs["x"].outputs[0].token_ids == sync.outputs[0].token_ids
    assert _prompt_logprobs(outputs["x"]) == _prompt_logprobs(sync)
    _all_blocks_back(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_grammar_request_joining_a_running_batch(tiny_llama, async_scheduling):
    """Found in review (failed with and without async scheduling, from before this change): a grammar request
    sampled after a plain one (it joins a running batch) made ModelRunner._bitmask_rows stack the bitmask rows
    of the grammar rows only ([len(masked), words]), while SamplingState._processed_logits called
    apply_bitmask(work, bitmask, index["masked"]), which indexes the bitmask by batch position: an IndexError
    whenever the grammar rows were not the step's first sampled rows. Now bitmask row j masks position
    masked[j]. (The async variant also needs the grammar request admitted while others run: see
    test_a_waiting_single_step_request_is_not_held_back_by_continued_rounds.)"""
    pytest.importorskip("llguidance")
    from kvfit.structured_params import StructuredOutputsParams
    grammar = SamplingParams(temperature=0, max_tokens=6,
                             structured_outputs=StructuredOutputsParams(regex=r"[0-9]{2}-[a-c]{1,3}"))
    alone = _llm(tiny_llama, False, 1).generate([PROMPTS[3]], grammar, use_tqdm=False)[0].outputs[0]
    llm = _llm(tiny_llama, async_scheduling, 1)
    engine = llm.engine
    engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), request_id="plain")
    engine.step()
    engine.step()
    engine.add_request(PROMPTS[3], grammar, request_id="g")
    outputs = _drain(engine)
    assert (outputs["g"].outputs[0].token_ids, outputs["g"].outputs[0].text) == (alone.token_ids, alone.text)
    _all_blocks_back(llm)
