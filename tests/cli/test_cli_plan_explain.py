"""`kvfit plan --explain`: every number is the engine's plan_kv_cache for the settings with the lever's one
change (issue 32 (4)), the table holds whole requests per context length, and a plan that does not fit names
settings under which plan_kv_cache does not raise."""

from __future__ import annotations

import json

import pytest

from kvfit import catalog
from kvfit.cli import main
from kvfit.config import EngineConfig
from kvfit.errors import CapacityError
from kvfit.kv.plan import plan_kv_cache
from kvfit.model_facts import load_model_facts
from kvfit.planning import spec_and_limits
from kvfit.platforms.base import Platform
from kvfit.platforms.estimate import estimate_reading

CASES = [("qwen3-0.6b", "H100-80GB", {}), ("llama-3.1-70b", "H100-80GB", {"tensor_parallel_size": 2}),
         ("llama-3.1-8b", "H200", {"max_model_len": 8192, "kv_cache_dtype": "fp8"})]


def explained(capsys, model, gpu, settings) -> dict:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]
    status = main(["plan", model, "--gpu", gpu, "--explain", "--json", *flags])
    out = json.loads(capsys.readouterr().out)
    assert status == (0 if out["fits"] else 1)
    return out


def engine_plan(model, gpu, settings):
    """plan_kv_cache for the settings, the reading estimated as `kvfit plan` does (raises when it cannot serve)."""
    config = Platform().resolve_config(EngineConfig.from_kwargs(model, **settings))
    facts = load_model_facts(model)
    spec, limits = spec_and_limits(facts, config, 2**63 - 1, "triton")
    reading = estimate_reading(facts, catalog.gpu_total_bytes(gpu), config.cache, config.scheduler,
                               config.parallel.tensor_parallel_size, None, limits.max_model_len)
    return plan_kv_cache(reading, spec, limits, config.parallel.tensor_parallel_size), config


@pytest.mark.parametrize("model,gpu,settings", CASES, ids=[c[0] for c in CASES])
def test_every_lever_is_plan_kv_cache_with_that_one_flag(capsys, model, gpu, settings):
    out = explained(capsys, model, gpu, settings)
    levers = out["explain"]["levers"]
    assert {lv["flag"].split()[0] for lv in levers} >= {"--gpu-memory-utilization", "-tp", "--max-model-len",
                                                         "--max-num-seqs"}
    assert any(lv["flag"] == "--kv-cache-dtype fp8" for lv in levers) == (settings.get("kv_cache_dtype") != "fp8")
    for lever in levers:
        if "refused" in lever:
            continue
        try:
            plan, config = engine_plan(model, gpu, {**settings, **lever["settings"]})
        except CapacityError:
            assert lever["fits"] is False, lever
            continue
        assert lever["fits"] and lever["num_blocks"] == plan.num_blocks, lever
        assert lever["blocks_change"] == plan.num_blocks - out["num_blocks"]
        held = plan.num_blocks // -(-plan.max_model_len // plan.block_size)
        assert lever["concurrent_requests"] == min(held, config.scheduler.max_num_seqs)
        assert lever["per_gpu_kv_cache_bytes"] == plan.kv_cache_bytes


@pytest.mark.parametrize("model,gpu,settings", CASES, ids=[c[0] for c in CASES])
def test_the_context_table_and_the_facts(capsys, model, gpu, settings):
    out = explained(capsys, model, gpu, settings)
    facts = load_model_facts(model)
    assert out["explain"]["num_params"] == facts.num_params and out["explain"]["weight_dtype"] == facts.torch_dtype
    rows = out["explain"]["contexts"]
    assert rows[-1]["context_tokens"] == out["max_model_len"] and len(rows) >= 2
    for row in rows:
        held = out["num_blocks"] // -(-row["context_tokens"] // out["block_size"])
        assert row["kv_requests"] == held and row["concurrent_requests"] == min(held, 256)


def test_a_plan_that_does_not_fit_names_settings_that_do(capsys):
    model, gpu, settings = CASES[1]
    out = explained(capsys, model, gpu, settings)
    assert out["fits"] is False and out["explain"]["would_fit"]
    flags = [fit["flag"] for fit in out["explain"]["would_fit"]]
    assert "-tp 4" in flags and any("--kv-cache-dtype fp8" in f for f in flags)
    assert f"--max-model-len {out['token_capacity']}" in flags           # the reason's own suggestion
    for fit in out["explain"]["would_fit"]:
        plan, _ = engine_plan(model, gpu, {**settings, **fit["settings"]})     # does not raise
        assert plan.num_blocks == fit["num_blocks"]


def test_text_labels_memory_per_gpu_under_tensor_parallelism(capsys):
    status = main(["plan", "llama-3.1-70b", "--gpu", "H100-80GB", "-tp", "2", "--explain"])
    out = capsys.readouterr().out
    assert status == 1
    assert "memory: weights (per GPU)" in out and "split over 2 GPUs" in out and "it would fit with:" in out
    assert "70.55B parameters" in out or "B parameters, weights in bfloat16" in out
