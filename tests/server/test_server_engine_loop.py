"""The engine loop with a fake engine (no model): failures stay per request, backpressure, shutdown."""

from __future__ import annotations

import httpx
import openai
import pytest

from fake_engine import FakeEngine
from server_testing import openai_error, running_server, scrape, wait_for_drain


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=20)


def test_a_failing_step_fails_its_batch_and_the_loop_keeps_serving():
    engine = FakeEngine()
    with running_server(engine, "fake") as (url, _):
        c = client(url)
        with pytest.raises(openai.InternalServerError) as info:
            c.completions.create(model="fake", prompt="FAIL-STEP", max_tokens=4)
        assert info.value.body["type"] == "server_error"
        with pytest.raises(openai.APIError):           # streaming: an error event, then [DONE]
            list(c.completions.create(model="fake", prompt="FAIL-STEP", max_tokens=4, stream=True))
        assert c.completions.create(model="fake", prompt="ok", max_tokens=3).choices[0].text == "abc"
        assert httpx.get(f"{url}/health").status_code == 200
        assert engine.requests == {}


def test_an_add_that_raises_is_a_500_for_that_request_only():
    with running_server(FakeEngine(), "fake") as (url, _):
        r = httpx.post(f"{url}/v1/completions", json={"model": "fake", "prompt": "FAIL-ADD"})
        assert r.status_code == 500 and openai_error(r)["type"] == "server_error"
        assert "exploded" not in r.text and "see the server log" in openai_error(r)["message"]   # no internals
        assert client(url).completions.create(model="fake", prompt="ok", max_tokens=2).choices[0].text == "ab"


def test_a_full_waiting_queue_answers_429_and_frees_nothing_it_did_not_take():
    # one request runs at a time; one may wait; a third is refused
    engine = FakeEngine(max_running=1, step_seconds=0.02)
    with running_server(engine, "fake", max_waiting_requests=1) as (url, _):
        c = client(url)
        running = c.completions.create(model="fake", prompt="a", max_tokens=60, stream=True)
        next(iter(running))                       # it has a token: it is running
        waiting = c.completions.create(model="fake", prompt="b", max_tokens=60, stream=True)
        with pytest.raises(openai.RateLimitError) as info:
            c.completions.create(model="fake", prompt="c", max_tokens=4)
        err = info.value.body
        assert err["code"] == "rate_limit_exceeded" and "--max-waiting-requests" in err["message"]
        r = httpx.post(f"{url}/v1/completions", json={"model": "fake", "prompt": "d", "max_tokens": 4})
        assert r.status_code == 429 and openai_error(r)["type"] == "rate_limit_error"
        running.close()
        waiting.close()            # gone before its first token: aborted too, not left to finish
        wait_for_drain(url, timeout_s=1.0)
        assert engine.num_aborted == 2
        # with room again, requests are served
        assert c.completions.create(model="fake", prompt="e", max_tokens=2).choices[0].text == "ab"


def test_shutdown_ends_open_streams_with_an_error_event_and_refuses_new_requests():
    engine = FakeEngine(step_seconds=0.02)
    with running_server(engine, "fake") as (url, app):
        c = client(url)
        stream = c.completions.create(model="fake", prompt="a", max_tokens=60, stream=True)
        chunks = iter(stream)
        next(chunks)
        app.state.kvfit.engine.begin_shutdown()
        with pytest.raises(openai.APIError) as info:
            for _ in chunks:
                pass
        assert "shutting down" in str(info.value)
        r = httpx.post(f"{url}/v1/completions", json={"model": "fake", "prompt": "late"})
        assert r.status_code == 503 and openai_error(r)["code"] == "server_shutting_down"
        assert httpx.get(f"{url}/health").status_code == 503
        assert engine.requests == {}
        assert scrape(url)['kvfit_kv_blocks{state="used"}'] == 0


def test_chat_on_a_model_without_a_template_is_a_clear_400():
    with running_server(FakeEngine(), "fake") as (url, _):
        with pytest.raises(openai.BadRequestError) as info:
            client(url).chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}])
        assert info.value.body["code"] == "no_chat_template" and "/v1/completions" in info.value.body["message"]
