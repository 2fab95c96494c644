"""Shared by the scheduler tests: a small scheduler, requests, a deterministic fake runner."""

from __future__ import annotations

import pytest

from kvfit.engine.request import Request, RequestStatus
from kvfit.engine.sampling_params import SamplingParams
from kvfit.engine.scheduler import Scheduler
from kvfit.engine.step_plan import StepPlan
from kvfit.errors import RequestError
from kvfit.kv.pool import BlockPool

EOS = 7


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_model_len: int = 64, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 64, prefix_caching: bool = False) -> Scheduler:
    pool = BlockPool(num_blocks, enable_prefix_caching=prefix_caching)
    return Scheduler(pool, block_size, max_model_len, max_num_seqs, max_num_batched_tokens)


def make_request(request_id: str, prompt, eos=(), **params) -> Request:
    params.setdefault("max_tokens", 4)
    return Request(request_id=request_id, prompt_token_ids=list(prompt), params=SamplingParams(**params),
                   eos_token_ids=tuple(eos))


def fake_token(request_id: str, num_generated: int) -> int:
    """Deterministic in (request_id, num_generated); always >= 100, so never EOS or a prompt token."""
    return 100 + (sum(map(ord, request_id)) * 31 + num_generated * 17) % 997


def step(sched: Scheduler, token=fake_token) -> tuple[StepPlan, list[Request]]:
    plan = sched.schedule()
    sampled = {s.request_id: token(s.request_id, s.num_generated) for s in plan.seqs if s.sample}
    finished = sched.update(plan, sampled)
    sched.pool.check_invariants()
    return plan, finished


def run_to_end(sched: Scheduler, token=fake_token, max_steps: int = 500) -> list[StepPlan]:
    plans = []
    while sched.num_unfinished:
        assert len(plans) < max_steps, "the scheduler did not finish"
        plans.append(step(sched, token)[0])
    return plans


def shape(plan: StepPlan) -> list[tuple[str, int, int, bool]]:
    """(request id, start_pos, number of tokens, sample) per scheduled seq."""
    return [(s.request_id, s.start_pos, len(s.token_ids), s.sample) for s in plan.seqs]


def assert_all_blocks_back(sched: Scheduler) -> None:
    pool = sched.pool
    assert pool.num_used_blocks == 0
    assert pool.num_free_blocks + pool.num_cached_blocks == pool.num_blocks
    pool.check_invariants()

def tiny_scheduler(num_blocks: int, prefix_caching: bool = False) -> Scheduler:
    sched = make_scheduler(num_blocks=num_blocks, block_size=2, max_model_len=8, prefix_caching=prefix_caching)
    for rid in "ab":
        sched.add(make_request(rid, [1, 2, 3], max_tokens=5))
    return sched
