"""Tensor parallelism: one process per rank; rank 0 (this process) schedules and sends each step.

Start-up: every rank loads its shard and measures its own reading; the readings are gathered so
every rank plans from the same list (the plan takes the minimum: another process on one GPU
shrinks every rank's plan). Each step rank 0 broadcasts the StepPlan (plain data) over a gloo
group; every rank runs the model (collectives inside it keep them in lockstep); rank 0 samples.
Workers exit when the engine stops, when rank 0 dies (their next collective fails), or on error.
"""

from __future__ import annotations

import datetime
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvfit.errors import ConfigError, KvfitError
from kvfit.runner.worker import Worker

_STOP = "stop"
START_TIMEOUT_S = float(os.environ.get("KVFIT_TP_TIMEOUT_S", "600"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_group(rank: int, world: int, port: int, device_type: str):
    timeout = datetime.timedelta(seconds=START_TIMEOUT_S)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=timeout)
    # plans travel over gloo even when the model's collectives use NCCL
    return dist.new_group(backend="gloo", timeout=timeout) if device_type == "cuda" else dist.group.WORLD


def _make_platform(device_type: str, rank: int):
    from kvfit.platforms.base import get_platform
    return get_platform(device_type, device_index=rank)


def _worker_main(rank, world, port, config, facts, backend_name, spec, errors):
    """Entry point of ranks 1..N-1."""
    try:
        from kvfit.attention.registry import get_backend
        platform = _make_platform(config.device.device if config.device.device != "auto" else "cpu", rank)
        torch.set_num_threads(max(1, torch.get_num_threads() // world))
        control = _init_group(rank, world, port, platform.name)
        worker = Worker(config, facts, platform, get_backend(backend_name), spec, tp_rank=rank)
        readings = [None] * world
        dist.all_gather_object(readings, worker.measure(), group=control)
        box = [None]
        dist.broadcast_object_list(box, src=0, group=control)
        if box[0] == _STOP:
            return
        worker.initialize_cache(box[0])
        while True:
            dist.broadcast_object_list(box, src=0, group=control)
            if box[0] == _STOP:
                return
            worker.execute(box[0])
    except BaseException as exc:  # report to rank 0, then exit non-zero
        errors.put((rank, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class TensorParallelWorkers:
    """The Worker interface (measure / initialize_cache / execute / shutdown) over N ranks."""

    def __init__(self, config, facts, platform, backend, spec):
        world = config.parallel.tensor_parallel_size
        if platform.name == "cuda" and torch.cuda.device_count() < world:
            raise ConfigError(f"--tensor-parallel-size {world} needs {world} GPUs but torch sees "
                              f"{torch.cuda.device_count()}; lower it")
        self.world = world
        ctx = mp.get_context("spawn")
        self.errors = ctx.Queue()
        port = _free_port()
        device = "cuda" if platform.name == "cuda" else "cpu"
        self.procs = [ctx.Process(target=_worker_main, daemon=True,
                                  args=(rank, world, port, config.replace(device=device), facts, backend.name,
                                        spec, self.errors))
                      for rank in range(1, world)]
        for p in self.procs:
            p.start()
        self._closed = False
        try:
            torch.set_num_threads(max(1, torch.get_num_threads() // world))
            self.control = _init_group(0, world, port, platform.name)
            self.worker = Worker(config, facts, platform, backend, spec, tp_rank=0)
        except BaseException:
            self._kill()
            raise

    def _check_alive(self) -> None:
        dead = [i + 1 for i, p in enumerate(self.procs) if not p.is_alive()]
        if dead:
            detail = ""
            if not self.errors.empty():
                rank, message, _ = self.errors.get_nowait()
                detail = f": rank {rank} failed with {message}"
            self._kill()
            raise KvfitError(f"tensor-parallel worker rank(s) {dead} exited{detail}")

    def measure(self):
        readings = [None] * self.world
        mine = self.worker.measure()
        self._check_alive()
        dist.all_gather_object(readings, mine, group=self.control)
        return readings

    def initialize_cache(self, num_blocks: int) -> None:
        self._check_alive()
        dist.broadcast_object_list([num_blocks], src=0, group=self.control)
        self.worker.initialize_cache(num_blocks)

    def execute(self, plan):
        self._check_alive()
        dist.broadcast_object_list([plan], src=0, group=self.control)
        return self.worker.execute(plan)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if all(p.is_alive() for p in self.procs) and dist.is_initialized():
                dist.broadcast_object_list([_STOP], src=0, group=self.control)
        except Exception:  # a dead peer: fall through to terminate
            pass
        for p in self.procs:
            p.join(timeout=10)
        self._kill()

    def _kill(self) -> None:
        self._closed = True
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        if dist.is_initialized():
            dist.destroy_process_group()
