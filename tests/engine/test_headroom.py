"""The headroom watchdog: free device memory under the low mark holds new requests back while others run
(nothing is lost, nothing waits forever), and admission resumes once memory is back."""

from __future__ import annotations

import pytest

from kvfit.config import EngineConfig
from kvfit.engine.headroom import MIN_HEADROOM_BYTES, HeadroomWatch
from kvfit.engine.llm_engine import LLMEngine
from kvfit.sampling_params import SamplingParams

LOW = MIN_HEADROOM_BYTES


def test_the_watch_pauses_under_the_low_mark_and_resumes_above_twice_it():
    readings = iter([10 * LOW, LOW - 1, LOW, 2 * LOW - 1, 2 * LOW])
    watch = HeadroomWatch(lambda: next(readings), total_bytes=None, check_every_steps=2)
    assert [watch.after_step() for _ in range(10)] == [False, False, False, True, True, True, True, True, True,
                                                        False]
    assert watch.headroom_bytes == 2 * LOW


def test_a_platform_that_cannot_say_is_never_throttled():
    watch = HeadroomWatch(lambda: None, total_bytes=None, check_every_steps=1)
    assert not any(watch.after_step() for _ in range(5)) and watch.headroom_bytes is None


def test_low_headroom_admits_one_request_at_a_time_then_all_once_memory_is_back(tiny_llama):
    engine = LLMEngine(EngineConfig.from_kwargs(tiny_llama, device="cpu", dtype="float32", max_model_len=64,
                                                num_gpu_blocks_override=64, block_size=16, max_num_seqs=8))
    free = {"bytes": LOW // 2}
    engine.headroom = HeadroomWatch(lambda: free["bytes"], total_bytes=None, check_every_steps=1)
    engine.scheduler.admission_paused = engine.headroom.check()       # another process just grew
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i in range(4):
        engine.add_request([1, 2, 3 + i], params, f"r{i}")
    running, finished = [], {}
    while engine.has_unfinished():
        if len(finished) == 2:
            free["bytes"] = 4 * LOW                                   # it gave its memory back
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        running.append(engine.stats()["running"])
        assert engine.stats()["device_headroom_bytes"] == free["bytes"]
    assert sorted(finished) == ["r0", "r1", "r2", "r3"]
    assert all(len(out.outputs[0].token_ids) == 4 for out in finished.values())
    assert max(running[:8]) == 1                                      # paused: one at a time
    assert max(running) == 2                                          # resumed: the last two together
    assert engine.stats()["kv_blocks_used"] == 0


def test_allocator_cache_releases_are_a_stat_and_a_counter_where_the_platform_counts_them(tiny_llama):
    from kvfit.server.metrics import _EngineCollector
    engine = LLMEngine(EngineConfig.from_kwargs(tiny_llama, device="cpu", dtype="float32", max_model_len=64,
                                                num_gpu_blocks_override=64, block_size=16, max_num_seqs=8))
    stats = engine.stats()
    assert stats["allocator_cache_releases"] is None                  # the CPU keeps no allocator cache

    def names(s):
        return {family.name: family for family in _EngineCollector(lambda: s, "m")._kvfit(s)}
    assert "kvfit:allocator_cache_releases" not in names(stats)
    engine.workers.platform.num_cache_releases = 3                    # as CudaPlatform.keep_within counts them
    counted = names(engine.stats())["kvfit:allocator_cache_releases"]
    assert counted.type == "counter" and counted.samples[0].value == 3
