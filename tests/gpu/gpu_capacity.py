"""Shared by the GPU tests: a budget derived from the GPU they run on (or a skip naming what they need), and
`kvfit plan`'s estimate for an engine's settings next to its profile."""

from __future__ import annotations

import math
from dataclasses import replace

WARM_MARGIN_BYTES = 64 << 20     # more in use at start than a fresh process by this: earlier work in the process
# the largest share of a card a test asks for: the budget counts everything in use (the CUDA context, other
# processes), so the rest of the card stays free
MOST_UTILIZATION = 0.95


def gpu_budget(model: str, settings: dict, kv_cache_bytes: int, least_kv_bytes: int) -> dict:
    """settings with the gpu_memory_utilization that leaves `model` about kv_cache_bytes of KV cache on this GPU,
    at most MOST_UTILIZATION of it; the test is skipped, naming what it needs, where that leaves less than
    least_kv_bytes. Needed beside the KV cache: what is in use on the GPU now (the CUDA context, other processes,
    this process's earlier tests) plus `kvfit plan`'s estimate of the engine's own memory (weights, activation
    peak, memory outside torch, CUDA graphs). The tests' expectations still come from the measured reading."""
    import gc

    import pytest
    import torch

    from kvfit.config import EngineConfig
    from kvfit.model_facts import DTYPE_BYTES, load_model_facts
    from kvfit.planning import resolve_model_dtype
    from kvfit.platforms.base import Platform
    from kvfit.platforms.estimate import estimate_reading
    from kvfit.units import gib
    gc.collect()
    torch.cuda.empty_cache()           # blocks an earlier test's engine left cached are not in use
    free, total = torch.cuda.mem_get_info()
    in_use = total - free
    config = Platform().resolve_config(EngineConfig.from_kwargs(model, **{**settings, "gpu_memory_utilization": 1.0}))
    facts = load_model_facts(model, config.model.quantization)
    estimate = estimate_reading(facts, total, config.cache, config.scheduler, 1,
                                DTYPE_BYTES[resolve_model_dtype(facts, config.model.dtype)], config.model.max_model_len)
    non_kv = in_use + estimate.non_kv_bytes - estimate.in_use_at_start_bytes
    share = min(math.ceil((non_kv + kv_cache_bytes) / total * 100) / 100, MOST_UTILIZATION)
    if share * total - non_kv < least_kv_bytes:
        card = math.ceil((non_kv + least_kv_bytes) / MOST_UTILIZATION)
        pytest.skip(f"needs a GPU of {gib(card)}: {model}'s weights ({gib(estimate.weights_bytes)}), its activations, "
                    f"a KV cache of at least {gib(least_kv_bytes)} and the {gib(in_use)} in use before it, within "
                    f"{MOST_UTILIZATION:.0%} of the card; this GPU has {gib(total)}")
    print(f"\nbudget: {share} of {gib(total)} ({gib(in_use)} in use before the engine, about {gib(non_kv)} "
          "with it but without its KV cache)")
    return {**settings, "gpu_memory_utilization": share}


def estimated_blocks(model: str, settings: dict, llm) -> int:
    """The block count `kvfit plan` estimates for `model` under `settings` on this device (the measured
    total memory), printed beside the profiled reading."""
    from kvfit.config import EngineConfig
    from kvfit.kv.plan import plan_kv_cache
    from kvfit.model_facts import load_model_facts
    from kvfit.planning import spec_and_limits
    from kvfit.platforms.estimate import estimate_reading
    from kvfit.platforms.base import Platform
    config = Platform().resolve_config(EngineConfig.from_kwargs(model, **settings))    # a GPU's defaults
    facts = load_model_facts(model, settings.get("quantization"))
    spec, limits = spec_and_limits(facts, config, 2**63 - 1, "triton")
    measured = llm.engine.readings[0]
    estimate = estimate_reading(facts, measured.total_bytes, config.cache, config.scheduler, 1, 2)
    # what the device held before the engine started is the machine's state, not the plan's to predict.
    # In a warm process (earlier tests of the same pytest run: more in use at start than a fresh one) those
    # tests also loaded kernels and driver reservations the estimate counts as the engine's own non-torch
    # growth; there the outside-torch total (start + growth) is compared, so nothing is counted twice
    # (2026-12-03 suite run: 804 MB at start + 19 MB growth, against the fresh estimate's 553 + 335 MB).
    # In a fresh process the estimate's non-torch growth still stands alone against the measured one.
    warm = measured.in_use_at_start_bytes > estimate.in_use_at_start_bytes + WARM_MARGIN_BYTES
    if warm:
        outside = max(estimate.in_use_at_start_bytes + estimate.non_torch_bytes,
                      measured.in_use_at_start_bytes + measured.non_torch_bytes)
        estimate = replace(estimate, in_use_at_start_bytes=outside - estimate.non_torch_bytes)
    else:
        estimate = replace(estimate, in_use_at_start_bytes=max(estimate.in_use_at_start_bytes,
                                                               measured.in_use_at_start_bytes))
    predicted = plan_kv_cache(estimate, spec, limits).num_blocks
    print(f"\nestimated reading {estimate}\nmeasured reading {measured}\n"
          f"predicted {predicted} vs profiled {llm.capacity.num_blocks}")
    return predicted
