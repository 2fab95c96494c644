"""Tensor parallelism: one process per rank; rank 0 (this process) schedules and sends each step.

Start-up: rank 0 hosts a TCPStore and spawns ranks 1..N-1 (torch.multiprocessing, spawn); every rank
joins one process group (NCCL on CUDA, device index = rank; gloo on CPU). Each rank loads its shard
and waits at a barrier (no rank enters a collective while another is still loading, or has failed),
then profiles and measures its own reading. The readings are gathered so the plan takes the minimum
(another process on one GPU shrinks every rank's plan); rank 0 plans and sends the block count, and
every rank reports the blocks it allocated. These start-up messages go through the store and rank 0
waits for them by polling while it checks that the ranks are alive: a rank that fails at start-up
is a one-line KvfitError in rank 0, not a hang.

Each step rank 0 broadcasts the StepDelta (plain data: only what changed, kvfit/step.py) over a gloo
group, with the tokens it sampled in the step before (the other ranks' persistent batches need them
as the next inputs); every rank runs the model (its collectives keep the ranks in lockstep; the
vocab-parallel lm_head gives every rank the full logits) and rank 0 samples. Workers exit when the engine stops (shutdown, garbage
collection or interpreter exit), when rank 0 dies (they watch their parent), or on an error, which
they report to rank 0. A rank that dies in the middle of an NCCL collective is noticed only at the
timeout; gloo notices at once.

Settings (ParallelConfig, read once at start-up and sent to the ranks): tp_timeout_s, how long any
rank waits for another (KVFIT_TP_TIMEOUT_S); test_rank_kv_bytes and test_rank_fail, tests only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import pickle
import signal
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvfit.config import ParallelConfig
from kvfit.errors import ConfigError, EngineDeadError, KvfitError
from kvfit.kv.plan import MemoryReading
from kvfit.runner.worker import Worker
from kvfit.step import SampledTokens, StepDelta

logger = logging.getLogger("kvfit")

_STOP = "stop"
JOIN_S = 10.0              # a stopped rank exits at once; this only bounds a stuck one
DEATH_GRACE_S = 3.0        # after a failed collective, how long to wait for the rank that caused it
CONTROL_TIMEOUT = datetime.timedelta(days=365)    # ranks wait for the next delta however long it takes


class InjectedFault(RuntimeError):
    """Raised by a rank that test_rank_fail told to fail (tests only)."""


class _Stopped(Exception):
    """Rank 0 stopped the engine during start-up."""


@dataclass(frozen=True)
class RankHooks:
    """Test-only behaviour of one rank, from ParallelConfig's test_rank_* fields (plain data)."""

    kv_bytes_cap: int | None = None
    fail_at: str | None = None

    @classmethod
    def for_rank(cls, parallel: ParallelConfig, rank: int) -> "RankHooks":
        return cls((parallel.test_rank_kv_bytes or {}).get(rank), (parallel.test_rank_fail or {}).get(rank))

    def fail_if(self, stage: str) -> None:
        if self.fail_at == stage:
            raise InjectedFault(f"test_rank_fail made this rank fail at {stage}")

    def cap(self, reading: MemoryReading) -> MemoryReading:
        if self.kv_bytes_cap is None or reading.available_kv_bytes <= self.kv_bytes_cap:
            return reading
        return dataclasses.replace(reading, kv_cache_memory_bytes=self.kv_bytes_cap,
                                   source=f"{reading.source}, capped by test_rank_kv_bytes")


@dataclass(frozen=True)
class Launch:
    """What every rank needs to join the group: plain data."""

    world: int
    port: int
    device_type: str          # a platform name (platforms/registry.py)
    timeout_s: float
    num_threads: int          # torch threads per rank
    parent_pid: int


def _post(store, key: str, value) -> None:
    store.set(key, pickle.dumps(value))


def _take(store, key: str):
    store.wait([key])          # raises at the store's timeout, or when rank 0 (the store's host) is gone
    return pickle.loads(store.get(key))


def _init_group(rank: int, launch: Launch, raw_store, platform):
    """Join the default group (the model's collectives); return the gloo group the deltas travel on."""
    timeout = datetime.timedelta(seconds=launch.timeout_s)
    platform.set_current_device()              # NCCL uses the current device: device index = rank
    dist.init_process_group(platform.distributed_backend, store=raw_store, rank=rank, world_size=launch.world,
                            timeout=timeout)
    # deltas travel over their own gloo group (even when the model's collectives use NCCL), whose
    # timeout is the longest idle spell of a server: a rank waits there until the next request
    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


def _exit_with_parent(parent_pid: int) -> None:
    """A rank must not outlive rank 0 (killed, or crashed past its clean-up): watch the parent."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, name="kvfit-parent-watch", daemon=True).start()


def _rank_main(rank, launch: Launch, config, facts, backend_name, spec, hooks: RankHooks, errors) -> None:
    """Entry point of ranks 1..N-1 (spawned)."""
    # a Ctrl-C or a supervisor's SIGTERM to the process group reaches rank 0 too, which stops the ranks in order
    # (or, killed, leaves them to _exit_with_parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _exit_with_parent(launch.parent_pid)
    try:
        torch.set_num_threads(launch.num_threads)
        hooks.fail_if("start")
        raw_store = dist.TCPStore("127.0.0.1", launch.port, launch.world, is_master=False,
                                  timeout=datetime.timedelta(seconds=launch.timeout_s))
        _serve(rank, launch, raw_store, config, facts, backend_name, spec, hooks)
    except BaseException as exc:  # report to rank 0, then exit non-zero
        import traceback
        message = (str(exc).strip().splitlines() or [""])[0]
        errors.put((rank, f"{type(exc).__name__}: {message}", traceback.format_exc()))
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _serve(rank, launch: Launch, raw_store, config, facts, backend_name, spec, hooks: RankHooks) -> None:
    from kvfit.attention.registry import get_backend
    from kvfit.platforms import get_platform
    store = dist.PrefixStore("kvfit/", raw_store)
    _post(store, f"joined/{rank}", True)
    platform = get_platform(launch.device_type, device_index=rank)
    control = _init_group(rank, launch, raw_store, platform)
    worker = Worker(config, facts, platform, get_backend(backend_name), spec, tp_rank=rank)

    def after_load() -> None:
        hooks.fail_if("load")
        _post(store, f"loaded/{rank}", True)
        if _take(store, "profile") == _STOP:
            raise _Stopped

    try:
        reading = hooks.cap(worker.measure_rank(after_load=after_load))
    except _Stopped:
        return
    _post(store, f"reading/{rank}", reading)
    num_blocks = _take(store, "num_blocks")
    if num_blocks == _STOP:
        return
    worker.initialize_cache(num_blocks)
    _post(store, f"allocated/{rank}", worker.num_cache_blocks)
    box = [None]
    while True:
        dist.broadcast_object_list(box, src=0, group=control)
        if isinstance(box[0], str):        # _STOP
            return
        hooks.fail_if("step")
        delta, sampled_before = box[0]
        worker.execute(delta, sampled_before)


class _Ranks:
    """Ranks 1..N-1, the store rank 0 hosts, and their clean-up.

    weakref.finalize holds close(), so this object never refers to the TensorParallelWorkers.
    """

    def __init__(self, launch: Launch, raw_store, procs, errors):
        self.launch, self.raw_store, self.procs, self.errors = launch, raw_store, procs, errors
        self.store = dist.PrefixStore("kvfit/", raw_store)
        self.control = None
        self.pending = ["profile", "num_blocks"]    # start-up keys the ranks still wait for
        self.closed = False
        self.threads_before = torch.get_num_threads()

    @property
    def serving(self) -> bool:
        """The ranks' next wait is a delta on the gloo group (not a store key)."""
        return not self.pending

    def rendezvous(self, platform) -> None:
        self.gather("joined", "that it started")
        self.control = _init_group(0, self.launch, self.raw_store, platform)

    def post(self, key: str, value) -> None:
        _post(self.store, key, value)
        if key in self.pending:
            self.pending.remove(key)

    def dead(self) -> list[int]:
        return [rank for rank, p in enumerate(self.procs, start=1) if not p.is_alive()]

    def check_alive(self) -> None:
        dead = self.dead()
        if dead:
            raise self.rank_error(dead)

    def rank_error(self, dead: list[int]) -> EngineDeadError:
        """The one-line error naming the ranks that exited, with the first error each reported."""
        reported: dict[int, str] = {}
        deadline = time.monotonic() + 1.0          # a rank's message may still be in the pipe
        while len(reported) < len(dead) and time.monotonic() < deadline:
            try:
                rank, message, trace = self.errors.get(timeout=0.1)
            except Exception:  # queue.Empty
                continue
            reported.setdefault(rank, message)
            logger.debug("tensor-parallel rank %d failed:\n%s", rank, trace)
        return EngineDeadError(f"tensor-parallel rank(s) {dead} failed: "
                          + "; ".join(self._why(rank, reported.get(rank)) for rank in dead))

    def _why(self, rank: int, message: str | None) -> str:
        code = self.procs[rank - 1].exitcode
        if message is not None:
            return f"rank {rank}: {message}"
        if code == -signal.SIGKILL:
            return f"rank {rank} was killed (SIGKILL: out of host memory?)"
        if code is not None and code < 0:
            return f"rank {rank} was killed by signal {-code}"
        # a spawned rank re-imports the main script: unguarded start-up code there fails it
        return (f"rank {rank} exited with code {code} before reporting an error (a script that starts "
                "a tensor-parallel engine needs `if __name__ == '__main__':`)")

    def wait_for_death(self) -> list[int]:
        """After a failed collective: the ranks that died (waiting briefly for the one that caused it)."""
        deadline = time.monotonic() + DEATH_GRACE_S
        while not self.dead() and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.dead()

    def gather(self, name: str, what: str) -> list:
        """Each rank's value posted under name/RANK, in rank order; polls, so a dead rank is an error."""
        keys = [f"{name}/{rank}" for rank in range(1, self.launch.world)]
        deadline, pause = time.monotonic() + self.launch.timeout_s, 0.002
        while not self.store.check(keys):
            self.check_alive()
            if time.monotonic() > deadline:
                missing = [rank for rank, key in enumerate(keys, start=1) if not self.store.check([key])]
                raise EngineDeadError(f"tensor-parallel rank(s) {missing} did not report {what} within "
                                 f"{self.launch.timeout_s:g} s; raise KVFIT_TP_TIMEOUT_S (tp_timeout_s) if start-up is that slow")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        return [pickle.loads(self.store.get(key)) for key in keys]

    def close(self, graceful: bool = True) -> None:
        """Stop every rank (STOP if they can hear it, else kill: they ignore SIGTERM), then leave the process
        group."""
        if self.closed:
            return
        self.closed = True
        if graceful:
            with contextlib.suppress(Exception):   # a dead peer: fall through to kill
                self._send_stop()
        deadline = time.monotonic() + (JOIN_S if graceful else 0.0)
        for p in self.procs:
            p.join(timeout=max(deadline - time.monotonic(), 0.0))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.errors.close()
        self.errors.cancel_join_thread()
        self.raw_store = self.store = None
        torch.set_num_threads(self.threads_before)

    def _send_stop(self) -> None:
        if not self.serving:
            for key in list(self.pending):      # the ranks wait on a store key
                self.post(key, _STOP)
        elif self.control is not None and not self.dead():
            dist.broadcast_object_list([_STOP], src=0, group=self.control)


def check_world(world: int, platform, facts) -> None:
    """One-line ConfigErrors before anything starts: too few devices, heads that do not split."""
    from kvfit.models.parallel import check_tensor_parallel
    from kvfit.models.registry import is_runnable
    count, what = platform.device_count(), platform.device_count_unit
    if world > count:
        raise ConfigError(f"--tensor-parallel-size {world} needs {world} {what} (one per rank) but there "
                          f"are {count}; use at most {count}")
    if is_runnable(facts.architecture):    # others fail at load with their own error
        check_tensor_parallel(facts.num_attention_heads, facts.num_kv_heads, facts.intermediate_size,
                              facts.vocab_size, world)
    if dist.is_initialized():
        import gc
        gc.collect()                   # an engine that is garbage but not yet collected stops here
    if dist.is_initialized():
        raise ConfigError("a torch.distributed process group already exists in this process (another "
                          "tensor-parallel engine?); shut it down before starting one with --tensor-parallel-size")


def _spawn(world: int, launch_args: dict, config, facts, backend, spec, hooks: list[RankHooks]) -> _Ranks:
    raw_store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=launch_args["timeout_s"]))
    launch = Launch(world=world, port=raw_store.port, **launch_args)
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, name=f"kvfit-tp-rank{rank}", daemon=True,
                         args=(rank, launch, config, facts, backend.name, spec, hooks[rank], errors))
             for rank in range(1, world)]
    ranks = _Ranks(launch, raw_store, procs, errors)
    try:
        for p in procs:
            p.start()
    except BaseException:
        ranks.close(graceful=False)
        raise
    return ranks


class TensorParallelWorkers:
    """The Executor protocol (runner/worker.py) over N ranks."""

    def __init__(self, config, facts, platform, backend, spec):
        world = config.parallel.tensor_parallel_size
        check_world(world, platform, facts)
        self.hooks = [RankHooks.for_rank(config.parallel, rank) for rank in range(world)]
        device = platform.name
        launch_args = dict(device_type=device, timeout_s=config.parallel.tp_timeout_s,
                           num_threads=max(1, torch.get_num_threads() // world), parent_pid=os.getpid())
        self.world = world
        self.rank_num_blocks: list[int] = []     # the KV blocks each rank allocated, in rank order
        self._sampled: dict[str, list[int]] = {}        # rank 0's tokens of the last step, sent with the next
        self._stopped_by: str | None = None     # the failure that stopped the ranks (then no step runs again)
        self._ranks = _spawn(world, launch_args, config.replace(device=device), facts, backend, spec, self.hooks)
        self._finalizer = weakref.finalize(self, self._ranks.close)
        with self._guard():
            torch.set_num_threads(launch_args["num_threads"])
            self._ranks.rendezvous(platform)
            self.worker = Worker(config, facts, platform, backend, spec, tp_rank=0)

    @contextlib.contextmanager
    def _guard(self):
        """Any failure stops every rank; one caused by a rank that died is reported as that rank's error."""
        ranks = self._ranks
        if ranks.closed:
            raise EngineDeadError("the tensor-parallel ranks have stopped after an earlier error; start a new engine")
        try:
            yield
        except BaseException as exc:
            # a collective that failed (RuntimeError) is most likely a rank that died: wait for it
            dead = ranks.wait_for_death() if isinstance(exc, RuntimeError) else ranks.dead()
            error = ranks.rank_error(dead) if dead and not isinstance(exc, KvfitError) else None
            # serving, the ranks may be inside a collective rank 0 left: stopping politely could hang
            ranks.close(graceful=not dead and not ranks.serving)
            self._stopped_by = str(exc)
            if error is not None:
                raise error from None
            raise

    def _after_load(self) -> None:
        # the barrier between loading and the profile's collectives
        self._ranks.gather("loaded", "its loaded weights")
        self._ranks.post("profile", "go")

    def measure(self) -> list[MemoryReading]:
        """Every rank's reading, in rank order (the plan takes the minimum)."""
        with self._guard():
            mine = self.hooks[0].cap(self.worker.measure_rank(after_load=self._after_load))
            return [mine] + self._ranks.gather("reading", "its memory reading")

    def initialize_cache(self, num_blocks: int) -> None:
        with self._guard():
            self._ranks.post("num_blocks", num_blocks)
            self.worker.initialize_cache(num_blocks)
            self.rank_num_blocks = [self.worker.num_cache_blocks] + self._ranks.gather("allocated", "its KV cache")

    def execute(self, delta: StepDelta) -> SampledTokens:
        """Send the delta (and the tokens sampled last step) to every rank, run rank 0's share."""
        with self._guard():
            self._ranks.check_alive()
            dist.broadcast_object_list([(delta, self._sampled)], src=0, group=self._ranks.control)
            sampled = self.worker.execute(delta)
            self._sampled = sampled.tokens       # the other ranks need the tokens only, not the logprobs
            return sampled

    def launch(self, delta: StepDelta) -> Callable[[], SampledTokens]:
        """The Executor protocol's launch: the step runs now (the ranks exchange each step's tokens, so
        there is no async scheduling with them); the callable returns its tokens."""
        tokens = self.execute(delta)
        return lambda: tokens

    def check_alive(self) -> None:
        """Raise EngineDeadError when no step can run again: a failure stopped the ranks, or a rank process
        exited on its own (ranks stopped by shutdown are not a failure)."""
        if self._stopped_by is not None:
            raise EngineDeadError(f"the tensor-parallel ranks stopped after a failed step: {self._stopped_by}")
        dead = [] if self._ranks.closed else self._ranks.dead()
        if dead:
            raise EngineDeadError(f"tensor-parallel rank(s) {dead} exited")

    @property
    def pids(self) -> list[int]:
        """Process ids of ranks 1..N-1."""
        return [p.pid for p in self._ranks.procs]

    def shutdown(self) -> None:
        """Stop the ranks and wait for them to exit (also run at garbage collection and at exit)."""
        self._finalizer()
