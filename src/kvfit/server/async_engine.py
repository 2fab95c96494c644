"""AsyncEngine: one thread owns the LLMEngine; asyncio handlers talk to it through commands.

The LLMEngine is not thread-safe, so every call on it (add, abort, step, stats) happens on the
engine thread. Handlers put commands on a queue (FIFO: an abort sent after an add runs after it)
and get outputs back on per-request asyncio queues through loop.call_soon_threadsafe. The thread
batches every client's requests: it drains all pending commands, then runs one step.

Prompts are tokenized before the add command is sent, on a small thread pool (`prepare`; the app
sends large bodies to worker processes instead, see prepare_pool.py), so the engine thread never
waits on a client's input; a text too long to fit in any tokenization is refused without
tokenizing it (see max_prompt_chars).

Invariant: a request id is in `_streams` exactly while the engine holds the request, so when a
client goes away, aborting its id frees its blocks at once.

Health: the engine is dead once its thread exits with an error, a step fails in a way the
executor cannot recover from (a tensor-parallel rank stopped), or a rank process is gone; from
then on /health and every new request get a 503 (`health()`), and `dead_reason` says why.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from kvfit.engine.output import RequestOutput
from kvfit.sampling_params import SamplingParams
from kvfit.engine.llm_engine import encode_prompt
from kvfit.errors import KvfitError
from kvfit.server.engine_core import EngineCore, engine_dead_error, shutting_down_error
from kvfit.server.params import cut_prompt_text, truncate_prompt
from kvfit.server.prepare import as_api_error, check_prompt_chars
from kvfit.server.protocol import APIError

logger = logging.getLogger("kvfit")

PREPARE_THREADS = 2          # parse bodies, render chat templates, tokenize (Tokenizer.encode releases the GIL)
# No token of a vocabulary stands for more characters than the longest vocabulary entry is long
# (entries spell each character or byte they stand for with at least one character), so a text
# whose tokens fit in max_model_len has at most max_model_len x that many characters. The floor
# leaves room for normalizers that shrink text (NFKC composition merges at most a few characters).
MIN_CHARS_PER_TOKEN = 64


def max_prompt_chars(tokenizer, max_model_len: int) -> int:
    """The most characters a prompt text can have and still fit in --max-model-len tokens."""
    backend = getattr(tokenizer, "backend", None)      # a tokenizers.Tokenizer, if any
    longest = max(map(len, backend.get_vocab(with_added_tokens=True)), default=0) if backend is not None else 0
    return max_model_len * max(longest, MIN_CHARS_PER_TOKEN)


@dataclass
class RequestStream:
    """One request's outputs as the event loop sees them, plus its timings (time.monotonic)."""

    request_id: str
    num_prompt_tokens: int = 0
    prompt_ids: list[int] | None = None  # the prompt's token ids as the engine got them (return_token_ids)
    prompt_cut: bool = False             # truncate_prompt_tokens removed part of the prompt (echo shows the rest)
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished: bool = False
    output: RequestOutput | None = None  # the latest output (cumulative)
    error: APIError | None = None        # set when the engine ended the request with an error
    closed: bool = False                 # the app has done its bookkeeping (abort, metrics)
    num_output_tokens: int = 0           # over every choice, as of the latest output
    # called on each output that adds tokens: (new prompt tokens (at the first), new tokens,
    # time to first token or None, time since the previous output or None)
    on_progress: Callable[[int, int, float | None, float | None], None] | None = None
    # one slot, not a queue: outputs are cumulative, so a newer one replaces one not yet read. A client that does
    # not read (its socket full) holds one output, not one per step (a queue of full copies grew the front-end by
    # gigabytes). The slot holds a RequestOutput or a callable making it when read (OutputAccumulator.snapshot).
    _latest: RequestOutput | Callable[[], RequestOutput] | None = None
    _error_next: APIError | None = None  # the engine ended the request with this; raised once _latest is read
    _ready: asyncio.Event = field(default_factory=asyncio.Event)
    # outputs that arrived before the add returned (its prompt tokens known): counted once it has (count_from)
    _early: list[tuple[int, float]] | None = field(default_factory=list)

    def put(self, item: RequestOutput | Callable[[], RequestOutput] | APIError, at: float = 0.0,
            num_tokens: int | None = None) -> None:
        """(On the event loop.) The newest output (its tokens over every choice, when item is a callable) as it
        arrived (at: monotonic s), or the error that ends the request."""
        if isinstance(item, APIError):
            self._error_next = self._error_next or item
        else:
            if num_tokens is None:
                num_tokens = sum(len(sample.token_ids) for sample in item.outputs)
            if self._early is not None:      # the add has not returned yet: counted by count_from
                self._early.append((num_tokens, at))
            else:
                self._account(num_tokens, at)    # each output counts as it arrives (one inter-token latency a step)
            self._latest = item
        self._ready.set()

    def count_from(self, num_prompt_tokens: int) -> None:
        """The add returned: the prompt's tokens are known; outputs from now on (and those before) count."""
        self.num_prompt_tokens, early, self._early = num_prompt_tokens, self._early or [], None
        for num_tokens, at in early:
            self._account(num_tokens, at)

    def fail(self, error: APIError) -> None:
        """End the request with error now, dropping an output not yet read (it may be half made)."""
        self._latest = None
        self.put(error)

    @property
    def unread(self) -> bool:
        return self._latest is not None or self._error_next is not None

    async def next(self, timeout: float | None = None) -> RequestOutput:
        """The next output; raises APIError if the engine failed the request, TimeoutError on timeout.

        Outputs are cumulative, so when several arrived since the last call (the event loop or the client fell
        behind the engine) only the newest is returned: one SSE event for all of them, which is when the front-end
        most needs fewer events. An error behind them is raised at the next call."""
        while not self.unread:
            self._ready.clear()
            # wait_for costs a timeout scope per call on Python 3.12 even without a timeout: only with one
            await (self._ready.wait() if timeout is None else asyncio.wait_for(self._ready.wait(), timeout))
        latest, self._latest = self._latest, None
        if latest is None:
            self.finished, self.error = True, self._error_next
            raise self._error_next
        output = latest if isinstance(latest, RequestOutput) else latest()
        self.finished, self.output = output.finished, output
        return output

    def _account(self, num_tokens: int, at: float) -> None:
        """Token counts, first-token and inter-token times of one output as it arrived (at: monotonic s)."""
        if num_tokens <= self.num_output_tokens:
            return
        first = self.first_token_time is None
        ttft = at - self.arrival_time if first else None
        itl = None if first else at - self.last_token_time
        if first:
            self.first_token_time = at
        self.last_token_time = at
        if self.on_progress is not None:
            self.on_progress(self.num_prompt_tokens if first else 0, num_tokens - self.num_output_tokens, ttft, itl)
        self.num_output_tokens = num_tokens


@dataclass(frozen=True)
class AddRequest:
    """One request of ServingEngine.add_batch (add's arguments)."""
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    max_tokens_given: bool = True
    cache_salt: str | None = None
    truncate: tuple[int, str] | None = None
    add_special_tokens: bool = True           # a text prompt: tokenized with the tokenizer's special tokens (bos)


class PromptRefused(Exception):
    """ServingEngine.add_batch: request `index` of the batch was refused with `error` (an APIError); none of the
    batch stays queued."""

    def __init__(self, index: int, error: APIError):
        super().__init__(index, error)
        self.index, self.error = index, error


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens_given: bool
    stream: RequestStream
    future: asyncio.Future
    cache_salt: str | None = None


@dataclass
class _Abort:
    request_id: str


class ServingEngine:
    """What the HTTP app sees of an engine, whichever transport carries its requests (the typed seam):
    facts (tokenizer, max_model_len, max_prompt_chars, max_logprobs, default_sampling_params,
    generation_config, model_folder), add/abort/stats/health, and off-loop work (prepare, encode).

    Subclasses deliver each request's outputs to its RequestStream and implement _submit_add, abort,
    stats, check_dead, begin_shutdown, start and stop."""

    def __init__(self, tokenizer, max_model_len: int, max_logprobs: int, default_sampling_params: dict,
                 generation_config, model_folder: str | None):
        self.tokenizer, self.max_model_len, self.max_logprobs = tokenizer, max_model_len, max_logprobs
        self.default_sampling_params, self.generation_config = default_sampling_params, generation_config
        self.model_folder = model_folder
        self.max_prompt_chars = max_prompt_chars(tokenizer, max_model_len)
        self.dead_reason: str | None = None   # set once, when the engine can no longer serve
        # requests that can run or wait at once (--max-num-seqs + --max-waiting-requests); 0: not known
        self.max_requests_at_once = 0
        self._closing = False                 # no new requests; running ones end with a 503
        # batches are admitted one at a time (add_batch): a refused one's aborts reach the core before the next's adds
        self._batch_admission = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._prepare = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="kvfit-prepare")

    def check_dead(self) -> str | None:
        """Why the engine can no longer serve (None while it can)."""
        return self.dead_reason

    def health(self) -> APIError | None:
        """None while requests are served; else the 503 to answer (engine dead or shutting down)."""
        if (reason := self.check_dead()) is not None:
            return engine_dead_error(reason)
        return shutting_down_error() if self._closing else None

    async def prepare(self, fn, *args):
        """fn(*args) on the prepare threads (parsing, chat templates, tokenizing), off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._prepare, fn, *args)

    def encode_now(self, text: str) -> list[int]:
        """A prompt's token ids, special tokens added (as LLMEngine.encode)."""
        return encode_prompt(self.tokenizer, text)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt text, tokenized off the event loop and the engine; a text with more
        characters than could ever fit is refused (400) without tokenizing it.

        add_special_tokens=False: as the text is (a rendered chat template holds its own bos)."""
        check_prompt_chars(text, self.max_prompt_chars, self.max_model_len)
        try:
            if add_special_tokens or self.tokenizer is None:
                return await self.prepare(self.encode_now, text)
            return await self.prepare(self.tokenizer.encode, text, False)
        except KvfitError as exc:
            raise as_api_error(exc) from None

    async def add(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                  max_tokens_given: bool = True, cache_salt: str | None = None,
                  truncate: tuple[int, str] | None = None, on_progress=None) -> RequestStream:
        """Queue a request; raise APIError (400 unservable, 429 queue full, 503 shutting down or dead).
        cache_salt: the request shares prefix-cache blocks only with requests of the same salt; truncate:
        truncate_prompt_tokens and its side (params.truncate_prompt); on_progress: RequestStream's."""
        try:
            (stream,) = await self.add_batch(
                [AddRequest(request_id, prompt, params, max_tokens_given, cache_salt, truncate)], on_progress)
        except PromptRefused as exc:
            raise exc.error from None
        return stream

    async def add_batch(self, requests: list[AddRequest], on_progress=None) -> list[RequestStream]:
        """Queue several requests as one (a completions request's prompts): each prompt tokenized in turn (a
        refused one stops the rest), then, one batch at a time, every add sent together and the core's answers
        awaited together: a batch costs the core one round trip, not one a prompt. If one is refused, the others
        are aborted (their blocks freed) before the next batch is sent, so a batch that does not fit never holds
        room another would fit in; PromptRefused names it. A cancelled caller aborts all."""
        if (error := self.health()) is not None:
            raise error
        prepared: list[_Add] = []
        for i, request in enumerate(requests):
            try:
                prepared.append(await self._prepared_add(request, on_progress))
            except APIError as exc:
                raise PromptRefused(i, exc) from None
        if len(prepared) == 1:
            return await self._admit(prepared)
        async with self._batch_admission:
            return await self._admit(prepared)

    async def _admit(self, prepared: list[_Add]) -> list[RequestStream]:
        """Send the adds together, await their answers together (add_batch)."""
        sent: list[_Add] = []
        try:
            for command in prepared:      # no await between them: no other request's add comes in between
                self._submit_add(command)
                sent.append(command)
            counts = await asyncio.gather(*(command.future for command in prepared), return_exceptions=True)
        except BaseException:            # cancelled, or the core went away mid-batch: the aborts follow the adds
            for command in sent:
                command.future.cancel()  # nobody reads their answers now
                self.abort(command.request_id)
            raise
        refused = next(((i, e) for i, e in enumerate(counts) if isinstance(e, BaseException)), None)
        if refused is not None:
            for command, count in zip(prepared, counts):
                if not isinstance(count, BaseException):
                    self.abort(command.request_id)
            index, error = refused
            if isinstance(error, APIError):
                raise PromptRefused(index, error)
            raise error
        for command, count in zip(prepared, counts):
            command.stream.count_from(count)
        return [command.stream for command in prepared]

    async def _prepared_add(self, request: AddRequest, on_progress) -> _Add:
        """An add command for the core: the prompt tokenized (a text) and truncated as the request asks."""
        stream = RequestStream(request.request_id, on_progress=on_progress)
        prompt, truncate, params = request.prompt, request.truncate, request.params
        if isinstance(prompt, str):
            text = cut_prompt_text(prompt, truncate, self.max_prompt_chars)
            ids, cut = await self.encode(text, request.add_special_tokens), len(text) < len(prompt)
        else:
            ids, cut = list(prompt), False
        kept = truncate_prompt(ids, truncate, self.max_model_len, params.max_tokens if request.max_tokens_given else 0)
        stream.prompt_ids, stream.prompt_cut = kept, cut or len(kept) < len(ids)
        return _Add(request.request_id, kept, params, request.max_tokens_given, stream,
                    asyncio.get_running_loop().create_future(), request.cache_salt)

    def _submit_add(self, command: "_Add") -> None:
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    def _shutdown_prepare(self) -> None:
        self._prepare.shutdown(wait=False, cancel_futures=True)


class AsyncEngine(ServingEngine):
    """Runs an LLMEngine on a daemon thread of this process; add/abort/stats are safe to call from the
    event loop. (`kvfit serve` runs the engine in its own process instead: core_process.py.)"""

    def __init__(self, engine, max_waiting_requests: int = 1024):
        config = getattr(engine, "config", None)
        model = getattr(config, "model", None)
        folder = getattr(model, "model", None)
        super().__init__(engine.tokenizer, engine.max_model_len, engine.max_logprobs,
                         engine.default_sampling_params, getattr(model, "generation_config", None),
                         folder if isinstance(folder, str) and os.path.isdir(folder) else None)
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self._core = EngineCore(engine, max_waiting_requests)    # engine thread only
        self.max_requests_at_once = self._core.max_requests_at_once
        self._exited = False          # the thread ended on its own (dead engine); commands are refused
        self._commands: deque = deque()
        self._wake = threading.Condition()
        self._streams: dict[str, RequestStream] = {}     # engine thread only
        self._stopped = False        # the thread exits
        self._stats = dict(self._core.stats)
        self._thread = threading.Thread(target=self._run, name="kvfit-engine", daemon=True)

    def encode_now(self, text: str) -> list[int]:
        return self.engine.encode(text)

    # event-loop side -----------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    def check_dead(self) -> str | None:
        """Why the engine can no longer serve (None while it can); also notices a rank that exited."""
        if self.dead_reason is None:
            self.dead_reason = self._core.check_ranks()
        if self.dead_reason is None and self._loop is not None and not self._stopped and not self._thread.is_alive():
            self.dead_reason = "the engine thread exited"
        return self.dead_reason

    def stats(self) -> dict:
        """The engine's stats as of the end of its last step or command (a snapshot, never torn)."""
        return self._stats

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
        self._shutdown_prepare()

    def _submit_add(self, command: _Add) -> None:
        self._send(command)

    def _send(self, command) -> None:
        with self._wake:
            if self._exited:          # nobody is left to run it: an add fails now, an abort is moot
                if isinstance(command, _Add):
                    raise self.health() or engine_dead_error("the engine thread exited")
                return
            self._commands.append(command)
            self._wake.notify()

    def _deliver(self, stream: RequestStream, item) -> None:
        """item: (output, arrival time) or the APIError that ends the request."""
        if isinstance(item, APIError):
            self._call_on_loop(stream.put, item)
        else:
            self._call_on_loop(stream.put, *item)

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
                if self._core.has_work():
                    self._step()
                if self._core.dead_reason is not None:
                    self.dead_reason = self._core.dead_reason
                    self._exit(engine_dead_error(self.dead_reason))
                    return
                self._core.refresh()
                self._stats = self._core.stats
        except BaseException:          # a bug in this loop: fail every request rather than hang them
            logger.exception("the engine loop stopped")
            self.dead_reason = self.dead_reason or "the engine loop stopped; see the server log"
            self._exit(APIError(500, "the engine loop stopped; see the server log", "server_error"))
            raise

    def _exit(self, error: APIError) -> None:
        """The thread is about to end on its own: fail queued adds and held requests with `error`."""
        with self._wake:
            self._exited = True
            pending = [c for c in self._commands if isinstance(c, _Add)]
            self._commands.clear()
        for command in pending:
            self._resolve(command.future, error=error)
        try:
            self._abort_all(error)
        except Exception:             # the engine itself is broken: still tell every client
            for stream in self._streams.values():
                self._deliver(stream, error)
            self._streams.clear()

    def _take_commands(self) -> tuple[list, bool, bool]:
        with self._wake:
            # sleep only with nothing to do: no commands, no requests to run or (closing) to abort
            while not (self._commands or self._stopped or self._core.has_work()
                       or (self._closing and self._streams)):
                self._wake.wait()
            commands = list(self._commands)
            self._commands.clear()
            return commands, self._closing, self._stopped

    def _handle(self, command, closing: bool) -> None:
        if isinstance(command, _Abort):
            if self._streams.pop(command.request_id, None) is not None:
                self._core.abort(command.request_id)
            return
        if closing:
            self._resolve(command.future, error=shutting_down_error())
            return
        try:
            num_prompt_tokens = self._core.add(command.request_id, command.prompt_ids, command.params,
                                               command.max_tokens_given, command.cache_salt)
        except APIError as exc:
            self._resolve(command.future, error=exc)
        except KvfitError as exc:
            self._resolve(command.future, error=as_api_error(exc))
        except Exception:             # one bad request must not take the loop down
            logger.exception("adding request %s failed", command.request_id)
            self._resolve(command.future, error=APIError(
                500, f"internal error while adding request {command.request_id}; see the server log", "server_error"))
        else:
            self._streams[command.request_id] = command.stream
            self._resolve(command.future, num_prompt_tokens)

    def _step(self) -> None:
        outputs, error = self._core.step()
        if error is not None:
            if self._core.dead_reason is None:
                self._abort_all(error)
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
        self._core.abort_all()
        for stream in self._streams.values():
            self._deliver(stream, error)
        self._streams.clear()
        self._core.refresh()
        self._stats = self._core.stats
