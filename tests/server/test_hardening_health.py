"""Issue 12, item 2: a dead engine thread or tensor-parallel rank makes the server unhealthy:
/health and new requests answer 503 with an OpenAI error, and `kvfit serve` exits non-zero."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time

import httpx
import openai
import pytest

from fake_engine import FakeEngine
from server_testing import openai_error, running_server, spawned_children, wait_healthy
from test_server_cli import read_until, serving

from kvfit.errors import EngineDeadError
from kvfit.server.app import create_app
from kvfit.server.launch import (DEAD_ENGINE_GRACE_SECONDS, GRACEFUL_SHUTDOWN_SECONDS, GracefulServer,
                                 GuardOptions, bind_socket, install_guards, url_of, uvicorn_config)

RANKS_STOPPED = "the tensor-parallel ranks have stopped after an earlier error; start a new engine"


class FakeTPEngine(FakeEngine):
    """A prompt containing 'KILL-RANK' makes step() fail as a step does after a rank died; dead_ranks: rank
    processes that exited on their own (check_alive says so, as the tensor-parallel executor's does)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dead_ranks: list[int] = []
        self.stopped = False

    def check_alive(self):
        if self.stopped:
            raise EngineDeadError("the tensor-parallel ranks have stopped after an earlier error; start a new engine")
        if self.dead_ranks:
            raise EngineDeadError(f"tensor-parallel rank(s) {self.dead_ranks} exited")

    def step(self):
        if any("KILL-RANK" in self.tokenizer.decode(r["prompt"]) for r in self.requests.values()):
            self.stopped = True
            raise EngineDeadError("tensor-parallel rank(s) [1] failed: rank 1 was killed by signal 9")
        return super().step()


class BrokenLoopEngine(FakeEngine):
    """A prompt containing 'BREAK-LOOP' makes stats() raise after the step: a bug in the loop itself."""

    def stats(self):
        if any("BREAK-LOOP" in self.tokenizer.decode(r["prompt"]) for r in self.requests.values()):
            raise RuntimeError("loop bug")
        return super().stats()


def assert_dead(url: str) -> None:
    r = httpx.get(f"{url}/health")
    assert r.status_code == 503 and openai_error(r)["code"] == "engine_dead", r.text
    r = httpx.post(f"{url}/v1/completions", json={"model": "fake", "prompt": "ok", "max_tokens": 2})
    err = openai_error(r)
    assert r.status_code == 503 and err["code"] == "engine_dead" and err["type"] == "service_unavailable", r.text


def test_a_rank_that_exits_while_idle_makes_health_and_new_requests_503():
    engine = FakeTPEngine()
    with running_server(engine, "fake") as (url, app):
        r = httpx.post(f"{url}/v1/completions", json={"model": "fake", "prompt": "ok", "max_tokens": 2})
        assert r.status_code == 200
        engine.dead_ranks = [1]
        assert_dead(url)
        assert "rank(s) [1]" in app.state.kvfit.engine.check_dead()


def test_a_step_failing_because_a_rank_died_fails_its_batch_then_every_new_request_503():
    engine = FakeTPEngine()
    with running_server(engine, "fake") as (url, app):
        r = httpx.post(f"{url}/v1/completions", json={"model": "fake", "prompt": "KILL-RANK", "max_tokens": 4})
        assert r.status_code >= 500, r.text
        openai_error(r)
        assert_dead(url)
        assert engine.requests == {}


@pytest.mark.parametrize("message", [RANKS_STOPPED, "tensor-parallel rank(s) [2] failed: rank 2: boom"])
def test_an_engine_dead_error_marks_the_engine_dead(message):
    class Engine(FakeEngine):
        def step(self):
            raise EngineDeadError(message)
    with running_server(Engine(), "fake") as (url, _):
        r = httpx.post(f"{url}/v1/completions", json={"model": "fake", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503, r.text
        assert_dead(url)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_engine_thread_makes_health_and_new_requests_503():
    with running_server(BrokenLoopEngine(), "fake") as (url, app):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10)
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model="fake", prompt="BREAK-LOOP", max_tokens=4)
        deadline = time.monotonic() + 5
        while app.state.kvfit.engine._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert_dead(url)


def test_an_ordinary_failed_step_keeps_the_server_healthy():
    with running_server(FakeTPEngine(), "fake") as (url, _):
        r = httpx.post(f"{url}/v1/completions", json={"model": "fake", "prompt": "FAIL-STEP", "max_tokens": 2})
        assert r.status_code == 500
        assert httpx.get(f"{url}/health").status_code == 200
        r = httpx.post(f"{url}/v1/completions", json={"model": "fake", "prompt": "ok", "max_tokens": 2})
        assert r.status_code == 200


@contextlib.contextmanager
def self_stopping_server(engine):
    """The app served as `kvfit serve` serves it: GracefulServer watching check_dead (a 0.3 s grace);
    yields (url, app, server thread); stops the server at the end if it still runs."""
    app = create_app(engine, "fake")
    install_guards(app, GuardOptions("127.0.0.1"))
    sock = bind_socket("127.0.0.1", 0)
    server = GracefulServer(uvicorn_config(app, log_level="warning", graceful_shutdown_s=5),
                            app.state.kvfit.engine.begin_shutdown, app.state.kvfit.engine.check_dead,
                            dead_grace_s=0.3)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_healthy(url_of(sock))
        yield url_of(sock), app, thread
    finally:
        app.state.kvfit.engine.begin_shutdown()
        server.should_exit = True
        thread.join(15)
        sock.close()


class DyingEngine(FakeTPEngine, BrokenLoopEngine):
    """KILL-RANK: a step fails as after a rank died; BREAK-LOOP: the engine thread dies."""


@pytest.mark.parametrize("prompt", ["KILL-RANK", "BREAK-LOOP"], ids=["fatal-step", "dead-engine-thread"])
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_the_server_stops_by_itself_once_the_engine_is_dead_after_the_request_in_flight_gets_its_error(prompt):
    with self_stopping_server(DyingEngine()) as (url, app, thread):
        r = httpx.post(f"{url}/v1/completions", json={"model": "fake", "prompt": prompt, "max_tokens": 4})
        assert r.status_code in (500, 503), r.text
        openai_error(r)
        thread.join(10)          # grace 0.3 s + uvicorn's drain: no request is left open
        assert not thread.is_alive(), "the server kept running with a dead engine"
        assert app.state.kvfit.engine.check_dead() is not None


def test_a_server_watching_a_healthy_engine_keeps_serving():
    with self_stopping_server(DyingEngine()) as (url, _, thread):
        for _ in range(3):
            r = httpx.post(f"{url}/v1/completions", json={"model": "fake", "prompt": "ok", "max_tokens": 2})
            assert r.status_code == 200, r.text
        time.sleep(0.5)          # past the grace: nothing stops a healthy server
        assert thread.is_alive() and httpx.get(f"{url}/health").status_code == 200


def test_serve_with_a_killed_rank_reports_503_then_exits_1_by_itself(tiny_llama, tmp_path):
    """No signal: once the engine is dead the server answers 503 for DEAD_ENGINE_GRACE_SECONDS, then
    stops on its own and exits 1 with the one-line error (a healthy server's SIGTERM exit 0 is in
    test_server_cli.py)."""
    with serving(tiny_llama, "--served-model-name", "tiny", "--tensor-parallel-size", "2",
                 log_path=tmp_path / "stderr.txt") as (proc, lines):
        match, _ = read_until(lines, r"listening on (http://127\.0\.0\.1:\d+)", timeout_s=120)
        url = match.group(1)
        wait_healthy(url)
        cores = spawned_children(proc.pid)          # the engine core process; the ranks are its children
        assert len(cores) == 1, cores
        ranks = spawned_children(cores[0])
        assert len(ranks) == 1, ranks
        os.kill(ranks[0], signal.SIGKILL)
        killed_at = time.monotonic()
        # a new request while the engine is dead: a 503 naming it (the server is still up: the
        # grace starts once the server loop has seen the rank gone, at most 0.1 s after /health has)
        while (r := httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "Hello",
                                                              "max_tokens": 2})).status_code == 200:
            assert time.monotonic() - killed_at < 10, "the dead rank went unnoticed"
            time.sleep(0.02)
        assert r.status_code == 503 and openai_error(r)["code"] == "engine_dead", r.text
        assert proc.wait(timeout=DEAD_ENGINE_GRACE_SECONDS + GRACEFUL_SHUTDOWN_SECONDS + 10) == 1
    log = (tmp_path / "stderr.txt").read_text()
    # "exited" when the server's check sees it first, "failed: rank 1 was killed (SIGKILL ...)" when a step does
    assert re.search(r"error: the engine stopped while serving \(tensor-parallel rank\(s\) \[1\] "
                     r"(exited|failed: rank 1 was killed)", log), log[-2000:]
    assert "Traceback" not in log, log[-4000:]
