"""The engine core in its own process (core_process.py): the HTTP app through EngineCoreClient, the
message deltas, start-up failures, core death, and the admission rules EngineCore holds for both
transports (n counted against the queue, an n that can never be queued, a client that goes away)."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import socket
import threading
import time
import types

import httpx
import msgspec
import pytest

from fake_engine import FakeEngine
from server_testing import openai_error, running_server
from kvfit.engine.output import CompletionOutput, Logprob, RequestOutput
from kvfit.errors import ConfigError, KvfitError
from kvfit.server.core_process import EngineCoreClient
from kvfit.sampling_params import SamplingParams
from kvfit.server.engine_core import EngineCore
from kvfit.server.protocol import APIError
from kvfit.server.core_protocol import ENCODER, REPLY_DECODER, DeltaTracker, OutputAccumulator, OutputBatch


def _failing_factory(message: str):
    raise ConfigError(message)


def _crashing_factory():
    raise RuntimeError("boom at start-up")


def launch(factory, max_waiting_requests: int = 1024) -> EngineCoreClient:
    from fake_engine import CharTokenizer
    return EngineCoreClient.launch(factory, tokenizer=CharTokenizer(), generation_config="vllm", model_folder=None,
                                   max_waiting_requests=max_waiting_requests, log_level="warning")


@pytest.fixture(scope="module")
def core_url():
    client = launch(functools.partial(FakeEngine, max_model_len=256, step_seconds=0.002))
    try:
        with running_server(client) as (url, app):
            yield url, client
    finally:
        client.stop()


# messages ---------------------------------------------------------------------------------------------
def _output(text: str, ids: list[int], finished: bool, reason=None, logprobs=None, prompt_logprobs=None,
            index: int = 0) -> RequestOutput:
    sample = CompletionOutput(index, text, ids, -0.5 if logprobs else None, logprobs, reason)
    return RequestOutput("r", None, [1, 2], prompt_logprobs, [sample], finished)


def _roundtrip(delta):
    batch = OutputBatch([], [delta], [], {})
    return REPLY_DECODER.decode(ENCODER.encode(batch)).deltas[0]


def test_deltas_rebuild_every_cumulative_output_through_msgpack():
    lp = lambda t: {t: Logprob(-0.1 * t, 1, chr(t)), t + 1: Logprob(-1.0, 2, None)}   # noqa: E731
    outputs = [_output("He", [72, 101], False, logprobs=[lp(72), lp(101)], prompt_logprobs=[None, lp(2)]),
               _output("Hello", [72, 101, 108], False, logprobs=[lp(72), lp(101), lp(108)],
                       prompt_logprobs=[None, lp(2)]),
               # a stop string cut text already sent: the delta keeps 3 characters and adds none
               _output("Hel", [72, 101, 108, 33], True, "stop", [lp(72), lp(101), lp(108), lp(33)],
                       [None, lp(2)])]
    tracker, accumulator = DeltaTracker(), OutputAccumulator("r", [1, 2])
    sizes = []
    for output in outputs:
        delta = tracker.delta(output)
        sizes.append(len(delta.samples[0].token_ids))
        rebuilt = accumulator.apply(_roundtrip(delta))
        assert rebuilt == output
    assert sizes == [2, 1, 1]             # each message holds only the new tokens
    assert tracker._sent == {}            # a finished request leaves nothing behind


def test_a_finished_request_s_phases_cross_the_process_boundary():
    """RequestOutput.metrics (the engine's stage times) reach the front-end with the finished delta only."""
    from kvfit.engine.output import RequestMetrics
    tracker, accumulator = DeltaTracker(), OutputAccumulator("r", [1, 2])
    running = _output("a", [7], False)
    done = _output("ab", [7, 8], True, "length")
    done.metrics = RequestMetrics(10.0, 10.25, 10.75, 12.0)
    assert accumulator.apply(_roundtrip(tracker.delta(running))).metrics is None
    rebuilt = accumulator.apply(_roundtrip(tracker.delta(done)))
    assert rebuilt.metrics == done.metrics
    assert rebuilt.metrics.phases() == {"queue": 0.25, "prefill": 0.5, "decode": 1.25, "inference": 1.75}
    assert RequestMetrics(1.0, None, None, 2.0).phases() is None          # never scheduled (aborted waiting)


def test_finished_samples_of_n_are_sent_once():
    tracker = DeltaTracker()
    a_done = CompletionOutput(0, "x", [1], finish_reason="length")
    first = RequestOutput("p", None, [1], None, [a_done, CompletionOutput(1, "y", [2])], False)
    second = RequestOutput("p", None, [1], None, [a_done, CompletionOutput(1, "yz", [2, 3])], False)
    tracker.delta(first)
    assert [s.index for s in tracker.delta(second).samples] == [1]


# start-up ---------------------------------------------------------------------------------------------
def test_a_config_error_at_start_up_is_raised_with_its_message():
    with pytest.raises(ConfigError, match="^--max-model-len 99999 is too long$"):
        launch(functools.partial(_failing_factory, "--max-model-len 99999 is too long"))


def test_an_engine_bug_at_start_up_is_one_error_naming_it():
    with pytest.raises(KvfitError, match="could not start.*RuntimeError: boom at start-up"):
        launch(_crashing_factory)


# serving through the process --------------------------------------------------------------------------
def test_streamed_and_whole_responses_agree_through_the_core_process(core_url):
    url, _ = core_url
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 7, "n": 2, "logprobs": 2}
    whole = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()
    texts = {0: "", 1: ""}
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = msgspec.json.decode(line[6:].encode())
                for choice in chunk["choices"]:
                    texts[choice["index"]] += choice["text"]
    assert [c["text"] for c in whole["choices"]] == ["abcdefg", "bcdefgh"]
    assert texts == {0: "abcdefg", 1: "bcdefgh"}
    assert whole["choices"][0]["logprobs"]["tokens"] == list("abcdefg")
    assert whole["usage"]["completion_tokens"] == 14


def test_a_burst_past_the_old_connection_cap_is_served(core_url):
    """300 streams at once (the old default cap was 256 connections: past it every request got 503)."""
    url, _ = core_url

    async def burst():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=None)) as client:
            replies = await asyncio.gather(*[client.post(f"{url}/v1/completions", json={
                "model": "tiny", "prompt": f"p{i}", "max_tokens": 3}) for i in range(300)])
        return [r.status_code for r in replies]
    assert asyncio.run(burst()) == [200] * 300


def test_an_n_that_can_never_be_queued_is_a_400_naming_n(core_url):
    url, _ = core_url
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 1,
                                                  "n": 2 ** 63 - 1}, timeout=30)
    assert r.status_code == 400 and openai_error(r)["param"] == "n", r.text
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200


def test_a_batch_that_can_never_be_queued_is_a_400_at_once(core_url):
    """A batch of more prompts (times n) than can run or wait at once held the batch lock while it queued prompt
    after prompt (another client's batch waited a minute behind 20,000 prompts), then failed on a late one."""
    url, client = core_url
    prompts = client.max_requests_at_once // 2 + 1
    start = time.monotonic()
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": ["Hi"] * prompts, "max_tokens": 1,
                                                  "n": 2}, timeout=30)
    assert r.status_code == 400 and openai_error(r)["param"] == "prompt", r.text
    assert f"{prompts} prompts x n=2" in openai_error(r)["message"] and time.monotonic() - start < 5
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": ["Hi"] * 3, "max_tokens": 1, "n": 2},
                   timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"]) == 6


def test_killing_the_core_process_makes_health_and_requests_503():
    client = launch(functools.partial(FakeEngine, step_seconds=0.05))
    try:
        with running_server(client) as (url, app):
            os.kill(client._process.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while httpx.get(f"{url}/health", timeout=5).status_code == 200:
                assert time.monotonic() < deadline, "the dead core went unnoticed"
                time.sleep(0.05)
            r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
                           timeout=10)
            assert r.status_code == 503 and openai_error(r)["code"] == "engine_dead", r.text
            assert "engine core process exited" in openai_error(r)["message"]
    finally:
        client.stop()


# EngineCore's admission, on the in-thread transport -------------------------------------------------
class _FullEngine:
    """An engine whose batch is full (2 of 2 slots) with 2 requests waiting."""

    config = types.SimpleNamespace(scheduler=types.SimpleNamespace(max_num_seqs=2))

    def __init__(self):
        self.added = []

    def stats(self):
        return {"kv_blocks_total": 64, "kv_blocks_free": 0, "kv_blocks_used": 64, "kv_blocks_cached": 0,
                "token_capacity": 1024, "block_size": 16, "running": 2, "waiting": 2 + len(self.added)}

    def add_request(self, prompt, params, request_id, strict_context=False, cache_salt=None):
        self.added += [request_id] * params.n


def test_n_samples_count_as_n_against_the_waiting_queue():
    engine = _FullEngine()
    core = EngineCore(engine, max_waiting_requests=4)
    with pytest.raises(APIError) as info:
        core.add("a", [1, 2], SamplingParams(n=3))          # 2 waiting + 3 samples > 4
    assert info.value.status == 429
    assert core.add("b", [1, 2], SamplingParams(n=2)) == 2  # 2 + 2 fit
    with pytest.raises(APIError) as info:
        core.add("c", [1, 2], SamplingParams(n=7))          # can never be queued: 2 slots + 4 waiting
    assert info.value.status == 400 and info.value.param == "n"
    assert engine.added == ["b", "b"]


def test_a_non_streamed_request_is_aborted_as_soon_as_its_client_leaves():
    """Tokens flow all the while (the old check ran only after 0.5 s without output)."""
    engine = FakeEngine(max_model_len=4096, step_seconds=0.01)
    with running_server(engine) as (url, app):
        host, port = url.removeprefix("http://").split(":")
        body = msgspec.json.encode({"model": "tiny", "prompt": "Hi", "max_tokens": 4000})
        sock = socket.create_connection((host, int(port)))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 10
        while not engine.requests:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.2)
        sock.close()
        left = time.monotonic()
        while engine.requests:
            assert time.monotonic() - left < 0.5, "the request kept running after its client left"
            time.sleep(0.01)
        assert engine.num_aborted == 1


def test_health_answers_while_a_big_logprob_response_is_built():
    engine = FakeEngine(max_model_len=512, step_seconds=0.0)
    with running_server(engine) as (url, app):
        latencies, done = [], threading.Event()

        def probe():
            while not done.is_set():
                start = time.monotonic()
                httpx.get(f"{url}/health", timeout=10)
                latencies.append(time.monotonic() - start)
                time.sleep(0.01)
        thread = threading.Thread(target=probe)
        thread.start()
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "Hi", "max_tokens": 100, "n": 10, "logprobs": 20})
        done.set()
        thread.join()
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 10
        assert max(latencies) < 1.0, max(latencies)


def test_a_wedged_core_is_reported_dead_and_its_requests_end():
    """A core that sends nothing while requests wait (a step that never returns) is dead to /health
    (which `kvfit serve` polls every 0.1 s), and the requests waiting on it get the 503."""
    client = launch(functools.partial(FakeEngine, step_seconds=5.0))
    client.stall_timeout_s = 1.0
    try:
        with running_server(client) as (url, app):
            replies = []
            thread = threading.Thread(target=lambda: replies.append(httpx.post(
                f"{url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2}, timeout=30)))
            thread.start()
            deadline = time.monotonic() + 4
            while (health := httpx.get(f"{url}/health", timeout=5)).status_code == 200:
                assert time.monotonic() < deadline, "the wedged core went unnoticed"
                time.sleep(0.1)
            assert "wedged" in openai_error(health)["message"]
            thread.join()
            assert replies[0].status_code == 503 and openai_error(replies[0])["code"] == "engine_dead"
    finally:
        client.stop()


def test_requests_after_an_idle_spell_longer_than_the_stall_limit_are_not_a_wedged_core():
    """The stall clock runs from when requests start waiting, not from the core's last message: two
    requests arriving together after a quiet spell (the first's AddResult not back yet when the second
    comes) are served, and the core stays healthy."""
    client = launch(functools.partial(FakeEngine, step_seconds=0.0))
    client.stall_timeout_s = 0.3
    try:
        async def burst_after_idle():
            client.start(asyncio.get_running_loop())
            await asyncio.sleep(0.6)                # idle: the core has nothing to say
            streams = await asyncio.gather(*[client.add(f"r{i}", [104, 105], SamplingParams(max_tokens=2))
                                             for i in range(2)])
            outputs = []
            for stream in streams:
                output = None
                while output is None or not output.finished:
                    output = await stream.next(timeout=5)
                outputs.append(output.outputs[0].text)
            return outputs
        assert asyncio.run(burst_after_idle()) == ["ab", "ab"]
        assert client.check_dead() is None
    finally:
        client.stop()


def test_stop_ends_every_open_request_with_the_shutting_down_error():
    """As AsyncEngine.stop: a stream still running and an add not yet answered when the client stops
    get the 503 (the reader reads the core's last batch before it exits), none waits forever."""
    client = launch(functools.partial(FakeEngine, max_model_len=4096, step_seconds=0.01))

    async def stop_while_running():
        client.start(asyncio.get_running_loop())
        stream = await client.add("running", [104, 105], SamplingParams(max_tokens=4000))
        await stream.next(timeout=5)
        stopping = asyncio.ensure_future(asyncio.to_thread(client.stop))
        errors = []
        try:
            while True:
                await stream.next(timeout=5)
        except APIError as exc:
            errors.append(exc)
        await stopping
        return errors
    [error] = asyncio.run(stop_while_running())
    assert error.status == 503 and error.code == "server_shutting_down"
    assert client.check_dead() is None            # a stop is not a dead engine (kvfit serve exits 0)


def test_an_abort_racing_stop_is_dropped_not_raised():
    """stop() runs off the event loop (the app's lifespan) while handlers may still abort: the command
    socket is closed under the send lock, so a late abort is dropped instead of raising ZMQError (or
    using a zmq socket from two threads at once)."""
    for _ in range(2):
        client = launch(FakeEngine)
        done, errors = threading.Event(), []

        def spam():
            while not done.is_set():
                try:
                    client.abort("gone")
                except Exception as exc:           # noqa: BLE001 - the test reports any
                    errors.append(exc)
                    return
        thread = threading.Thread(target=spam)
        thread.start()
        time.sleep(0.05)
        try:
            client.stop()
        finally:
            done.set()
            thread.join()
        assert errors == []


def _marking_factory(path: str):
    open(path, "w").close()
    return FakeEngine()


def test_a_core_whose_server_died_before_it_started_does_not_build_the_engine(tmp_path):
    """PR_SET_PDEATHSIG only covers a parent that dies after it is set: a server killed while the core
    was still importing left a core that loaded the model (minutes, device memory) for nobody. The
    core checks its parent right after setting it (here: a parent pid that is not its parent)."""
    import multiprocessing
    from kvfit.server.core_process import run_engine_core
    marker = tmp_path / "built"
    address = f"ipc://{tmp_path}/nobody"
    process = multiprocessing.get_context("spawn").Process(
        target=run_engine_core, args=(functools.partial(_marking_factory, str(marker)), address, address, 16,
                                      "warning", os.getpid() + 10 ** 6))
    process.start()
    process.join(30)
    assert process.exitcode == 0 and not marker.exists()


def test_ending_a_core_at_once_logs_no_timeout_warning():
    """A Ctrl-C during start-up ends the core at once (timeout 0): that is no 'did not exit within 0 s'
    warning before the one 'interrupted' line."""
    import logging
    import multiprocessing
    from kvfit.server.core_process import _end_process
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("kvfit")
    logger.addHandler(handler)
    try:
        process = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
        process.start()
        _end_process(process, 0)
    finally:
        logger.removeHandler(handler)
    assert not process.is_alive() and records == []


def _slow_factory():
    time.sleep(60)
    return FakeEngine()


_LAUNCH_SLOWLY = """
import functools, sys, os
sys.path.insert(0, {tests!r})
import test_engine_core_process as t
from kvfit.server import core_process
print(os.getpid(), flush=True)
try:
    t.launch(t._slow_factory)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(130)
"""


def test_a_sigterm_during_start_up_ends_the_core_and_removes_its_socket_folder(tmp_path):
    """A supervisor's SIGTERM while the engine loads (minutes on a GPU) is an interrupted start-up,
    as a Ctrl-C is: the core is ended and the private socket folder removed (the default action
    killed the server at once and left the folder in the temporary directory)."""
    import subprocess
    import sys
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-c", _LAUNCH_SLOWLY.format(tests=os.path.dirname(__file__))],
                            stdout=subprocess.PIPE, text=True, env=env)
    proc.stdout.readline()
    deadline = time.monotonic() + 20
    while not list(tmp_path.glob("kvfit-core-*/commands")):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "interrupted" in out
    assert list(tmp_path.glob("kvfit-core-*")) == []


def apply_batch(client, batch) -> None:
    """What the loop does with one core batch, all at once."""
    for _, piece in client._batch_pieces(batch, 0.0):
        piece()


def test_a_delta_that_cannot_be_folded_fails_its_request_alone():
    """One broken delta in a batch: its request gets a 500 and is aborted; the batch's other requests go on."""
    from kvfit.server.async_engine import RequestStream
    from kvfit.server.core_protocol import RequestDelta, SampleDelta

    async def run():
        client = EngineCoreClient.__new__(EngineCoreClient)
        client._streams, client._pending, client._stats, client.dead_reason = {}, {}, {}, None
        sent = []
        client.abort = sent.append
        good, bad = RequestStream("good"), RequestStream("bad")
        client._streams["good"] = (good, OutputAccumulator("good", [1]))
        client._streams["bad"] = (bad, OutputAccumulator("bad", [1]))
        broken = SampleDelta(0, 5, "x", [2], None, None, None, None)      # keeps 5 chars of an empty text
        client._streams["bad"][1].fold = lambda delta: (_ for _ in ()).throw(ValueError("broken"))
        apply_batch(client, OutputBatch([], [RequestDelta("bad", False, [broken]),
                                             RequestDelta("good", True, [SampleDelta(0, 0, "hi", [7], None, None,
                                                                                     "length", None)])], [], {}))
        with pytest.raises(APIError) as info:
            await bad.next()
        assert info.value.status == 500 and sent == ["bad"]
        assert (await good.next()).outputs[0].text == "hi"
    asyncio.run(run())


def test_a_large_round_is_applied_in_chunks_in_order():
    """A batch of 300 deltas goes to the streams DISPATCH_CHUNK at a time, one loop callback each (the loop runs
    its other work between them), and work handed over after it (an end of everything) waits for all of it."""
    import collections

    from kvfit.server import core_process
    from kvfit.server.async_engine import RequestStream
    from kvfit.server.core_protocol import RequestDelta, SampleDelta

    async def run():
        loop = asyncio.get_running_loop()
        client = EngineCoreClient.__new__(EngineCoreClient)
        client._streams, client._pending, client._stats, client.dead_reason = {}, {}, {}, None
        client._work, client._draining, client._loop = collections.deque(), False, loop
        streams = {f"r{i}": RequestStream(f"r{i}") for i in range(300)}
        for rid, stream in streams.items():
            client._streams[rid] = (stream, OutputAccumulator(rid, [1]))
        deltas = [RequestDelta(rid, False, [SampleDelta(0, 0, "w", [7], None, None, None, None)]) for rid in streams]
        ticks = []

        def tick():                       # another loop callback, queued behind each drain
            ticks.append(sum(s.unread for s in streams.values()))
            if len(ticks) < 5:
                loop.call_soon(tick)
        client._hand_over(client._batch_pieces(OutputBatch([], deltas, [], {"running": 300}), 0.0))
        client._call_on_loop(client._end_all, APIError(503, "gone", "service_unavailable"))
        loop.call_soon(tick)
        await asyncio.sleep(0)
        while client._work or client._draining:
            await asyncio.sleep(0)
        chunk = core_process.DISPATCH_CHUNK
        assert ticks[:3] == [0, chunk, 2 * chunk]        # the loop ran its other callbacks between chunks
        assert client._stats == {"running": 300}
        for stream in streams.values():   # every delta, then the end: no output lost to the later end
            assert (await stream.next()).outputs[0].text == "w"
            with pytest.raises(APIError):
                await stream.next()
    asyncio.run(run())
