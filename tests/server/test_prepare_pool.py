"""Large bodies are prepared in worker processes (prepare_pool.py): the same results and errors as
the prepare threads, a worker's death fails only the request it held, and no worker outlives its
server."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import threading
import time

import httpx
import pytest

from server_testing import make_engine, openai_error, running_server, spawned_children, wait_healthy
from test_server_cli import read_until, serving

from kvfit.server.prepare import PrepareContext, Prepared, prepare_request
from kvfit.server.prepare_pool import PreparePool
from kvfit.text.tokenizer import load_tokenizer
from kvfit.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                   TokenizeRequest)

MODEL = "tiny"
CONTEXT = PrepareContext((MODEL, "alias"), None, max_prompt_chars=200_000, max_model_len=128)
SYSTEM = {"role": "system", "content": "be brief"}
USER = {"role": "user", "content": "hello there"}


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": [SYSTEM, USER], "max_tokens": 4, **fields}


def many_messages(count: int) -> list[dict]:
    return [{"role": "user", "content": f"msg {i:05d}"} for i in range(count)]


# (model class, body: a dict to send as JSON, or raw bytes)
CASES = {
    "chat": (ChatCompletionRequest, chat()),
    "chat add_special_tokens": (ChatCompletionRequest, chat(add_special_tokens=True)),
    "chat text parts, echo of an open assistant turn": (ChatCompletionRequest, chat(
        messages=[USER, {"role": "assistant", "content": [{"type": "text", "text": "Sure"}]}], echo=True,
        add_generation_prompt=False, continue_final_message=True)),
    "chat unknown fields and unread template kwargs (logged)": (ChatCompletionRequest, chat(
        colour="blue", chat_template_kwargs={"nobody_reads_this": 1})),
    "chat of 2,500 messages": (ChatCompletionRequest, chat(messages=many_messages(2500))),
    "chat too long to tokenize": (ChatCompletionRequest, chat(messages=many_messages(10_000))),
    "chat wrong model": (ChatCompletionRequest, chat(model="other")),
    "chat no messages": (ChatCompletionRequest, chat(messages=[])),
    "chat bad role in the second slice": (ChatCompletionRequest, chat(
        messages=many_messages(1500)[:1207] + [{"role": "robot", "content": "x"}])),
    "chat tools": (ChatCompletionRequest, chat(tools=[{"type": "function"}])),
    "chat lone surrogate": (ChatCompletionRequest, b'{"model": "tiny", "messages": [{"role": "user", '
                                                   b'"content": "a\\ud800"}]}'),
    "not JSON": (ChatCompletionRequest, b'{"model": "tiny", "messages": ['),
    "nested too deep": (ChatCompletionRequest, b'{"model": "tiny", "x": ' + b"[" * 80 + b"]" * 80 + b"}"),
    "huge integer": (CompletionRequest, b'{"model": "tiny", "prompt": "a", "seed": ' + b"9" * 30 + b"}"),
    "completion text": (CompletionRequest, {"model": MODEL, "prompt": "Hello", "max_tokens": 3}),
    "completion batch of token ids": (CompletionRequest, {"prompt": [[1, 2, 3]] * 3000, "echo": True}),
    "completion bad prompt": (CompletionRequest, {"model": MODEL, "prompt": 5}),
    "tokenize messages": (TokenizeRequest, {"model": MODEL, "messages": [SYSTEM, USER]}),
    "tokenize prompt": (TokenizeRequest, {"prompt": "Hello"}),
    "tokenize both": (TokenizeRequest, {"prompt": "Hello", "messages": [USER]}),
    "detokenize": (DetokenizeRequest, {"model": "alias", "tokens": list(range(50)) * 200}),
}


def raw_body(body) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


def outcome(run) -> Prepared | tuple:
    """What a prepare call gives: its Prepared, or its APIError's fields."""
    try:
        return run()
    except APIError as exc:
        return (exc.status, exc.message, exc.type, exc.param, exc.code)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return load_tokenizer(tiny_llama)


@pytest.fixture(scope="module")
def pool(tiny_llama):
    pool = PreparePool(tiny_llama, CONTEXT, num_processes=1)
    yield pool
    pids = pool.worker_pids()
    pool.shutdown()
    assert pids and not any(alive(pid) for pid in pids), pids


def alive(pid: int) -> bool:
    """Whether pid runs (a zombie, exited but not yet reaped by its new parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("name", list(CASES))
def test_a_worker_process_prepares_a_body_as_the_threads_do(name, pool, tokenizer, caplog):
    model_class, body = CASES[name]
    raw = raw_body(body)
    with caplog.at_level(logging.WARNING, logger="kvfit"):
        in_thread = outcome(lambda: prepare_request(raw, model_class, CONTEXT, tokenizer, {}))
        thread_logs = [r.getMessage() for r in caplog.records]
        caplog.clear()
        in_worker = outcome(lambda: asyncio.run(pool.prepare(raw, model_class)))
        worker_logs = [r.getMessage() for r in caplog.records]
    assert in_worker == in_thread
    assert worker_logs == thread_logs
    if isinstance(in_thread, tuple):
        return
    if "unknown" in name:
        assert len(thread_logs) == 2 and "'colour'" in thread_logs[0] and "nobody_reads_this" in thread_logs[1]
    if model_class is ChatCompletionRequest or (model_class is TokenizeRequest and "messages" in body):
        messages = [{**m, "content": "".join(p["text"] for p in m["content"]) if isinstance(m["content"], list)
                     else m["content"]} for m in body["messages"]]
        expected = tokenizer.apply_chat_template(messages, body.get("add_generation_prompt", True),
                                                 continue_final_message=body.get("continue_final_message", False),
                                                 tokenize=True)
        if body.get("add_special_tokens"):
            expected = tokenizer.encode(tokenizer.apply_chat_template(messages), True)
        assert in_worker.prompt_ids == expected and in_worker.body.messages == []
        assert in_worker.last_message == messages[-1]
    else:
        assert in_worker.prompt_ids is None and in_worker.body == model_class.model_validate(json.loads(raw))


def test_the_errors_cover_each_check(pool):
    """The cases above reach every refusal the preparation makes (else the comparison proves little)."""
    codes = {}
    for name, (model_class, body) in CASES.items():
        result = outcome(lambda: asyncio.run(pool.prepare(raw_body(body), model_class)))
        if isinstance(result, tuple):
            codes[name] = (result[0], result[4], result[3])
    assert codes == {
        "chat too long to tokenize": (400, "context_length_exceeded", "prompt"),
        "chat wrong model": (404, 404, "model"),
        "chat no messages": (400, None, "messages"),
        "chat bad role in the second slice": (400, None, "messages"),
        "chat tools": (400, None, "tools"),
        "chat lone surrogate": (400, "invalid_text", "messages"),
        "not JSON": (400, "invalid_json", None),
        "nested too deep": (400, "invalid_json", None),
        "huge integer": (400, "invalid_json", None),
        "completion bad prompt": (400, None, "prompt"),
        "tokenize both": (400, None, "prompt"),
    }


# through a server: every body in the processes (large_body_bytes=0) or every body on the threads ----
REQUESTS = [
    ("/v1/chat/completions", chat(temperature=0, max_tokens=5)),
    ("/v1/chat/completions", chat(messages=[USER, {"role": "assistant", "content": "Sure"}], echo=True,
                                  add_generation_prompt=False, continue_final_message=True, temperature=0)),
    ("/v1/chat/completions", chat(messages=many_messages(100), temperature=0)),       # over 128 tokens
    ("/v1/chat/completions", chat(messages=many_messages(2000))),                      # over the characters
    ("/v1/chat/completions", chat(model="other")),
    ("/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 5, "temperature": 0, "echo": True,
                         "logprobs": 2}),
    ("/v1/completions", {"model": MODEL, "prompt": [[1, 2, 3], [4, 5]], "max_tokens": 2, "temperature": 0}),
    ("/tokenize", {"model": MODEL, "messages": [SYSTEM, USER], "return_token_strs": True}),
    ("/detokenize", {"model": MODEL, "tokens": [1, 2, 3, 4]}),
]


def answers(url: str) -> list[tuple[int, dict]]:
    out = []
    for path, body in REQUESTS:
        r = httpx.post(f"{url}{path}", json=body, timeout=60)
        data = r.json()
        for key in ("id", "created"):
            data.pop(key, None)
        out.append((r.status_code, data))
    return out


@pytest.fixture(scope="module")
def engine(tiny_llama):
    engine = make_engine(tiny_llama)
    yield engine
    engine.shutdown()


def test_a_server_answers_the_same_with_bodies_prepared_in_processes_or_threads(engine):
    with running_server(engine, MODEL, prepare_processes=0) as (url, app):
        assert app.state.kvfit.prepare_pool is None
        on_threads = answers(url)
    with running_server(engine, MODEL, large_body_bytes=0, prepare_processes=1) as (url, app):
        in_processes = answers(url)
        assert len(app.state.kvfit.prepare_pool.worker_pids()) == 1
    assert in_processes == on_threads
    assert [status for status, _ in on_threads] == [200, 200, 400, 400, 404, 200, 200, 200, 200]
    assert [data["error"]["code"] for _, data in on_threads[2:4]] == ["context_length_exceeded"] * 2


def test_a_worker_that_dies_fails_its_request_with_500_and_the_next_is_served(engine):
    with running_server(engine, MODEL, large_body_bytes=0, prepare_processes=1) as (url, app):
        pool = app.state.kvfit.prepare_pool
        assert httpx.post(f"{url}/v1/chat/completions", json=chat()).status_code == 200
        [pid] = pool.worker_pids()
        os.kill(pid, signal.SIGSTOP)          # the body waits in the worker's queue until it is killed
        result = {}
        poster = threading.Thread(target=lambda: result.update(r=httpx.post(
            f"{url}/v1/chat/completions", json=chat(), timeout=60)))
        poster.start()
        deadline = time.monotonic() + 30
        while pool.num_in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.num_in_flight == 1
        os.kill(pid, signal.SIGKILL)
        poster.join(60)
        failed = result["r"]
        error = openai_error(failed)
        assert failed.status_code == 500 and error["type"] == "server_error", failed.text
        assert error["message"].startswith("internal error err-")
        ok = httpx.post(f"{url}/v1/chat/completions", json=chat(), timeout=60)
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]
        [new_pid] = pool.worker_pids()
        assert new_pid != pid and not alive(pid)
        assert httpx.get(f"{url}/health").status_code == 200
    assert not alive(new_pid)                 # the server's shutdown stopped the new worker


def worker_pids_of(server_pid: int) -> list[int]:
    """The pids of the server's prepare workers: its children started by multiprocessing's spawn."""
    return spawned_children(server_pid)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads child processes from /proc")
def test_workers_exit_when_the_server_is_killed(tiny_llama, tmp_path):
    big = json.dumps(chat(messages=many_messages(5000))).encode()
    assert len(big) > 64 * 1024
    with serving(tiny_llama, "--served-model-name", MODEL, log_path=tmp_path / "stderr.txt") as (proc, lines):
        url = read_until(lines, r"listening on (http://127\.0\.0\.1:\d+)")[0].group(1)
        wait_healthy(url)
        r = httpx.post(f"{url}/v1/chat/completions", content=big, headers={"content-type": "application/json"},
                       timeout=60)
        assert r.status_code == 400 and openai_error(r)["code"] == "context_length_exceeded"
        workers = worker_pids_of(proc.pid)
        assert len(workers) >= 1
        proc.kill()                           # no shutdown path runs: the workers notice on their own
        proc.wait()
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in workers)


SLOW_BRANCH = "{% if slow %}{% for i in range(400) %}{% for j in range(400) %}{% endfor %}{% endfor %}{% endif %}"
LOOP_BRANCH = ("{% if loop_forever %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
               "{% endif %}")


def test_a_chat_template_that_runs_long_on_a_thread_is_rendered_in_a_worker(engine):
    """A template past THREAD_RENDER_CPU_SECONDS on a prepare thread held the server's GIL for its whole run
    (a 2 s loop held streams 100-350 ms at a time): it is stopped there and rendered in a worker, with the
    same result; an ordinary chat starts no worker; one past the full bound is still a one-line 400."""
    from tiny_models import CHAT_TEMPLATE
    template = SLOW_BRANCH + LOOP_BRANCH + CHAT_TEMPLATE
    with running_server(engine, MODEL, prepare_processes=1, chat_template=template) as (url, app):
        pool = app.state.kvfit.prepare_pool
        fast = httpx.post(f"{url}/v1/chat/completions", json=chat(temperature=0), timeout=60)
        assert fast.status_code == 200 and pool.worker_pids() == []
        slow = httpx.post(f"{url}/v1/chat/completions", json=chat(temperature=0, chat_template_kwargs={"slow": True}),
                          timeout=60)
        assert slow.status_code == 200, slow.text
        assert len(pool.worker_pids()) == 1
        assert slow.json()["usage"] == fast.json()["usage"]
        assert slow.json()["choices"][0]["message"] == fast.json()["choices"][0]["message"]
        looping = httpx.post(f"{url}/v1/chat/completions", json=chat(chat_template_kwargs={"loop_forever": True}),
                             timeout=60)
        assert looping.status_code == 400 and "CPU time" in openai_error(looping)["message"]
        assert "\n" not in openai_error(looping)["message"]


def test_a_chat_prepared_again_in_a_worker_logs_its_warnings_once(engine, caplog):
    """The thread logged the ignored fields and unread chat_template_kwargs before the template ran past its
    share, and the worker's copies were replayed: every such request logged each warning twice."""
    from tiny_models import CHAT_TEMPLATE
    with running_server(engine, MODEL, prepare_processes=1, chat_template=SLOW_BRANCH + CHAT_TEMPLATE) as (url, app):
        with caplog.at_level(logging.WARNING, logger="kvfit"):
            slow = httpx.post(f"{url}/v1/chat/completions", timeout=60, json=chat(
                temperature=0, colour="blue", chat_template_kwargs={"slow": True, "nobody_reads_this": 1}))
        assert slow.status_code == 200, slow.text
        assert len(app.state.kvfit.prepare_pool.worker_pids()) == 1          # it was prepared again in a worker
    lines = [r.getMessage() for r in caplog.records]
    assert sum("'colour'" in line for line in lines) == 1, lines
    assert sum("nobody_reads_this" in line for line in lines) == 1, lines
