"""A bounded load test on loopback: 64 concurrent streams on a cache that holds about 3 full requests.

Every request must end (a finished stream or an explicit error), /health must stay 200 under load,
the cache must preempt, and after the drain every block is free or cached-free.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import openai
import pytest

from server_testing import assert_blocks_balanced, make_engine, running_server, scrape, wait_for_drain

MODEL = "tiny-llama"
MAX_MODEL_LEN = 128
NUM_BLOCKS = 24            # 24 x 16 = 384 tokens = 3 requests of max_model_len
NUM_REQUESTS = 64
DEADLINE_S = 60


@pytest.fixture(scope="module")
def engine(tiny_llama):
    engine = make_engine(tiny_llama, max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=NUM_BLOCKS,
                         max_num_seqs=64)
    yield engine
    engine.shutdown()


async def one_stream(client: openai.AsyncOpenAI, prompt: list[int], max_tokens: int):
    """('ok', completion tokens, finish reason, text) or ('error', status, message)."""
    try:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True,
                                                 temperature=0.8, seed=len(prompt),
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        text, reason, usage = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            usage = chunk.usage or usage
        return ("ok", usage.completion_tokens, reason, text)
    except openai.APIStatusError as exc:
        return ("error", exc.status_code, str(exc))
    except openai.APIError as exc:         # an error event inside the stream
        return ("error", None, str(exc))


async def watch_health(url: str, stop: asyncio.Event) -> list[int]:
    statuses = []
    async with httpx.AsyncClient(timeout=10) as http:
        while not stop.is_set():
            statuses.append((await http.get(f"{url}/health")).status_code)
            await asyncio.sleep(0.05)
    return statuses


async def load(url: str, requests: list[tuple[list[int], int]]):
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=DEADLINE_S)
    stop = asyncio.Event()
    health = asyncio.create_task(watch_health(url, stop))
    try:
        results = await asyncio.wait_for(asyncio.gather(*(one_stream(client, p, n) for p, n in requests)),
                                         DEADLINE_S)
    finally:
        stop.set()
        statuses = await health
        await client.close()
    return results, statuses


def make_requests(count: int, seed: int, max_tokens: tuple[int, int]) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, 250) for _ in range(rng.randint(8, 40))], rng.randint(*max_tokens))
            for _ in range(count)]


def test_64_concurrent_streams_preempt_and_drain(engine):
    requests = make_requests(NUM_REQUESTS, seed=0, max_tokens=(8, 24))
    with running_server(engine, MODEL) as (url, _):
        before = scrape(url)["kvfit_preemptions_total"]
        start = time.monotonic()
        results, statuses = asyncio.run(load(url, requests))
        elapsed = time.monotonic() - start
        m = wait_for_drain(url)
    assert len(results) == NUM_REQUESTS and elapsed < DEADLINE_S
    errors = [r for r in results if r[0] != "ok"]
    assert not errors, errors[:3]          # a queue of 1024 takes them all: none should fail
    for (_, max_tokens), (_, num_tokens, reason, _) in zip(requests, results):
        assert (num_tokens, reason) == (max_tokens, "length")
    assert statuses and set(statuses) == {200}
    assert_blocks_balanced(m)
    assert m["kvfit_preemptions_total"] > before, "the cache was meant to be too small for the batch"
    assert m["kvfit_kv_blocks_total"] == NUM_BLOCKS


def test_a_burst_beyond_the_waiting_limit_gets_429_and_the_rest_finish(engine):
    requests = make_requests(32, seed=1, max_tokens=(48, 64))
    with running_server(engine, MODEL, max_waiting_requests=4) as (url, _):
        results, statuses = asyncio.run(load(url, requests))
        m = wait_for_drain(url)
    outcomes = [r[1] if r[0] == "error" else r[2] for r in results]
    assert set(outcomes) <= {429, "length"}, outcomes
    assert outcomes.count(429) >= 1 and outcomes.count("length") >= 1
    assert set(statuses) == {200}
    assert_blocks_balanced(m)
