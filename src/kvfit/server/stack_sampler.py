"""A stack sampler inside each `kvfit serve` process: a profile of the front-end and of the engine core under load
where py-spy may not attach (no ptrace, as on the GPU machine).

Off unless $KVFIT_STACK_SAMPLES names a folder (then no timer, no thread, no cost). When it does, the front-end
process (EngineCoreClient.launch) and the engine core process (run_engine_core) each sample themselves once
serving begins (engine start-up is not sampled) and write FOLDER/<role>-<pid>.txt (kvfit-frontend-PID.txt,
kvfit-core-PID.txt) in py-spy's raw (collapsed) format, one stack a line, root first:

    process kvfit-core pid 4242;thread (4242): MainThread;<module> (kvfit/cli.py:9);...;step (kvfit/x.py:80) 1730

each frame `qualified name (path below its sys.path entry:line)` as py-spy writes it, so the readers of py-spy's
files (benchmarks/bench_serve.py: spy_stacks, print_stacks) and flamegraph tools read these too. A line's count is
CPU microseconds: each sample weighs a thread's stack by the CPU time the thread used since the previous sample
(its own CPU clock), so an idle thread (a loop in epoll, a worker on its queue) weighs nothing, as py-spy leaves
idle threads out, and shares are shares of CPU time, comparable across threads and across the two processes.

How: a POSIX timer on the main thread's CPU clock sends SIGPROF to the main thread every $KVFIT_STACK_SAMPLE_MS
milliseconds (default 5) of its CPU time (_MainThreadCpuTimer); Python runs the handler in the main thread at its
next bytecode, where it reads the main thread's frame (the handler's argument) and the other threads'
(sys._current_frames()). The main thread is where both processes work (`kvfit serve` runs uvicorn's event loop
there; the core its loop). Not a thread polling sys._current_frames(): such a thread reads the stacks only once it
holds the GIL, and it gets the GIL where the others release it, so its samples pile up there. Measured on this CPU
(2-core AMD EPYC, Python 3.11): a loop of Python work and a C call that releases the GIL (51% / 49% of the time)
sampled 100% in the C call by such a thread, 49% / 51% by this timer; uvloop running two Python callbacks (25% /
75%) 100% in `run_forever`, 24% / 69% (7% uvloop's own); under benchmarks/profile_frontend.py the thread found
62% of the front-end in `Runner.run` (py-spy: 4-6%), the timer agreed with py-spy within a few points per entry
point (SSE framing 3.1% / 3.2%, detokenizing 9.7 / 7.4, folding deltas 16.8 / 15.0). A C call that releases the
GIL is counted where the thread next runs Python (its caller's next line; after uvloop's C, the next callback).
The other threads weigh their exact CPU time but are read where the GIL left them, and only when the main thread
runs (a process whose main thread idles is barely sampled). One daemon thread rewrites the file every FLUSH_S
seconds (a killed process leaves what it had); stop() writes it at the end: the client's stop() (which `kvfit
serve` reaches on SIGTERM or Ctrl-C), the core's exit from its loop, and atexit.

The counts run from the start of serving. A window is two readings subtracted (bench_serve reads the files before
a run and again after the first rewrite that follows it), so there are no start/stop settings.

It needs Linux (timer_create with SIGEV_THREAD_ID, through ctypes), the main thread (signal handlers run only
there) and SIGPROF free (another profiler's): else it logs why and does not sample. SIGPROF interrupts the main
thread's blocking system calls: Python retries its own (PEP 475), as do pyzmq, libuv and the CUDA driver.

Cost, measured here: a sample takes the handler 90-120 us (median; p90 125-185 us) with the main thread ~36 frames
deep beside 7 other threads, one sample per 5 ms of the main thread's CPU: about 2% of it (a larger
$KVFIT_STACK_SAMPLE_MS costs proportionally less). The writer formats a stack once (about 20 us) and then rewrites
the file, 10-15 ms for 3,000 stacks (2 MB), every FLUSH_S seconds. benchmarks/profile_frontend.py's front-end CPU
per token, three alternating pairs of runs: 107 / 83 / 96 us with the sampler, 104 / 102 / 98 without: inside the
noise of this machine.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import ctypes
import logging
import os
import re
import signal
import sys
import threading
import time
from typing import Iterator, Mapping

from kvfit.errors import ConfigError

logger = logging.getLogger("kvfit")

FOLDER_ENV = "KVFIT_STACK_SAMPLES"
INTERVAL_ENV = "KVFIT_STACK_SAMPLE_MS"
DEFAULT_INTERVAL_MS = 5.0
FLUSH_S = 2.0                # the file is rewritten this often
FRONTEND_ROLE, CORE_ROLE = "kvfit-frontend", "kvfit-core"
FILE_PATTERN = re.compile(r"(kvfit-[a-z]+)-(\d+)\.txt")      # <role>-<pid>.txt


class StackSampler:
    """Counts the CPU time of this process's threads per stack on SIGPROF; writes it as collapsed stacks.

    start() starts it (in the main thread), stop() ends it and writes the file (idempotent); sample() and write()
    are what the signal handler and the writer thread do."""

    def __init__(self, folder: str, role: str, interval_s: float = DEFAULT_INTERVAL_MS / 1e3):
        self.path = os.path.join(folder, f"{role}-{os.getpid()}.txt")
        self.interval_s = interval_s
        self._process_frame = f"process {role} pid {os.getpid()}"
        # (id(code), line, ... leaf first, thread native id, thread name) -> CPU us; and each key's codes
        self._counts: collections.Counter = collections.Counter()
        self._codes: dict[tuple, list] = {}
        self._cpu_ns: dict[int, int] = {}         # thread ident -> its CPU clock at the previous sample
        self._names: dict[object, str] = {}       # code -> "qualname (short path:"
        self._texts: dict[tuple, str] = {}        # key -> its frames as collapsed text (the writer's)
        self._stopped = threading.Event()
        self._in_handler = False
        self._writer: threading.Thread | None = None
        self._previous_handler = None
        self._timer: _MainThreadCpuTimer | None = None

    @classmethod
    def from_environment(cls, role: str, environ: Mapping[str, str] = os.environ) -> "StackSampler | None":
        """A sampler (not started) when $KVFIT_STACK_SAMPLES names a folder (made if missing), else None."""
        folder = environ.get(FOLDER_ENV)
        if not folder:
            return None
        text = environ.get(INTERVAL_ENV, str(DEFAULT_INTERVAL_MS))
        try:
            interval_ms = float(text)
        except ValueError:
            interval_ms = float("nan")
        if not 0.1 <= interval_ms <= 10_000:
            raise ConfigError(f"${INTERVAL_ENV} must be milliseconds of CPU time between samples in [0.1, 10000], "
                              f"got {text!r}")
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"${FOLDER_ENV} must name a folder for the sample files, got {folder!r} "
                              f"({exc})") from None
        return cls(folder, role, interval_ms / 1e3)

    def start(self) -> bool:
        """Install the SIGPROF handler and timer and start the writer; False (logged) where it cannot sample."""
        why = None
        if threading.current_thread() is not threading.main_thread():
            why = "it must start in the main thread"
        elif signal.getsignal(signal.SIGPROF) not in (signal.SIG_DFL, signal.SIG_IGN, None):
            why = "SIGPROF has a handler (another profiler?)"
        if why is None:
            try:                                   # there from the start: a reader waits for its rewrites; written
                self.write()                       # before the timer, which a failure here would leave running
            except OSError as exc:
                why = f"cannot write {self.path} ({exc})"
        if why is None:
            self.sample(None)                      # every thread's CPU clock: the first weights start here
            self._previous_handler = signal.signal(signal.SIGPROF, self._on_signal)
            try:
                self._timer = _MainThreadCpuTimer(self.interval_s)
            except OSError as exc:
                signal.signal(signal.SIGPROF, self._previous_handler)
                why = f"no per-thread CPU timer here ({exc})"
        if why is not None:
            logger.warning("$%s: not sampling this process (%s)", FOLDER_ENV, why)
            return False
        self._writer = threading.Thread(target=self._write_every, name="kvfit-stack-sampler", daemon=True)
        self._writer.start()
        atexit.register(self.stop)
        return True

    def stop(self) -> None:
        """Stop sampling and write the file (once; later calls do nothing)."""
        if self._writer is None or self._stopped.is_set():
            return
        self._timer.delete()
        self._stopped.set()
        self._writer.join()
        if threading.current_thread() is threading.main_thread():
            # SIG_IGN rather than SIG_DFL: a SIGPROF still on its way must not end the process
            previous = self._previous_handler
            signal.signal(signal.SIGPROF, signal.SIG_IGN if previous in (signal.SIG_DFL, None) else previous)
        atexit.unregister(self.stop)
        self.write()

    def _on_signal(self, signum, frame) -> None:
        # a SIGPROF that lands inside the handler (several came during a long C call) would count the same CPU time
        # twice, at the handler's own line: the running sample counts it
        if self._stopped.is_set() or self._in_handler:
            return
        self._in_handler = True
        try:
            self.sample(frame)
        finally:
            self._in_handler = False

    def _write_every(self) -> None:
        while not self._stopped.wait(FLUSH_S):
            self.write()

    def sample(self, main_frame) -> None:
        """Add each thread's CPU time since the previous sample to its current stack (the main thread's is
        main_frame, where the signal found it; None: only read the clocks). The writer thread is left out."""
        main, writer = threading.main_thread().ident, self._writer.ident if self._writer is not None else None
        cpu_ns = {}
        for ident, frame in sys._current_frames().items():
            if ident == writer:
                continue
            try:
                cpu_ns[ident] = time.clock_gettime_ns(time.pthread_getcpuclockid(ident))
            except OSError:           # the thread ended meanwhile
                continue
            weight_us = (cpu_ns[ident] - self._cpu_ns.get(ident, cpu_ns[ident])) // 1000
            if main_frame is None or weight_us <= 0:
                continue              # idle since the previous sample (or first seen)
            # threading._active read without its lock: threading.enumerate() takes a lock the main thread may
            # hold where the signal interrupted it (a deadlock)
            thread = threading._active.get(ident)
            self._count(main_frame if ident == main else frame,
                        (thread.native_id, thread.name) if thread is not None else (ident, "?"), weight_us)
        self._cpu_ns = cpu_ns         # ended threads drop out

    def _count(self, frame, thread_key: tuple, weight_us: int) -> None:
        # the key holds ints only (hashing a code object hashes its bytecode); the codes of a new key are kept
        # beside it, so an id in a key always names the code it was taken from
        key, codes = [], []
        while frame is not None:
            code = frame.f_code
            codes.append(code)
            key += (id(code), frame.f_lineno)
            frame = frame.f_back
        key = tuple(key) + thread_key
        if key not in self._counts:
            self._codes[key] = codes
        self._counts[key] += weight_us

    def collapsed_lines(self) -> list[str]:
        """The counts so far as py-spy's raw lines: `process ...;thread (tid): name;root;...;leaf count`."""
        # dict() copies in C without running Python code, so the signal handler cannot change it meanwhile
        return sorted(f"{self._stack_text(key)} {count}" for key, count in dict(self._counts).items())

    def _stack_text(self, key: tuple) -> str:
        """A key's frames as collapsed text, made once (each rewrite then only formats the counts)."""
        text = self._texts.get(key)
        if text is None:
            native_id, name = key[-2:]
            frames = [self._process_frame, f"thread ({native_id}): {name}".replace(";", ",")]
            frames += [self._frame_name(code) + f"{line})" for code, line in zip(self._codes[key], key[1:-2:2])][::-1]
            text = self._texts[key] = ";".join(frames)
        return text

    def write(self) -> None:
        """Replace the file with the counts so far (a reader never sees half a file)."""
        partial = f"{self.path}.partial"
        with open(partial, "w", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in self.collapsed_lines())
        os.replace(partial, self.path)

    def _frame_name(self, code) -> str:
        name = self._names.get(code)
        if name is None:
            name = f"{getattr(code, 'co_qualname', code.co_name)} ({_short_path(code.co_filename)}:".replace(";", ",")
            self._names[code] = name
        return name


@contextlib.contextmanager
def sampling(role: str) -> Iterator[None]:
    """Sample this process as `role` inside the block when $KVFIT_STACK_SAMPLES is set; the file is written at
    its end."""
    sampler = StackSampler.from_environment(role)
    if sampler is None or not sampler.start():
        yield
        return
    try:
        yield
    finally:
        sampler.stop()


class _MainThreadCpuTimer:
    """A POSIX timer on the main thread's CPU clock that sends SIGPROF to the main thread itself (Linux: timer_create
    with SIGEV_THREAD_ID, through ctypes). setitimer's SIGPROF goes to whichever thread is running, and Python runs
    the handler of a signal another thread received only once the main thread next recomputes its eval breaker (as
    it takes the GIL back): late, and at the places the GIL is released. Raises OSError where there is none."""

    SIGEV_THREAD_ID = 4

    class _SigEvent(ctypes.Structure):          # struct sigevent: 64 bytes on Linux
        _fields_ = [("value", ctypes.c_void_p), ("signo", ctypes.c_int), ("notify", ctypes.c_int),
                    ("tid", ctypes.c_int), ("pad", ctypes.c_int * ((64 - ctypes.sizeof(ctypes.c_void_p) - 12) // 4))]

    class _TimeSpec(ctypes.Structure):
        _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]

    def __init__(self, interval_s: float):
        if not sys.platform.startswith("linux"):
            raise OSError("timer_create with SIGEV_THREAD_ID is Linux's")
        libc = ctypes.CDLL(None, use_errno=True)
        if not hasattr(libc, "timer_create"):            # glibc before 2.34: in librt
            libc = ctypes.CDLL("librt.so.1", use_errno=True)
        self._libc, self._timer = libc, ctypes.c_void_p()
        main = threading.main_thread()
        event = self._SigEvent(signo=signal.SIGPROF, notify=self.SIGEV_THREAD_ID, tid=main.native_id)
        clock = time.pthread_getcpuclockid(main.ident)
        self._check(libc.timer_create(ctypes.c_int(clock), ctypes.byref(event), ctypes.byref(self._timer)))
        seconds, nanoseconds = int(interval_s), round(interval_s % 1 * 1e9)
        spec = (self._TimeSpec * 2)(self._TimeSpec(seconds, nanoseconds), self._TimeSpec(seconds, nanoseconds))
        try:                                             # struct itimerspec: {interval, first expiry}
            self._check(libc.timer_settime(self._timer, 0, ctypes.byref(spec), None))
        except OSError:
            self.delete()
            raise

    def delete(self) -> None:
        self._libc.timer_delete(self._timer)

    @staticmethod
    def _check(result: int) -> None:
        if result != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, os.strerror(errno))


def sample_files(folder: str, pids: set[int]) -> list[str]:
    """The sample files in folder written by the processes pids."""
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return sorted(os.path.join(folder, name) for name in names
                  if (match := FILE_PATTERN.fullmatch(name)) and int(match.group(2)) in pids)


def _short_path(path: str) -> str:
    """A source path below its sys.path entry, as py-spy shortens it (kvfit/server/app.py, asyncio/events.py);
    a package outside sys.path (an editable install's import hook) from its top package's parent."""
    roots = [root.rstrip("/") + "/" for root in sys.path if root and path.startswith(root.rstrip("/") + "/")]
    if roots:
        return path[len(max(roots, key=len)):]
    if not os.path.isabs(path):             # <frozen ...>, <string>
        return path
    folder = os.path.dirname(path)
    while os.path.isfile(os.path.join(folder, "__init__.py")):
        folder = os.path.dirname(folder)
    return os.path.relpath(path, folder)
