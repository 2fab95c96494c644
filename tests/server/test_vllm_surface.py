"""Small parts of vLLM's HTTP surface a client or load balancer relies on."""

import httpx

from fake_engine import FakeEngine
from server_testing import running_server


def test_ping_answers_get_and_a_bodyless_post_as_health_does():
    with running_server(FakeEngine(), "fake") as (url, _):
        assert httpx.get(f"{url}/ping", timeout=5).status_code == 200
        assert httpx.post(f"{url}/ping", timeout=5).status_code == 200      # no Content-Type (SageMaker's)
