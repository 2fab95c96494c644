"""Batches of prompts arriving together are queued one at a time (app._add_all): interleaved, each took the queue
for its first prompt and then failed on its second, so six concurrent batches of which three fit got 429 all."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import httpx

from server_testing import make_engine, running_server


def test_concurrent_batches_are_queued_one_whole_batch_at_a_time(tiny_llama):
    engine = make_engine(tiny_llama, max_num_seqs=2)
    try:
        # room for 2 running + 8 waiting samples; each request asks for 2 prompts x 5 samples: one fits at a time
        with running_server(engine, "tiny", max_waiting_requests=8) as (url, app):
            serving = app.state.kvfit.engine
            add, order = serving.add, []

            async def add_after_a_hop(request_id, *args, **kwargs):   # the engine core process's round trip
                order.append(request_id)
                await asyncio.sleep(0.05)
                return await add(request_id, *args, **kwargs)
            serving.add = add_after_a_hop
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
