"""The capacity report: one log line, a readable table, and the plan as JSON. No torch."""

from __future__ import annotations

import json
import os

from kvfit.errors import ConfigError
from kvfit.kv.plan import KVPlan
from kvfit.units import gib


def plan_table(plan: KVPlan, title: str) -> str:
    """A readable table of the plan, every limit and the memory parts it came from."""
    def num(value):
        return "-" if value is None else f"{value:,}"
    r = plan.reading
    per = " (per GPU)" if plan.tensor_parallel_size > 1 else ""      # readings and bytes are one rank's
    rows = [
        ("num_blocks", f"{plan.num_blocks:,}  (bound by {plan.bound_by})"),
        ("block_size", f"{plan.block_size} tokens"),
        ("bytes_per_block" + per, f"{plan.bytes_per_block:,}"),
        ("kv_cache" + per, f"{gib(plan.kv_cache_bytes)} of {gib(plan.available_kv_bytes)} available"),
        ("token_capacity", f"{plan.token_capacity:,}"),
        ("max_model_len", f"{plan.max_model_len:,} tokens{plan.auto_note()}"),
        ("max_concurrency", f"{plan.max_concurrency:.2f} requests of {plan.max_model_len:,} tokens"),
        ("kv_heads_per_rank", f"{plan.kv_heads_per_rank} (tensor parallel {plan.tensor_parallel_size})"),
        ("kv_cache_dtype", plan.kv_cache_dtype),
        ("limit: memory", num(plan.limits["memory"])),
        ("limit: override", num(plan.limits["override"])),
        ("limit: max_num_blocks", num(plan.limits["max_num_blocks"])),
        ("limit: index_width", f"{num(plan.limits['index_width'])} ({plan.backend}, offsets <= {plan.max_element_offset:,})"),
        ("memory: total" + per, gib(r["total_bytes"])),
        ("memory: budget" + per, gib(r["budget_bytes"])),
        ("memory: weights" + per, gib(r["weights_bytes"])),
        ("memory: activation peak" + per, gib(r["activation_peak_bytes"])),
        ("memory: non-torch" + per, gib(r["non_torch_bytes"])),
        ("memory: CUDA graphs" + per, gib(r["cuda_graph_bytes"])),
        ("memory: in use at start" + per, gib(r["in_use_at_start_bytes"])),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [title] + [f"  {k.ljust(width)}  {v}" for k, v in rows]
    lines += [f"  warning: {w}" for w in plan.warnings]
    return "\n".join(lines)


def write_plan_json(plan: KVPlan, path: str, extra: dict | None = None) -> None:
    """Write the whole plan as one JSON object; an unwritable path is a ConfigError."""
    payload = {**plan.to_dict(), **(extra or {})}
    try:
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(payload, fh, indent=2)
            fh.write("\n")
    except OSError as exc:
        raise ConfigError(f"cannot write the KV plan to {path}: {exc.strerror}; pass a writable --plan-json path") from None
