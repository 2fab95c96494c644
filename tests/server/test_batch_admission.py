"""Batches of prompts arriving together are queued one whole batch at a time (ServingEngine.add_batch): interleaved,
each took the queue for its first prompt and then failed on its second, so six concurrent batches of which three fit
got 429 all. A batch's adds go to the core together: one round trip a batch, not one a prompt."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from server_testing import make_engine, running_server


def test_concurrent_batches_are_queued_one_whole_batch_at_a_time(tiny_llama):
    engine = make_engine(tiny_llama, max_num_seqs=2)
    try:
        # room for 2 running + 8 waiting samples; each request asks for 2 prompts x 5 samples: one fits at a time
        with running_server(engine, "tiny", max_waiting_requests=8) as (url, app):
            serving = app.state.kvfit.engine
            prepared, order = serving._prepared_add, []

            async def prepared_after_a_hop(request, on_progress):     # tokenizing takes a while: batches overlap
                await asyncio.sleep(0.05)
                return await prepared(request, on_progress)
            submit = serving._submit_add

            def submit_in_order(command):
                order.append(command.request_id)
                submit(command)
            serving._prepared_add, serving._submit_add = prepared_after_a_hop, submit_in_order
            body = {"model": "tiny", "prompt": [[5, 6, 7], [8, 9, 10]], "max_tokens": 60, "n": 5, "ignore_eos": True}

            def post(_):
                return httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            with ThreadPoolExecutor(8) as pool:
                responses = list(pool.map(post, range(8)))
            statuses = sorted(r.status_code for r in responses)
            assert set(statuses) <= {200, 429} and 200 in statuses, statuses
            for r in responses:
                if r.status_code == 200:
                    assert len(r.json()["choices"]) == 10
            # each batch's prompts were added one after the other, never between another batch's
            batches = [request_id.rsplit("-", 1)[0] for request_id in order]
            runs = [b for i, b in enumerate(batches) if i == 0 or batches[i - 1] != b]
            assert len(runs) == len(set(runs)), order
            assert httpx.get(f"{url}/health").status_code == 200
    finally:
        engine.shutdown()


def test_a_batch_waits_for_the_core_once_and_a_refused_prompt_aborts_the_others(tiny_llama):
    """add_batch sends every prompt's add before awaiting any answer (a batch of 6 is answered in the core's one
    round, not six); a prompt the core refuses fails the request naming it, and the prompts queued before it are
    aborted: the KV cache is empty after."""
    engine = make_engine(tiny_llama, max_num_seqs=4)
    try:
        with running_server(engine, "tiny", max_waiting_requests=64) as (url, app):
            serving = app.state.kvfit.engine
            submit, waits = serving._submit_add, []

            def submit_counting(command):
                waits.append(sum(not c.future.done() for c in pending))     # adds sent, not yet answered
                pending.append(command)
                submit(command)
            pending: list = []
            serving._submit_add = submit_counting
            body = {"model": "tiny", "prompt": [[5, 6, 7]] * 6, "max_tokens": 3, "ignore_eos": True}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200 and len(r.json()["choices"]) == 6
            assert waits == [0, 1, 2, 3, 4, 5]           # none answered before the last was sent
            # prompt 2 longer than the model: refused by the core; prompts 0 and 1 were queued and are aborted
            long = list(range(1, engine.max_model_len + 5))
            body = {"model": "tiny", "prompt": [[5, 6, 7], [8, 9], long, [4]], "max_tokens": 50, "ignore_eos": True}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 400 and "prompt 2 of 4" in r.json()["error"]["message"], r.text
            assert len(pending) == 10 and waits[6:] == [0, 1, 2, 3]      # all four sent: the core refused it
            for _ in range(100):
                stats = serving.stats()
                if stats["running"] == stats["waiting"] == 0 and stats["kv_blocks_used"] == 0:
                    break
                time.sleep(0.05)
            assert stats["running"] == stats["waiting"] == 0 and stats["kv_blocks_used"] == 0, stats
    finally:
        engine.shutdown()


def test_a_batch_that_does_not_fit_leaves_the_room_to_the_next_one(tiny_llama):
    """Three batches at once with room for 10 (2 running + 8 waiting): A (8) fits, B (8) does not and is refused
    whole, C (2) fits in what B's refusal leaves (B's first prompts are aborted before C's adds are sent)."""
    from kvfit.sampling_params import SamplingParams
    from kvfit.server.async_engine import AddRequest, AsyncEngine, PromptRefused
    engine = make_engine(tiny_llama, max_num_seqs=2)
    try:
        async def main():
            serving = AsyncEngine(engine, max_waiting_requests=8)
            serving.start(asyncio.get_running_loop())
            params = SamplingParams(max_tokens=120, ignore_eos=True)

            async def admit(name, size):
                try:
                    await serving.add_batch([AddRequest(f"{name}-{i}", [5, 6, 7 + i], params) for i in range(size)])
                    return "ok"
                except PromptRefused as exc:
                    return exc.error.status
            try:
                return await asyncio.gather(admit("A", 8), admit("B", 8), admit("C", 2))
            finally:
                serving.stop()
        assert asyncio.run(main()) == ["ok", 429, "ok"]
    finally:
        engine.shutdown()
