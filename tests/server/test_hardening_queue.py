"""Issue 12, item 6: requests take free batch slots before counting as waiting, so
--max-waiting-requests bounds the queue beyond the batch, and 0 means no queue, not no service."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from server_testing import make_engine, openai_error, running_server, wait_for_drain

MODEL = "tiny-llama"
MAX_NUM_SEQS = 4


@pytest.fixture(scope="module")
def engine(tiny_llama):
    engine = make_engine(tiny_llama, max_num_seqs=MAX_NUM_SEQS)
    yield engine
    engine.shutdown()


async def burst(url: str, count: int) -> list[int]:
    """Status codes of `count` concurrent streamed completions, each long enough to hold its slot."""
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 100, "stream": True, "ignore_eos": True}

    async def one(http: httpx.AsyncClient) -> int:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                assert openai_error(r)["code"] == "rate_limit_exceeded"
            async for _ in r.aiter_bytes():
                pass
            return r.status_code

    async with httpx.AsyncClient(timeout=60) as http:
        return await asyncio.gather(*(one(http) for _ in range(count)))


def test_a_burst_fills_the_batch_slots_and_then_the_waiting_queue(engine):
    with running_server(engine, MODEL, max_waiting_requests=2) as (url, _):
        statuses = asyncio.run(burst(url, 10))
        wait_for_drain(url)
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) >= MAX_NUM_SEQS + 2, statuses
    assert statuses.count(429) >= 1, statuses      # the queue is still bounded


def test_no_waiting_queue_still_serves_an_idle_server(engine):
    with running_server(engine, MODEL, max_waiting_requests=0) as (url, _):
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 3,
                                                      "ignore_eos": True}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        statuses = asyncio.run(burst(url, 8))
        wait_for_drain(url)
    assert statuses.count(200) >= MAX_NUM_SEQS, statuses
