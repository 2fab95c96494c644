"""Helpers for the tensor-parallel tests: engine settings and process checks through /proc."""

from __future__ import annotations

import time

# a small explicit KV budget (never the CPU default, a share of RAM): 4096 blocks at most per rank
ENGINE_KWARGS = dict(device="cpu", dtype="float32", block_size=4, max_model_len=128, kv_cache_memory="4MiB")


def process_gone(pid: int) -> bool:
    """True when pid no longer runs: no /proc entry, or a zombie waiting for its reaper."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def all_gone(pids, timeout_s: float = 10.0) -> bool:
    """Wait up to timeout_s for every pid to be gone."""
    deadline = time.monotonic() + timeout_s
    while True:
        if all(process_gone(pid) for pid in pids):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def rank_pids(llm) -> list[int]:
    """Process ids of ranks 1..N-1 of an LLM's engine."""
    return llm.engine.workers.pids


def rank_exit_codes(workers) -> list[int | None]:
    """Exit codes of ranks 1..N-1 of a TensorParallelWorkers (0: stopped when told to; -9: killed)."""
    return [p.exitcode for p in workers._ranks.procs]
