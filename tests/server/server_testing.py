"""Server test helpers: run an app in-process on a free loopback port, read /metrics, check errors."""

from __future__ import annotations

import os

import contextlib
import threading
import time

import httpx

from kvfit.server.app import create_app
from kvfit.server.launch import (ConnectionLimits, GracefulServer, GuardOptions, bind_socket, install_guards, url_of,
                                 uvicorn_config)

# Every server test is CPU, float32, with a small cache; the model loads once per module.
ENGINE_KWARGS = dict(device="cpu", dtype="float32", max_model_len=128, block_size=16, max_num_seqs=64,
                     max_num_batched_tokens=512, num_gpu_blocks_override=64, enable_prefix_caching=True)


def make_engine(model_path: str, **overrides):
    from kvfit.config import EngineConfig
    from kvfit.engine.llm_engine import LLMEngine
    return LLMEngine(EngineConfig.from_kwargs(model_path, **{**ENGINE_KWARGS, **overrides}))


@contextlib.contextmanager
def running_server(engine, model_name: str = "tiny", guards: GuardOptions | None = None,
                   limits: ConnectionLimits = ConnectionLimits(), **app_kwargs):
    """Serve `engine` on 127.0.0.1:<free port> in a thread; yields (base_url, app); joins on exit.

    The guards and uvicorn settings are `kvfit serve`'s, so every server test goes through them
    (guards: what they are told; default: bound to 127.0.0.1 with the app's key)."""
    app = create_app(engine, model_name, **app_kwargs)
    install_guards(app, guards or GuardOptions("127.0.0.1", app_kwargs.get("api_key"),
                                               app_kwargs.get("metrics_require_key", False)))
    sock = bind_socket("127.0.0.1", 0)
    config = uvicorn_config(app, limits, log_level="warning", graceful_shutdown_s=5)
    server = GracefulServer(config, app.state.kvfit.engine.begin_shutdown)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    url = url_of(sock)
    try:
        wait_healthy(url)
        yield url, app
    finally:
        app.state.kvfit.engine.begin_shutdown()
        server.should_exit = True
        thread.join(15)
        sock.close()
        assert not thread.is_alive(), "the server did not shut down"


def wait_healthy(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.05)
    raise AssertionError(f"{url}/health did not answer 200 within {timeout_s} s")


def scrape(url: str) -> dict[str, float]:
    """/metrics as {'name{labels}': value} (the text format, comments dropped)."""
    response = httpx.get(f"{url}/metrics", timeout=5)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    values = {}
    for line in response.text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def wait_for_drain(url: str, timeout_s: float = 20.0) -> dict[str, float]:
    """Poll /metrics until no block is used and nothing runs or waits; return that scrape."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape(url)
        if (m['kvfit_kv_blocks{state="used"}'] == 0 and m["kvfit_requests_running"] == 0
                and m["kvfit_requests_waiting"] == 0):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks still in use after {timeout_s} s: {m}")
        time.sleep(0.05)


def assert_blocks_balanced(m: dict[str, float]) -> None:
    total = m["kvfit_kv_blocks_total"]
    assert m['kvfit_kv_blocks{state="used"}'] == 0
    assert m['kvfit_kv_blocks{state="free"}'] + m['kvfit_kv_blocks{state="cached"}'] == total, m


def openai_error(response: httpx.Response) -> dict:
    """The OpenAI error object of a response, checked for its four fields."""
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"], body
    return body["error"]


def completion_text(client, stream: bool, **kwargs) -> tuple[str, str]:
    """(text, finish_reason) of one completion through the openai client, streamed or not."""
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))
        return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    choice = client.completions.create(**kwargs).choices[0]
    return choice.text, choice.finish_reason


def spawned_children(parent_pid: int) -> list[int]:
    """Children of parent_pid started by multiprocessing's spawn (tensor-parallel ranks, prepare workers;
    not its resource tracker)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent_pid and "spawn_main" in cmdline:
            pids.append(int(entry))
    return pids


async def answer_lifespan(scope, receive, send) -> bool:
    """A bare ASGI app's lifespan handling: True when scope was the lifespan (answered), else False."""
    if scope["type"] != "lifespan":
        return False
    while (await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})
    return True


@contextlib.contextmanager
def bare_uvicorn(app, limits: ConnectionLimits = ConnectionLimits()):
    """A bare ASGI app under kvfit's uvicorn settings (its HTTP protocol and head guard) on 127.0.0.1:<free port>,
    in a thread; yields (host, port)."""
    import uvicorn
    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn_config(app, limits, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    host, port = url_of(sock).removeprefix("http://").rsplit(":", 1)
    try:
        yield host, int(port)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
