"""The capacity plan over ranks: the minimum of every rank's reading, used by every rank.

KVFIT_TEST_RANK_KV_BYTES (test only, read once at start-up by rank 0 and sent to the rank) caps one
rank's available KV bytes, as another process on its GPU would. The plan must take that figure,
the log must name each rank's bytes, and every rank must allocate the same (minimum) block count.
The engine here is then dropped without shutdown(): garbage collection must stop its ranks.
"""

from __future__ import annotations

import gc
import logging

import pytest
from tp_helpers import ENGINE_KWARGS, all_gone, rank_pids

from kvfit import LLM, SamplingParams
from kvfit.errors import ConfigError
from kvfit.kv.spec import KVSpec
from kvfit.model_facts import load_model_facts
from kvfit.runner.tp_executor import RankHooks, read_test_hooks
from kvfit.units import parse_bytes

RANK1_BLOCKS = 300


def test_every_rank_plans_the_minimum(tiny_llama, monkeypatch, caplog):
    spec = KVSpec.from_model(load_model_facts(tiny_llama), block_size=4, kv_cache_dtype="float32",
                             tensor_parallel_size=2)
    budget = parse_bytes(ENGINE_KWARGS["kv_cache_memory"], "kv_cache_memory")
    cap = RANK1_BLOCKS * spec.bytes_per_block + spec.bytes_per_block // 2     # not a whole number of blocks
    assert cap < budget
    monkeypatch.setenv("KVFIT_TEST_RANK_KV_BYTES", f"1:{cap}")
    caplog.set_level(logging.INFO, logger="kvfit")
    llm = LLM(tiny_llama, tensor_parallel_size=2, **ENGINE_KWARGS)
    pids = rank_pids(llm)
    plan = llm.capacity
    assert plan.per_rank_available_kv_bytes == [budget, cap]
    assert plan.available_kv_bytes == cap
    assert plan.num_blocks == RANK1_BLOCKS and plan.bound_by == "memory"
    assert llm.engine.workers.rank_num_blocks == [RANK1_BLOCKS, RANK1_BLOCKS]
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(budget) in m and str(cap) in m and "minimum" in m for m in logged), logged
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 3
    del llm, out
    gc.collect()
    assert all_gone(pids, timeout_s=0), "garbage collection of the LLM did not stop its ranks"


def test_test_hooks_parse_or_say_what_is_wrong():
    assert read_test_hooks(2, {}) == [RankHooks(), RankHooks()]
    hooks = read_test_hooks(3, {"KVFIT_TEST_RANK_KV_BYTES": "0:10, 2:20", "KVFIT_TEST_RANK_FAIL": "1:step"})
    assert hooks == [RankHooks(10), RankHooks(None, "step"), RankHooks(20)]
    for env in ({"KVFIT_TEST_RANK_KV_BYTES": "2:10"}, {"KVFIT_TEST_RANK_KV_BYTES": "1:lots"},
                {"KVFIT_TEST_RANK_KV_BYTES": "10"}, {"KVFIT_TEST_RANK_FAIL": "1:later"},
                {"KVFIT_TEST_RANK_FAIL": "0:load"}):
        with pytest.raises(ConfigError, match="KVFIT_TEST_RANK_"):
            read_test_hooks(2, env)
