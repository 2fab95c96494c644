"""plan_kv_cache: the pure function from a memory reading to a block count. No torch, no device.

num_blocks = min(memory limit (or the override that replaces it), max_num_blocks, index limit).
Every limit is recorded; the smallest names `bound_by`. Errors, not clamps: a plan that cannot
serve one request of max_model_len, or a budget with nothing left for KV, raises CapacityError
(assess_kv_cache returns that plan instead, with `fits` False and the reason, for `kvfit plan --json`).
The one lowering is asked for: --max-model-len auto takes the longest request the blocks hold.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Sequence

from kvfit.errors import CapacityError, ConfigError
from kvfit.kv.spec import KVSpec
from kvfit.units import gib

OFFSET_64_BIT = 2**63 - 1
OFFSET_32_BIT = 2**31 - 1
# Block tables hold block ids as int32 (the kernels load them so), so no block id may pass this.
MAX_BLOCK_ID = 2**31 - 1
BOUND_NAMES = ("memory", "override", "max_num_blocks", "index_width")


@dataclass(frozen=True)
class MemoryReading:
    """What one rank's device holds, in bytes. Plain data: measured by a platform or estimated.

    budget_bytes is total x gpu_memory_utilization: the most that may be in use on the device while
    serving, counting memory already in use at start-up (CUDA context, other processes).
    kv_cache_memory_bytes, when set, is the KV budget itself and replaces the subtraction.
    """

    total_bytes: int
    budget_bytes: int
    weights_bytes: int = 0
    activation_peak_bytes: int = 0
    non_torch_bytes: int = 0
    cuda_graph_bytes: int = 0
    in_use_at_start_bytes: int = 0      # CUDA context, other processes, own earlier tensors: before this engine
    own_torch_at_start_bytes: int = 0   # of that, this process's torch memory (inside its allocator's reserved)
    kv_cache_memory_bytes: int | None = None
    source: str = "measured"             # measured | estimated | explicit
    # other processes holding the device, (pid, name, bytes) largest first (platforms/nvml.py): who holds part
    # of in_use_at_start_bytes; () where the platform cannot tell
    co_tenants: tuple = ()

    @property
    def non_kv_bytes(self) -> int:
        return (self.weights_bytes + self.activation_peak_bytes + self.non_torch_bytes
                + self.cuda_graph_bytes + self.in_use_at_start_bytes)

    @property
    def available_kv_bytes(self) -> int:
        if self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        return self.budget_bytes - self.non_kv_bytes

    @property
    def process_budget_bytes(self) -> int | None:
        """What this process's allocator may hold while serving (weights, activations, graphs, KV, and the
        torch memory it held before the engine): the budget less memory outside it. None with an explicit
        kv_cache_memory (no device budget)."""
        if self.kv_cache_memory_bytes is not None:
            return None
        return self.budget_bytes - self.non_torch_bytes - (self.in_use_at_start_bytes - self.own_torch_at_start_bytes)

    def explain(self) -> str:
        others = "".join(f"; {tenant_label(pid, name)} holds {gib(used)}" for pid, name, used in self.co_tenants)
        return (f"budget {gib(self.budget_bytes)} - weights {gib(self.weights_bytes)} - activation peak "
                f"{gib(self.activation_peak_bytes)} - non-torch {gib(self.non_torch_bytes)} - CUDA graphs "
                f"{gib(self.cuda_graph_bytes)} - in use at start (context, other processes, own tensors) "
                f"{gib(self.in_use_at_start_bytes)}{others} = {gib(self.available_kv_bytes)}")


@dataclass(frozen=True)
class PlanLimits:
    """Everything besides memory that bounds the block count."""

    max_model_len: int
    num_gpu_blocks_override: int | None = None
    max_num_blocks: int | None = None
    max_element_offset: int = OFFSET_64_BIT   # declared by the attention backend
    backend: str = "torch"
    # --max-model-len auto: max_model_len is the cap (the model's), lowered to what one request can use
    max_model_len_auto: bool = False

    def __post_init__(self):
        if self.max_model_len < 1:
            raise ConfigError(f"--max-model-len must be >= 1, got {self.max_model_len}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ConfigError(f"--num-gpu-blocks-override must be >= 1, got {self.num_gpu_blocks_override}")
        if self.max_num_blocks is not None and self.max_num_blocks < 1:
            raise ConfigError(f"--max-num-blocks must be >= 1, got {self.max_num_blocks}")
        assert self.max_element_offset > 0


@dataclass(frozen=True)
class KVPlan:
    """The block count and why. Returned, never written back into the config."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    kv_cache_bytes: int
    available_kv_bytes: int
    bound_by: str
    limits: dict
    max_model_len: int
    max_concurrency: float
    token_capacity: int
    kv_heads_per_rank: int
    tensor_parallel_size: int
    num_layers: int
    head_dim: int
    kv_cache_dtype: str
    backend: str
    max_element_offset: int
    per_rank_available_kv_bytes: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    reading: dict = field(default_factory=dict)
    fits: bool = True                    # False only from assess_kv_cache: it cannot serve, see reason
    reason: str | None = None
    max_model_len_cap: int | None = None   # --max-model-len auto: the model's length it was capped at
    co_tenants: list = field(default_factory=list)   # other processes that cost blocks, one line each

    def to_dict(self) -> dict:
        return asdict(self)

    def log_line(self) -> str:
        return (f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens, bound by {self.bound_by}, "
                f"{gib(self.kv_cache_bytes)}, token capacity {self.token_capacity}, "
                f"max concurrency {self.max_concurrency:.2f}x at {self.max_model_len} tokens"
                + self.auto_note() + "".join(f"; {line}" for line in self.co_tenants))

    def auto_note(self) -> str:
        """How --max-model-len auto chose max_model_len ('' when it was not asked for)."""
        if self.max_model_len_cap is None:
            return ""
        if self.max_model_len < self.max_model_len_cap:
            return (f" (--max-model-len auto: {self.max_model_len}, the longest request the KV cache holds; "
                    f"the model allows {self.max_model_len_cap})")
        return f" (--max-model-len auto: the model's maximum {self.max_model_len_cap} fits)"


def memory_limit_blocks(reading: MemoryReading, spec: KVSpec) -> int:
    return max(reading.available_kv_bytes, 0) // spec.bytes_per_block


def index_limit_blocks(spec: KVSpec, max_element_offset: int) -> int:
    """Largest block count the backend can address in one per-layer tensor (and in int32 block tables)."""
    return min(spec.max_addressable_blocks(max_element_offset), MAX_BLOCK_ID + 1)


def device_budget_bytes(total_bytes: int, gpu_memory_utilization: float) -> int:
    """The most that may be in use on a device while serving: total x --gpu-memory-utilization."""
    return int(total_bytes * gpu_memory_utilization)


def over_budget(what: str, used_bytes: int, budget_bytes: int, total_bytes: int, fixes: str) -> str | None:
    """The budget check: memory taken before the KV cache (`what`: the weights, or what was in use at start-up)
    at or over the budget leaves the cache nothing. None when it fits, else the one-line reason (what, the
    budget, the device's total and its share) ending with the flags that change it (`fixes`)."""
    if used_bytes < budget_bytes:
        return None
    share = budget_bytes / total_bytes if total_bytes else 0.0
    return (f"{what} ({gib(used_bytes)}) leave no room under the budget ({gib(budget_bytes)}: "
            f"--gpu-memory-utilization {share:.3g} of {gib(total_bytes)}) for the KV cache; {fixes}")


def _budget_problem(readings: Sequence[MemoryReading]) -> str | None:
    """Why the budget leaves nothing for the KV cache on some rank, or None."""
    for rank, reading in enumerate(readings):
        where = f" on rank {rank}" if len(readings) > 1 else ""
        problem = None if reading.kv_cache_memory_bytes is not None else over_budget(
            f"the weights{where}", reading.weights_bytes, reading.budget_bytes, reading.total_bytes,
            "use more --tensor-parallel-size, a larger device or a higher --gpu-memory-utilization")
        if problem is not None:
            return problem
        if reading.available_kv_bytes <= 0:
            return (f"no memory left for the KV cache{where}: {reading.explain()}; raise --gpu-memory-utilization, "
                    "lower --max-num-batched-tokens, use more --tensor-parallel-size or a larger device, "
                    "or set --kv-cache-memory")
    return None


def plan_kv_cache(reading: MemoryReading | Sequence[MemoryReading], spec: KVSpec, limits: PlanLimits,
                  tensor_parallel_size: int = 1) -> KVPlan:
    """Plan the KV cache. With several readings (one per rank) the plan uses the minimum.
    A plan that cannot serve (see assess_kv_cache) raises CapacityError with the reason."""
    plan = assess_kv_cache(reading, spec, limits, tensor_parallel_size)
    if not plan.fits:
        raise CapacityError(plan.reason)
    return plan


def assess_kv_cache(reading: MemoryReading | Sequence[MemoryReading], spec: KVSpec, limits: PlanLimits,
                    tensor_parallel_size: int = 1) -> KVPlan:
    """The plan whether or not it can serve: `fits` False and `reason` (the error plan_kv_cache raises)
    when the budget leaves no KV memory, the override does not fit, or one request of max_model_len
    does not fit. With limits.max_model_len_auto, max_model_len is lowered to what one request can use."""
    readings = [reading] if isinstance(reading, MemoryReading) else list(reading)
    assert readings, "plan_kv_cache needs at least one reading"
    problem = _budget_problem(readings)
    per_rank = [r.available_kv_bytes for r in readings]
    tightest = readings[per_rank.index(min(per_rank))]
    available = min(per_rank)
    memory = memory_limit_blocks(tightest, spec)
    index = index_limit_blocks(spec, limits.max_element_offset)
    override = limits.num_gpu_blocks_override
    if problem is None and override is not None and override > memory:
        problem = (f"--num-gpu-blocks-override {override} needs {gib(override * spec.bytes_per_block)} but only "
                   f"{gib(available)} are available for the KV cache ({memory} blocks); lower the override "
                   "or raise --gpu-memory-utilization / --kv-cache-memory")
    candidates = [("override" if override is not None else "memory", override if override is not None else memory),
                  ("max_num_blocks", limits.max_num_blocks), ("index_width", index)]
    bound_by, num_blocks = min(((n, v) for n, v in candidates if v is not None), key=lambda nv: nv[1])
    max_model_len = limits.max_model_len
    if limits.max_model_len_auto:
        # kvfit reserves no block (padding writes go to PADDING_SLOT_ID, not to a null block), so one
        # request may hold every block
        max_model_len = max(min(max_model_len, num_blocks * spec.block_size), 1)
    blocks_per_seq = spec.num_blocks_for_tokens(max_model_len)
    if problem is None:
        problem = _request_problem(num_blocks, blocks_per_seq, bound_by, available, spec, limits)
    return KVPlan(
        num_blocks=num_blocks, block_size=spec.block_size, bytes_per_block=spec.bytes_per_block,
        kv_cache_bytes=num_blocks * spec.bytes_per_block, available_kv_bytes=available, bound_by=bound_by,
        limits={"memory": memory, "override": override, "max_num_blocks": limits.max_num_blocks,
                "index_width": index},
        max_model_len=max_model_len, max_concurrency=round(num_blocks / blocks_per_seq, 2),
        token_capacity=num_blocks * spec.block_size, kv_heads_per_rank=spec.kv_heads_per_rank,
        tensor_parallel_size=tensor_parallel_size, num_layers=spec.num_layers, head_dim=spec.head_dim,
        kv_cache_dtype=spec.dtype, backend=limits.backend, max_element_offset=limits.max_element_offset,
        per_rank_available_kv_bytes=per_rank,
        warnings=_warnings(bound_by, memory, index, spec.max_addressable_blocks(limits.max_element_offset),
                           limits, per_rank),
        co_tenants=co_tenant_costs(tightest, spec, num_blocks, candidates[1:]) if override is None else [],
        reading=asdict(tightest), fits=problem is None, reason=problem,
        max_model_len_cap=limits.max_model_len if limits.max_model_len_auto else None)


UNLISTED_PID = 0     # a co-tenant entry for memory held outside this process that NVML attributes to no listed process


def tenant_label(pid: int, name: str) -> str:
    """'pid 4242 python', or the name alone for memory no listed process accounts for (UNLISTED_PID)."""
    return name if pid == UNLISTED_PID else f"pid {pid} {name}"


def co_tenant_costs(reading: MemoryReading, spec: KVSpec, num_blocks: int, other_limits) -> list[str]:
    """One line per other process whose memory costs the plan blocks: the blocks the plan would have without
    it (the same limits, its bytes back in the budget) less those it has. other_limits: (name, blocks or None)."""
    if reading.kv_cache_memory_bytes is not None:
        return []                      # an explicit KV size: other processes change nothing
    caps = [v for _, v in other_limits if v is not None]
    lines = []
    for pid, name, used in reading.co_tenants:
        freed = MemoryReading(**{**asdict(reading), "in_use_at_start_bytes": reading.in_use_at_start_bytes - used,
                                 "co_tenants": ()})
        fewer = min([memory_limit_blocks(freed, spec), *caps]) - num_blocks
        if fewer > 0:
            lines.append(f"{tenant_label(pid, name)} holds {gib(used)} of the device: {fewer:,} blocks fewer")
    return lines


def _request_problem(num_blocks: int, blocks_per_seq: int, bound_by: str, available: int, spec: KVSpec,
                     limits: PlanLimits) -> str | None:
    """Why one request of max_model_len cannot be served from num_blocks, or None."""
    if num_blocks == 0:
        return (f"the KV cache budget ({gib(available)}) holds no block of {gib(spec.bytes_per_block)} "
                f"(bound by {bound_by}); raise --kv-cache-memory or --gpu-memory-utilization")
    if num_blocks < blocks_per_seq:
        return (f"one request of --max-model-len {limits.max_model_len} needs {blocks_per_seq} blocks "
                f"({gib(blocks_per_seq * spec.bytes_per_block)}) but the KV cache holds {num_blocks} "
                f"(bound by {bound_by}, {gib(num_blocks * spec.bytes_per_block)} of {gib(available)} available); "
                f"lower --max-model-len to at most {num_blocks * spec.block_size} (or use --max-model-len auto) "
                "or give the cache more memory")
    return None


def _warnings(bound_by: str, memory: int, index: int, offset_blocks: int, limits: PlanLimits,
              per_rank: list) -> list:
    notes = []
    if bound_by == "index_width" and memory > index and offset_blocks > index:
        # the offsets would allow more: the int32 block ids in the block tables bind
        notes.append(f"block tables hold int32 block ids: {index} blocks of the {memory} that fit in memory "
                     "are used; a larger --block-size would use more of the memory")
    elif bound_by == "index_width" and memory > index:
        notes.append(f"the {limits.backend} attention backend addresses element offsets up to "
                     f"{limits.max_element_offset}: {index} blocks of the {memory} that fit in memory are used; "
                     "a backend with 64-bit offsets would use them all")
    if bound_by == "max_num_blocks" and memory > (limits.max_num_blocks or 0):
        notes.append(f"--max-num-blocks {limits.max_num_blocks} leaves {memory - limits.max_num_blocks} "
                     "blocks of memory unused")
    if len(set(per_rank)) > 1:
        notes.append("ranks differ in KV memory (bytes: " + ", ".join(str(b) for b in per_rank)
                     + "); every rank uses the minimum")
    return notes
