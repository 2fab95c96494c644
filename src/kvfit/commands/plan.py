"""`kvfit plan MODEL`: the KV plan for a model on a GPU, estimated without the GPU."""

from __future__ import annotations

import json

from kvfit import catalog
from kvfit.attention.registry import backend_max_offset
from kvfit.config import EngineConfig
from kvfit.planning import spec_and_limits
from kvfit.kv.plan import plan_kv_cache
from kvfit.kv.report import plan_table
from kvfit.model_facts import DTYPE_ALIASES, DTYPE_BYTES, load_model_facts
from kvfit.platforms.estimate import estimate_reading
from kvfit.units import parse_bytes


def register(sub) -> None:
    from kvfit.commands.flags import add_capacity_flags
    p = sub.add_parser("plan", help="plan the KV cache of MODEL on a GPU (no GPU needed)")
    p.add_argument("model", metavar="MODEL", help="model folder, config.json, or catalog name")
    p.add_argument("--gpu", default=None, help=f"one of {', '.join(catalog.GPUS)} (default H200)")
    p.add_argument("--device-memory", default=None, help="device memory instead of --gpu, e.g. 80GiB")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    add_capacity_flags(p)
    p.set_defaults(run=run)


def run(args) -> int:
    from kvfit.commands.flags import engine_kwargs
    facts = load_model_facts(args.model)
    if args.device_memory is not None:
        total, device_name = parse_bytes(args.device_memory, "--device-memory"), "custom"
    else:
        device_name = args.gpu or "H200"
        total = catalog.gpu_total_bytes(device_name)
    kwargs = engine_kwargs(args)
    kwargs.pop("attention_backend", None)
    config = EngineConfig.from_kwargs(args.model, **kwargs)
    backend = args.attention_backend or "triton"
    spec, limits = spec_and_limits(facts, config, backend_max_offset(backend), backend)
    dtype = config.model.dtype
    dtype_bytes = None if dtype == "auto" else DTYPE_BYTES[DTYPE_ALIASES[dtype.lower()]]
    reading = estimate_reading(facts, total, config.cache, config.scheduler,
                               config.parallel.tensor_parallel_size, dtype_bytes, limits.max_model_len)
    plan = plan_kv_cache(reading, spec, limits, config.parallel.tensor_parallel_size)
    if args.json:
        print(json.dumps({**plan.to_dict(), "model": args.model, "device": device_name,
                          "device_memory_bytes": total}))
    else:
        print(plan_table(plan, f"kvfit plan: {args.model} on {device_name} ({total:,} bytes), "
                               f"tensor parallel {config.parallel.tensor_parallel_size}, memory estimated"))
    return 0



