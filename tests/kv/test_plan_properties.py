"""Invariants of plan_kv_cache over random specs, readings and limits (hypothesis)."""

from __future__ import annotations

import dataclasses

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvfit.errors import CapacityError
from kvfit.kv.plan import MAX_BLOCK_ID, OFFSET_32_BIT, OFFSET_64_BIT, MemoryReading, PlanLimits, plan_kv_cache
from kvfit.kv.spec import KVSpec

GiB = 1 << 30

specs = st.builds(
    KVSpec,
    num_layers=st.integers(1, 96),
    block_size=st.sampled_from([1, 2, 8, 16, 32, 64, 128]),
    kv_heads_per_rank=st.integers(1, 16),
    head_dim=st.sampled_from([1, 8, 64, 80, 96, 128, 192, 256, 576]),
    dtype=st.sampled_from(["float32", "bfloat16", "float16", "fp8_e4m3"]),
    mla=st.booleans(),
)


@st.composite
def cases(draw, only_memory=False):
    """A spec, a reading with room for about `blocks` blocks, and limits that mostly leave a valid plan."""
    spec = draw(specs)
    blocks = draw(st.integers(1, 1 << 22))
    kv_bytes = blocks * spec.bytes_per_block + draw(st.integers(0, spec.bytes_per_block - 1))
    parts = draw(st.lists(st.integers(0, 40 * GiB), min_size=5, max_size=5))
    explicit = draw(st.booleans())
    budget = sum(parts) + (draw(st.integers(1, 10 * GiB)) if explicit else kv_bytes)
    reading = MemoryReading(total_bytes=budget + draw(st.integers(0, 10 * GiB)), budget_bytes=budget,
                            weights_bytes=parts[0], activation_peak_bytes=parts[1], non_torch_bytes=parts[2],
                            cuda_graph_bytes=parts[3], in_use_at_start_bytes=parts[4],
                            kv_cache_memory_bytes=kv_bytes if explicit else None)
    tokens = blocks * spec.block_size
    limits = PlanLimits(
        max_model_len=draw(st.one_of(st.integers(1, tokens), st.integers(1, 2 * tokens))),
        num_gpu_blocks_override=None if only_memory else draw(
            st.one_of(st.none(), st.integers(1, blocks), st.integers(1, 2 * blocks))),
        max_num_blocks=None if only_memory else draw(st.one_of(st.none(), st.integers(1, 2 * blocks))),
        max_element_offset=draw(st.sampled_from([OFFSET_32_BIT, OFFSET_64_BIT])),
    )
    return spec, reading, limits


def plan_or_none(reading, spec, limits):
    try:
        return plan_kv_cache(reading, spec, limits)
    except CapacityError:
        return None


@settings(max_examples=100, deadline=None)
@given(case=cases())
def test_every_plan_respects_every_limit(case):
    spec, reading, limits = case
    plan = plan_or_none(reading, spec, limits)
    assume(plan is not None)
    n = plan.num_blocks
    assert n >= 1
    # the override replaces the memory limit; the smallest limit wins
    first = limits.num_gpu_blocks_override if limits.num_gpu_blocks_override is not None else plan.limits["memory"]
    assert n == min(v for v in (first, limits.max_num_blocks, plan.limits["index_width"]) if v is not None)
    assert n <= plan.limits["memory"] == max(reading.available_kv_bytes, 0) // spec.bytes_per_block
    for name in ("override", "max_num_blocks", "index_width"):
        if plan.limits[name] is not None:
            assert n <= plan.limits[name]
    assert plan.limits[plan.bound_by] == n
    # the backend can address every element of every per-layer tensor, block ids fit int32
    assert n * spec.elements_per_block - 1 <= limits.max_element_offset
    assert n - 1 <= MAX_BLOCK_ID
    assert plan.kv_cache_bytes == n * spec.bytes_per_block <= plan.available_kv_bytes
    assert n >= spec.num_blocks_for_tokens(limits.max_model_len)       # one full request fits
    assert plan.token_capacity == n * spec.block_size


@settings(max_examples=100, deadline=None)
@given(case=cases(only_memory=True))
def test_no_block_is_wasted_when_bound_by_memory(case):
    spec, reading, limits = case
    plan = plan_or_none(reading, spec, limits)
    assume(plan is not None and plan.bound_by == "memory")
    assert plan.num_blocks * spec.bytes_per_block <= plan.available_kv_bytes
    assert plan.num_blocks * spec.bytes_per_block + spec.bytes_per_block > plan.available_kv_bytes


@settings(max_examples=100, deadline=None)
@given(case=cases(), extra=st.integers(1, 100 * GiB),
       field=st.sampled_from(["budget_bytes", "kv_cache_memory_bytes", "less_weights"]))
def test_more_memory_never_gives_fewer_blocks(case, extra, field):
    spec, reading, limits = case
    if field == "budget_bytes":
        more = dataclasses.replace(reading, budget_bytes=reading.budget_bytes + extra,
                                   total_bytes=reading.total_bytes + extra)
    elif field == "kv_cache_memory_bytes":
        assume(reading.kv_cache_memory_bytes is not None)
        more = dataclasses.replace(reading, kv_cache_memory_bytes=reading.kv_cache_memory_bytes + extra)
    else:
        more = dataclasses.replace(reading, weights_bytes=max(reading.weights_bytes - extra, 0))
    assert more.available_kv_bytes >= reading.available_kv_bytes
    small = plan_or_none(reading, spec, limits)
    assume(small is not None)
    big = plan_or_none(more, spec, limits)
    assert big is not None, "more memory turned a working plan into an error"
    assert big.num_blocks >= small.num_blocks


@settings(max_examples=100, deadline=None)
@given(case=cases(), weights=st.lists(st.integers(-GiB, GiB), min_size=1, max_size=4))
def test_several_ranks_plan_as_the_tightest_alone(case, weights):
    spec, reading, limits = case
    ranks = [dataclasses.replace(reading, weights_bytes=max(reading.weights_bytes + w, 0)) for w in weights]
    plan = plan_or_none(ranks, spec, limits)
    assume(plan is not None)
    tightest = min(ranks, key=lambda r: r.available_kv_bytes)
    alone = plan_kv_cache(tightest, spec, limits)
    assert plan.num_blocks == alone.num_blocks and plan.bound_by == alone.bound_by
    assert plan.available_kv_bytes == min(r.available_kv_bytes for r in ranks)
    for r in ranks:
        assert plan.num_blocks * spec.bytes_per_block <= r.available_kv_bytes


@settings(max_examples=100, deadline=None)
@given(case=cases())
def test_a_plan_is_a_pure_function(case):
    spec, reading, limits = case
    a, b = plan_or_none(reading, spec, limits), plan_or_none(reading, spec, limits)
    assert (a is None) == (b is None)
    if a is not None:
        assert a.to_dict() == b.to_dict()
