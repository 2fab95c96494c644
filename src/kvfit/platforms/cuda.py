"""CUDA platform: reads torch.cuda.mem_get_info and the caching allocator around the start-up steps."""

from __future__ import annotations

import gc
import logging
import os

import torch

from kvfit.config import CacheConfig
from kvfit.errors import CapacityError
from kvfit.kv.plan import MemoryReading, device_budget_bytes, over_budget
from kvfit.platforms.base import Platform, StartupSteps
from kvfit.platforms.estimate import CUDA_CONTEXT_BYTES
from kvfit.platforms.nvml import co_tenant_note, co_tenants, unlisted_tenant
from kvfit.units import MiB, gib

logger = logging.getLogger("kvfit")

# hold_activation_reserve leaves this much of the budget to what cannot come out of the held block
HOLD_SLACK_BYTES = 64 * MiB
# keep_within stops taking the reserve again after this many re-holds in a row that the very next step released
# (the steps could not use the held block: e.g. a user's max_split_size_mb, under which a large cached block
# serves no smaller request), each one a device sync and a reallocation of the activation peak
MAX_FUTILE_REHOLDS = 3
LOGGED_RELEASES = 5                  # releases logged at info (the rest at debug)


def _expandable_segments() -> None:
    """Turn on expandable allocator segments through whichever API this torch has."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is None:
        return
    try:
        setter("expandable_segments:True")
    except RuntimeError:   # a torch that cannot switch once the allocator is in use
        pass


# Decode steps per scheduling round on CUDA: the host's part of a step (schedule, inputs, update,
# outputs: about 1 ms at batch 1 and 4 ms at batch 256 on the H200 host, benchmarks/profile_kernels.py)
# is paid once per round instead of once per token, while a new request waits at most one round.
CUDA_SCHEDULER_STEPS = 8


class CudaPlatform(Platform):
    """One NVIDIA GPU per rank: NCCL collectives, CUDA graphs, Triton or torch attention."""

    name = "cuda"
    label = "CUDA"
    device_count_unit = "GPUs"
    distributed_backend = "nccl"
    supports_graphs = True
    supported_backends = ("triton", "torch")
    default_backend = "triton"
    nvml = None                          # the NVML binding co_tenants() reads (None: pynvml; tests: a fake)
    _releases_in_a_row = 0               # keep_within's calls in a row that released the cache
    _warned_futile = False

    def __init__(self, device_index: int = 0):
        super().__init__(device_index)
        self.device = torch.device("cuda", device_index)
        self.num_cache_releases = 0      # keep_within's releases of the allocator cache

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def torch_device(self):
        return self.device

    def set_current_device(self) -> None:
        torch.cuda.set_device(self.device)         # NCCL uses the current device

    def default_scheduler_steps(self, tensor_parallel_size: int) -> int:
        # multi-step rounds run on one rank only (the engine refuses them with tensor parallelism)
        return CUDA_SCHEDULER_STEPS if tensor_parallel_size == 1 else 1

    def host_copy(self, t: torch.Tensor) -> torch.Tensor:
        if not t.is_cuda:
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)     # pinned: the copy does not block the host
        host.copy_(t, non_blocking=True)
        return host

    def ready_event(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def release_cached_memory(self) -> None:
        torch.cuda.empty_cache()

    def free_device_bytes(self) -> int | None:
        free, _ = torch.cuda.mem_get_info(self.device)
        return free

    def total_device_bytes(self) -> int | None:
        return torch.cuda.mem_get_info(self.device)[1]

    def _used_bytes(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free, total

    def measure(self, steps: StartupSteps, cache: CacheConfig) -> MemoryReading:
        # Steps of varying shapes fragment fixed-size allocator segments beyond the profiled peak;
        # expandable segments keep reserved memory close to what is allocated. (A user's own
        # PYTORCH_CUDA_ALLOC_CONF wins.)
        if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
            _expandable_segments()
        torch.cuda.set_device(self.device)
        torch.cuda.init()
        # an earlier engine of this process that is garbage but not yet collected would be counted in use at
        # start and then freed while the weights load, shrinking the weights measured (its memory given twice)
        gc.collect()
        torch.cuda.empty_cache()
        used, total = self._used_bytes()
        # Everything in use on the device before this engine: the CUDA context, other processes, and this
        # process's own live torch memory (the caller's tensors, an earlier engine not yet collected: torch
        # memory this engine cannot use). It counts against the budget (another process shrinks the plan).
        # Non-torch growth is measured from the outside-torch part alone.
        in_use_at_start = used
        outside_torch_at_start = used - torch.cuda.memory_reserved(self.device)
        # who else holds part of in_use_at_start (NVML); where it names nobody, what no listed process accounts for
        tenants = self.co_tenants() or unlisted_tenant(outside_torch_at_start, CUDA_CONTEXT_BYTES)
        budget = device_budget_bytes(total, cache.gpu_memory_utilization)
        who = f" ({co_tenant_note(tenants)})" if tenants else ""
        problem = None if cache.kv_cache_memory is not None else over_budget(
            "the context, other processes and own tensors in use at start-up", in_use_at_start, budget, total,
            f"free memory held by other processes{who} or by this one, or raise --gpu-memory-utilization")
        if problem is not None:
            raise CapacityError(problem)
        allocated_before = torch.cuda.memory_allocated(self.device)
        steps.load_weights()
        torch.cuda.synchronize(self.device)
        after_weights = torch.cuda.memory_allocated(self.device)
        reserved_after_weights = torch.cuda.memory_reserved(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        scratch_kv_bytes = steps.profile() or 0
        torch.cuda.synchronize(self.device)
        # the allocator's reserved peak, not only its allocated peak: fragmentation is real memory
        activation_peak = max(torch.cuda.max_memory_allocated(self.device) - after_weights,
                              torch.cuda.max_memory_reserved(self.device) - reserved_after_weights) - scratch_kv_bytes
        torch.cuda.empty_cache()
        graph_bytes = self._graph_bytes(steps)
        used_now, _ = self._used_bytes()
        non_torch = max(used_now - torch.cuda.memory_reserved(self.device) - outside_torch_at_start, 0)
        return MemoryReading(
            total_bytes=total, budget_bytes=budget, weights_bytes=after_weights - allocated_before,
            activation_peak_bytes=activation_peak, non_torch_bytes=non_torch, cuda_graph_bytes=graph_bytes,
            in_use_at_start_bytes=in_use_at_start, own_torch_at_start_bytes=in_use_at_start - outside_torch_at_start,
            kv_cache_memory_bytes=cache.kv_cache_memory, source="measured", co_tenants=tenants)

    def co_tenants(self) -> tuple[tuple[int, str, int], ...]:
        """Other processes on this GPU, (pid, name, bytes), through NVML (self.nvml: the binding, None =
        pynvml); () where it cannot tell. The GPU is found by its UUID (CUDA_VISIBLE_DEVICES renumbers)."""
        try:
            uuid = str(torch.cuda.get_device_properties(self.device).uuid)
        except (AttributeError, RuntimeError):
            uuid = None
        if uuid is not None and not uuid.startswith(("GPU-", "MIG-")):
            uuid = f"GPU-{uuid}"
        return co_tenants(uuid, getattr(self, "device_index", 0), nvml=self.nvml)

    def keep_within(self, reading: MemoryReading) -> None:
        # Live memory stays inside the plan (weights + KV + graphs + the profiled activation peak),
        # but blocks cached after steps of shapes unlike the profile's can push reserved memory
        # past the budget. A host-side read each step; a release synchronises the device (49 of them
        # in the full-load capacity run on the H200, docs/benchmarks.md).
        # The release hands back the activation reserve too (hold_activation_reserve), so it is taken again at
        # once: between steps the process always holds the plan's activation memory, where a co-tenant cannot.
        # Unless re-holding is futile (MAX_FUTILE_REHOLDS): then it stops, and says once what that risks.
        cap = reading.process_budget_bytes if reading is not None else None
        if cap is None or torch.cuda.memory_reserved(self.device) <= cap:
            self._releases_in_a_row = 0
            return
        stats = torch.cuda.memory_stats(self.device)
        torch.cuda.empty_cache()
        self.num_cache_releases += 1
        self._releases_in_a_row += 1
        # what was cached where: live tensors, the free parts of split blocks, and what the release gave back (the
        # first releases at info: the start-up's are the ones to explain; then at debug)
        (logger.info if self.num_cache_releases <= LOGGED_RELEASES else logger.debug)(
            "allocator cache release %d: reserved %s over the cap %s (live tensors %s, free in split blocks %s, "
            "activation reserve %s); %s given back", self.num_cache_releases,
            gib(stats.get("reserved_bytes.all.current", 0)), gib(cap), gib(stats.get("allocated_bytes.all.current", 0)),
            gib(stats.get("inactive_split_bytes.all.current", 0)), gib(reading.activation_peak_bytes),
            gib(stats.get("reserved_bytes.all.current", 0) - torch.cuda.memory_reserved(self.device)))
        futile = self._releases_in_a_row - 1          # re-holds in a row that the very next step released
        if futile < MAX_FUTILE_REHOLDS:
            self.hold_activation_reserve(reading)
        elif not self._warned_futile:
            self._warned_futile = True
            logger.warning("the steps' activations outgrew the held activation reserve three steps in a row (steps "
                           "of shapes the start-up profile did not cover, or the allocator's settings: "
                           "PYTORCH_CUDA_ALLOC_CONF); it is no longer held between steps, so another "
                           "process that takes the device's free memory can make a large step run out of it "
                           "(it is taken again once a step passes without a release)")

    def hold_activation_reserve(self, reading: MemoryReading) -> int:
        # One allocation of the profiled peak, freed at once: the caching allocator keeps it reserved (until an
        # empty_cache, which keep_within does only past the budget), and the steps' activations reuse it. Without
        # this the plan's activation memory stays free on the device between steps, and a co-tenant that takes it
        # turns the next large step into an out-of-memory the headroom watchdog cannot prevent.
        # HOLD_SLACK_BYTES of the budget stay unheld: the allocator serves small tensors (<= 1 MiB) from their own
        # 2 MiB segments, never from a held block, and rounds segments up; held to the cap, those segments would
        # push the process past it on every step, and keep_within would release every step.
        cap = reading.process_budget_bytes if reading is not None else None
        size = reading.activation_peak_bytes if reading is not None else 0
        if cap is not None:
            size = min(size, cap - torch.cuda.memory_reserved(self.device) - HOLD_SLACK_BYTES)
        if size <= 0:
            return 0
        try:
            self._cache_block(size)
        except torch.OutOfMemoryError:
            return 0            # someone took it already: the watchdog will see the low headroom
        return size

    def _cache_block(self, size: int) -> None:
        """Allocate size bytes and free them: the caching allocator keeps the block reserved."""
        torch.empty(size, dtype=torch.uint8, device=self.device)

    def _graph_bytes(self, steps: StartupSteps) -> int:
        """Torch memory a trial capture of the CUDA graphs holds (their private pool: decode and mixed steps).

        Non-torch memory the capture adds (workspaces of its stream, loaded kernels) stays after
        release and is counted once, in non_torch_bytes.
        """
        if steps.capture_graphs is None:
            return 0
        reserved_before = torch.cuda.memory_reserved(self.device)
        steps.capture_graphs()
        torch.cuda.synchronize(self.device)
        graph_bytes = torch.cuda.memory_reserved(self.device) - reserved_before
        if steps.release_graphs is not None:
            steps.release_graphs()
        torch.cuda.empty_cache()
        return max(graph_bytes, 0)
