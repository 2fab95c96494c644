"""Prepare worker processes: a large body is prepared (prepare.prepare_request) in another process,
so its JSON parsing, validation, chat template rendering and tokenizing never hold the server
process's GIL, which the event loop (/health, every stream) and the engine thread need.

Threads are not enough: json.loads of 1 MB, pydantic's validation and jinja's rendering hold the
GIL for tens of milliseconds at a time, and four such bodies kept /health waiting 150-240 ms.
Small bodies (up to LARGE_BODY_BYTES) stay on the prepare threads: no inter-process hop for the
requests almost every client sends; one whose chat template runs past THREAD_RENDER_CPU_SECONDS there is
stopped and prepared again here.

Workers are started with `spawn` (never fork: the server has threads and may hold CUDA), on the
first large body (a server that never gets one starts none), at nice WORKER_NICENESS: when the CPUs are
busy, a body's preparation waits rather than the streams (a 2 s chat template in a worker at nice 0 held
streams 74-130 ms at a time on 2 cores, at nice 10 42-111 ms, while the stream ran 2x as many events);
each loads the model's tokenizer from its folder once, ignores SIGINT and SIGTERM (a Ctrl-C or a
supervisor's stop reaches the whole process group; the server drains, then stops them) and exits when
the server process is gone. A worker that dies fails the requests it held with an
internal error (500) and the pool is replaced; the server goes on serving.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from kvfit.server.prepare import PrepareContext, Prepared, prepare_request
from kvfit.server.protocol import APIError

logger = logging.getLogger("kvfit")

LARGE_BODY_BYTES = 64 * 1024      # bodies over this are prepared in a worker process
# and so is a chat whose template runs past this much CPU time on a prepare thread (text/chat_template.py's
# thread_share): a 25,000-message chat renders in about 0.1 s, an ordinary one in well under a millisecond
THREAD_RENDER_CPU_SECONDS = 0.02
MAX_PREPARE_PROCESSES = 4
WORKER_NICENESS = 10              # workers run at a lower CPU priority than the server and the engine core
PARENT_CHECK_SECONDS = 1.0        # how often a worker checks that the server process is still there
SHUTDOWN_GRACE_SECONDS = 2.0      # then workers still busy are killed


def default_num_processes() -> int:
    """Half the CPUs this process may use (the other half serve the event loop and the engine),
    at least 1, at most MAX_PREPARE_PROCESSES."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_PREPARE_PROCESSES, cpus // 2))


class PrepareWorkerDied(RuntimeError):
    """A worker process ended while it held this request (the app answers 500 with an error id)."""


@dataclass
class _Outcome:
    """What a worker sends back: the Prepared or the client's APIError, and the log lines it wrote."""

    prepared: Prepared | None
    error: APIError | None
    logs: list[tuple[int, str]]


class _LogCapture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelno, record.getMessage()))


# A worker process's state, set once by _init_worker (a worker serves one server, one body at a time).
_worker: dict = {}


def _init_worker(model_path: str | None, context: PrepareContext, parent_pid: int) -> None:
    # a Ctrl-C or a supervisor's SIGTERM reaches the whole process group: the server drains, then stops us
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.nice(WORKER_NICENESS)       # a body's preparation yields the CPU to the streams and the engine
    except OSError:
        pass
    from kvfit.text.tokenizer import load_tokenizer
    capture = _LogCapture()
    log = logging.getLogger("kvfit")
    log.handlers[:] = [capture]
    log.setLevel(logging.DEBUG)
    log.propagate = False
    tokenizer = load_tokenizer(model_path) if model_path is not None else None
    _worker.update(tokenizer=tokenizer, context=context, template_variables={}, capture=capture)
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), name="kvfit-parent-watch", daemon=True).start()


def _exit_with_parent(parent_pid: int) -> None:
    # a server killed with SIGKILL cannot stop its workers; they must not linger
    while os.getppid() == parent_pid:
        time.sleep(PARENT_CHECK_SECONDS)
    os._exit(0)


def _prepare_in_worker(raw: bytes, model_class) -> _Outcome:
    capture = _worker["capture"]
    capture.lines = []
    try:
        prepared = prepare_request(raw, model_class, _worker["context"], _worker["tokenizer"],
                                   _worker["template_variables"])
    except APIError as exc:
        return _Outcome(None, exc, capture.lines)
    return _Outcome(prepared, None, capture.lines)


class PreparePool:
    """prepare_request in worker processes; used from the event loop thread.

    model_path: the folder the engine's tokenizer was read from (None: the model has none)."""

    def __init__(self, model_path: str | None, context: PrepareContext, num_processes: int):
        if num_processes < 1:
            raise ValueError(f"a prepare pool needs at least 1 process, got {num_processes}")
        self.model_path, self.context, self.num_processes = model_path, context, num_processes
        self.num_in_flight = 0            # bodies submitted and not yet answered
        self._lock = threading.Lock()     # guards _executor and _closed (shutdown runs on another thread)
        self._executor: ProcessPoolExecutor | None = None
        self._closed = False

    async def prepare(self, raw: bytes, model_class, replay_logs: bool = True) -> Prepared:
        """prepare_request(raw, model_class) in a worker; raises its APIError, or PrepareWorkerDied.
        replay_logs: log here the lines the worker logged (False: a prepare thread logged them already)."""
        executor, future = self._submit(raw, model_class)
        self.num_in_flight += 1
        try:
            outcome: _Outcome = await asyncio.wrap_future(future)
        except BrokenProcessPool:
            self._replace(executor)
            raise PrepareWorkerDied(f"a prepare worker process died while preparing this {len(raw)}-byte body; "
                                    "the worker pool was replaced") from None
        finally:
            self.num_in_flight -= 1
        for level, line in outcome.logs if replay_logs else ():
            logger.log(level, "%s", line)
        if outcome.error is not None:
            raise outcome.error
        return outcome.prepared

    def worker_pids(self) -> list[int]:
        """The pids of the worker processes started so far (none before the first large body)."""
        with self._lock:
            processes = getattr(self._executor, "_processes", None) or {}
            return [p.pid for p in list(processes.values()) if p.pid is not None]

    def shutdown(self, grace_s: float = SHUTDOWN_GRACE_SECONDS) -> None:
        """Stop every worker: queued bodies are dropped, a busy worker gets grace_s, then is killed.
        Blocks for up to grace_s: call it off the event loop."""
        with self._lock:
            self._closed, executor, self._executor = True, self._executor, None
        if executor is not None:
            _stop(executor, grace_s)

    def _submit(self, raw: bytes, model_class):
        with self._lock:
            if self._closed:
                raise APIError(503, "the server is shutting down; retry later", "service_unavailable",
                               None, "server_shutting_down")
            for _ in range(2):
                if self._executor is None:
                    self._executor = self._new_executor()
                executor = self._executor
                try:
                    return executor, executor.submit(_prepare_in_worker, raw, model_class)
                except BrokenProcessPool:     # a worker died while idle: nothing of this body ran yet
                    logger.warning("a prepare worker process had died; starting new ones")
                    self._executor = None
                    _stop(executor, 0.0)
            raise PrepareWorkerDied("the prepare worker processes could not be started")

    def _replace(self, broken: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._executor is not broken:      # another request replaced it already
                return
            self._executor = None
        logger.error("a prepare worker process died while preparing a request; starting new ones")
        _stop(broken, 0.0)

    def _new_executor(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(self.num_processes, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init_worker, initargs=(self.model_path, self.context, os.getpid()))


def _stop(executor: ProcessPoolExecutor, grace_s: float) -> None:
    processes = list((getattr(executor, "_processes", None) or {}).values())
    executor.shutdown(wait=False, cancel_futures=True)
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(max(deadline - time.monotonic(), 0.0))
        if process.is_alive():
            process.kill()
            process.join(5)
