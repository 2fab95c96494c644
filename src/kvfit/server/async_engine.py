"""AsyncEngine: one thread owns the LLMEngine; asyncio handlers talk to it through commands.

The LLMEngine is not thread-safe, so every call on it (add, abort, step, stats) happens on the
engine thread. Handlers put commands on a queue (FIFO: an abort sent after an add runs after it)
and get outputs back on per-request asyncio queues through loop.call_soon_threadsafe. The thread
batches every client's requests: it drains all pending commands, then runs one step.

Invariant: a request id is in `_streams` exactly while the engine holds the request, so when a
client goes away, aborting its id frees its blocks at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from kvfit.engine.output import RequestOutput
from kvfit.sampling_params import SamplingParams
from kvfit.errors import KvfitError, RequestError
from kvfit.server.protocol import APIError, bad_request

logger = logging.getLogger("kvfit")


def queue_full_error(max_waiting_requests: int) -> APIError:
    return APIError(429, f"the server is at capacity: {max_waiting_requests} requests are already waiting "
                         "(--max-waiting-requests); retry later", "rate_limit_error", None, "rate_limit_exceeded")


def shutting_down_error() -> APIError:
    return APIError(503, "the server is shutting down; retry later", "service_unavailable",
                    None, "server_shutting_down")


@dataclass
class RequestStream:
    """One request's outputs as the event loop sees them, plus its timings (time.monotonic)."""

    request_id: str
    num_prompt_tokens: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished: bool = False
    output: RequestOutput | None = None  # the latest output (cumulative)
    error: APIError | None = None        # set when the engine ended the request with an error
    closed: bool = False                 # the app has done its bookkeeping (abort, metrics)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    async def next(self, timeout: float | None = None) -> RequestOutput:
        """The next output; raises APIError if the engine failed the request, TimeoutError on timeout."""
        item = await asyncio.wait_for(self.queue.get(), timeout)
        if isinstance(item, APIError):
            self.finished, self.error = True, item
            raise item
        output, at = item
        if output.token_ids and self.first_token_time is None:
            self.first_token_time = at
        self.last_token_time = at
        self.finished, self.output = output.finished, output
        return output


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    max_tokens_given: bool
    stream: RequestStream
    future: asyncio.Future


@dataclass
class _Abort:
    request_id: str


class AsyncEngine:
    """Runs an LLMEngine on a daemon thread; add/abort/stats are safe to call from the event loop."""

    def __init__(self, engine, max_waiting_requests: int = 1024):
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self._commands: deque = deque()
        self._wake = threading.Condition()
        self._streams: dict[str, RequestStream] = {}     # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False        # no new requests; the thread aborts what it holds
        self._stopped = False        # the thread exits
        self._stats = dict(engine.stats())
        self._thread = threading.Thread(target=self._run, name="kvfit-engine", daemon=True)

    # event-loop side -----------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._closing

    def stats(self) -> dict:
        """The engine's stats as of the end of its last step or command (a snapshot, never torn)."""
        return self._stats

    async def add(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                  max_tokens_given: bool = True) -> RequestStream:
        """Queue a request; raise APIError (400 unservable, 429 queue full, 503 shutting down)."""
        if self._closing:
            raise shutting_down_error()
        stream = RequestStream(request_id)
        future = asyncio.get_running_loop().create_future()
        self._send(_Add(request_id, prompt, params, max_tokens_given, stream, future))
        try:
            stream.num_prompt_tokens = await future
        except asyncio.CancelledError:
            self.abort(request_id)     # runs after the add, so a request added meanwhile is freed
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (a no-op if it already ended); its blocks are freed on the engine thread."""
        self._send(_Abort(request_id))

    def begin_shutdown(self) -> None:
        """Refuse new requests and end running ones with a 503 error (a SIGTERM/SIGINT)."""
        with self._wake:
            self._closing = True
            self._wake.notify()

    def stop(self, timeout: float = 10.0) -> None:
        """End every request and join the engine thread."""
        with self._wake:
            self._closing = self._stopped = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _send(self, command) -> None:
        with self._wake:
            self._commands.append(command)
            self._wake.notify()

    def _deliver(self, stream: RequestStream, item) -> None:
        self._call_on_loop(stream.queue.put_nowait, item)

    def _call_on_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:         # the loop is closed: nobody is left to tell
            pass

    def _resolve(self, future: asyncio.Future, result=None, error: BaseException | None = None) -> None:
        def settle():
            if future.done():        # the handler was cancelled meanwhile
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)
        self._call_on_loop(settle)

    # engine-thread side --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                commands, closing, stopped = self._take_commands()
                for command in commands:
                    self._handle(command, closing)
                if closing:
                    self._abort_all(shutting_down_error())
                if stopped:
                    return
                if self.engine.has_unfinished():
                    self._step()
                self._stats = dict(self.engine.stats())
        except BaseException:          # a bug in this loop: fail every request rather than hang them
            logger.exception("the engine loop stopped")
            error = APIError(500, "the engine loop stopped; see the server log", "server_error")
            with self._wake:
                self._closing = True
                pending = [c for c in self._commands if isinstance(c, _Add)]
                self._commands.clear()
            for command in pending:
                self._resolve(command.future, error=error)
            self._abort_all(error)
            raise

    def _take_commands(self) -> tuple[list, bool, bool]:
        with self._wake:
            # sleep only with nothing to do: no commands, no requests to run or (closing) to abort
            while not (self._commands or self._stopped or self.engine.has_unfinished()
                       or (self._closing and self._streams)):
                self._wake.wait()
            commands = list(self._commands)
            self._commands.clear()
            return commands, self._closing, self._stopped

    def _handle(self, command, closing: bool) -> None:
        if isinstance(command, _Abort):
            if self._streams.pop(command.request_id, None) is not None:
                self.engine.abort(command.request_id)
            return
        if closing:
            self._resolve(command.future, error=shutting_down_error())
            return
        try:
            num_prompt_tokens = self._add(command)
        except APIError as exc:
            self._resolve(command.future, error=exc)
        except RequestError as exc:
            self._resolve(command.future, error=bad_request(str(exc), exc.param, exc.code))
        except KvfitError as exc:
            self._resolve(command.future, error=bad_request(str(exc)))
        except Exception as exc:      # one bad request must not take the loop down
            logger.exception("adding request %s failed", command.request_id)
            self._resolve(command.future, error=APIError(500, f"internal error: {exc}", "server_error"))
        else:
            self._streams[command.request_id] = command.stream
            self._resolve(command.future, num_prompt_tokens)

    def _add(self, command: _Add) -> int:
        engine = self.engine
        if engine.stats()["waiting"] >= self.max_waiting_requests:
            raise queue_full_error(self.max_waiting_requests)
        ids = engine.encode(command.prompt) if isinstance(command.prompt, str) else list(command.prompt)
        # the engine's admission check is the only one; its RequestError carries param and code
        engine.add_request(ids, command.params, command.request_id, strict_context=command.max_tokens_given)
        return len(ids)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            # the engine cannot say which request broke the step: fail the batch, keep serving
            logger.exception("an engine step failed; ending the %d active requests", len(self._streams))
            self._abort_all(APIError(500, "the engine failed while running this request; see the server log",
                                     "server_error"))
            return
        now = time.monotonic()
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:       # aborted while the step ran
                continue
            if output.finished:
                del self._streams[output.request_id]
            self._deliver(stream, (output, now))

    def _abort_all(self, error: APIError) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort(request_id)
            self._deliver(stream, error)
        self._streams.clear()
        self._stats = dict(self.engine.stats())
