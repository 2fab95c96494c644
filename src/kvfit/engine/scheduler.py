"""Continuous batching over the block pool: chunked prefill, prefix caching, preemption by recompute.

Each step: running requests first (oldest first), each takes its next tokens (1 for decode, a
chunk for a prefill in progress) within max_num_batched_tokens; when no block is free the newest
running request is preempted (blocks freed, recomputed later). Then waiting requests are admitted
while tokens, sequence slots and blocks last. A request that fits the cache alone always makes
progress, so the loop never deadlocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from kvfit.engine.request import Request, RequestStatus
from kvfit.engine.step_plan import ScheduledSeq, StepPlan
from kvfit.errors import RequestError
from kvfit.kv.pool import BlockPool
from kvfit.kv.prefix import hash_full_blocks


class Scheduler:
    """Owns the waiting/running queues and every request's block table."""

    def __init__(self, pool: BlockPool, block_size: int, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int):
        self.pool = pool
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_prefix_queries = 0      # prompt tokens looked up in the prefix cache
        self.num_prefix_hits = 0         # of those, tokens found

    # admission ----------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a request, or raise RequestError if it can never be served."""
        prompt_len = len(request.prompt_token_ids)
        if prompt_len == 0:
            raise RequestError("the prompt is empty; give at least one token")
        if request.request_id in self.requests:
            raise RequestError(f"request id {request.request_id!r} is already in use")
        if prompt_len >= self.max_model_len:
            raise RequestError(
                f"the prompt has {prompt_len} tokens but --max-model-len is {self.max_model_len} "
                "(prompt + at least one output token); shorten the prompt or raise --max-model-len")
        max_tokens = request.params.max_tokens or self.max_model_len
        request.max_total_tokens = min(prompt_len + max_tokens, self.max_model_len)
        blocks = -(-request.max_total_tokens // self.block_size)
        if blocks > self.pool.num_blocks:
            raise RequestError(
                f"the request needs {blocks} KV blocks but the cache has {self.pool.num_blocks}; "
                "lower max_tokens or give the cache more memory")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # one step -----------------------------------------------------------------------------------
    def schedule(self, num_steps: int = 1) -> StepPlan:
        """The next step; with num_steps > 1 an all-decode step may become a multi-step plan."""
        budget = self.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        preempted: list[str] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self._grow(req, req.num_computed_tokens + num_new):
                victim = self.running.pop()          # newest running request
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                seqs.append(self._scheduled(req, num_new))
                budget -= num_new
                i += 1
                continue
            break
        if not preempted:
            budget = self._admit(seqs, budget)
        plan = StepPlan(seqs=tuple(seqs), preempted_ids=tuple(preempted))
        return self._multi_step(plan, num_steps) if num_steps > 1 and not preempted else plan

    def _multi_step(self, plan: StepPlan, num_steps: int) -> StepPlan:
        """Give every sequence of an all-decode plan up to num_steps decode steps (never past its
        max_tokens), with blocks for all of them allocated now. The plan stays one step when a
        waiting request could be admitted instead, or when the blocks are not all free (no request
        is preempted to make room for tokens that may never be needed)."""
        if not plan.seqs or (self.waiting and len(self.running) < self.max_num_seqs):
            return plan
        if any(len(s.token_ids) != 1 or not s.sample for s in plan.seqs):
            return plan
        reqs = [self.requests[s.request_id] for s in plan.seqs]
        steps = [max(1, min(num_steps, r.max_total_tokens - r.num_tokens)) for r in reqs]
        if max(steps) == 1:
            return plan
        need = sum(self._blocks_short(r, r.num_computed_tokens + n) for r, n in zip(reqs, steps))
        if need > self.pool.num_allocatable_blocks:
            return plan
        seqs = []
        for seq, req, n in zip(plan.seqs, reqs, steps):
            grown = self._grow(req, req.num_computed_tokens + n)
            assert grown, "blocks counted free above"
            seqs.append(replace(seq, block_ids=tuple(req.block_ids), num_steps=n))
        return StepPlan(seqs=tuple(seqs))

    def _admit(self, seqs: list[ScheduledSeq], budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hits = self._prefix_hits(req)
            self.pool.ref(hits)
            req.block_ids = list(hits)
            req.num_computed_tokens = len(hits) * self.block_size
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._grow(req, req.num_computed_tokens + num_new):
                self.pool.free(req.block_ids)
                req.block_ids, req.num_computed_tokens = [], 0
                break
            self.waiting.popleft()
            if req.num_preemptions == 0:
                self.num_prefix_queries += len(req.prompt_token_ids)
                self.num_prefix_hits += req.num_computed_tokens
                req.num_cached_prompt_tokens = req.num_computed_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            seqs.append(self._scheduled(req, num_new))
            budget -= num_new
        return budget

    def _prefix_hits(self, req: Request) -> list[int]:
        """Cached blocks of the request's leading full blocks (at least one token is left to compute)."""
        if not self.pool.enable_prefix_caching:
            return []
        req.block_hashes = hash_full_blocks(req.all_token_ids, self.block_size, req.block_hashes)
        hits = []
        max_hits = (req.num_tokens - 1) // self.block_size
        for block_hash in req.block_hashes[:max_hits]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def _blocks_short(self, req: Request, num_tokens: int) -> int:
        """Blocks req's table lacks to cover num_tokens (0 if it covers them)."""
        return max(-(-num_tokens // self.block_size) - len(req.block_ids), 0)

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Make req's block table cover num_tokens; False (nothing changed) if blocks ran out."""
        need = self._blocks_short(req, num_tokens)
        if need == 0:
            return True
        new = self.pool.allocate(need)
        if new is None:
            return False
        req.block_ids.extend(new)
        return True

    def _scheduled(self, req: Request, num_new: int) -> ScheduledSeq:
        start = req.num_computed_tokens
        tokens = req.token_slice(start, start + num_new)
        return ScheduledSeq(request_id=req.request_id, token_ids=tuple(tokens), start_pos=start,
                            block_ids=tuple(req.block_ids), sample=start + num_new == req.num_tokens,
                            params=req.params, num_generated=len(req.output_token_ids))

    def _preempt(self, req: Request) -> None:
        self.pool.free(req.block_ids)
        req.block_ids, req.num_computed_tokens = [], 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # after the model ran ------------------------------------------------------------------------
    def update(self, plan: StepPlan, sampled: dict[str, int], step: int = 0) -> list[Request]:
        """Record computed tokens and sampled ones of the plan's step `step` (0 unless multi-step);
        return the requests that finished with it. Steps are applied in order."""
        finished = []
        for seq in plan.seqs:
            if step >= seq.num_steps:
                continue
            req = self.requests.get(seq.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:   # aborted (or re-added) meanwhile
                continue
            req.num_computed_tokens = seq.start_pos + len(seq.token_ids) + step
            self._register_full_blocks(req)
            token = sampled.get(seq.request_id)
            if seq.sample and token is not None:
                req.output_token_ids.append(token)
                reason = self._stop_reason(req, token)
                if reason is not None:
                    self.finish(req.request_id, reason)
                    finished.append(req)
        return finished

    def _register_full_blocks(self, req: Request) -> None:
        if not self.pool.enable_prefix_caching:
            return
        num_full = req.num_computed_tokens // self.block_size
        req.block_hashes = hash_full_blocks(req.all_token_ids[:num_full * self.block_size], self.block_size,
                                            req.block_hashes[:num_full])
        for block, block_hash in zip(req.block_ids[:num_full], req.block_hashes):
            self.pool.register(block, block_hash)

    def _stop_reason(self, req: Request, token: int) -> str | None:
        params = req.params
        if not params.ignore_eos and token in req.eos_token_ids:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if req.num_tokens >= req.max_total_tokens:
            return "length"
        return None

    def finish(self, request_id: str, reason: str) -> Request | None:
        """End a request (stop, length, abort): its blocks go back to the pool at once."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
        return req
