"""The capacity plan over ranks: the minimum of every rank's reading, used by every rank.

test_rank_kv_bytes (a ParallelConfig field for tests, sent to the rank with its config) caps one
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
from kvfit.config import ParallelConfig
from kvfit.runner.tp_executor import RankHooks
from kvfit.units import parse_bytes

RANK1_BLOCKS = 300


def test_every_rank_plans_the_minimum(tiny_llama, monkeypatch, caplog):
    spec = KVSpec.from_model(load_model_facts(tiny_llama), block_size=4, kv_cache_dtype="float32",
                             tensor_parallel_size=2)
    budget = parse_bytes(ENGINE_KWARGS["kv_cache_memory"], "kv_cache_memory")
    cap = RANK1_BLOCKS * spec.bytes_per_block + spec.bytes_per_block // 2     # not a whole number of blocks
    assert cap < budget
    caplog.set_level(logging.INFO, logger="kvfit")
    llm = LLM(tiny_llama, tensor_parallel_size=2, test_rank_kv_bytes={1: cap}, **ENGINE_KWARGS)
    pids = rank_pids(llm)
    plan = llm.capacity
    assert plan.per_rank_available_kv_bytes == [budget, cap]
    assert plan.available_kv_bytes == cap
    assert plan.num_blocks == RANK1_BLOCKS and plan.bound_by == "memory"
    assert llm.engine.workers.rank_num_blocks == [RANK1_BLOCKS, RANK1_BLOCKS]
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(budget) in m and str(cap) in m and "minimum" in m for m in logged), logged
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    del llm, out
    gc.collect()
    assert all_gone(pids, timeout_s=0), "garbage collection of the LLM did not stop its ranks"


def test_test_hooks_are_config_fields_checked_or_say_what_is_wrong():
    parallel = ParallelConfig(tensor_parallel_size=3, test_rank_kv_bytes={0: 10, 2: 20}, test_rank_fail={1: "step"})
    assert [RankHooks.for_rank(parallel, r) for r in range(3)] == [RankHooks(10), RankHooks(None, "step"),
                                                                   RankHooks(20)]
    assert RankHooks.for_rank(ParallelConfig(tensor_parallel_size=2), 1) == RankHooks()
    for kwargs in ({"test_rank_kv_bytes": {2: 10}}, {"test_rank_kv_bytes": {1: "lots"}},
                   {"test_rank_fail": {1: "later"}}, {"test_rank_fail": {0: "load"}},
                   {"test_rank_fail": "1:step"}, {"test_rank_kv_bytes": [1, 2]}):
        with pytest.raises(ConfigError, match="test_rank_"):
            ParallelConfig(tensor_parallel_size=2, **kwargs)


def test_the_tp_timeout_is_read_from_the_environment_once(monkeypatch):
    monkeypatch.setenv("KVFIT_TP_TIMEOUT_S", "4")
    assert ParallelConfig().tp_timeout_s == 4.0 and ParallelConfig(tp_timeout_s=9).tp_timeout_s == 9
    for text in ("soon", "inf", "0"):
        monkeypatch.setenv("KVFIT_TP_TIMEOUT_S", text)
        with pytest.raises(ConfigError, match="KVFIT_TP_TIMEOUT_S"):
            ParallelConfig()
    monkeypatch.delenv("KVFIT_TP_TIMEOUT_S")
    with pytest.raises(ConfigError, match="tp_timeout_s"):
        ParallelConfig(tp_timeout_s=float("inf"))
