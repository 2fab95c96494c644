"""Bad tensor-parallel settings are one-line ConfigErrors before any rank starts; a rank that fails,
at start-up or mid-generation, is a clear KvfitError in rank 0 (not a hang) and leaves no process.

Failures are injected with the test_rank_fail config field (tests only): "1:start" fails rank 1 before it joins
the group, "1:load" after loading its weights, "1:step" on its first step.
"""

from __future__ import annotations

import os
import time

import pytest
from tp_helpers import ENGINE_KWARGS, all_gone, rank_pids

from kvfit import LLM, SamplingParams
from kvfit.cli import build_parser, main
from kvfit.errors import CapacityError, ConfigError, EngineDeadError, KvfitError
from kvfit.runner import tp_executor

FAST_S = 30.0      # far below KVFIT_TP_TIMEOUT_S (600): an error, not a timeout


def test_bad_sizes_are_config_errors(tiny_llama, monkeypatch):
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size must be an integer >= 1, got 0"):
        LLM(tiny_llama, tensor_parallel_size=0, **ENGINE_KWARGS)
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size 3 does not fit the model's 2 KV heads"):
        LLM(tiny_llama, tensor_parallel_size=3, **ENGINE_KWARGS)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})        # a one-core machine
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size 2 needs 2 CPU cores .* there are 1"):
        LLM(tiny_llama, tensor_parallel_size=2, **ENGINE_KWARGS)


def test_cli_flag_on_generate_profile_and_serve(tiny_llama, capsys):
    for command in ("generate", "profile", "serve"):
        assert build_parser().parse_args([command, tiny_llama, "--tensor-parallel-size", "2"]).tensor_parallel_size == 2
    rc = main(["generate", tiny_llama, "--prompt", "hi", "--tensor-parallel-size", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith("error: --tensor-parallel-size must be an integer >= 1, got 0")
    rc = main(["profile", tiny_llama, "--tensor-parallel-size", "4", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--tensor-parallel-size 4" in err


def test_profile_json_with_two_ranks(tiny_llama, capsys):
    import json
    rc = main(["profile", tiny_llama, "--json", "--tensor-parallel-size", "2", "--device", "cpu",
               "--dtype", "float32", "--block-size", "4", "--max-model-len", "128", "--kv-cache-memory", "4MiB"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tensor_parallel_size"] == 2 and len(out["measured"]["per_rank_readings"]) == 2


def test_a_plan_that_fails_in_rank_0_stops_the_ranks(tiny_llama, monkeypatch):
    """The ranks wait for the block count; rank 0's CapacityError must tell them to stop (exit 0)."""
    closed = []
    close = tp_executor._Ranks.close

    def spy(self, graceful=True):
        close(self, graceful)
        closed.append([p.exitcode for p in self.procs])
    monkeypatch.setattr(tp_executor._Ranks, "close", spy)
    with pytest.raises(CapacityError, match="--num-gpu-blocks-override 100000000"):
        LLM(tiny_llama, tensor_parallel_size=2, num_gpu_blocks_override=10**8, **ENGINE_KWARGS)
    assert closed == [[0]]


@pytest.mark.parametrize("stage", ["start", "load"])
def test_a_rank_failing_at_start_up_is_an_error_in_rank_0(tiny_llama, monkeypatch, stage):
    started = time.monotonic()
    with pytest.raises(KvfitError, match=rf"rank\(s\) \[1\] failed: rank 1: InjectedFault: .* at {stage}") as info:
        LLM(tiny_llama, tensor_parallel_size=2, test_rank_fail={1: stage}, **ENGINE_KWARGS)
    assert time.monotonic() - started < FAST_S
    assert "\n" not in str(info.value)


def test_a_rank_failing_mid_generation_is_an_error_in_rank_0(tiny_llama, monkeypatch):
    llm = LLM(tiny_llama, tensor_parallel_size=2, test_rank_fail={1: "step"}, **ENGINE_KWARGS)
    pids = rank_pids(llm)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"rank 1: InjectedFault: .* at step"):
        llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert time.monotonic() - started < FAST_S
    assert all_gone(pids, timeout_s=0)
    with pytest.raises(EngineDeadError, match="stopped after an earlier error"):
        llm.generate([[5, 6, 7]], params, use_tqdm=False)
    # what a server asks after a failed step: no step can run again
    with pytest.raises(EngineDeadError, match="ranks stopped after a failed step"):
        llm.engine.check_alive()
    llm.shutdown()


def test_ranks_stopped_by_shutdown_are_not_a_dead_engine(tiny_llama):
    llm = LLM(tiny_llama, tensor_parallel_size=2, **ENGINE_KWARGS)
    llm.engine.check_alive()
    llm.shutdown()
    llm.engine.check_alive()            # a server that stops its engine exits 0, not as if it died
