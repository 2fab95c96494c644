"""Served decode rounds are multi-step only with a quarter of --max-num-seqs running (engine_core.py says why);
--num-scheduler-steps given explicitly keeps its rounds at any batch; LLM.generate is not affected."""

from __future__ import annotations

import pytest

from kvfit import LLM
from kvfit.server.engine_core import MULTI_STEP_SHARE, EngineCore, serving_multi_step_min


@pytest.mark.parametrize("max_num_seqs, minimum", [(256, 64), (1024, 256), (7, 1), (1, 1)])
def test_the_served_minimum_is_a_quarter_of_max_num_seqs(max_num_seqs, minimum):
    assert serving_multi_step_min(max_num_seqs) == minimum == max(1, max_num_seqs // MULTI_STEP_SHARE)


@pytest.mark.parametrize("steps, expected", [(None, 8), (4, 1), (1, 1)])
def test_engine_core_sets_the_minimum_only_for_the_default_steps(tiny_llama, steps, expected):
    llm = LLM(tiny_llama, device="cpu", max_model_len=64, max_num_seqs=32, num_scheduler_steps=steps)
    try:
        assert llm.engine.scheduler.min_multi_step_seqs == 1          # offline: any batch
        EngineCore(llm.engine, max_waiting_requests=8)
        assert llm.engine.scheduler.min_multi_step_seqs == expected
    finally:
        llm.engine.shutdown()
