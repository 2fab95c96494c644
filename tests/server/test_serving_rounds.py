"""Served decode rounds are one step unless --num-scheduler-steps is given (commands/serve.py says why);
LLM.generate keeps the platform's default."""

from __future__ import annotations

import pytest

from kvfit import LLM
from kvfit.commands.flags import engine_kwargs
from kvfit.commands.serve import SERVED_SCHEDULER_STEPS, with_served_steps
from kvfit.config import EngineConfig


def _serve_args(*flags):
    from kvfit.cli import build_parser
    return build_parser().parse_args(["serve", "some-model", *flags])


@pytest.mark.parametrize("flags, expected", [((), SERVED_SCHEDULER_STEPS), (("--num-scheduler-steps", "8"), 8),
                                             (("--num-scheduler-steps", "1"), 1)])
def test_served_rounds_are_one_step_unless_given(flags, expected, tiny_llama):
    settings = with_served_steps(engine_kwargs(_serve_args(*flags)))
    config = EngineConfig.from_kwargs(tiny_llama, **settings)
    assert config.scheduler.num_scheduler_steps == expected
    assert SERVED_SCHEDULER_STEPS == 1


def test_offline_engines_keep_the_platforms_default(tiny_llama):
    llm = LLM(tiny_llama, device="cpu", max_model_len=64, max_num_seqs=32)
    try:
        assert llm.engine.config.scheduler.num_scheduler_steps is None
    finally:
        llm.engine.shutdown()
