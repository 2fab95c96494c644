"""A Worker is one rank: a platform that measures and a runner that executes.

The engine talks to workers only through measure / initialize_cache / execute, so one process
and several tensor-parallel processes look the same to it.
"""

from __future__ import annotations

from typing import Callable

from kvfit.config import EngineConfig
from kvfit.engine.step_plan import StepPlan
from kvfit.kv.plan import MemoryReading
from kvfit.kv.spec import KVSpec
from kvfit.model_facts import ModelFacts
from kvfit.platforms.base import Platform, StartupSteps
from kvfit.runner.model_runner import ModelRunner


class Worker:
    def __init__(self, config: EngineConfig, facts: ModelFacts, platform: Platform, backend, spec: KVSpec,
                 tp_rank: int = 0):
        self.platform = platform
        self.config = config
        self.runner = ModelRunner(config, facts, platform.torch_device(), backend, spec, tp_rank=tp_rank)
        self.reading: MemoryReading | None = None      # this rank's, once measured

    def measure(self, after_load: Callable[[], None] | None = None) -> MemoryReading:
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
                             capture_graphs=getattr(runner, "trial_capture_graphs", None),
                             release_graphs=getattr(runner, "release_graphs", None))
        self.reading = self.platform.measure(steps, self.config.cache)
        return self.reading

    def initialize_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)
        capture = getattr(self.runner, "capture_graphs", None)
        if capture is not None:
            capture()

    def execute(self, plan: StepPlan) -> dict[str, int]:
        sampled = self.runner.execute(plan)
        self.platform.keep_within(self.reading)
        return sampled

    def execute_steps(self, plan: StepPlan) -> dict[str, list[int]]:
        sampled = self.runner.execute_steps(plan)
        self.platform.keep_within(self.reading)
        return sampled

    def shutdown(self) -> None:
        pass
