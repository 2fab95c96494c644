"""Continuous batching policy: who runs, chunked prefill, preemption by recompute, multi-step rounds.

Each step: running requests first (oldest first), each takes its next tokens (1 for decode, a
chunk for a prefill in progress) within max_num_batched_tokens; when no block is free the newest
running request is preempted (blocks freed, recomputed later). Then waiting requests are admitted
while tokens, sequence slots and blocks last. A request that fits the cache alone always makes
progress, so the loop never deadlocks.

The mechanism (block tables, prefix cache) is the KVCacheManager's; what the runner needs to know
leaves as a StepDelta (kvfit/step.py). Whether a request is finished is not decided here: the
engine's output processor decides and calls finish().
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from kvfit.engine.request import Request, RequestStatus
from kvfit.kv.manager import KVCacheManager
from kvfit.step import NewRequest, StepDelta


class _Scheduled:
    """One request's share of the step being built (mutable until the delta is made)."""

    __slots__ = ("req", "num_tokens", "new_blocks", "is_new", "num_steps")

    def __init__(self, req: Request, num_tokens: int, new_blocks: list[int], is_new: bool):
        self.req, self.num_tokens, self.new_blocks, self.is_new = req, num_tokens, new_blocks, is_new
        self.num_steps = 1


class Scheduler:
    """Owns the waiting/running queues; asks the KVCacheManager for blocks."""

    def __init__(self, kv: KVCacheManager, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.block_size = kv.block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_prefix_queries = 0      # prompt tokens looked up in the prefix cache
        self.num_prefix_hits = 0         # of those, tokens found
        self._finished_ids: list[str] = []   # ended since the last delta: the runner drops their rows
        # request id -> its committed block count before the last schedule() cached its step's blocks
        self._unrun_commits: dict[str, int] = {}

    @property
    def pool(self):
        return self.kv.pool

    def add(self, request: Request) -> None:
        """Queue a request the engine's admission check accepted."""
        assert request.request_id not in self.requests, "admission checks ids"
        assert 0 < request.num_prompt_tokens < request.max_total_tokens <= self.max_model_len, "admission checks lengths"
        self.requests[request.request_id] = request
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def block_ids(self, request_id: str):
        return self.kv.block_ids(request_id)

    # one step -----------------------------------------------------------------------------------
    def schedule(self, num_steps: int = 1) -> StepDelta:
        """The next step; with num_steps > 1 an all-decode step may become a multi-step round."""
        self._unrun_commits = {}
        budget = self.max_num_batched_tokens
        scheduled: list[_Scheduled] = []
        preempted: list[str] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            new_blocks = self.kv.grow(req.request_id, req.num_computed_tokens + num_new)
            if new_blocks is None:
                victim = self.running.pop()          # newest running request
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
                continue
            scheduled.append(_Scheduled(req, num_new, new_blocks, is_new=False))
            self._commit_scheduled(req, req.num_computed_tokens + num_new)
            budget -= num_new
            i += 1
        if not preempted:
            self._admit(scheduled, budget)
            if num_steps > 1:
                self._multi_step(scheduled, num_steps)
        return self._delta(scheduled, preempted)

    def _commit_scheduled(self, req: Request, num_tokens: int) -> None:
        """Cache the full blocks among the request's first num_tokens now, before the step computes them
        (vLLM caches at allocation): a request admitted behind this one in the same step finds a prompt
        prefix they share instead of computing a copy (every layer writes the step's K/V before it
        attends). Until the step has run (update), forget_unrun_commits can take them back."""
        self._unrun_commits.setdefault(req.request_id, self.kv.num_committed_blocks(req.request_id))
        self.kv.commit(req.request_id, req.token_ids, num_tokens)

    def forget_unrun_commits(self, request_id: str | None = None) -> None:
        """The last scheduled step failed before it ran: the blocks it cached hold no K/V, so their
        hashes go (the engine then ends its requests). With a request id: only that request's (its
        logits were not finite, so neither may its K/V be), before the step is applied."""
        for rid in [request_id] if request_id is not None else list(self._unrun_commits):
            keep = self._unrun_commits.pop(rid, None)
            if keep is not None:
                self.kv.uncommit(rid, keep)

    def _multi_step(self, scheduled: list[_Scheduled], num_steps: int) -> None:
        """Give every request of an all-decode step up to num_steps decode steps (never past its
        max_tokens), with blocks for all of them allocated now. The step stays single when a
        waiting request could be admitted instead, or when the blocks are not all free (no request
        is preempted to make room for tokens that may never be needed)."""
        if not scheduled or (self.waiting and len(self.running) < self.max_num_seqs):
            return
        if any(s.num_tokens != 1 or s.req.num_computed_tokens + 1 != s.req.num_tokens for s in scheduled):
            return
        steps = [1 if s.req.single_step else max(1, min(num_steps, s.req.max_total_tokens - s.req.num_tokens))
                 for s in scheduled]
        if max(steps) == 1:
            return
        grown = self._grow_all([(s.req, s.req.num_computed_tokens + n) for s, n in zip(scheduled, steps)])
        if grown is None:
            return
        for s, n, blocks in zip(scheduled, steps, grown):
            s.new_blocks.extend(blocks)
            s.num_steps = n

    def _grow_all(self, targets: list[tuple[Request, int]]) -> list[list[int]] | None:
        """Tables grown to cover each (request, tokens) target, all or none: the new block ids of each,
        or None (nothing allocated) when the pool cannot give them all without preempting."""
        need = sum(self.kv.num_blocks_short(req.request_id, num_tokens) for req, num_tokens in targets)
        if need > self.pool.num_allocatable_blocks:
            return None
        grown = [self.kv.grow(req.request_id, num_tokens) for req, num_tokens in targets]
        assert all(blocks is not None for blocks in grown), "blocks counted free above"
        return grown

    def schedule_continuation(self, prev: StepDelta, num_steps: int = 1) -> StepDelta | None:
        """Async scheduling: the next all-decode round, scheduled while `prev` (not yet applied) is still
        on the device, as if every request of it goes on. None when the next step must wait for prev's
        tokens: prev was not all-decode, a request waits for admission, a running request was not in
        prev, one needs the host each token (a grammar), or the blocks are not all free (nothing
        is preempted for it). A request that ends by length in prev is left out; one that stops within
        prev (a stop token or string) ends when prev is applied, and its continued tokens are dropped."""
        if prev.empty or prev.num_tokens != len(prev.request_ids):
            return None
        if self.waiting and len(self.running) < self.max_num_seqs:
            return None
        index = {rid: i for i, rid in enumerate(prev.request_ids)}
        plan: list[tuple[Request, int, int]] = []          # (request, tokens computed after prev, steps)
        for req in self.running:
            i = index.get(req.request_id)
            if (i is None or req.single_step
                    or req.num_computed_tokens + 1 != req.num_tokens):    # prev must have been its decode
                return None
            computed = req.num_computed_tokens + prev.steps_of(i)
            left = req.max_total_tokens - (req.num_tokens + prev.steps_of(i))
            if left > 0:
                plan.append((req, computed, min(num_steps, left)))
        grown = self._grow_all([(req, computed + n) for req, computed, n in plan]) if plan else None
        if grown is None:
            return None
        scheduled = []
        for (req, _, n), blocks in zip(plan, grown):
            s = _Scheduled(req, 1, blocks, is_new=False)
            s.num_steps = n
            scheduled.append(s)
        return replace(self._delta(scheduled, []), continues=True)

    def _admit(self, scheduled: list[_Scheduled], budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            rid = req.request_id
            # prompt logprobs need every prompt position computed: no prefix-cache hit (vLLM)
            wants_all = req.params.prompt_logprobs is not None
            num_hit = self.kv.lookup_prefix(rid, req.token_ids[:1] if wants_all else req.token_ids, count=False,
                                            cache_salt=req.cache_salt)
            num_new = min(req.num_tokens - num_hit, budget)
            if self.kv.grow(rid, num_hit + num_new) is None:
                self.kv.free(rid)
                break
            self.waiting.popleft()
            self._commit_scheduled(req, num_hit + num_new)     # before the next admission looks up its prefix
            req.num_computed_tokens = num_hit
            if req.num_preemptions == 0:
                self.num_prefix_queries += req.num_prompt_tokens
                self.num_prefix_hits += num_hit
                req.num_cached_prompt_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(_Scheduled(req, num_new, [], is_new=True))
            budget -= num_new

    def _delta(self, scheduled: list[_Scheduled], preempted: list[str]) -> StepDelta:
        finished, self._finished_ids = tuple(self._finished_ids), []
        multi = any(s.num_steps > 1 for s in scheduled)
        return StepDelta(request_ids=tuple(s.req.request_id for s in scheduled),
                         num_scheduled_tokens=tuple(s.num_tokens for s in scheduled),
                         new_block_ids=tuple(tuple(s.new_blocks) for s in scheduled),
                         num_steps=tuple(s.num_steps for s in scheduled) if multi else (),
                         new_requests=tuple(self._new_request(s) for s in scheduled if s.is_new),
                         finished_ids=finished, preempted_ids=tuple(preempted),
                         num_common_prefix_blocks=self._common_prefix_blocks(scheduled))

    def _common_prefix_blocks(self, scheduled: list[_Scheduled]) -> int:
        # shared prompts are found by prefix caching's block hashes; one request alone shares nothing
        if not scheduled or not self.pool.enable_prefix_caching or self.kv.num_requests < 2:
            return 0
        return self.kv.num_common_prefix_blocks(scheduled[0].req.request_id)

    def _new_request(self, s: _Scheduled) -> NewRequest:
        """What the runner needs once: tokens, params and the table as admitted (a multi-step round's
        extra blocks follow in new_block_ids, like any other request's)."""
        req = s.req
        table = self.kv.block_ids(req.request_id)
        return NewRequest(request_id=req.request_id, prompt_token_ids=tuple(req.prompt_token_ids),
                          output_token_ids=tuple(req.token_ids[req.num_prompt_tokens:]), params=req.params,
                          block_ids=tuple(table[:len(table) - len(s.new_blocks)]),
                          num_computed_tokens=req.num_computed_tokens,
                          eos_token_ids=() if req.params.ignore_eos else req.eos_token_ids,
                          bad_words_token_ids=req.bad_words_token_ids)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # after the model ran ------------------------------------------------------------------------
    def update(self, delta: StepDelta, sampled: dict[str, int], step: int = 0) -> list[Request]:
        """Record what step `step` of the delta computed (0 unless multi-step; steps in order) and
        append the sampled tokens; return the requests that got a token, for the finish decision."""
        got = []
        self._unrun_commits = {}                     # the scheduled step ran: what it cached is written
        for index, request_id in enumerate(delta.request_ids):
            if step >= delta.steps_of(index):
                continue
            req = self.requests.get(request_id)
            if req is None or req.status is not RequestStatus.RUNNING:   # ended (or re-added) meanwhile
                continue
            req.num_computed_tokens += delta.num_scheduled_tokens[index] if step == 0 else 1
            self.kv.commit(request_id, req.token_ids, req.num_computed_tokens)
            token = sampled.get(request_id)
            if token is not None and req.num_computed_tokens == req.num_tokens:
                req.append_output(token)
                got.append(req)
        return got

    def finish(self, request_id: str, reason: str) -> Request | None:
        """End a request (stop, length, abort): its blocks go back to the pool at once."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        # the runner drops the row if it has one (a waiting request may hold one when the delta that
        # preempted it never reached the runner); unknown ids are ignored there
        self._finished_ids.append(request_id)
        self.kv.free(request_id)
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
        return req
