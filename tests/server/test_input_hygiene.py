"""Hostile input through a real server on loopback (fake engine, no model): bad JSON, lone surrogates,
wrong Content-Type, slow or half-sent requests, too many connections, a client gone mid-upload.

Each is answered with OpenAI's error JSON (or the connection is closed), never a 500 or a traceback,
and the server keeps serving.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import time

import httpx
import pytest

from fake_engine import FakeEngine
from kvfit.server.launch import ConnectionLimits, GuardOptions
from server_testing import openai_error, running_server

JSON = {"Content-Type": "application/json"}


@contextlib.contextmanager
def guarded_server(bind_host: str = "127.0.0.1", limits: ConnectionLimits = ConnectionLimits(),
                   api_key: str | None = None, **guard_kwargs):
    """A fake-engine app with the guards, under kvfit's uvicorn config, on 127.0.0.1:<free port>.

    bind_host is what the guards are told the server is bound to (the socket is loopback anyway)."""
    guards = GuardOptions(bind_host, api_key, **guard_kwargs)
    with running_server(FakeEngine(), "fake", guards=guards, limits=limits, api_key=api_key) as (url, _):
        yield url


@pytest.fixture(scope="module")
def server():
    with guarded_server(limits=ConnectionLimits(header_timeout_s=0.5), body_timeout_s=0.5) as url:
        yield url


def post(url: str, raw: bytes, headers: dict | None = None, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(f"{url}{path}", content=raw, headers=JSON if headers is None else headers, timeout=10)


def assert_serving(url: str) -> None:
    r = httpx.post(f"{url}/v1/completions", json={"model": "fake", "prompt": "ok", "max_tokens": 2}, timeout=10)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ab", r.text


# JSON limits ------------------------------------------------------------------------------------
BAD_JSON = {
    "nested-100000": b'{"model": "fake", "prompt": "hi", "tools": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "nested-80": b'{"model": "fake", "prompt": "hi", "tools": ' + b"[" * 80 + b"]" * 80 + b"}",
    "int-5000-digits": b'{"model": "fake", "prompt": "hi", "seed": ' + b"7" * 5000 + b"}",
    "int-2**64": b'{"model": "fake", "prompt": "hi", "seed": 18446744073709551616}',
    "float-1e400": b'{"model": "fake", "prompt": "hi", "temperature": 1e400}',
    "encoded-surrogate": b'{"model": "fake", "prompt": "\xed\xa0\x80"}',
}


@pytest.mark.parametrize("raw", BAD_JSON.values(), ids=BAD_JSON.keys())
def test_json_past_the_limits_is_400_invalid_json(server, raw, capfd):
    r = post(server, raw)
    assert r.status_code == 400, r.text
    error = openai_error(r)
    assert error["code"] == "invalid_json" and len(error["message"]) < 200, error
    assert_serving(server)
    assert "Traceback" not in capfd.readouterr().err


LONE_SURROGATES = {
    "prompt": ("/v1/completions", {"model": "fake", "prompt": "a\ud800b"}, "prompt"),
    "prompt-list": ("/v1/completions", {"model": "fake", "prompt": ["\udfff"]}, "prompt"),
    "model": ("/v1/completions", {"model": "\ud800", "prompt": "hi"}, "model"),
    "stop": ("/v1/completions", {"model": "fake", "prompt": "hi", "stop": ["\ud800"]}, "stop"),
    "messages": ("/v1/chat/completions", {"model": "fake", "messages": [{"role": "user", "content": "\ud800"}]},
                 "messages"),
    "message-part": ("/v1/chat/completions", {"model": "fake", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "x\udc00"}]}]}, "messages"),
}


@pytest.mark.parametrize("path, body, field", LONE_SURROGATES.values(), ids=LONE_SURROGATES.keys())
def test_a_lone_surrogate_is_400_naming_its_field(server, path, body, field, capfd):
    raw = json.dumps(body).encode()                    # ensure_ascii: the surrogate travels as \ud800
    r = post(server, raw, path=path)
    assert r.status_code == 400, r.text
    error = openai_error(r)
    assert error["param"] == field and error["code"] == "invalid_text", error
    assert "Traceback" not in capfd.readouterr().err


def test_a_surrogate_pair_and_long_digits_in_text_are_fine(server):
    raw = json.dumps({"model": "fake", "prompt": "\U0001f600 12345678901234567890123", "max_tokens": 2,
                      "seed": 2**63 - 1}).encode()
    assert post(server, raw).status_code == 200


@pytest.mark.parametrize("seed", [2**63, -2**63 - 1, 2**64 - 1])
def test_a_seed_past_64_bits_is_400_naming_seed(server, seed):
    # vLLM's API bounds the seed to a 64-bit signed integer
    r = post(server, json.dumps({"model": "fake", "prompt": "hi", "max_tokens": 2, "seed": seed}).encode())
    assert r.status_code == 400 and openai_error(r)["param"] == "seed", r.text


# Content-Type -----------------------------------------------------------------------------------
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_post_that_is_not_application_json_is_415(server, content_type):
    raw = json.dumps({"model": "fake", "prompt": "hi", "max_tokens": 2}).encode()
    r = post(server, raw, headers={} if content_type is None else {"Content-Type": content_type})
    assert r.status_code == 415, r.text
    assert openai_error(r)["code"] == "unsupported_media_type"
    r = post(server, raw, headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200, r.text


# slow, half-sent and many connections ----------------------------------------------------------
def raw_socket(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def read_all(sock: socket.socket, timeout_s: float) -> tuple[bytes, float]:
    """Everything until the server closes, and the seconds that took."""
    start, data = time.monotonic(), b""
    sock.settimeout(timeout_s)
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data, time.monotonic() - start


HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"],
                         ids=["nothing", "half-a-head"])
def test_a_connection_without_a_complete_head_is_closed(server, sent):
    socks = [raw_socket(server) for _ in range(20)]
    for s in socks:
        s.sendall(sent)
    for s in socks:
        data, seconds = read_all(s, timeout_s=5)      # before the fix: never closed (recv times out)
        assert data == b"" and seconds < 3
        s.close()
    assert_serving(server)


def test_a_body_that_does_not_arrive_in_time_is_408(server):
    with raw_socket(server) as s:
        s.sendall(HEAD + b"Content-Length: 100\r\n\r\n" + b'{"model": ')
        data, seconds = read_all(s, timeout_s=5)
    assert data.startswith(b"HTTP/1.1 408"), data
    assert b"request_timeout" in data and seconds < 3
    assert_serving(server)


def test_past_max_connections_requests_get_503_until_some_close():
    with guarded_server(limits=ConnectionLimits(max_connections=4, header_timeout_s=30)) as url:
        idle = [raw_socket(url) for _ in range(4)]
        time.sleep(0.2)
        assert httpx.get(f"{url}/health", timeout=5).status_code == 503
        for s in idle:
            s.close()
        time.sleep(0.2)
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200


def test_a_client_gone_mid_upload_is_one_debug_line(server, caplog, capfd):
    caplog.set_level(logging.DEBUG, logger="kvfit")
    with raw_socket(server) as s:
        s.sendall(HEAD + b"Content-Length: 1000\r\n\r\n" + b'{"model": "fake", ')
        time.sleep(0.1)
    deadline = time.monotonic() + 5
    while not any("went away" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = [r for r in caplog.records if r.name == "kvfit" and r.levelno >= logging.DEBUG]
    assert [r.getMessage() for r in lines] == ["client went away while sending the body of POST /v1/completions"]
    assert lines[0].levelno == logging.DEBUG and lines[0].exc_info is None
    assert "Traceback" not in capfd.readouterr().err
    assert_serving(server)
