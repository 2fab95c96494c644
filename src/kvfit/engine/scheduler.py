"""Continuous batching policy: who runs, chunked prefill, preemption by recompute, multi-step rounds.

A request whose grammar compiles or whose bad words tokenize off the engine thread is added PREPARING
(vLLM's WAITING_FOR_FSM): it is in `preparing`, never scheduled, until the engine releases it to the
waiting queue (or ends it); everyone else keeps stepping meanwhile.

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

import time
from collections import deque
from dataclasses import replace

from kvfit.engine.request import Request, RequestStatus
from kvfit.kv.manager import KVCacheManager
from kvfit.step import NewRequest, StepDelta


class _Scheduled:
    """One request's share of the step being built (mutable until the delta is made)."""

    __slots__ = ("req", "num_tokens", "new_blocks", "is_new", "num_steps", "num_computed", "num_known")

    def __init__(self, req: Request, num_tokens: int, new_blocks: list[int], is_new: bool,
                 num_computed: int | None = None, num_known: int | None = None):
        self.req, self.num_tokens, self.new_blocks, self.is_new = req, num_tokens, new_blocks, is_new
        self.num_steps = 1
        # the request's computed and known tokens before this step (a continuation counts the step in flight's)
        self.num_computed = req.num_computed_tokens if num_computed is None else num_computed
        self.num_known = req.num_tokens if num_known is None else num_known


class Scheduler:
    """Owns the waiting/running queues; asks the KVCacheManager for blocks."""

    def __init__(self, kv: KVCacheManager, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.block_size = kv.block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        # set by the engine while device memory outside the plan is short (engine/headroom.py): no new
        # request is admitted while another runs
        self.admission_paused = False
        self.running: list[Request] = []
        # added, not yet schedulable: their grammar or bad words are prepared off the engine thread
        # (vLLM's WAITING_FOR_FSM); the engine releases them to `waiting` in arrival order, or ends them
        self.preparing: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_prefix_queries = 0      # prompt tokens looked up in the prefix cache
        self.num_prefix_hits = 0         # of those, tokens found
        self._finished_ids: list[str] = []   # ended since the last delta: the runner drops their rows
        # request id -> its committed block count before the step being built cached its blocks; then, per
        # scheduled step not yet run (two with a continuation in flight), the same for that step
        self._step_commits: dict[str, int] = {}
        self._unrun: list[tuple[StepDelta, dict[str, int]]] = []

    @property
    def pool(self):
        return self.kv.pool

    def add(self, request: Request) -> None:
        """Queue a request the engine's admission check accepted."""
        assert request.request_id not in self.requests, "admission checks ids"
        assert 0 < request.num_prompt_tokens < request.max_total_tokens <= self.max_model_len, "admission checks lengths"
        self.requests[request.request_id] = request
        if request.pending:
            request.status = RequestStatus.PREPARING
            self.preparing.append(request)
        else:
            self.waiting.append(request)

    def release(self, request: Request) -> None:
        """A preparing request is ready: it queues behind the waiting ones."""
        assert request.status is RequestStatus.PREPARING, "only a preparing request is released"
        self.preparing.remove(request)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.preparing) + len(self.waiting) + len(self.running)

    def block_ids(self, request_id: str):
        return self.kv.block_ids(request_id)

    # one step -----------------------------------------------------------------------------------
    def schedule(self, num_steps: int = 1) -> StepDelta:
        """The next step; with num_steps > 1 an all-decode step may become a multi-step round."""
        self._unrun, self._step_commits = [], {}         # nothing is in flight when a step is scheduled
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
        return self._made(self._delta(scheduled, preempted))

    def _commit_scheduled(self, req: Request, num_tokens: int) -> None:
        """Cache the full blocks among the request's first num_tokens now, before the step computes them
        (vLLM caches at allocation): a request admitted behind this one in the same step finds a prompt
        prefix they share instead of computing a copy (every layer writes the step's K/V before it
        attends). Until the step has run (update), forget_unrun_commits can take them back."""
        self._step_commits.setdefault(req.request_id, self.kv.num_committed_blocks(req.request_id))
        self.kv.commit(req.request_id, req.token_ids, num_tokens)

    def _made(self, delta: StepDelta) -> StepDelta:
        """The step is built: what it cached is remembered as its own until update() applies it."""
        if self._step_commits:
            self._unrun.append((delta, self._step_commits))
        self._step_commits = {}
        return delta

    def forget_unrun_commits(self, request_id: str | None = None) -> None:
        """The scheduled steps not yet applied failed before they ran: the blocks they cached hold no
        K/V, so their hashes go (the engine then ends their requests). With a request id: only that
        request's (its logits were not finite, so neither may its K/V be), before its step is applied."""
        for _, commits in reversed(self._unrun):            # the latest first: each keeps an earlier count
            for rid in [request_id] if request_id is not None else list(commits):
                keep = commits.pop(rid, None)
                if keep is not None:
                    self.kv.uncommit(rid, keep)
        if request_id is None:
            self._unrun = []

    def _multi_step(self, scheduled: list[_Scheduled], num_steps: int) -> None:
        """Give every request of an all-decode step up to num_steps decode steps (never past its
        max_tokens), with blocks for all of them allocated now. The step stays single when a
        waiting request could be admitted instead, or when the blocks are not all free (no request
        is preempted to make room for tokens that may never be needed)."""
        if not scheduled or (self.waiting and len(self.running) < self.max_num_seqs):
            return
        if any(s.num_tokens != 1 or s.num_computed + 1 != s.num_known for s in scheduled):
            return
        steps = [1 if s.req.single_step else max(1, min(num_steps, s.req.max_total_tokens - s.num_known))
                 for s in scheduled]
        if max(steps) == 1:
            return
        grown = self._grow_all([(s.req, s.num_computed + n) for s, n in zip(scheduled, steps)])
        if grown is None:
            return
        for s, n, blocks in zip(scheduled, steps, grown):
            s.new_blocks.extend(blocks)
            s.num_steps = n

    def _grow_all(self, targets: list[tuple[Request, int]]) -> list[list[int]] | None:
        """Tables grown to cover each (request, tokens) target, all or none: the new block ids of each,
        or None (nothing allocated) when the pool cannot give them all without preempting."""
        shorts = [self.kv.num_blocks_short(req.request_id, num_tokens) for req, num_tokens in targets]
        if sum(shorts) > self.pool.num_allocatable_blocks:
            return None
        # most decodes' tables already cover their next token (one block in block_size steps needs one): only
        # the short ones grow (a target has at least one token, so a request without a table is short)
        grown = [self.kv.grow(req.request_id, num_tokens) if short else []
                 for (req, num_tokens), short in zip(targets, shorts)]
        assert all(blocks is not None for blocks in grown), "blocks counted free above"
        return grown

    def schedule_continuation(self, prev: StepDelta, num_steps: int = 1) -> StepDelta | None:
        """Async scheduling: the next step, scheduled while `prev` (not yet applied) is still on the device,
        as if every request of it goes on: a request that samples in prev decodes one token more (its input
        the device's token), a prefill in progress takes its next chunk, waiting requests are admitted as
        schedule() would. None when the next step must wait for prev's tokens: a running request needs the
        host each token (a grammar, multi-token bad words) or the next waiting one does and has a slot, or
        the running requests' blocks are not all free (nothing is preempted for it; schedule() does that
        once prev is applied). A request that ends by length in prev is left out; one that stops within prev
        (a stop token or string) ends when prev is applied, and its continued tokens are dropped. An
        all-decode continuation with nobody to admit may be a multi-step round."""
        if prev.empty:
            return None
        if self.waiting and self.waiting[0].single_step and len(self.running) < self.max_num_seqs:
            return None         # schedule() admits it once prev is applied (a continuation would not)
        index = {rid: i for i, rid in enumerate(prev.request_ids)}
        plan: list[tuple[Request, int, int]] = []       # (request, tokens computed, tokens known) after prev
        for req in self.running:
            if req.single_step:
                return None
            computed, total = req.num_computed_tokens, req.num_tokens
            i = index.get(req.request_id)
            if i is not None:
                steps = prev.steps_of(i)
                if computed + prev.num_scheduled_tokens[i] == total:           # prev samples it
                    total += steps
                    if total >= req.max_total_tokens:
                        continue                                              # ends by length in prev
                computed += prev.num_scheduled_tokens[i] + steps - 1
            plan.append((req, computed, total))
        budget = self.max_num_batched_tokens
        targets: list[tuple[Request, int, int, int]] = []     # (request, computed, known, tokens this step)
        for req, computed, total in plan:
            if budget <= 0:
                break
            num_new = min(total - computed, budget)
            targets.append((req, computed, total, num_new))
            budget -= num_new
        grown = self._grow_all([(req, computed + n) for req, computed, _, n in targets]) if targets else []
        if grown is None:
            return None
        scheduled = []
        for (req, computed, total, n), blocks in zip(targets, grown):
            scheduled.append(_Scheduled(req, n, blocks, is_new=False, num_computed=computed, num_known=total))
            # the token prev samples is not known yet: only blocks of known tokens are cached now
            self._commit_scheduled(req, min(computed + n, req.num_tokens))
        self._admit(scheduled, budget, in_flight=index)
        if not scheduled:
            return None
        if num_steps > 1:
            self._multi_step(scheduled, num_steps)
        return self._made(replace(self._delta(scheduled, []), continues=True))

    def _admit(self, scheduled: list[_Scheduled], budget: int, in_flight: dict | None = None) -> None:
        """Admit waiting requests in arrival order while tokens, slots and blocks last. A continuation (the ids
        of the step in flight given) stops at a request that needs the host each token (its first sample
        needs the host's grammar state) and at one whose id the step in flight holds (an ended request's id
        used again: applying that step must not find the new request running under it)."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            if self.admission_paused and self.running:    # low device headroom: the running ones finish first
                break
            req = self.waiting[0]
            if in_flight is not None and (req.single_step or req.request_id in in_flight):
                break
            rid = req.request_id
            # prompt logprobs need every prompt position computed: no prefix-cache hit (vLLM)
            wants_all = req.params.prompt_logprobs is not None
            num_hit = self.kv.lookup_prefix(rid, req.token_ids[:1] if wants_all else req.token_ids,
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
            if req.first_scheduled_time is None:       # a preempted request keeps its first admission
                req.first_scheduled_time = time.monotonic()
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
                          eos_token_ids=req.eos_token_ids,      # held back until min_tokens, ignore_eos or not
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
        if step == 0:                                # the step ran: what it cached is written
            self._unrun = [(d, commits) for d, commits in self._unrun if d is not delta]
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
        elif req.status is RequestStatus.PREPARING:
            self.preparing.remove(req)
        # the runner drops the row if it has one (a waiting request may hold one when the delta that
        # preempted it never reached the runner); unknown ids are ignored there
        self._finished_ids.append(request_id)
        self.kv.free(request_id)
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
        return req
