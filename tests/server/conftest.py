"""tests/server: the helper modules beside the tests (server_testing, fake_engine) are importable; the
offline reference (kvfit.LLM on the tiny llama, the servers' settings) and a server of that model, with
an openai client for it, per module."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def offline(tiny_llama):
    """kvfit.LLM with the settings of every test server: the reference a server must equal."""
    from kvfit import LLM
    from server_testing import ENGINE_KWARGS
    llm = LLM(tiny_llama, **ENGINE_KWARGS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def tiny_client(tiny_server):
    """The official openai client of tiny_server."""
    import openai
    return openai.OpenAI(base_url=f"{tiny_server}/v1", api_key="unused", max_retries=0, timeout=60)
