"""The worker protocol, and Worker: one rank in this process (a platform that measures, a runner).

The engine talks to its executor only through this protocol, so one process and several
tensor-parallel processes (runner/tp_executor.py) look the same to it:

    measure() -> list[MemoryReading]      load weights, profile, measure: one reading per rank
    initialize_cache(num_blocks) -> None  allocate the KV cache (every rank the same count), capture graphs
    execute(delta) -> SampledTokens       apply one StepDelta and run it; rank 0's sampled tokens
    launch(delta) -> () -> SampledTokens  the same, its tokens read later (async scheduling: one rank only)
    check_alive() -> None                 raise EngineDeadError if no step can run again
    shutdown() -> None
"""

from __future__ import annotations

from typing import Callable, Protocol

from kvfit.config import EngineConfig
from kvfit.kv.plan import MemoryReading
from kvfit.kv.spec import KVSpec
from kvfit.model_facts import ModelFacts
from kvfit.platforms.base import Platform, StartupSteps
from kvfit.runner.model_runner import ModelRunner
from kvfit.step import SampledTokens, StepDelta


class Executor(Protocol):
    def measure(self) -> list[MemoryReading]: ...
    def initialize_cache(self, num_blocks: int) -> None: ...
    def execute(self, delta: StepDelta) -> SampledTokens: ...
    def launch(self, delta: StepDelta) -> Callable[[], SampledTokens]: ...
    def check_alive(self) -> None: ...
    def shutdown(self) -> None: ...


class Worker:
    """One rank: the Executor protocol for a single process, and the body of every tensor-parallel rank."""

    def __init__(self, config: EngineConfig, facts: ModelFacts, platform: Platform, backend, spec: KVSpec,
                 tp_rank: int = 0):
        self.platform = platform
        self.config = config
        self.runner = ModelRunner(config, facts, platform, backend, spec, tp_rank=tp_rank)
        self.reading: MemoryReading | None = None      # this rank's, once measured

    def measure_rank(self, after_load: Callable[[], None] | None = None) -> MemoryReading:
        """Load weights and profile, measured by the platform.

        after_load runs between the two (tensor parallelism: a barrier, so no rank enters the
        profile's collectives while another is still loading or has failed).
        """
        runner = self.runner

        def load_weights() -> int:
            weights_bytes = runner.load_model()
            if after_load is not None:
                after_load()
            return weights_bytes

        steps = StartupSteps(load_weights=load_weights, profile=runner.profile_run,
                             capture_graphs=runner.trial_capture_graphs, release_graphs=runner.release_graphs)
        self.reading = self.platform.measure(steps, self.config.cache)
        return self.reading

    def measure(self) -> list[MemoryReading]:
        return [self.measure_rank()]

    def initialize_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)
        self.runner.capture_graphs()
        if self.reading is not None:
            self.platform.hold_activation_reserve(self.reading)

    @property
    def num_cache_blocks(self) -> int:
        caches = self.runner.kv_caches
        return caches[0][0].shape[0] if caches else 0

    def execute(self, delta: StepDelta, sampled_before: dict[str, list[int]] | None = None) -> SampledTokens:
        sampled = self.runner.execute(delta, sampled_before)
        self.platform.keep_within(self.reading)
        return sampled

    def launch(self, delta: StepDelta) -> Callable[[], SampledTokens]:
        """Async scheduling (one rank): put the delta on the device; the callable reads its tokens."""
        result = self.runner.launch(delta)
        self.platform.keep_within(self.reading)
        return result

    def check_alive(self) -> None:
        """One process: a failed step does not stop the next one."""

    def shutdown(self) -> None:
        """Give the device memory back now (weights, KV cache, graphs), not when the engine is collected: a
        later engine in this process would count it as in use at its start."""
        self.runner.release()
