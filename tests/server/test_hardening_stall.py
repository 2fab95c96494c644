"""Issue 12, item 1: a client's input is parsed, rendered and tokenized off the event loop and the
engine thread (a large body in another process), and a text that cannot fit is refused before it is
tokenized."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest

from fake_engine import FakeEngine
from server_testing import openai_error, running_server, wait_healthy
from test_prepare_pool import alive, worker_pids_of
from test_server_cli import read_until, start

from kvfit.server.launch import bind_socket
from kvfit.server.protocol import APIError

MODEL = "tiny-llama"
NUM_BODIES = 4
NUM_MESSAGES = 25_000
# The issue asks for every /health within 100 ms. A body over 64 KiB is parsed, validated, rendered
# and tokenized in a prepare worker process (prepare_pool.py), so the server's GIL stays free; the
# ~45 ms floor seen before was Nagle's algorithm (the server's sockets lacked TCP_NODELAY, see
# test_connections_accepted_on_the_servers_socket_send_at_once). Measured on the 2-core VM with this
# test's scenario repeated, servers x rounds (a server's first round starts its worker):
#   alone, 1 x 4 + 2 x 3:                         median 2-3 ms, worst 5-19 ms (70-117 calls a round)
#   beside a tests/server run, 3 x 3:             median 2-5 ms, worst 7-22 ms
#   beside tests/models + tests/runner (torch on both cores), 3 x 3: median 3-5 ms, worst 12-38 ms
# Before, alone, 1 x 3: threads without TCP_NODELAY median 56-57 ms, worst 142-176 ms (beside a full
# test run: 49-58 ms, 150-240 ms); threads with TCP_NODELAY median 17-19 ms, worst 146-205 ms. Every
# call is held to the 100 ms (2.6x the worst seen under load); the median bound catches a
# floor coming back.
HEALTH_MEDIAN_LIMIT_S = 0.03
HEALTH_MAX_LIMIT_S = 0.1


def big_chat_body() -> bytes:
    """About 1 MB of short messages, under the 1 MiB body limit."""
    messages = [{"role": "user", "content": f"msg {i:05d}"} for i in range(NUM_MESSAGES)]
    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 4}, separators=(",", ":")).encode()
    assert 900_000 < len(body) < (1 << 20), len(body)
    return body


def watch_health(url: str, stop: threading.Event, latencies: list[float]) -> None:
    """GET /health every 10 ms from its own thread (the posts' event loop must not delay it)."""
    with httpx.Client(timeout=10) as http:
        while not stop.is_set():
            start = time.monotonic()
            assert http.get(f"{url}/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.01)


async def post_all(url: str, body: bytes) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=20) as http:
        return await asyncio.gather(*(http.post(f"{url}/v1/chat/completions", content=body,
                                                headers={"content-type": "application/json"})
                                      for _ in range(NUM_BODIES)))


@pytest.fixture
def server(tiny_llama, tmp_path):
    """`kvfit serve` in its own process (the client's work must not share the server's GIL): (url, process).
    Its prepare workers must be gone once it exits on SIGTERM."""
    with open(tmp_path / "stderr.txt", "w+") as err:
        proc, lines = start(tiny_llama, "--served-model-name", MODEL, stderr=err)
        try:
            match, _ = read_until(lines, r"listening on (http://127\.0\.0\.1:\d+)")
            wait_healthy(match.group(1))
            yield match.group(1), proc
            workers = worker_pids_of(proc.pid)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=20) == 0
            assert not any(alive(pid) for pid in workers), workers
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_health_keeps_answering_while_four_1mb_chat_bodies_are_processed(server):
    url, proc = server
    body = big_chat_body()
    stop, latencies = threading.Event(), []
    watcher = threading.Thread(target=watch_health, args=(url, stop, latencies), daemon=True)
    watcher.start()
    time.sleep(0.05)
    begin = time.monotonic()
    try:
        responses = asyncio.run(post_all(url, body))
    finally:
        elapsed = time.monotonic() - begin
        stop.set()
        watcher.join(10)
    for r in responses:
        assert r.status_code == 400 and openai_error(r)["code"] == "context_length_exceeded", r.text[:300]
    if os.path.isdir("/proc"):
        assert worker_pids_of(proc.pid), "the bodies were not prepared in a worker process"
    assert len(latencies) >= 5, (latencies, elapsed)
    latencies.sort()
    assert latencies[len(latencies) // 2] < HEALTH_MEDIAN_LIMIT_S, (latencies, elapsed)
    assert latencies[-1] < HEALTH_MAX_LIMIT_S, (latencies[-5:], elapsed)
    assert elapsed < 40          # the four bodies are served at all (a loaded 2-core machine took 18 s once)


def test_connections_accepted_on_the_servers_socket_send_at_once():
    """TCP_NODELAY on every connection: uvicorn writes a response's head and body apart, and with
    Nagle's algorithm the body waited for the client's delayed ACK (~40 ms per keep-alive request)."""
    async def accepted_nodelay() -> int:
        sock = bind_socket("127.0.0.1", 0)
        accepted = asyncio.get_running_loop().create_future()
        server = await asyncio.start_server(lambda reader, writer: accepted.set_result(writer), sock=sock)
        async with server:
            _, client = await asyncio.open_connection(*sock.getsockname()[:2])
            writer = await asyncio.wait_for(accepted, 10)
            nodelay = writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            client.close()
            writer.close()
            return nodelay
    assert asyncio.run(accepted_nodelay()) != 0


def test_a_long_message_list_is_validated_in_slices_with_the_same_result_and_errors():
    from kvfit.server.protocol import MESSAGES_PER_SLICE, ChatCompletionRequest, parse_body
    messages = [{"role": "user", "content": f"m{i}"} for i in range(MESSAGES_PER_SLICE * 2 + 5)]
    raw = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 4}).encode()
    body = parse_body(raw, ChatCompletionRequest)
    assert body == ChatCompletionRequest.model_validate(json.loads(raw))
    assert [m.content for m in body.messages] == [m["content"] for m in messages]
    messages[MESSAGES_PER_SLICE + 7]["role"] = 7          # a role must be a string (any string reaches the template)
    with pytest.raises(APIError) as info:
        parse_body(json.dumps({"model": MODEL, "messages": messages}).encode(), ChatCompletionRequest)
    assert info.value.param == "messages" and f"messages.{MESSAGES_PER_SLICE + 7}.role" in str(info.value)


class RecordingEngine(FakeEngine):
    """Records the thread of every encode call."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.encode_threads: list[str] = []

    def encode(self, text):
        self.encode_threads.append(threading.current_thread().name)
        return super().encode(text)


def test_prompts_are_tokenized_off_the_engine_thread_and_the_event_loop():
    engine = RecordingEngine()
    with running_server(engine, "fake") as (url, _):
        r = httpx.post(f"{url}/v1/completions", json={"model": "fake", "prompt": "hello", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ab"
        assert r.json()["usage"]["prompt_tokens"] == 5
    assert engine.encode_threads and all(name.startswith("kvfit-prepare") for name in engine.encode_threads), \
        engine.encode_threads


def test_a_text_too_long_to_ever_fit_is_refused_without_tokenizing_it():
    engine = RecordingEngine(max_model_len=64)
    with running_server(engine, "fake") as (url, app):
        limit = app.state.kvfit.engine.max_prompt_chars
        assert limit >= 64 * 64        # never below max_model_len x 64 characters
        r = httpx.post(f"{url}/v1/completions", json={"model": "fake", "prompt": "x" * (limit + 1)})
        err = openai_error(r)
        assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "prompt"
        assert "--max-model-len" in err["message"]
        assert engine.encode_threads == []
        # one that might fit is tokenized, and the engine's admission check decides
        r = httpx.post(f"{url}/v1/completions", json={"model": "fake", "prompt": "x" * 64})
        assert r.status_code == 400 and openai_error(r)["code"] == "context_length_exceeded"
        assert len(engine.encode_threads) == 1
