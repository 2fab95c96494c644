"""Small parts of vLLM's HTTP surface a client or load balancer relies on."""

import httpx

from fake_engine import FakeEngine
from server_testing import running_server


def test_ping_answers_get_and_a_bodyless_post_as_health_does():
    with running_server(FakeEngine(), "fake") as (url, _):
        assert httpx.get(f"{url}/ping", timeout=5).status_code == 200
        assert httpx.post(f"{url}/ping", timeout=5).status_code == 200      # no Content-Type (SageMaker's)


def test_the_no_chat_template_message_says_it_once():
    with running_server(FakeEngine(), "fake") as (url, _):
        body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
        error = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=5).json()["error"]
    assert error["code"] == "no_chat_template"
    assert error["message"].count("chat template") + error["message"].count("chat_template") == 1   # said once
    assert "--chat-template" in error["message"] and "/v1/completions" in error["message"]
