"""`kvfit plan MODEL`: the KV plan for a model on a GPU, estimated without the GPU.

Exit status 0: it fits; 1: it does not (with --json the plan is printed all the same, `"fits": false`
and `"reason"`; without, the reason is one `error:` line); 2: a user mistake.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from kvfit import catalog
from kvfit.attention.registry import backend_max_offset
from kvfit.config import EngineConfig
from kvfit.planning import resolve_model_dtype, spec_and_limits
from kvfit.kv.plan import KVPlan, MemoryReading, assess_kv_cache
from kvfit.kv.report import plan_table
from kvfit.model_facts import DTYPE_BYTES, ModelFacts, load_model_facts
from kvfit.platforms.base import Platform
from kvfit.platforms.estimate import estimate_reading
from kvfit.units import parse_bytes

DOES_NOT_FIT = 1       # exit status when the model does not fit (2 is a user mistake)


def register(sub) -> None:
    from kvfit.commands.flags import add_capacity_flags, add_model_argument
    p = sub.add_parser("plan", help="plan the KV cache of MODEL on a GPU (no GPU needed)")
    add_model_argument(p, f"a catalog name ({', '.join(catalog.MODELS)})")
    p.add_argument("--gpu", default=None, help=f"one of {', '.join(catalog.GPUS)} (default: H200)")
    p.add_argument("--device-memory", default=None,
                   help="device memory with a unit, e.g. 80GiB, instead of --gpu (default: --gpu's)")
    p.add_argument("--json", action="store_true",
                   help='print the plan as one JSON object, also when it does not fit ("fits": false, "reason")')
    p.add_argument("--explain", action="store_true",
                   help="also: requests at several context lengths, the binding limit, what each lever "
                        "(--gpu-memory-utilization +-0.05, fp8 KV, -tp x 2, --max-model-len, --max-num-seqs) "
                        "would change, and for a plan that does not fit the settings that would (with --json: "
                        'an "explain" object)')
    add_capacity_flags(p)
    p.set_defaults(run=run)


def _device(args) -> tuple[int, str]:
    if args.device_memory is not None:
        return parse_bytes(args.device_memory, "--device-memory"), "custom"
    name = args.gpu or "H200"
    return catalog.gpu_total_bytes(name), name


def _estimate(facts: ModelFacts, total: int, config: EngineConfig, dtype_bytes, max_model_len: int) -> MemoryReading:
    return estimate_reading(facts, total, config.cache, config.scheduler, config.parallel.tensor_parallel_size,
                            dtype_bytes, max_model_len)


def plan_of(config: EngineConfig, facts: ModelFacts, total: int, backend: str) -> KVPlan:
    """The plan `kvfit plan` prints for these settings: the estimated reading through assess_kv_cache (the
    engine's plan_kv_cache, returning a plan that does not fit instead of raising). --explain's levers too."""
    spec, limits = spec_and_limits(facts, config, backend_max_offset(backend), backend)
    dtype = config.model.dtype
    dtype_bytes = None if dtype == "auto" else DTYPE_BYTES[resolve_model_dtype(facts, dtype)]
    reading = _estimate(facts, total, config, dtype_bytes, limits.max_model_len)
    return assess_kv_cache(reading, spec, limits, config.parallel.tensor_parallel_size)


def weights_dtype(config: EngineConfig, facts: ModelFacts) -> str:
    """The weights' dtype as the plan's title says it: fp8 and its scheme, or the 16-bit dtype."""
    dtype = config.model.dtype
    return facts.quantization.describe() if facts.quantization else facts.torch_dtype if dtype == "auto" else dtype


def explain(config: EngineConfig, facts: ModelFacts, total: int, backend: str, plan: KVPlan) -> dict:
    """--explain's data: every number from plan_of, the lever's one setting changed."""
    from kvfit.commands.explain import explanation
    settings = {f.name: getattr(getattr(config, section), f.name)
                for section in ("model", "cache", "scheduler", "parallel", "device")
                for f in dataclasses.fields(getattr(config, section))}

    def plan_with(changed: dict) -> KVPlan:
        flat = dict(changed)
        return plan_of(EngineConfig.from_kwargs(flat.pop("model"), **flat), facts, total, backend)
    return explanation(settings, plan, plan_with, facts.context_len,
                       {"num_params": facts.num_params, "weight_dtype": weights_dtype(config, facts)})


def run(args) -> int:
    from kvfit.commands.flags import engine_kwargs
    kwargs = engine_kwargs(args)
    kwargs.pop("attention_backend", None)
    config = EngineConfig.from_kwargs(args.model, **kwargs)     # a missing model is the first error
    config = Platform().resolve_config(config)                  # a GPU's defaults (--max-num-batched-tokens)
    facts = load_model_facts(config.model.model, config.model.quantization)
    total, device_name = _device(args)
    backend = args.attention_backend or "triton"
    plan = plan_of(config, facts, total, backend)
    explained = explain(config, facts, total, backend, plan) if args.explain else None
    tp = config.parallel.tensor_parallel_size
    if args.json:
        extra = {"explain": explained} if explained is not None else {}
        print(json.dumps({**plan.to_dict(), "model": args.model, "device": device_name,
                          "device_memory_bytes": total, **extra}))
        return 0 if plan.fits else DOES_NOT_FIT
    if plan.fits or explained is not None:
        per_gpu = " per GPU" if tp > 1 else ""
        print(plan_table(plan, f"kvfit plan: {args.model} on {device_name} ({total:,} bytes{per_gpu}), "
                               f"tensor parallel {tp}, weights {weights_dtype(config, facts)}, "
                               "memory estimated"))
    if explained is not None:
        from kvfit.commands.explain import explanation_text
        print(explanation_text(explained, plan))
    if not plan.fits:
        sys.stderr.write(f"error: {plan.reason}\n")
    return 0 if plan.fits else DOES_NOT_FIT
