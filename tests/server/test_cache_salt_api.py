"""cache_salt through the HTTP API (vLLM's field, completions and chat): requests share prefix-cache
blocks only with requests of the same salt; a salt that is not a non-empty string is a 400 naming it."""

from __future__ import annotations

import httpx
import pytest

from kvfit.text.chat_template import load_chat_template
from server_testing import make_engine, openai_error, running_server
from test_chat_rendering import BOS_TEMPLATE

MODEL = "tiny"
PROMPT = list(range(1, 50))            # 3 full blocks of 16 + 1 token
MESSAGES = [{"role": "user", "content": "a long enough question " * 3}]


@pytest.fixture(scope="module")
def server(tiny_llama):
    engine = make_engine(tiny_llama)
    try:
        with running_server(engine, MODEL, chat_template=load_chat_template(BOS_TEMPLATE)) as (url, app):
            yield url, app.state.kvfit.engine
    finally:
        engine.shutdown()


def hit_tokens(server, path: str, body: dict) -> int:
    """Prefix-cache hit tokens of one request (the engine's counter before and after)."""
    url, engine = server
    before = engine.engine.stats()["prefix_cache_hits"]
    r = httpx.post(f"{url}{path}", json={"model": MODEL, "max_tokens": 2, "temperature": 0, **body}, timeout=30)
    assert r.status_code == 200, r.text
    return engine.engine.stats()["prefix_cache_hits"] - before


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": PROMPT}),
                                        ("/v1/chat/completions", {"messages": MESSAGES})],
                         ids=["completions", "chat"])
def test_only_requests_with_the_same_salt_share_cached_blocks(server, path, body):
    salt = f"tenant-a-{path}"
    assert hit_tokens(server, path, {**body, "cache_salt": salt}) == 0
    assert hit_tokens(server, path, {**body, "cache_salt": salt}) >= 16          # same salt: a hit
    assert hit_tokens(server, path, {**body, "cache_salt": salt + "-other"}) == 0
    assert hit_tokens(server, path, body) == 0            # the salted blocks are not seen without a salt
    assert hit_tokens(server, path, body) >= 16           # unsalted requests share as before


@pytest.mark.parametrize("salt", ["", 5, ["a"], {"a": 1}, True])
@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "hi"}),
                                        ("/v1/chat/completions", {"messages": MESSAGES})],
                         ids=["completions", "chat"])
def test_a_salt_that_is_not_a_non_empty_string_is_a_400_naming_it(server, path, body, salt):
    url, _ = server
    r = httpx.post(f"{url}{path}", json={"model": MODEL, "max_tokens": 2, "cache_salt": salt, **body})
    err = openai_error(r)
    assert r.status_code == 400 and err["param"] == "cache_salt", r.text
    assert "cache_salt must be a non-empty string" in err["message"]


def test_a_null_salt_is_no_salt(server):
    prompt = list(range(60, 95))
    assert hit_tokens(server, "/v1/completions", {"prompt": prompt}) == 0
    assert hit_tokens(server, "/v1/completions", {"prompt": prompt, "cache_salt": None}) == 32
