"""The engine core in its own process (`kvfit serve`): the HTTP front-end never shares a GIL with the
loop that schedules and launches steps.

```
front-end process (uvicorn, this module's EngineCoreClient)     engine core process (run_engine_core)
  HTTP, parsing, chat templates, tokenizing, response building     EngineCore: admission, scheduler,
  add / abort / close / stop  --- PUSH ipc:// (msgspec) --->       KV manager, executor (and the
  text of the outputs (FrontEndText)                               text of requests with stop strings)
  RequestStreams  <--- PULL ipc:// (msgspec): Ready, then one      one OutputBatch per loop round:
                       OutputBatch per round (deltas) ---          adds taken, step deltas, errors, stats
```

pyzmq carries the messages (maintained, no broker, ipc:// sockets in a private temporary folder) and
msgspec encodes them (core_protocol.py): per round, only what is new. The core process is spawned (a
fresh interpreter: CUDA cannot be forked), builds the engine from a picklable factory, and reports
Ready with the facts the front-end needs, or StartFailed. It dies with the front-end (PR_SET_PDEATHSIG
on Linux, and a parent check while idle) and ignores SIGINT (and, once serving, SIGTERM): a Ctrl-C or a
supervisor's stop reaches the whole process group, and the front-end shuts the core down in order (close:
every request ends with a 503; stop: exit).

Health: the core is dead once it reports a dead_reason (a step it cannot recover from) or its process
is gone; the client then fails every pending request with a 503, /health answers 503, and `kvfit
serve` exits 1 (GracefulServer).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import functools
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import Callable

import zmq

from kvfit.errors import ConfigError, KvfitError
from kvfit.server.async_engine import RequestStream, ServingEngine, _Add
from kvfit.server.core_protocol import (COMMAND_DECODER, ENCODER, REPLY_DECODER, AbortCommand, AddCommand,
                                        AddResult, CloseCommand, DeltaTracker, ErrorInfo, FrontEndText, OutputAccumulator,
                                        OutputBatch, Ready, StartFailed, StopCommand)
from kvfit.server.engine_core import EngineCore, engine_dead_error, shutting_down_error
from kvfit.server.gc_tuning import tune_gc_after_startup
from kvfit.server.prepare import as_api_error
from kvfit.server.protocol import APIError
from kvfit.server.stack_sampler import CORE_ROLE, FRONTEND_ROLE, StackSampler, sampling

logger = logging.getLogger("kvfit")

IDLE_POLL_MS = 500                # an idle core checks its parent is alive this often
# a core with requests to run that sends nothing for this long is wedged: /health says so and the
# server exits 1 (a supervisor restarts it); far above any one step (a CPU prefill chunk, a graph capture)
DEFAULT_STALL_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 10.0             # after a stop, how long the core gets to exit before it is killed
DISPATCH_CHUNK = 32              # core outputs applied per event-loop callback (then the loop's other work runs)
TOKEN_TEXT_CACHE = 1 << 16        # token texts for logprobs kept decoded (a few MiB at most)
_PR_SET_PDEATHSIG = 1


# engine core process ------------------------------------------------------------------------------
def _die_with_parent() -> None:
    """SIGKILL this process when the process that spawned it exits (Linux; elsewhere the idle check)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass


def run_engine_core(factory, commands_address: str, replies_address: str, max_waiting_requests: int,
                    log_level: str, parent_pid: int) -> None:
    """The engine core process's main: build the engine with factory(), report Ready, serve commands."""
    _die_with_parent()
    if os.getppid() != parent_pid:      # it died before the death signal was set: build nothing for nobody
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)        # the front-end stops us in order
    from kvfit.server.logs import configure_logging
    configure_logging(log_level)
    context = zmq.Context()
    commands, replies = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    _unbounded(commands, replies)
    commands.connect(commands_address)
    replies.connect(replies_address)

    def send(message) -> None:
        replies.send(ENCODER.encode(message), copy=False)

    try:
        try:
            engine = factory()
        except KvfitError as exc:
            send(StartFailed(str(exc), isinstance(exc, ConfigError)))
            return
        except BaseException as exc:     # an engine bug: the front-end says so in one line, the log has the rest
            logger.exception("the engine could not start")
            send(StartFailed(f"the engine could not start ({type(exc).__name__}: {exc}); see the log above"))
            return
        try:
            core = EngineCore(engine, max_waiting_requests)
            plan = getattr(engine, "plan", None)
            send(Ready(engine.max_model_len, engine.max_logprobs, core.max_num_seqs,
                       dict(engine.default_sampling_params), plan.log_line() if plan is not None else "",
                       core.stats, list(engine.eos_token_ids), core.max_requests_at_once))
            tune_gc_after_startup("engine core")
            # a SIGTERM to the whole process group (systemd's stop, `timeout`, `kill -- -PGID`) reaches us too:
            # as with a Ctrl-C, the front-end drains and stops us in order (we die with it: _die_with_parent)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            with sampling(CORE_ROLE):       # $KVFIT_STACK_SAMPLES: this process's stacks, from here on
                _CoreLoop(core, commands, send, parent_pid).run()
        finally:
            engine.shutdown()
    finally:
        replies.close(linger=2000)       # the last batch (errors, dead_reason) still goes out
        commands.close(linger=0)
        context.term()


class _CoreLoop:
    """Drain commands, run a step, send the round's news; sleep on the socket only with nothing to do."""

    def __init__(self, core: EngineCore, commands: zmq.Socket, send, parent_pid: int):
        self.core, self.commands, self.send, self.parent_pid = core, commands, send, parent_pid
        self.tracker = DeltaTracker()
        self.closing = self.stopping = False

    def run(self) -> None:
        core = self.core
        while True:
            commands = self._receive()
            added = [result for command in commands if (result := self._handle(command)) is not None]
            errors: list[tuple[str, ErrorInfo]] = []
            if self.closing or self.stopping:
                errors += self._abort_all(shutting_down_error())
            # adds answered before the step (a slow step does not delay them); after aborts alone too,
            # so the stats the front-end shows count the freed blocks while the core sleeps
            if commands or errors:
                core.refresh()
                self.send(OutputBatch(added, [], errors, core.stats))
                added, errors = [], []
            if self.stopping:
                return
            deltas = []
            if core.has_work():
                outputs, error = core.step()
                if error is not None:
                    errors += self._abort_all(error)
                else:
                    deltas = [self.tracker.delta(output) for output in outputs]
                core.refresh()
                self.send(OutputBatch([], deltas, errors, core.stats, core.dead_reason))
            if core.check_ranks() is not None:
                errors = self._abort_all(engine_dead_error(core.dead_reason))
                self.send(OutputBatch([], [], errors, core.stats, core.dead_reason))
                return

    def _receive(self) -> list:
        """The commands waiting; blocks (checking the parent is alive) only when there is nothing to run."""
        messages = []
        while not (self.core.has_work() or messages or self.stopping):
            if self.commands.poll(IDLE_POLL_MS):
                break
            if os.getppid() != self.parent_pid:      # the front-end is gone: nobody will stop us
                logger.error("the server process exited; the engine core stops")
                self.stopping = True
                return []
            if self.core.check_ranks() is not None:  # a rank died while idle: the loop reports it
                return []
        while True:
            try:
                messages.append(COMMAND_DECODER.decode(self.commands.recv(zmq.NOBLOCK, copy=False)))
            except zmq.Again:
                return messages

    def _handle(self, command) -> AddResult | None:
        core = self.core
        if isinstance(command, AbortCommand):
            for request_id in command.request_ids:
                core.abort(request_id)
                self.tracker.drop(request_id)
        elif isinstance(command, CloseCommand):
            self.closing = True
        elif isinstance(command, StopCommand):
            self.stopping = True
        elif isinstance(command, AddCommand):
            return self._add(command)
        return None

    def _add(self, command: AddCommand) -> AddResult:
        if self.closing or self.stopping:
            return AddResult(command.request_id, 0, ErrorInfo.of(shutting_down_error()))
        try:
            params = pickle.loads(command.params)
            num_prompt_tokens = self.core.add(command.request_id, command.prompt_ids, params,
                                              command.max_tokens_given, command.cache_salt)
        except APIError as exc:
            return AddResult(command.request_id, 0, ErrorInfo.of(exc))
        except KvfitError as exc:
            return AddResult(command.request_id, 0, ErrorInfo.of(as_api_error(exc)))
        except Exception:             # one bad request must not take the loop down
            logger.exception("adding request %s failed", command.request_id)
            return AddResult(command.request_id, 0, ErrorInfo(
                500, f"internal error while adding request {command.request_id}; see the server log", "server_error"))
        return AddResult(command.request_id, num_prompt_tokens)

    def _abort_all(self, error: APIError) -> list[tuple[str, ErrorInfo]]:
        ids = self.core.abort_all()
        for request_id in ids:
            self.tracker.drop(request_id)
        info = ErrorInfo.of(error)
        return [(request_id, info) for request_id in ids]


# front-end client ---------------------------------------------------------------------------------
class EngineCoreClient(ServingEngine):
    """The HTTP process's view of an engine core process (the ServingEngine the app uses)."""

    def __init__(self, process, context: zmq.Context, commands: zmq.Socket, replies: zmq.Socket, folder: str,
                 ready: Ready, tokenizer, generation_config, model_folder: str | None):
        super().__init__(tokenizer, ready.max_model_len, ready.max_logprobs, ready.default_sampling_params,
                         generation_config, model_folder)
        self.max_num_seqs = ready.max_num_seqs
        self.max_requests_at_once = ready.max_requests_at_once
        self.capacity_line = ready.capacity_line
        self._process, self._context, self._commands, self._replies = process, context, commands, replies
        self._folder = folder
        self._send_lock = threading.Lock()
        self._stats = dict(ready.stats)
        self._eos_token_ids = tuple(ready.eos_token_ids)
        # a token's text for logprobs (vLLM's decoded_token: Tokenizer.token_text)
        self._token_text = functools.lru_cache(maxsize=TOKEN_TEXT_CACHE)(
            lambda token_id: tokenizer.token_text(token_id))      # (no tokenizer: never called)
        self._pending: dict[str, _Add] = {}                     # adds sent, not yet answered (loop only)
        self._streams: dict[str, tuple[RequestStream, OutputAccumulator]] = {}   # loop only
        self._stopped = False
        self.stall_timeout_s = DEFAULT_STALL_TIMEOUT_S
        self._last_message = time.monotonic()               # when the core last sent anything (reader)
        self._waiting_since = self._last_message            # when requests last began to wait on an idle core
        self._reader = threading.Thread(target=self._read, name="kvfit-core-reader", daemon=True)
        # the reader's work waiting for the loop, in order (loop only): (number of deltas, work); see _drain
        self._work: collections.deque[tuple] = collections.deque()
        self._draining = False
        self._sampler: StackSampler | None = None     # this process's stacks ($KVFIT_STACK_SAMPLES), while serving

    @classmethod
    def launch(cls, factory, *, tokenizer, generation_config, model_folder: str | None,
               max_waiting_requests: int, log_level: str = "info",
               stall_timeout_s: float | None = None) -> "EngineCoreClient":
        """Spawn the engine core process, wait for its start-up; raises ConfigError/KvfitError with its
        reason when it cannot start."""
        sampler = StackSampler.from_environment(FRONTEND_ROLE)      # a bad $KVFIT_STACK_SAMPLE_MS fails first
        folder = tempfile.mkdtemp(prefix="kvfit-core-")
        context = zmq.Context()
        commands, replies = context.socket(zmq.PUSH), context.socket(zmq.PULL)
        _unbounded(commands, replies)
        commands_address, replies_address = f"ipc://{folder}/commands", f"ipc://{folder}/replies"
        commands.bind(commands_address)
        replies.bind(replies_address)
        process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, name="kvfit-engine-core",
            args=(factory, commands_address, replies_address, max_waiting_requests, log_level, os.getpid()))
        try:
            with _sigterm_interrupts():
                process.start()
                first = cls._wait_for_start(process, replies)
            client = cls(process, context, commands, replies, folder, first, tokenizer, generation_config,
                         model_folder)
        except BaseException:
            _end_process(process, 0)
            _close(context, [commands, replies], folder)
            raise
        if stall_timeout_s is not None:
            client.stall_timeout_s = stall_timeout_s
        if sampler is not None and sampler.start():
            client._sampler = sampler
        return client

    @staticmethod
    def _wait_for_start(process, replies: zmq.Socket) -> Ready:
        while not replies.poll(200):
            if not process.is_alive():
                raise KvfitError(f"the engine core process exited during start-up (exit code {process.exitcode}); "
                                 "see the log above")
        message = REPLY_DECODER.decode(replies.recv())
        if isinstance(message, StartFailed):
            process.join(STOP_TIMEOUT_S)
            raise (ConfigError if message.config else KvfitError)(message.message)
        assert isinstance(message, Ready), f"the engine core's first message was {type(message).__name__}"
        return message

    # event-loop side -------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._reader.start()

    def check_dead(self) -> str | None:
        """Why the core cannot serve: it said so, its process is gone, or it is wedged (requests wait and
        it has sent nothing for stall_timeout_s: one step never takes that long)."""
        if self.dead_reason is None and not self._stopped:
            if not self._process.is_alive():
                self.dead_reason = f"the engine core process exited (exit code {self._process.exitcode})"
            elif ((self._pending or self._streams)
                  and time.monotonic() - max(self._last_message, self._waiting_since) > self.stall_timeout_s):
                self.dead_reason = (f"the engine core sent nothing for {self.stall_timeout_s:.0f} s while requests "
                                    "waited (wedged)")
                self._fail_everything(self.dead_reason)
        return self.dead_reason

    def stats(self) -> dict:
        return self._stats

    def _submit_add(self, command: _Add) -> None:
        if (error := self.health()) is not None:
            raise error
        if not (self._pending or self._streams):     # the stall clock starts now, not at the core's last word
            self._waiting_since = time.monotonic()
        self._pending[command.request_id] = command
        params = command.params
        if FrontEndText.applies(self.tokenizer, params):      # the text is made here, not in the core
            params = FrontEndText.core_params(params)
        self._send(AddCommand(command.request_id, command.prompt_ids, pickle.dumps(params),
                              command.max_tokens_given, command.cache_salt))

    def abort(self, request_id: str) -> None:
        """Abort a request (a no-op if it already ended); the core frees its blocks at its next round."""
        self._pending.pop(request_id, None)
        if self._streams.pop(request_id, None) is not None or self.dead_reason is None:
            self._send(AbortCommand([request_id]))

    def begin_shutdown(self) -> None:
        self._closing = True
        self._send(CloseCommand())

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """End every request, stop the core process (killed if it does not exit in time). Idempotent."""
        if self._stopped:
            return
        self._closing = True
        self._send(StopCommand())
        self._stopped = True
        _end_process(self._process, timeout)
        if self._reader.is_alive():
            self._reader.join()          # it reads the core's last batch, then exits; sockets close after it
        with self._send_lock:            # an abort from the event loop may be sending right now
            _close(self._context, [self._commands, self._replies], self._folder)
        # what the core never answered (it was killed, or the reader never ran) ends too, after the last batch
        self._call_on_loop(self._end_all, shutting_down_error())
        self._shutdown_prepare()
        if self._sampler is not None:
            self._sampler.stop()

    def _send(self, message) -> None:
        """Never blocks the event loop: queued without bound while the core is busy; dropped once the
        core is gone (its death is reported by check_dead and the reader)."""
        with self._send_lock:
            if self._commands.closed:
                return
            try:
                self._commands.send(ENCODER.encode(message), zmq.NOBLOCK, copy=False)
            except zmq.Again:
                logger.debug("the engine core process is not there to take %s", type(message).__name__)

    # reader thread -> loop -------------------------------------------------------------------------
    def _read(self) -> None:
        """Decode the core's batches off the event loop; hand each to the loop. Notices the core dying."""
        while True:
            try:
                if not self._replies.poll(IDLE_POLL_MS):
                    if self._process.is_alive():
                        continue
                    if not self._stopped:
                        reason = f"the engine core process exited (exit code {self._process.exitcode})"
                        self._call_on_loop(self._fail_everything, reason)
                    return                 # stopped: the core's last batch (its 503s) has been read
                message = REPLY_DECODER.decode(self._replies.recv(copy=False))
                self._last_message = time.monotonic()
            except zmq.ZMQError:           # closed by stop()
                return
            self._hand_over(self._batch_pieces(message, time.monotonic()))

    def _call_on_loop(self, fn, *args) -> None:
        """Run fn(*args) on the event loop after everything the reader handed over before it (in order)."""
        self._hand_over([(0, functools.partial(fn, *args))])

    def _hand_over(self, pieces: list[tuple[int, Callable[[], None]]]) -> None:
        """Queue (number of deltas, work) pieces for the loop, in order, from any thread."""
        if self._loop is None:       # never started: no request was taken
            return
        try:
            self._loop.call_soon_threadsafe(self._enqueue, pieces)
        except RuntimeError:         # the loop is closed: nobody is left to tell
            pass

    def _enqueue(self, pieces: list[tuple[int, Callable[[], None]]]) -> None:
        self._work.extend(pieces)
        if not self._draining:
            self._draining = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        """The reader's work in order, about DISPATCH_CHUNK deltas per callback: between callbacks the loop runs
        its other work (the streams woken so far, /health), so a round of 2,000 outputs does not hold it for one
        long callback."""
        budget = DISPATCH_CHUNK
        while self._work and budget > 0:
            num_deltas, piece = self._work.popleft()
            budget -= num_deltas
            try:
                piece()
            except Exception:      # a bug: that piece is dropped, the work behind it still runs (and drains)
                logger.exception("applying the engine core's output failed")
        if self._work:
            self._loop.call_soon(self._drain)
        else:
            self._draining = False

    def _batch_pieces(self, batch: OutputBatch, now: float) -> list[tuple[int, Callable[[], None]]]:
        """One core batch as loop work, in order: its adds, its deltas DISPATCH_CHUNK at a time, then its errors,
        stats and (once) the engine's death."""
        pieces = [(0, functools.partial(self._settle_adds, batch.added))]
        for start in range(0, len(batch.deltas), DISPATCH_CHUNK):
            chunk = batch.deltas[start:start + DISPATCH_CHUNK]
            pieces.append((len(chunk), functools.partial(self._apply_deltas, chunk, now)))
        pieces.append((0, functools.partial(self._end_batch, batch)))
        return pieces

    def _settle_adds(self, results: list[AddResult]) -> None:
        for result in results:
            self._settle_add(result)

    def _apply_deltas(self, deltas: list, now: float) -> None:
        for delta in deltas:
            self._apply_delta(delta, now)

    def _end_batch(self, batch: OutputBatch) -> None:
        for request_id, info in batch.errors:
            entry = self._streams.pop(request_id, None)
            if entry is not None:
                entry[0].put(info.error())
        self._stats = batch.stats
        if batch.dead_reason is not None:
            self._fail_everything(batch.dead_reason)

    def _apply_delta(self, delta, now: float) -> None:
        entry = self._streams.get(delta.request_id)
        if entry is None:          # aborted meanwhile
            return
        stream, accumulator = entry
        if delta.finished:
            del self._streams[delta.request_id]
        try:
            num_tokens = accumulator.fold(delta)
        except Exception:          # a bug folding one delta: that request fails, the batch's others go on
            logger.exception("request %s: its output could not be rebuilt", delta.request_id)
            self._streams.pop(delta.request_id, None)
            self.abort(delta.request_id)
            stream.fail(APIError(500, "internal error while building this request's output; see the server log",
                                 "server_error"))
            return
        stream.put(accumulator.snapshot, now, num_tokens)     # the output is made when the stream reads it

    def _settle_add(self, result: AddResult) -> None:
        command = self._pending.pop(result.request_id, None)
        if command is None:               # its handler was cancelled (and sent the abort)
            return
        if command.future.done():
            return
        if result.error is not None:
            command.future.set_exception(result.error.error())
            return
        text = (FrontEndText(self.tokenizer, command.params, self._eos_token_ids, self._token_text)
                if FrontEndText.applies(self.tokenizer, command.params) else None)
        self._streams[result.request_id] = (command.stream,
                                            OutputAccumulator(result.request_id, command.prompt_ids, text))
        command.future.set_result(result.num_prompt_tokens)

    def _fail_everything(self, reason: str) -> None:
        self.dead_reason = self.dead_reason or reason
        self._end_all(engine_dead_error(self.dead_reason))

    def _end_all(self, error: APIError) -> None:
        for command in self._pending.values():
            if not command.future.done():
                command.future.set_exception(error)
        self._pending.clear()
        for stream, _ in self._streams.values():
            stream.put(error)
        self._streams.clear()


@contextlib.contextmanager
def _sigterm_interrupts():
    """While the engine starts (minutes on a GPU), a SIGTERM interrupts as a Ctrl-C does, so the core is
    ended and the socket folder removed (the default action kills at once); only in the main thread and
    where nobody set a SIGTERM handler."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _unbounded(*sockets: zmq.Socket) -> None:
    """No high-water mark: a burst of adds while the core runs a long step waits in the queue (the
    waiting queue's bound is --max-waiting-requests, enforced by the core), it never blocks a sender."""
    for sock in sockets:
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)


def _end_process(process, timeout: float) -> None:
    if process.pid is None:
        return
    process.join(timeout)
    if process.is_alive():
        if timeout > 0:              # 0: ended at once on purpose (an interrupted start-up)
            logger.warning("the engine core process did not exit within %.0f s; killing it", timeout)
        process.kill()               # not SIGTERM: once serving the core ignores it (run_engine_core)
        process.join()


def _close(context: zmq.Context, sockets: list, folder: str) -> None:
    for sock in sockets:
        sock.close(linger=0)
    context.term()
    shutil.rmtree(folder, ignore_errors=True)
