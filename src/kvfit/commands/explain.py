"""`kvfit plan --explain`: why the KV cache is this size and what each flag would change.

Every number comes from `plan_of` (commands/plan.py): the same estimate and `assess_kv_cache` (kv/plan.py,
the engine's `plan_kv_cache` without the raise) that the plan itself prints. A lever is the settings with one
flag changed, planned again; nothing here recomputes blocks, bytes or concurrency by another formula.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvfit.errors import KvfitError
from kvfit.kv.plan import KVPlan
from kvfit.kv.spec import num_blocks_for_tokens
from kvfit.units import gib

CONTEXT_LENGTHS = (1024, 4096, 8192, 32768, 131072)      # rows of the table, up to --max-model-len
MAX_TP = 8                                               # a plan that does not fit tries -tp up to this


@dataclass(frozen=True)
class Lever:
    """One flag changed: the plan it gives (None and why where the settings are refused)."""

    flag: str                    # as typed, e.g. "--kv-cache-dtype fp8"
    settings: dict               # the config settings it changes
    plan: KVPlan | None
    refused: str | None = None


def requests_at(plan: KVPlan, num_tokens: int) -> int:
    """Whole requests of num_tokens tokens the plan's blocks hold at once."""
    return plan.num_blocks // num_blocks_for_tokens(num_tokens, plan.block_size)


def context_rows(plan: KVPlan, max_num_seqs: int) -> list[dict]:
    """Per context length (up to max_model_len): requests the KV cache holds, and of them how many run at once
    (--max-num-seqs caps the batch)."""
    lengths = sorted({n for n in CONTEXT_LENGTHS if n < plan.max_model_len} | {plan.max_model_len})
    return [{"context_tokens": n, "kv_requests": requests_at(plan, n),
             "concurrent_requests": min(requests_at(plan, n), max_num_seqs)} for n in lengths]


def binding(plan: KVPlan, max_num_seqs: int) -> str:
    """What limits concurrency at max_model_len, in words."""
    kv = requests_at(plan, plan.max_model_len)
    if not plan.fits:
        return f"nothing runs: {plan.reason}"
    if kv >= max_num_seqs:
        return (f"--max-num-seqs {max_num_seqs}: the KV cache holds {kv:,} requests of {plan.max_model_len:,} "
                f"tokens, more than the batch may run")
    return (f"the KV cache ({plan.bound_by}): {plan.num_blocks:,} blocks hold {kv:,} requests of "
            f"{plan.max_model_len:,} tokens")


def lever_settings(settings: dict, plan: KVPlan, model_max_len: int) -> list[tuple[str, dict]]:
    """(flag, changed settings) of each lever from `settings` (the plan's own)."""
    util = settings["gpu_memory_utilization"]
    tp = settings["tensor_parallel_size"]
    seqs = settings["max_num_seqs"]
    out = []
    if settings.get("kv_cache_memory") is None:
        for step in (+0.05, -0.05):
            value = round(util + step, 2)
            if 0 < value <= 1:
                out.append((f"--gpu-memory-utilization {value}", {"gpu_memory_utilization": value}))
    if not plan.kv_cache_dtype.startswith("fp8"):
        out.append(("--kv-cache-dtype fp8", {"kv_cache_dtype": "fp8"}))
    out.append((f"-tp {tp * 2}", {"tensor_parallel_size": tp * 2}))
    for length in (plan.max_model_len // 2, plan.max_model_len * 2):
        if 0 < length <= model_max_len and length != plan.max_model_len:
            out.append((f"--max-model-len {length}", {"max_model_len": length}))
    for value in (seqs // 2, seqs * 2):
        if value >= 1:
            out.append((f"--max-num-seqs {value}", {"max_num_seqs": value}))
    return out


def levers(settings: dict, plan: KVPlan, plan_of: Callable[[dict], KVPlan], model_max_len: int) -> list[Lever]:
    """Each lever planned: plan_of(settings with the change)."""
    out = []
    for flag, change in lever_settings(settings, plan, model_max_len):
        try:
            out.append(Lever(flag, change, plan_of({**settings, **change})))
        except KvfitError as exc:            # e.g. more ranks than KV heads: the flag itself is refused
            out.append(Lever(flag, change, None, str(exc)))
    return out


def fitting_settings(settings: dict, plan: KVPlan, plan_of: Callable[[dict], KVPlan],
                     model_max_len: int) -> list[Lever]:
    """For a plan that does not fit: settings that would (each a Lever whose plan fits), smallest change first:
    the longest --max-model-len the cache holds, fp8 KV, more ranks, both."""
    tries = []
    if plan.num_blocks > 0:
        tries.append({"max_model_len": plan.num_blocks * plan.block_size})
    tp = settings["tensor_parallel_size"]
    more_tp = [tp * 2 ** k for k in range(1, 4) if tp * 2 ** k <= MAX_TP]
    if not plan.kv_cache_dtype.startswith("fp8"):
        tries.append({"kv_cache_dtype": "fp8"})
    tries += [{"tensor_parallel_size": n} for n in more_tp]
    if not plan.kv_cache_dtype.startswith("fp8"):
        tries += [{"kv_cache_dtype": "fp8", "tensor_parallel_size": n} for n in more_tp]
    found = []
    while tries:
        change = tries.pop(0)
        try:
            candidate = plan_of({**settings, **change})
        except KvfitError:
            continue
        if candidate.fits and candidate.max_model_len <= model_max_len:
            found.append(Lever(_flags(change), change, candidate))
        elif candidate.num_blocks > 0 and "max_model_len" not in change:
            # more blocks, still short of one request: with the longest length they hold
            tries.append({**change, "max_model_len": candidate.num_blocks * candidate.block_size})
    return found


def _flags(change: dict) -> str:
    names = {"max_model_len": "--max-model-len", "kv_cache_dtype": "--kv-cache-dtype",
             "tensor_parallel_size": "-tp", "gpu_memory_utilization": "--gpu-memory-utilization",
             "max_num_seqs": "--max-num-seqs"}
    return " ".join(f"{names[k]} {v}" for k, v in change.items())


def explanation(settings: dict, plan: KVPlan, plan_of: Callable[[dict], KVPlan], model_max_len: int,
                facts_line: dict) -> dict:
    """Everything --explain shows, as plain data (the --json form)."""
    seqs = settings["max_num_seqs"]
    at_max = requests_at(plan, plan.max_model_len)

    def lever_dict(lever: Lever) -> dict:
        if lever.plan is None:
            return {"flag": lever.flag, "settings": lever.settings, "refused": lever.refused}
        p = lever.plan
        kv_requests = requests_at(p, p.max_model_len)
        concurrent = min(kv_requests, lever.settings.get("max_num_seqs", seqs))
        return {"flag": lever.flag, "settings": lever.settings, "fits": p.fits, "num_blocks": p.num_blocks,
                "blocks_change": p.num_blocks - plan.num_blocks, "max_model_len": p.max_model_len,
                "kv_requests": kv_requests, "concurrent_requests": concurrent,
                "concurrency_change": concurrent - min(at_max, seqs),
                "per_gpu_kv_cache_bytes": p.kv_cache_bytes, "tensor_parallel_size": p.tensor_parallel_size}
    out = {**facts_line, "binding": binding(plan, seqs), "contexts": context_rows(plan, seqs),
           "levers": [lever_dict(lv) for lv in levers(settings, plan, plan_of, model_max_len)]}
    if not plan.fits:
        out["would_fit"] = [lever_dict(lv) for lv in fitting_settings(settings, plan, plan_of, model_max_len)]
    return out


def explanation_text(data: dict, plan: KVPlan) -> str:
    """The explanation as lines under the plan's table."""
    tp = plan.tensor_parallel_size
    lines = [f"  model: {data['num_params'] / 1e9:.2f}B parameters, weights in {data['weight_dtype']}"
             + (f", split over {tp} GPUs (memory lines are per GPU; blocks span all GPUs)" if tp > 1 else ""),
             f"  binding: {data['binding']}", "", "  context tokens   requests the KV cache holds   run at once"]
    for row in data["contexts"]:
        lines.append(f"  {row['context_tokens']:>14,}   {row['kv_requests']:>27,}   {row['concurrent_requests']:>11,}")
    lines += ["", "  what a flag would change (blocks; requests of max_model_len run at once; KV cache):"]
    lines += ["  " + _lever_line(lever) for lever in data["levers"]]
    if "would_fit" in data:
        lines.append("")
        if data["would_fit"]:
            lines.append("  it would fit with:")
            lines += ["  " + _lever_line(lever) for lever in data["would_fit"]]
        else:
            lines.append(f"  no single lever makes it fit (tried --max-model-len, fp8 KV, -tp up to {MAX_TP})")
    return "\n".join(lines)


def _lever_line(lever: dict) -> str:
    if "refused" in lever:
        return f"  {lever['flag']:<34} refused: {lever['refused']}"
    if not lever["fits"]:
        return f"  {lever['flag']:<34} {lever['num_blocks']:>10,} blocks ({lever['blocks_change']:+,}): does not fit"
    return (f"  {lever['flag']:<34} {lever['num_blocks']:>10,} blocks ({lever['blocks_change']:+,}), "
            f"{lever['concurrent_requests']:,} at once of {lever['max_model_len']:,} tokens "
            f"({lever['concurrency_change']:+,}), KV {gib(lever['per_gpu_kv_cache_bytes'])}"
            + (" per GPU" if lever["tensor_parallel_size"] > 1 else ""))
