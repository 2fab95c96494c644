"""Issue 27's adversarial cases against a real `kvfit serve` subprocess (CPU, API key, tiny Llama): every input
gets its documented answer (a 400 naming the field and the limit, or a 200), the server never dies, never logs
a traceback, keeps /health fast and keeps other requests moving. tests/tools/adversarial.py runs ISSUE_27_CASES
too, beside its older categories.

The chat template the server is started with loops, includes, recurses or asks for range(10**9) when a
chat_template_kwargs flag says so: the operator's template misbehaving on a client's request (item 12).
Covered elsewhere, as unit tests: NaN logits under top_p (tests/engine/test_nonfinite_top_p.py), a checkpoint
with NaN weights and offline-API misuses (tests/engine/test_offline_misuse.py), llguidance's run-time limits
(tests/engine/test_request_preparation.py), the grammar cache's byte bound (tests/structured).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from grammar_bombs import lark_chain, ref_chain
from tiny_models import CHAT_TEMPLATE, make_tiny_model

pytest.importorskip("llguidance")

KEY = "adversarial-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
C, CH = "/v1/completions", "/v1/chat/completions"
MAX_WAITING = 16
GOOD = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}
TRIGGERS = ("{% if loop_forever %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
            "{% endif %}{% if do_include %}{% include 'other.jinja' %}{% endif %}"
            "{% if recurse %}{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}{% endif %}"
            "{% if big_range %}{% for i in range(10**9) %}{% endfor %}{% endif %}")


def _chat(**extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **extra}


def _so(**spec) -> dict:
    return {**GOOD, "structured_outputs": spec}


# (case, path, JSON body or raw bytes, statuses that are right, words the error message must hold)
ISSUE_27_CASES = [
    ("(1) Lark grammar of 3,000 chained rules", C, _so(grammar=lark_chain(3000)), (400,), ["grammar", "1000"]),
    ("(1) JSON schema with a $ref chain 3,000 deep", C, _so(json=ref_chain(3000)), (400,), ["$ref", "1000"]),
    ("(1) JSON schema with an allOf/$ref chain 3,000 deep", C, _so(json=ref_chain(3000, all_of=True)), (400,),
     ["$ref"]),
    ("(1) a $ref chain of 1,000 (at the limit) compiles", C, _so(json=ref_chain(999)), (200,), []),
    ("(1) tool_choice required over a tool whose parameters chain $refs 3,000 deep", CH,
     _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": ref_chain(3000)}}],
           tool_choice="required"), (400,), ["tools", "$ref"]),
    ("(1) tool_choice naming a tool whose parameters chain $refs 3,000 deep", CH,
     _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": ref_chain(3000)}}],
           tool_choice={"type": "function", "function": {"name": "f"}}), (400,), ["tools", "$ref"]),
    ("(2) n = 2^63-1", C, {**GOOD, "n": 2**63 - 1}, (400,), ["n"]),
    ("(3) n = 5,000 past the queue", C, {**GOOD, "n": 5000}, (400, 429), ["n"]),
    ("(3) n = 200,000 past the queue", C, {**GOOD, "n": 200_000}, (400, 429), ["n"]),
    ("(5) 50,000-entry choice", C, _so(choice=[f"c{i}" for i in range(50_000)]), (400,), ["choice", "8192"]),
    ("(low) 90,000-entry choice: one line, no panic", C, _so(choice=[f"c{i}" for i in range(90_000)]), (400,),
     ["8192"]),
    ("(8) logit_bias key '²'", C, {**GOOD, "logit_bias": {"²": 1}}, (400,), ["logit_bias"]),
    ("(8) logit_bias key of 5,000 digits", C, {**GOOD, "logit_bias": {"9" * 5000: 1}}, (400,), ["logit_bias"]),
    ("(8) logit_bias key fullwidth '５'", C, {**GOOD, "logit_bias": {"５": 1}}, (400,), ["logit_bias"]),
    ("(8) chat_template_kwargs {'self': 1}", CH, _chat(chat_template_kwargs={"self": 1}), (200,), []),
    ("(8) chat_template_kwargs {'raise_exception': 1}", CH, _chat(chat_template_kwargs={"raise_exception": 1}),
     (400,), ["raise_exception"]),
    ("(8) JSON schema as text nested 5,000 deep", C, _so(json='{"a":' * 5000 + "1" + "}" * 5000), (400,),
     ["32"]),
    ("(10) 20,000 bad_words", C, {**GOOD, "bad_words": [f"w{i}" for i in range(20_000)]}, (400,),
     ["bad_words", "1024"]),
    ("(10) 1,024 bad_words (at the limit)", C, {**GOOD, "bad_words": [f"w{i}" for i in range(1024)]}, (200,), []),
    ("(12) a chat template that loops", CH, _chat(chat_template_kwargs={"loop_forever": True}), (400,),
     ["CPU time"]),
    ("(low) a chat template that includes", CH, _chat(chat_template_kwargs={"do_include": True}), (400,),
     ["other.jinja"]),
    ("(low) a recursive macro", CH, _chat(chat_template_kwargs={"recurse": True}), (400,), ["recursed"]),
    ("(low) range(10**9) in the template", CH, _chat(chat_template_kwargs={"big_range": True}), (400,),
     ["1000000000"]),
]


class Server:
    """`kvfit serve` in a subprocess; stderr kept in a file, so tracebacks can be counted."""

    def __init__(self, model: str, workdir: str):
        template = os.path.join(workdir, "template.jinja")
        with open(template, "w", encoding="utf-8") as fh:
            fh.write(TRIGGERS + CHAT_TEMPLATE)
        self.err_path = os.path.join(workdir, "serve.stderr")
        env = dict(os.environ, KVFIT_API_KEY=KEY)
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvfit.cli", "serve", model, "--device", "cpu", "--dtype", "float32",
                 "--max-model-len", "128", "--num-gpu-blocks-override", "64", "--port", "0",
                 "--served-model-name", "tiny", "--max-waiting-requests", str(MAX_WAITING),
                 "--chat-template", template], stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        self.url = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and self.url is None:
            line = self.proc.stdout.readline()
            if not line:
                break
            if "listening on " in line:
                self.url = line.split("listening on ", 1)[1].split()[0].rstrip("/")
        if self.url is None:
            self.proc.kill()
            raise AssertionError(f"kvfit serve did not start: {open(self.err_path).read()[-3000:]}")
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()     # never block on a full pipe
        self.client = httpx.Client(base_url=self.url, timeout=60, headers=AUTH)

    def log(self) -> str:
        with open(self.err_path, errors="replace") as fh:
            return fh.read()

    def stop(self) -> int:
        self.client.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("adversarial")
    srv = Server(make_tiny_model(root, arch="llama"), str(root))
    yield srv
    assert srv.stop() == 0, "kvfit serve did not exit 0 on SIGTERM"


def _error_message(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text


@pytest.mark.parametrize("case, path, body, statuses, words", ISSUE_27_CASES, ids=[c[0] for c in ISSUE_27_CASES])
def test_issue_27_case(server, case, path, body, statuses, words):
    before = server.log().count("Traceback")
    response = server.client.post(path, json=body)
    assert response.status_code in statuses, f"{case}: {response.status_code} {response.text[:300]}"
    message = _error_message(response)
    for word in words:
        assert word in message, f"{case}: {message}"
    if response.status_code >= 400:
        assert "\n" not in message and "Traceback" not in message and "panic" not in message, message
    assert server.proc.poll() is None, f"{case}: the server died (exit {server.proc.returncode})"
    assert server.log().count("Traceback") == before, f"{case}: a traceback in the server log"


def test_a_grammar_compiling_does_not_stop_other_requests(server):
    # (5): a JSON schema of 3,000 properties takes seconds to check and compile; short requests sent meanwhile
    # are answered in their usual time (on the engine thread the compile stopped them all)
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        big = pool.submit(server.client.post, C, json=_so(json=schema))
        latencies = []
        while not big.done() and len(latencies) < 200:
            t = time.monotonic()
            assert server.client.post(C, json=GOOD).status_code == 200
            latencies.append(time.monotonic() - t)
        assert big.result().status_code == 200
        took = time.monotonic() - started
    assert len(latencies) >= 3, f"the schema took only {took:.2f} s: nothing overlapped it"
    assert max(latencies) < 1.0, f"a plain request took {max(latencies):.2f} s while a grammar compiled"


def test_unicode_line_separators_in_sse(server):
    # (low): a choice holding U+2028 streams as events that str.splitlines does not break
    body = {**_so(choice=["a\u2028b\u2029c\x85d"]), "stream": True, "max_tokens": 30}
    with server.client.stream("POST", C, json=body) as response:
        raw = b"".join(response.iter_bytes()).decode("utf-8")
    events = [line for line in raw.splitlines() if line]
    assert events[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in events), events
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in events[:-1])
    assert text == "a\u2028b\u2029c\x85d"


def _raw_request(url: str, head: bytes) -> bytes:
    """The server's answer to raw bytes, read until it closes. A refused head is answered and the rest of the
    client's bytes read before the close (a lingering close), so the answer is never lost to a TCP reset."""
    host, port = url.removeprefix("http://").split(":")
    chunks = []
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head)
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize("size", [17 * 1024, 100 * 1024])
def test_a_request_head_past_16_kib_in_one_write_is_refused(server, size):
    head = (b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Pad: " + b"a" * size + b"\r\n\r\n")
    answer = _raw_request(server.url, head)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    assert server.client.get("/health").status_code == 200


def test_idle_connections_do_not_starve_health(server):
    # (11): 300 connections that never send a byte; /health still answers at once
    idle = [socket.create_connection(tuple(server.url.removeprefix("http://").rsplit(":", 1)[0:1]) +
                                     (int(server.url.rsplit(":", 1)[1]),), timeout=5) for _ in range(300)]
    try:
        start = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        assert time.monotonic() - start < 1.0
    finally:
        for sock in idle:
            sock.close()


def test_big_logprob_responses_do_not_block_health(server):
    # (6): n = 16 samples with 20 top logprobs each (12,800 entries; within the cache, so no preemption on the
    # CPU's slow path); /health is answered within 0.5 s all along
    body = _chat(n=16, logprobs=True, top_logprobs=20, max_tokens=40, ignore_eos=True)
    with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=server.url, timeout=10) as probe:
        big = pool.submit(server.client.post, CH, json=body)
        worst = 0.0
        while not big.done():
            start = time.monotonic()
            assert probe.get("/health").status_code == 200
            worst = max(worst, time.monotonic() - start)
            time.sleep(0.02)
        assert big.result().status_code == 200
    assert worst < 0.5, f"/health took {worst:.2f} s while a big logprob response was built"


def _gauge(server, name: str) -> float:
    for line in server.client.get("/metrics").text.splitlines():
        if line.startswith(name):
            return float(line.split()[-1])
    raise AssertionError(f"no {name} in /metrics")


def test_a_non_streamed_request_stops_when_its_client_leaves(server):
    # (4): n = 60 samples of 120 tokens; the client gives up after 0.3 s and the work stops at once (on a quiet
    # machine the whole request can finish in about 1 s, so the client must leave well before that)
    body = {**GOOD, "n": 60, "max_tokens": 120, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + C, json=body, headers=AUTH, timeout=0.3)
    deadline = time.monotonic() + 2.0
    while _gauge(server, "vllm:num_requests_running") + _gauge(server, "vllm:num_requests_waiting") > 0:
        assert time.monotonic() < deadline, "the request kept running (or counted as running) after its client left"
        time.sleep(0.05)


def test_the_server_is_healthy_and_logged_no_traceback(server):
    assert server.client.get("/health").status_code == 200
    assert server.client.post(C, json=GOOD).status_code == 200
    log = server.log()
    assert "Traceback" not in log, log[log.find("Traceback"):][:3000]
