"""Scheduler invariants under random workloads (hypothesis).

Requests arrive between steps with random prompts (often sharing a prefix), max_tokens, EOS and
stop tokens; some are aborted. Pool size, block size, max_num_seqs, max_num_batched_tokens and
prefix caching are random, the pool always big enough for one max_model_len request. A fake runner
answers each sampled seq with a token fixed by (request_id, num_generated). Checked:
- every step: the token budget and max_num_seqs hold; each seq continues exactly where its request
  stopped, its block table covers its tokens and is append-only between preemptions; no two tokens
  write one slot and no token writes a block shared by another table; every used block is held by
  running tables only, with a ref count equal to the number of tables holding it; pool invariants.
- progress: a step with unfinished requests never plans nothing; the loop ends within a bound.
- results: every request not aborted ends with exactly the tokens and finish reason that an
  undisturbed run gives; at the end no block is used and free + cached == total.
- all of it with multi-step rounds too (schedule(num_steps), tokens applied step by step).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvfit.engine.request import Request, RequestStatus
from kvfit.sampling_params import SamplingParams
from kvfit.kv.manager import KVCacheManager
from scheduler_helpers import Scheduler
from kvfit.kv.pool import BlockPool

EOS = 0
STOP = 99


@dataclass
class Spec:
    request_id: str
    prompt: list[int]
    max_tokens: int | None
    ignore_eos: bool
    use_stop_token: bool
    outputs: list[int]          # what the fake runner answers at each num_generated
    arrival_step: int
    abort_step: int | None


def expected_output(spec: Spec, max_model_len: int) -> tuple[list[int], str]:
    """The tokens and reason an undisturbed run ends with."""
    limit = min(len(spec.prompt) + (spec.max_tokens or max_model_len), max_model_len)
    out: list[int] = []
    for token in spec.outputs:
        out.append(token)
        if (token == EOS and not spec.ignore_eos) or (token == STOP and spec.use_stop_token):
            return out, "stop"
        if len(spec.prompt) + len(out) >= limit:
            return out, "length"
    raise AssertionError("the fake runner's table is too short")


@st.composite
def configs(draw) -> tuple[dict, list[list[int]]]:
    """A scheduler config (the pool always fits one max_model_len request) and prompt prefixes to share."""
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8]))
    max_model_len = draw(st.integers(2, 40))
    min_blocks = -(-max_model_len // block_size)
    num_blocks = draw(st.integers(min_blocks, min_blocks + 12))
    config = dict(block_size=block_size, max_model_len=max_model_len, num_blocks=num_blocks,
                  max_num_seqs=draw(st.integers(1, 5)), max_num_batched_tokens=draw(st.integers(1, 24)),
                  prefix_caching=draw(st.booleans()), num_steps=draw(st.sampled_from([1, 1, 2, 5])))
    prefixes = [draw(st.lists(st.integers(1, 4), max_size=3 * block_size)) for _ in range(2)] + [[]]
    return config, prefixes


@st.composite
def workloads(draw):
    config, prefixes = draw(configs())
    max_model_len = config["max_model_len"]
    specs = []
    for i in range(draw(st.integers(1, 8))):
        prefix = draw(st.sampled_from(prefixes))
        tail = draw(st.lists(st.integers(1, 4), max_size=12))
        prompt = (prefix + tail)[:max_model_len - 1] or [1]
        # mostly ordinary tokens, so requests run long; EOS and STOP now and then
        outputs = draw(st.lists(st.sampled_from([1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, EOS, STOP]),
                                min_size=max_model_len, max_size=max_model_len))
        abort_step = draw(st.one_of(st.none(), st.none(), st.integers(0, 30)))
        specs.append(Spec(request_id=f"r{i}", prompt=prompt, max_tokens=draw(st.one_of(st.none(), st.integers(1, 12))),
                          ignore_eos=draw(st.booleans()), use_stop_token=draw(st.booleans()), outputs=outputs,
                          arrival_step=draw(st.integers(0, 12)), abort_step=abort_step))
    return config, specs


def check_step(sched: Scheduler, plan, running_before: dict[str, int], tables: dict[str, list[int]],
               config: dict) -> None:
    """Everything one plan must satisfy; running_before maps running ids to their computed tokens."""
    bs = config["block_size"]
    assert plan.num_tokens <= config["max_num_batched_tokens"]
    assert len(plan.seqs) <= config["max_num_seqs"]
    assert len({s.request_id for s in plan.seqs}) == len(plan.seqs)
    assert not set(plan.preempted_ids) & {s.request_id for s in plan.seqs}
    assert set(plan.preempted_ids) <= set(running_before)
    if plan.preempted_ids:      # no admission in a step that preempts
        assert {s.request_id for s in plan.seqs} <= set(running_before)
    for rid in plan.preempted_ids:
        tables.pop(rid, None)
    written = set()
    for seq in plan.seqs:
        req = sched.requests[seq.request_id]
        assert req.status is RequestStatus.RUNNING
        if seq.request_id in running_before:
            assert seq.start_pos == running_before[seq.request_id]      # continues where it stopped
        else:       # admitted now: from zero or after whole prefix-cached blocks
            assert seq.start_pos % bs == 0 and (config["prefix_caching"] or seq.start_pos == 0)
        end = seq.start_pos + len(seq.token_ids)
        assert len(seq.token_ids) >= 1
        assert list(seq.token_ids) == req.all_token_ids[seq.start_pos:end]
        assert seq.sample == (end == req.num_tokens)
        assert seq.num_generated == len(req.output_token_ids)
        if seq.num_steps > 1:       # a multi-step decode round: one token in, blocks for every step
            assert len(seq.token_ids) == 1 and seq.sample and seq.num_steps <= config["num_steps"]
            assert req.num_tokens + seq.num_steps - 1 < req.max_total_tokens
        end += seq.num_steps - 1
        assert len(seq.block_ids) == -(-end // bs)
        old = tables.get(seq.request_id, [])
        assert list(seq.block_ids[:len(old)]) == old, "block tables are append-only"
        tables[seq.request_id] = list(seq.block_ids)
        for pos in range(seq.start_pos, end):
            block = seq.block_ids[pos // bs]
            slot = block * bs + pos % bs
            assert slot not in written, "two tokens write one slot"
            written.add(slot)
            holders = sched.pool.ref_count(block)
            if holders > 1:
                # blocks are cached when scheduled: the only other tables holding a block this step writes are
                # requests admitted behind this one in the same step, which hit it, and the step writes it
                # whole (every layer writes the step's K/V before it attends)
                sharers = [s for s in plan.seqs if s.request_id != seq.request_id and block in s.block_ids]
                assert len(sharers) == holders - 1 and all(s.request_id not in running_before for s in sharers), \
                    "a token writes a block another table held before this step"
                assert end >= (pos // bs + 1) * bs, "a block shared in its step is left partly written"


def check_ownership(sched: Scheduler) -> None:
    pool = sched.pool
    pool.check_invariants()
    assert all(not list(sched.block_ids(r.request_id)) for r in sched.waiting)
    held = Counter(b for r in sched.running for b in sched.block_ids(r.request_id))
    assert all(len(set(sched.block_ids(r.request_id))) == len(list(sched.block_ids(r.request_id))) for r in sched.running)
    assert pool.num_used_blocks == len(held)
    for block, count in held.items():
        assert pool.ref_count(block) == count
    assert pool.num_free_blocks + pool.num_cached_blocks + pool.num_used_blocks == pool.num_blocks
    assert len(sched.running) <= sched.max_num_seqs


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_finish_with_the_expected_tokens_and_free_every_block(workload):
    config, specs = workload
    pool = BlockPool(config["num_blocks"], enable_prefix_caching=config["prefix_caching"])
    sched = Scheduler(KVCacheManager(pool, config["block_size"]), config["max_model_len"], config["max_num_seqs"],
                      config["max_num_batched_tokens"])
    by_id = {s.request_id: s for s in specs}
    reqs: dict[str, Request] = {}
    aborted: set[str] = set()
    tables: dict[str, list[int]] = {}

    def runner(plan, k):
        # step k of the plan: the token a request's (num_generated + k)-th sample gives
        return {s.request_id: by_id[s.request_id].outputs[s.num_generated + k] for s in plan.seqs
                if s.sample and k < s.num_steps}

    total_tokens = sum(len(s.prompt) + config["max_model_len"] for s in specs)
    bound = max(s.arrival_step for s in specs) + 1 + 4 * total_tokens * (1 + len(specs))
    step = rounds = 0
    while step <= max(s.arrival_step for s in specs) or sched.num_unfinished:
        assert step <= bound, "the scheduler did not finish"
        for spec in specs:
            if spec.arrival_step == step:
                params = SamplingParams(max_tokens=spec.max_tokens, ignore_eos=spec.ignore_eos,
                                        stop_token_ids=(STOP,) if spec.use_stop_token else ())
                req = Request(request_id=spec.request_id, prompt_token_ids=list(spec.prompt), params=params,
                              eos_token_ids=(EOS,))
                sched.add(req)                 # the pool fits a max_model_len request: never rejected
                reqs[spec.request_id] = req
            if spec.abort_step == step and sched.finish(spec.request_id, "abort") is not None:
                aborted.add(spec.request_id)
                tables.pop(spec.request_id, None)
                assert list(sched.block_ids(spec.request_id)) == []
                check_ownership(sched)
        if sched.num_unfinished:
            running_before = {r.request_id: r.num_computed_tokens for r in sched.running}
            plan = sched.schedule(config["num_steps"])
            assert not plan.empty, "requests are waiting but nothing was scheduled"
            check_step(sched, plan, running_before, tables, config)
            check_ownership(sched)
            rounds += plan.num_steps > 1
            for k in range(plan.num_steps):      # the engine applies a round's tokens in order
                sched.update(plan, runner(plan, k), k)
                check_ownership(sched)
        step += 1

    for rid, req in reqs.items():
        assert req.status is RequestStatus.FINISHED and list(sched.block_ids(req.request_id)) == []
        expected, reason = expected_output(by_id[rid], config["max_model_len"])
        if rid in aborted:
            assert req.finish_reason == "abort"
            assert req.output_token_ids == expected[:len(req.output_token_ids)]
        else:
            assert (req.output_token_ids, req.finish_reason) == (expected, reason)
    assert not sched.requests and not sched.waiting and not sched.running
    assert pool.num_used_blocks == 0
    assert pool.num_free_blocks + pool.num_cached_blocks == pool.num_blocks
    if not config["prefix_caching"]:
        assert pool.num_cached_blocks == 0
    pool.check_invariants()
    # shown by --hypothesis-show-statistics: how often the interesting paths ran
    event(f"preempted: {sched.num_preemptions > 0}")
    event(f"prefix hits: {sched.num_prefix_hits > 0}")
    event(f"aborted: {bool(aborted)}")
    event(f"multi-step rounds ran: {rounds > 0}")
