"""RoundPacer: multi-step rounds shorten while requests arrive, and keep --num-scheduler-steps otherwise; an
engine given max_round_steps runs rounds no longer than that, with the same tokens."""

from __future__ import annotations

import pytest

from kvfit import SamplingParams
from kvfit.engine.round_pacer import RoundPacer


def test_full_rounds_without_arrivals_or_step_time():
    pacer = RoundPacer(8)
    assert pacer.steps(0.0, slot_free=True) == 8            # no step timed yet
    pacer.round_ran(0.016, 8)
    assert pacer.step_seconds == pytest.approx(0.002)
    assert pacer.steps(10.0, slot_free=True) == 8           # nobody arrived


def test_rounds_shorten_with_the_arrival_rate():
    pacer = RoundPacer(8)
    pacer.round_ran(0.020, 8)                                # 2.5 ms a step
    for i in range(10):                                      # 10 req/s: 0.2 / (10 x 2.5 ms) = 8 steps
        pacer.arrived(i * 0.1)
    assert pacer.arrival_rate(0.95) == pytest.approx(10)
    assert pacer.steps(0.95, slot_free=True) == 8
    for i in range(30):                                      # 40 req/s over the window: 0.2 / 0.1 = 2 steps
        pacer.arrived(0.95 + i * 0.001)
    assert pacer.steps(0.99, slot_free=True) == 2
    assert pacer.steps(0.99, slot_free=False) == 8           # a new request would wait for a slot anyway
    for i in range(1000):                                    # a burst: never below one step
        pacer.arrived(0.99)
    assert pacer.steps(0.99, slot_free=True) == 1
    assert pacer.steps(2.5, slot_free=True) == 8             # the burst ages out of the window


def test_step_time_is_a_moving_average():
    pacer = RoundPacer(4)
    pacer.round_ran(0.004, 4)
    pacer.round_ran(0.024, 4)                                # one slow round moves it a fifth of the way
    assert pacer.step_seconds == pytest.approx(0.001 + 0.2 * 0.005)
    pacer.round_ran(0.0, 4)                                  # nothing measured: ignored
    pacer.round_ran(0.1, 0)
    assert pacer.step_seconds == pytest.approx(0.002)


def test_single_step_engines_keep_one_step():
    pacer = RoundPacer(1)
    pacer.round_ran(0.002, 1)
    pacer.arrived(0.0)
    assert pacer.steps(0.0, slot_free=True) == 1
    with pytest.raises(ValueError):
        RoundPacer(0)


def test_engine_rounds_follow_max_round_steps(tiny_llama):
    from kvfit.config import EngineConfig
    from kvfit.engine.llm_engine import LLMEngine
    kwargs = dict(device="cpu", dtype="float32", max_model_len=128, kv_cache_memory=2 * 2**20,
                  num_scheduler_steps=4, async_scheduling=False)
    engine = LLMEngine(EngineConfig.from_kwargs(tiny_llama, **kwargs))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    try:
        def run(limit):
            engine.add_request([1, 2, 3, 4, 5], params, "r")
            rounds, tokens = [], []
            while engine.has_unfinished():
                for out in engine.step(max_round_steps=limit):
                    tokens = out.outputs[0].token_ids
                rounds.append(engine.last_round_steps)
            return rounds, list(tokens)
        full_rounds, full_tokens = run(None)
        short_rounds, short_tokens = run(2)
    finally:
        engine.shutdown()
    assert max(full_rounds) == 4 and max(short_rounds) == 2
    assert short_tokens == full_tokens and len(full_tokens) == 12


def test_the_serving_core_paces_a_multi_step_engine():
    """EngineCore asks its pacer before each step: full rounds alone, one step under a stream of arrivals
    while a batch slot is free."""
    from kvfit.server.engine_core import EngineCore

    class Engine:
        num_scheduler_steps = 8
        last_round_steps = 0
        config = None

        def __init__(self):
            self.asked: list[int | None] = []
            self.running = 0

        def stats(self):
            return {"running": self.running, "waiting": 0, "kv_blocks_free": 100, "kv_blocks_cached": 0,
                    "block_size": 16}

        def add_request(self, *args, **kwargs):
            self.running += 1

        def check_alive(self):
            """One process: always able to step."""

        def step(self, max_round_steps=None):
            self.asked.append(max_round_steps)
            self.last_round_steps = max_round_steps
            return []

    engine = Engine()
    core = EngineCore(engine, max_waiting_requests=10)
    core.max_num_seqs = 4
    core.refresh()
    core.pacer.round_ran(0.02, 8)                  # 2.5 ms a step
    core.step()
    assert engine.asked[-1] == 8
    for i in range(3):                             # 3 arrivals now
        core.add(f"r{i}", [1, 2], SamplingParams(max_tokens=4))
    core.pacer._arrivals.extend([core.pacer._arrivals[-1]] * 100)      # as if 100 more came in this second
    core.refresh()
    core.step()
    assert engine.asked[-1] == 1                   # 103 req/s x 2.5 ms: one step per round
    engine.running = 4                             # every slot taken: an arrival waits for a slot anyway
    core.refresh()
    core.step()
    assert engine.asked[-1] == 8
