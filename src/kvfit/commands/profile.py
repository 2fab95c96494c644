"""`kvfit profile MODEL`: load, profile, plan and allocate on the device; print what was measured."""

from __future__ import annotations

import dataclasses
import json

from kvfit.errors import ConfigError
from kvfit.units import gib


def register(sub) -> None:
    from kvfit.commands.flags import add_engine_flags, add_model_argument
    p = sub.add_parser("profile", help="measure the memory breakdown and the KV plan on a device")
    add_model_argument(p, "a catalog name with --load-format dummy")
    p.add_argument("--json", action="store_true", help="the plan and the measured parts as one JSON object")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="draw the breakdown as a stacked bar into this PNG (needs matplotlib; default: no plot)")
    add_engine_flags(p)
    p.set_defaults(run=run)


def engine_platform(engine):
    """The engine's platform (rank 0's), or for an engine that names only its device, that device's."""
    platform = getattr(engine, "platform", None)
    if platform is None:
        from kvfit.platforms import get_platform
        platform = get_platform(engine.device_name)
    return platform


def measured_breakdown(engine, platform) -> dict:
    """The measured parts of the device memory after start-up (rank 0), in bytes."""
    r = engine.readings[0]
    free_after = platform.free_device_bytes()      # None where the device does not report it
    parts = {"total_bytes": r.total_bytes, "budget_bytes": r.budget_bytes, "weights_bytes": r.weights_bytes,
             "activation_peak_bytes": r.activation_peak_bytes, "non_torch_bytes": r.non_torch_bytes,
             "cuda_graph_bytes": r.cuda_graph_bytes, "in_use_at_start_bytes": r.in_use_at_start_bytes,
             "kv_cache_bytes": engine.plan.kv_cache_bytes, "free_after_allocation_bytes": free_after,
             "co_tenants": [{"pid": pid, "name": name, "bytes": used} for pid, name, used in r.co_tenants]}
    if len(engine.readings) > 1:
        parts["per_rank_readings"] = [dataclasses.asdict(x) for x in engine.readings]
    return parts


def import_pyplot():
    """matplotlib's pyplot (headless); without matplotlib, the one-line --plot error."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install matplotlib (or kvfit[plot])") from None
    return plt


def plot_breakdown(parts: dict, path: str, title: str) -> None:
    plt = import_pyplot()
    names = ["in_use_at_start", "weights", "activation_peak", "non_torch", "cuda_graph", "kv_cache"]
    values = [parts[f"{n}_bytes"] / 2**30 for n in names]
    free = parts["free_after_allocation_bytes"]
    if free is not None:
        names.append("free")
        values.append(free / 2**30)
    fig, ax = plt.subplots(figsize=(4, 6))
    bottom = 0.0
    for name, value in zip(names, values):
        ax.bar([0], [value], bottom=[bottom], label=f"{name}: {value:.2f} GiB")
        bottom += value
    ax.axhline(parts["total_bytes"] / 2**30, color="k", linestyle="--", label="total")
    ax.set_ylabel("GiB")
    ax.set_xticks([])
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.savefig(path, bbox_inches="tight", dpi=120)
    plt.close(fig)


def run(args) -> int:
    from kvfit.commands.flags import engine_kwargs
    from kvfit.commands.common import engine_startup, setup_logging
    from kvfit.config import EngineConfig
    setup_logging()
    config = EngineConfig.from_kwargs(args.model, **engine_kwargs(args))   # a missing model is the first error
    if args.plot:
        import_pyplot()      # before minutes of loading and profiling, not after
    from kvfit.engine.llm_engine import LLMEngine
    with engine_startup(config):
        engine = LLMEngine(config)
    try:
        platform = engine_platform(engine)
        device = platform.name
        parts = measured_breakdown(engine, platform)
        plan = engine.plan
        if args.plot:
            plot_breakdown(parts, args.plot, f"{args.model}: {plan.num_blocks} blocks, bound by {plan.bound_by}")
        if args.json:
            print(json.dumps({**plan.to_dict(), "model": args.model, "device": device,
                              "measured": parts}))
            return 0
        print(f"kvfit profile: {args.model} on {device}")
        for key, value in parts.items():
            if isinstance(value, int):
                print(f"  {key.removesuffix('_bytes'):<24} {gib(value):>12}  ({value:,} bytes)")
        print(f"  num_blocks               {plan.num_blocks:,} (bound by {plan.bound_by}), "
              f"token capacity {plan.token_capacity:,}")
        for line in plan.co_tenants:     # other processes on the device that cost blocks (NVML)
            print(f"  co-tenant                {line}")
    finally:
        engine.shutdown()
    return 0
