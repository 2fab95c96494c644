"""Start-up in one function: facts -> platform -> executor -> load, profile, measure -> plan ->
allocate the KV cache -> capture graphs. The engine gets the result; its constructor orchestrates nothing.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvfit.attention.registry import get_backend
from kvfit.config import EngineConfig
from kvfit.errors import CapacityError, ConfigError
from kvfit.kv.plan import KVPlan, MemoryReading, PlanLimits, plan_kv_cache
from kvfit.kv.report import write_plan_json
from kvfit.kv.spec import KVSpec
from kvfit.model_facts import ModelFacts, load_model_facts
from kvfit.planning import resolve_model_dtype, spec_and_limits
from kvfit.platforms import get_platform
from kvfit.platforms.base import Platform
from kvfit.units import gib

if TYPE_CHECKING:          # the runner (and torch) load with the executor, not with this module
    from kvfit.runner.worker import Executor

logger = logging.getLogger("kvfit")


@dataclass
class StartedEngine:
    """Everything start-up produced: the executor is running with its KV cache allocated."""

    config: EngineConfig
    facts: ModelFacts
    platform: Platform
    spec: KVSpec
    limits: PlanLimits
    executor: Executor
    readings: list[MemoryReading]
    plan: KVPlan
    num_scheduler_steps: int
    async_scheduling: bool


def async_scheduling(config: EngineConfig) -> bool:
    """--async-scheduling, or auto: on with one rank (the Worker launches a step and reads it later;
    the tensor-parallel ranks exchange each step's tokens, so they run without)."""
    wanted = config.scheduler.async_scheduling
    can = config.parallel.tensor_parallel_size == 1
    if wanted and not can:
        raise ConfigError(f"--async-scheduling needs --tensor-parallel-size 1 (got "
                          f"{config.parallel.tensor_parallel_size}); use --no-async-scheduling with tensor parallelism")
    return can if wanted is None else wanted


def scheduler_steps(config: EngineConfig, platform: Platform) -> int:
    """--num-scheduler-steps, or the platform's default for this tensor-parallel size."""
    steps = config.scheduler.num_scheduler_steps
    tp = config.parallel.tensor_parallel_size
    if steps is None:
        return platform.default_scheduler_steps(tp)
    if steps > 1 and tp > 1:
        raise ConfigError(f"--num-scheduler-steps {steps} needs --tensor-parallel-size 1 (got {tp}); "
                          "use --num-scheduler-steps 1 with tensor parallelism")
    return steps


def _make_executor(config: EngineConfig, facts: ModelFacts, platform: Platform, backend, spec: KVSpec) -> Executor:
    if config.parallel.tensor_parallel_size > 1:
        from kvfit.runner.tp_executor import TensorParallelWorkers
        return TensorParallelWorkers(config, facts, platform, backend, spec)
    from kvfit.runner.worker import Worker
    return Worker(config, facts, platform, backend, spec)


def loading_line(config: EngineConfig, facts: ModelFacts) -> str:
    """Start-up's first line: where the weights come from, their size and shards, the dtype they run in."""
    from kvfit.model_facts import DTYPE_BYTES
    dtype = resolve_model_dtype(facts, config.model.dtype)
    tp = config.parallel.tensor_parallel_size
    ranks = f", split over {tp} tensor-parallel ranks" if tp > 1 else ""
    if facts.quantization is not None:          # FP8 linear weights, the rest in dtype
        dtype = f"{dtype} with {facts.quantization.describe()}"
    if config.model.load_format == "dummy":
        size_bytes = facts.weight_bytes if facts.quantization else facts.num_params * DTYPE_BYTES.get(dtype, 0)
        size = f", {gib(size_bytes)}" if size_bytes else ""
        return (f"loading: random weights (--load-format dummy) for {config.model.model}: "
                f"{facts.num_params / 1e9:.2f}B parameters{size} in {dtype}{ranks}")
    from kvfit.models.loader import checkpoint_files
    files = checkpoint_files(config.model.model, config.model.load_format)
    size_bytes = sum(os.path.getsize(path) for path in files)
    kind = "safetensors" if files[0].endswith(".safetensors") else "PyTorch state dicts"
    return (f"loading: {config.model.model}: {gib(size_bytes)} of {kind} in {len(files)} "
            f"shard{'s' if len(files) > 1 else ''}, run in {dtype}{ranks}")


def _check_weights_can_fit(config: EngineConfig, facts: ModelFacts, platform: Platform) -> None:
    """Weights that could not fit a rank's device at one byte a parameter: one error line before loading
    (the loader's own check catches the rest when an allocation fails)."""
    total = platform.total_device_bytes()
    tp_size = config.parallel.tensor_parallel_size
    if total is not None and facts.num_params // tp_size > total:
        raise CapacityError(
            f"the weights do not fit: {facts.num_params:,} parameters need at least {gib(facts.num_params // tp_size)} "
            f"per rank, more than the {gib(total)} of {platform.torch_device()}; use a larger device, --tensor-parallel-size "
            "or a smaller model")


def start_engine(config: EngineConfig, facts: ModelFacts | None = None) -> StartedEngine:
    """Load, profile, measure, plan, allocate and capture; on any failure the executor is shut down.
    facts: the model's, where the caller has read them already (else read here)."""
    if facts is None:
        facts = load_model_facts(config.model.model, config.model.quantization)
    platform = get_platform(config.device.device)
    config = platform.resolve_config(config)    # the platform's defaults (--max-num-batched-tokens); the engine uses this
    backend_name = config.device.attention_backend or platform.default_backend
    backend = get_backend(backend_name)         # an unknown name is its own error, before "not on this device"
    platform.check_backend(backend_name)
    num_steps = scheduler_steps(config, platform)
    use_async = async_scheduling(config)
    spec, limits = spec_and_limits(facts, config, backend.max_element_offset, backend.name)
    if config.parallel.tensor_parallel_size > 1:    # too few devices: one error line before the loading line
        from kvfit.runner.tp_executor import check_world
        check_world(config.parallel.tensor_parallel_size, platform, facts)
    _check_weights_can_fit(config, facts, platform)
    logger.info(loading_line(config, facts))
    started = time.monotonic()
    executor = _make_executor(config, facts, platform, backend, spec)
    try:
        readings = executor.measure()
        logger.info("loaded and profiled in %.1f s (weights %s a rank)", time.monotonic() - started,
                    gib(max(r.weights_bytes for r in readings)))
        plan = plan_kv_cache(readings, spec, limits, config.parallel.tensor_parallel_size)
        # --max-model-len auto: the planner chose the length; the scheduler and admission use it
        limits = replace(limits, max_model_len=plan.max_model_len)
        logger.info(plan.log_line())
        for warning in plan.warnings:
            logger.warning(warning)
        if config.cache.plan_json:
            write_plan_json(plan, config.cache.plan_json, {"model": config.model.model})
        executor.initialize_cache(plan.num_blocks)
        logger.info("scheduling: %d decode step(s) per round, async scheduling %s", num_steps,
                    "on" if use_async else "off")
    except BaseException:
        executor.shutdown()
        raise
    return StartedEngine(config=config, facts=facts, platform=platform, spec=spec, limits=limits,
                         executor=executor, readings=readings, plan=plan, num_scheduler_steps=num_steps,
                         async_scheduling=use_async)
