"""Scheduler invariants under async scheduling (hypothesis), driven the way LLMEngine.step drives it.

At most one delta is in flight: each iteration takes it as the current delta (or schedule()s one), asks
schedule_continuation for the next and launches it before the current delta's tokens are read and applied
step by step. A fake device (`FakeDevice`: the runner's persistent batch and KV cache in plain Python,
worked in launch order, i.e. stream order) answers each sampled row with a token fixed by (incarnation,
num_generated); a continued decode's input is the token it sampled itself, not yet known to the host (the
carry). Requests arrive with random prompts (often sharing a prefix), max_tokens, EOS and stop tokens; some
are aborted (also while a delta holding them is in flight); some ids are added again after they end (also
at once, while the old request's round is still in flight). Pools are small (continuations refused, schedule()
preempts), prefix caching on or off, multi-step rounds. Checked:
- every delta: the token budget and max_num_seqs hold; ids are distinct; a continuation never preempts and
  holds no single-step request; each input is the incarnation's token at that position, known to the host
  or carried from the device (a carried input only for a one-token decode of a request the previous delta
  sampled); no request computes a position past max_total_tokens - 1;
- the KV cache: every position a delta reads (its own chunk, earlier steps, prefix hits) holds the K/V of the
  same tokens, written by that delta or one launched before it (each slot stores a hash of the prefix ending
  there);
- after each applied delta: the device's view of every running request (computed tokens, tokens, table)
  equals the scheduler's plus what the delta in flight adds; pool and manager invariants;
- a delta in flight whose requests all ended is read and dropped (LLMEngine._still_running);
- results: every request not aborted ends with exactly the tokens and finish reason of an undisturbed run;
  at the end no block is used and free + cached == total.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from scheduler_helpers import Scheduler, StepPlan
from test_scheduler_properties import EOS, STOP, configs, expected_output   # an Incarnation has a Spec's fields

from kvfit.engine.request import Request, RequestStatus
from kvfit.kv.manager import KVCacheManager
from kvfit.kv.pool import BlockPool
from kvfit.sampling_params import SamplingParams
from kvfit.step import StepDelta


@dataclass
class Incarnation:
    """One request under an id (an id may have two: the second added after the first ended)."""

    request_id: str
    prompt: list[int]
    max_tokens: int | None
    ignore_eos: bool
    use_stop_token: bool
    outputs: list[int]            # what the fake device samples at each num_generated
    abort_after: int | None       # iterations after it was added
    single_step: bool = False     # needs the host each token (multi-token bad words; the fake device ignores them)


@dataclass
class Spec:
    first: Incarnation
    arrival_step: int
    again: Incarnation | None     # the id added again, readd_delay iterations after the first ended
    readd_delay: int


@st.composite
def incarnations(draw, request_id: str, max_model_len: int, prefixes: list[list[int]]) -> Incarnation:
    prefix = draw(st.sampled_from(prefixes))
    tail = draw(st.lists(st.integers(1, 4), max_size=12))
    prompt = (prefix + tail)[:max_model_len - 1] or [1]
    # mostly ordinary tokens, so requests run long; EOS and STOP now and then
    outputs = draw(st.lists(st.sampled_from([1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, EOS, STOP]),
                            min_size=max_model_len, max_size=max_model_len))
    return Incarnation(request_id, prompt, draw(st.one_of(st.none(), st.integers(1, 12))), draw(st.booleans()),
                       draw(st.booleans()), outputs, draw(st.one_of(st.none(), st.none(), st.integers(0, 12))),
                       draw(st.sampled_from([False] * 11 + [True])))


@st.composite
def workloads(draw):
    config, prefixes = draw(configs())
    max_model_len = config["max_model_len"]
    specs = []
    for i in range(draw(st.integers(1, 8))):
        first = draw(incarnations(f"r{i}", max_model_len, prefixes))
        again = draw(st.one_of(st.none(), st.none(), incarnations(f"r{i}", max_model_len, prefixes)))
        specs.append(Spec(first, draw(st.integers(0, 12)), again, draw(st.sampled_from([0, 0, 1, 3]))))
    return config, specs


@dataclass
class Row:
    """The runner's row of one request: its tokens as the device knows them (the host's, then the ones it
    sampled and the host has not recorded yet), its computed count, its table, the K/V key of each token."""

    request: Request
    inc: Incarnation
    seq: list[int]
    num_known: int                # seq[:num_known] the host has recorded (the runner's token_ids)
    computed: int
    table: list[int]
    keys: list[int] = field(default_factory=list)   # keys[p]: hash of seq[:p + 1], the K/V at position p

    def extend_keys(self) -> None:
        while len(self.keys) < len(self.seq):
            self.keys.append(hash((self.keys[-1] if self.keys else 0, self.seq[len(self.keys)])))


class FakeDevice:
    """The runner (persistent batch, carry, KV cache) in plain Python; deltas run in launch order."""

    def __init__(self, sched: Scheduler, incs: dict[int, Incarnation], config: dict):
        self.sched, self.incs, self.config = sched, incs, config
        self.bs = config["block_size"]
        self.rows: dict[str, Row] = {}
        self.slots: dict[int, int] = {}          # slot -> key of the K/V written there last
        self.carry: dict[str, int] = {}          # the last launched delta's last sampled token per row
        self.results: dict[int, dict[str, tuple[Request, list[int]]]] = {}

    def _slot(self, row: Row, pos: int) -> int:
        assert pos // self.bs < len(row.table), "a position past the request's table"
        return row.table[pos // self.bs] * self.bs + pos % self.bs

    def launch(self, delta: StepDelta) -> None:
        """Apply the delta to the rows, check its inputs, write and read the cache, sample."""
        for rid in delta.removed_ids:
            self.rows.pop(rid, None)
        for new in delta.new_requests:
            assert new.request_id not in self.rows, "a request added twice without being removed"
            req = self.sched.requests[new.request_id]
            seq = list(new.prompt_token_ids) + list(new.output_token_ids)
            assert seq == req.token_ids
            row = Row(req, self.incs[id(req)], seq, len(seq), new.num_computed_tokens, list(new.block_ids))
            row.extend_keys()
            self.rows[new.request_id] = row
        assert len(self.rows) <= self.config["max_num_seqs"], "more rows than max_num_seqs"
        rows = [self.rows[rid] for rid in delta.request_ids]
        for row, blocks in zip(rows, delta.new_block_ids):
            row.table.extend(blocks)
        starts, samples = [], []
        for i, row in enumerate(rows):
            start, n, steps = row.computed, delta.num_scheduled_tokens[i], delta.steps_of(i)
            known = max(0, min(n, row.num_known - start))
            if known != n:      # the runner's build_inputs: only a continued one-token decode is carried
                assert delta.continues and n == 1 and known == 0, "inputs beyond the request's known tokens"
                assert row.request.request_id in self.carry and start == len(row.seq) - 1, "no carry for it"
                assert self.carry[row.request.request_id] == row.seq[start]
            truth = row.inc.prompt + row.inc.outputs
            assert row.seq[start:start + n] == truth[start:start + n], "an input is not the request's token"
            assert start + n + steps - 1 <= row.request.max_total_tokens - 1, "computes past max_total_tokens"
            sample = start + n == len(row.seq)
            assert sample or steps == 1, "a multi-step row that does not sample"
            starts.append(start)
            samples.append(sample)
        out: dict[str, tuple[Request, list[int]]] = {}
        for k in range(delta.max_num_steps):
            active = [i for i in range(len(rows)) if k < delta.steps_of(i)]
            spans = {}
            for i in active:
                row = rows[i]
                first = starts[i] if k == 0 else starts[i] + delta.num_scheduled_tokens[i] + k - 1
                last = starts[i] + delta.num_scheduled_tokens[i] + k       # positions [first, last) this step
                spans[i] = last
                for pos in range(first, last):          # every layer writes the step's K/V before it attends
                    self.slots[self._slot(row, pos)] = row.keys[pos]
            for i in active:
                row = rows[i]
                for pos in range(spans[i]):
                    assert self.slots.get(self._slot(row, pos)) == row.keys[pos], \
                        f"{row.request.request_id} reads K/V at position {pos} not written before"
            for i in active:
                if samples[i]:
                    row = rows[i]
                    token = row.inc.outputs[len(row.seq) - len(row.inc.prompt)]
                    row.seq.append(token)
                    row.extend_keys()
                    out.setdefault(row.request.request_id, (row.request, []))[1].append(token)
        self.carry = {rid: toks[-1] for rid, (_, toks) in out.items()}
        for i, row in enumerate(rows):
            row.computed += delta.num_scheduled_tokens[i] + delta.steps_of(i) - 1
        self.results[id(delta)] = out

    def read(self, delta: StepDelta) -> dict[str, list[int]]:
        """The delta's sampled tokens, recorded in the rows still there (the runner's record_sampled)."""
        out = self.results.pop(id(delta))
        for rid, (req, tokens) in out.items():
            row = self.rows.get(rid)
            if row is not None:
                assert row.request is req, "a stale delta's tokens recorded in a new request's row"
                row.num_known += len(tokens)
        return {rid: tokens for rid, (_, tokens) in out.items()}


def check_delta(delta: StepDelta, config: dict, sched: Scheduler) -> None:
    assert delta.num_tokens <= config["max_num_batched_tokens"]
    assert len(delta.request_ids) <= config["max_num_seqs"]
    assert len(set(delta.request_ids)) == len(delta.request_ids)
    assert all(n >= 1 for n in delta.num_scheduled_tokens)
    if delta.continues:
        assert not delta.preempted_ids, "a continuation never preempts"
        assert not any(sched.requests[rid].single_step for rid in delta.request_ids)
    assert delta.max_num_steps <= config["num_steps"]


def check_state(sched: Scheduler, device: FakeDevice, inflight: StepDelta | None) -> None:
    """The device's view of every running request is the scheduler's plus the delta in flight's share."""
    sched.kv.check_invariants()
    index = {rid: i for i, rid in enumerate(inflight.request_ids)} if inflight is not None else {}
    for req in sched.running:
        rid = req.request_id
        row = device.rows[rid]
        assert row.request is req
        ahead = 0
        if rid in index:
            i = index[rid]
            ahead = inflight.num_scheduled_tokens[i] + inflight.steps_of(i) - 1
        assert row.computed == req.num_computed_tokens + ahead, "the device and the scheduler disagree"
        assert row.seq[:row.num_known] == req.token_ids
        assert row.table == list(sched.block_ids(rid)) == sched.mirror.tables[rid]
    for req in sched.waiting:
        assert not list(sched.block_ids(req.request_id))
    assert len(sched.running) <= sched.max_num_seqs


def _add(sched: Scheduler, inc: Incarnation, incs: dict[int, Incarnation]) -> Request:
    params = SamplingParams(max_tokens=inc.max_tokens, ignore_eos=inc.ignore_eos,
                            stop_token_ids=(STOP,) if inc.use_stop_token else ())
    req = Request(request_id=inc.request_id, prompt_token_ids=list(inc.prompt), params=params, eos_token_ids=(EOS,),
                  bad_words_token_ids=((7, 8),) if inc.single_step else ())     # multi-token bad words: single_step
    sched.add(req)                 # the pool fits a max_model_len request: never rejected
    incs[id(req)] = inc
    return req


class AsyncLoop:
    """LLMEngine.step with async scheduling, over the scheduler and the fake device."""

    def __init__(self, sched: Scheduler, device: FakeDevice, config: dict):
        self.sched, self.device, self.config = sched, device, config
        self.inflight: StepPlan | None = None
        self.stats = dict(continuations=0, mixed=0, refused=0, dropped=0)

    def step(self) -> StepPlan | None:
        """One engine step; the delta whose tokens it applied (None when there was nothing to run)."""
        sched, device, num_steps = self.sched, self.device, self.config["num_steps"]
        inflight, self.inflight = self.inflight, None
        # a round in flight whose requests all ended is read and dropped (LLMEngine._still_running)
        if inflight is not None and not any(rid in sched.requests and sched.requests[rid].status
                                            is RequestStatus.RUNNING for rid in inflight.delta.request_ids):
            device.read(inflight.delta)
            inflight = None
            self.stats["dropped"] += 1
        if inflight is not None:
            current = inflight
        elif sched.num_unfinished:
            current = sched.schedule(num_steps)
            assert not current.empty, "requests are waiting but nothing was scheduled"
            check_delta(current.delta, self.config, sched)
            device.launch(current.delta)
        else:
            return None
        after = sched.schedule_continuation(current.delta, num_steps)
        if after is not None:
            assert after.continues and not any(r.single_step for r in sched.running), "a continuation beside a "\
                "request that needs the host each token"
            check_delta(after, self.config, sched)
            self.inflight = StepPlan(after, sched.mirror.apply(after))
            device.launch(after)
            self.stats["continuations"] += 1
            self.stats["mixed"] += after.num_tokens != len(after.request_ids) or bool(after.new_requests)
        else:
            self.stats["refused"] += 1
        tokens = device.read(current.delta)
        for k in range(current.num_steps):      # the engine applies a round's tokens in order
            sched.update(current, {rid: toks[k] for rid, toks in tokens.items() if k < len(toks)}, k)
        check_state(sched, device, self.inflight.delta if self.inflight is not None else None)
        return current


def _make(config: dict) -> tuple[Scheduler, dict[int, Incarnation], AsyncLoop]:
    pool = BlockPool(config["num_blocks"], enable_prefix_caching=config["prefix_caching"])
    sched = Scheduler(KVCacheManager(pool, config["block_size"]), config["max_model_len"], config["max_num_seqs"],
                      config["max_num_batched_tokens"])
    incs: dict[int, Incarnation] = {}
    return sched, incs, AsyncLoop(sched, FakeDevice(sched, incs, config), config)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_async_driven_workloads_finish_with_the_expected_tokens_and_free_every_block(workload):
    config, specs = workload
    sched, incs, loop = _make(config)
    pool = sched.pool
    added: list[tuple[Request, Incarnation, int]] = []        # (request, incarnation, iteration added)
    aborted: set[int] = set()                                  # id() of aborted requests
    ended_at: dict[str, int] = {}                              # an id -> the iteration its first request ended
    inflight_aborts = readds_in_flight = 0

    def in_flight(request_id: str) -> bool:
        return loop.inflight is not None and request_id in loop.inflight.delta.request_ids

    total_tokens = sum(len(s.first.prompt) + 2 * config["max_model_len"] for s in specs)
    last_arrival = max(s.arrival_step for s in specs)
    bound = last_arrival + 10 + 4 * total_tokens * (1 + 2 * len(specs))
    pending_again = [s for s in specs if s.again is not None]
    step = 0
    while step <= last_arrival or sched.num_unfinished or loop.inflight is not None or pending_again:
        assert step <= bound, "the scheduler did not finish"
        for spec in specs:
            if spec.arrival_step == step:
                added.append((_add(sched, spec.first, incs), spec.first, step))
        for req, inc, at in added:
            if inc.abort_after is not None and at + inc.abort_after == step and not req.finished:
                inflight_aborts += in_flight(req.request_id)
                assert sched.finish(req.request_id, "abort") is req
                aborted.add(id(req))
                assert not list(sched.block_ids(req.request_id))
        for spec in list(pending_again):
            first = next((r for r, inc, _ in added if inc is spec.first), None)
            if first is None or not first.finished:
                continue
            ended_at.setdefault(spec.first.request_id, step)
            if step >= ended_at[spec.first.request_id] + spec.readd_delay:
                readds_in_flight += in_flight(spec.first.request_id)
                added.append((_add(sched, spec.again, incs), spec.again, step))
                pending_again.remove(spec)
        loop.step()
        step += 1

    for req, inc, _ in added:
        assert req.status is RequestStatus.FINISHED
        expected, reason = expected_output(inc, config["max_model_len"])
        if id(req) in aborted:
            assert req.finish_reason == "abort"
            assert req.output_token_ids == expected[:len(req.output_token_ids)]
        else:
            assert (req.output_token_ids, req.finish_reason) == (expected, reason), req.request_id
    assert not sched.requests and not sched.waiting and not sched.running
    assert pool.num_used_blocks == 0
    assert pool.num_free_blocks + pool.num_cached_blocks == pool.num_blocks
    if not config["prefix_caching"]:
        assert pool.num_cached_blocks == 0
    sched.kv.check_invariants()
    # shown by --hypothesis-show-statistics: how often the interesting paths ran
    stats = loop.stats
    event(f"continuations made: {stats['continuations'] > 0}")
    event(f"mixed continuations (prefill chunks or admissions): {stats['mixed'] > 0}")
    event(f"continuations refused: {stats['refused'] > 0}")
    event(f"preempted: {sched.num_preemptions > 0}")
    event(f"prefix hits: {sched.num_prefix_hits > 0}")
    event(f"a round in flight read and dropped: {stats['dropped'] > 0}")
    event(f"aborted while in flight: {inflight_aborts > 0}")
    event(f"id re-added while its old round is in flight: {readds_in_flight > 0}")


def test_a_waiting_single_step_request_is_not_held_back_by_continued_rounds():
    """Found in review: a request that needs the host each token (a grammar, multi-token bad words) at the
    head of the waiting queue is never admitted by a continuation, and every continuation was made while it
    waited, so it (and every request behind it) waited until the running requests ended: 38 steps here,
    where the synchronous engine admits it at the next step. schedule_continuation now returns None while
    such a request heads the queue with a batch slot free, so the next step's schedule() admits it."""
    config = dict(block_size=4, max_model_len=48, num_blocks=24, max_num_seqs=4, max_num_batched_tokens=16,
                  prefix_caching=False, num_steps=1)
    sched, incs, loop = _make(config)
    outputs = [1, 2, 3, 4, 5, 6] * 8
    _add(sched, Incarnation("long", [1, 2, 3], 40, True, False, outputs, None), incs)
    for _ in range(3):
        loop.step()
    assert loop.inflight is not None                    # rounds are being continued
    late = [_add(sched, Incarnation("host", [4, 3], 3, True, False, outputs, None, single_step=True), incs),
            _add(sched, Incarnation("plain", [2, 2], 3, True, False, outputs, None), incs)]
    waited = 0
    while any(req.num_computed_tokens == 0 and not req.finished for req in late):
        assert waited < 40
        loop.step()
        waited += 1
    assert waited <= 2, f"admitted after {waited} steps"
