"""Shared by the scheduler tests: a small scheduler, requests, a deterministic fake runner.

`Scheduler` here is the engine's scheduler with the rest of the engine's request path around it,
so test bodies read as before: add() runs the engine's admission check; schedule() returns the
StepDelta together with the per-sequence view a runner rebuilds from it (`RunnerMirror`, the
contract in plain Python: new requests once, then token counts and appended block ids); update()
applies the sampled tokens and the engine's one finish decision (OutputProcessor.finish_reason).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfit.engine.admission import check_request
from kvfit.engine.output_processor import OutputProcessor
from kvfit.engine.request import Request
from kvfit.engine.scheduler import Scheduler as EngineScheduler
from kvfit.errors import RequestError
from kvfit.kv.manager import KVCacheManager
from kvfit.kv.pool import BlockPool
from kvfit.sampling_params import SamplingParams
from kvfit.step import StepDelta


@dataclass(frozen=True)
class ScheduledSeq:
    """One request's share of a step, as the runner sees it after applying the delta."""

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_ids: tuple[int, ...]
    sample: bool
    num_generated: int
    num_steps: int = 1


@dataclass(frozen=True)
class StepPlan:
    delta: StepDelta
    seqs: tuple[ScheduledSeq, ...]

    @property
    def preempted_ids(self):
        return self.delta.preempted_ids

    @property
    def num_tokens(self) -> int:
        return self.delta.num_tokens

    @property
    def empty(self) -> bool:
        return self.delta.empty

    @property
    def num_steps(self) -> int:
        return self.delta.max_num_steps


class RunnerMirror:
    """What the runner's persistent batch keeps, in plain Python: tables and tokens per request."""

    def __init__(self):
        self.tables: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.prompt_len: dict[str, int] = {}
        self.computed: dict[str, int] = {}

    def apply(self, delta: StepDelta) -> tuple[ScheduledSeq, ...]:
        for request_id in delta.removed_ids:
            for d in (self.tables, self.tokens, self.prompt_len, self.computed):
                d.pop(request_id, None)
        for new in delta.new_requests:
            assert new.request_id not in self.tables, "a request sent twice without being removed"
            self.tables[new.request_id] = list(new.block_ids)
            self.tokens[new.request_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
            self.prompt_len[new.request_id] = len(new.prompt_token_ids)
            self.computed[new.request_id] = new.num_computed_tokens
        seqs = []
        for i, request_id in enumerate(delta.request_ids):
            self.tables[request_id].extend(delta.new_block_ids[i])
            start, n = self.computed[request_id], delta.num_scheduled_tokens[i]
            tokens = self.tokens[request_id]
            seqs.append(ScheduledSeq(request_id, tuple(tokens[start:start + n]), start,
                                     tuple(self.tables[request_id]), start + n == len(tokens),
                                     len(tokens) - self.prompt_len[request_id], delta.steps_of(i)))
            self.computed[request_id] = start + n + delta.steps_of(i) - 1
        return tuple(seqs)

    def record(self, request_id: str, token: int) -> None:
        if request_id in self.tokens:
            self.tokens[request_id].append(token)


class Scheduler(EngineScheduler):
    """The engine's scheduler with admission, the runner's view and the finish decision around it."""

    def __init__(self, kv: KVCacheManager, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int):
        super().__init__(kv, max_model_len, max_num_seqs, max_num_batched_tokens)
        self.mirror = RunnerMirror()
        self.processor = OutputProcessor(None)

    def add(self, request: Request) -> None:
        request.max_total_tokens = check_request(request.prompt_token_ids, request.params, 10**9, self.max_model_len,
                                                 self.block_size, self.pool.num_blocks)
        if request.request_id in self.requests:
            raise RequestError(f"request id {request.request_id!r} is already in use")
        super().add(request)
        self.processor.add(request, None)

    def schedule(self, num_steps: int = 1) -> StepPlan:
        delta = super().schedule(num_steps)
        return StepPlan(delta, self.mirror.apply(delta))

    def update(self, plan: StepPlan, sampled: dict[str, int], step: int = 0) -> list[Request]:
        finished = []
        for req in super().update(plan.delta, sampled, step):
            self.mirror.record(req.request_id, req.token_ids[-1])
            reason = self.processor.finish_reason(req)
            if reason is not None:
                self.finish(req.request_id, reason)
                finished.append(req)
        return finished

    def finish(self, request_id: str, reason: str):
        self.processor.drop(request_id)
        return super().finish(request_id, reason)


EOS = 7


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_model_len: int = 64, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 64, prefix_caching: bool = False) -> Scheduler:
    pool = BlockPool(num_blocks, enable_prefix_caching=prefix_caching)
    return Scheduler(KVCacheManager(pool, block_size), max_model_len, max_num_seqs, max_num_batched_tokens)


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
    for req in sched.running:       # the runner's tables, rebuilt from deltas alone, are the scheduler's
        assert sched.mirror.tables[req.request_id] == list(sched.block_ids(req.request_id))
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
