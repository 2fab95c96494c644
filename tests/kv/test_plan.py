"""plan_kv_cache with made-up byte counts: every expected number is computed here from the inputs."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from kvfit.errors import CapacityError, ConfigError
from kvfit.kv.plan import (BOUND_NAMES, MAX_BLOCK_ID, OFFSET_32_BIT, OFFSET_64_BIT, MemoryReading, PlanLimits,
                           device_budget_bytes, over_budget, plan_kv_cache)
from kvfit.kv.spec import KVSpec
from kvfit.units import GiB, gib

# Llama-3.1-8B-like shapes at GiB scale, so the GiB figures in messages are distinct numbers.
SPEC = KVSpec(num_layers=32, block_size=16, kv_heads_per_rank=8, head_dim=128, dtype="bfloat16")
BPB = 2 * 32 * 16 * 8 * 128 * 2      # K and V x layers x block_size x heads x head_dim x bytes


def reading(**kw) -> MemoryReading:
    base = dict(total_bytes=80 * GiB, budget_bytes=72 * GiB, weights_bytes=15 * GiB + 12_345,
                activation_peak_bytes=int(3.25 * GiB), non_torch_bytes=GiB // 2, cuda_graph_bytes=int(0.75 * GiB),
                in_use_at_start_bytes=int(1.5 * GiB))
    return MemoryReading(**{**base, **kw})


def available(r: MemoryReading) -> int:
    if r.kv_cache_memory_bytes is not None:
        return r.kv_cache_memory_bytes
    return (r.budget_bytes - r.weights_bytes - r.activation_peak_bytes - r.non_torch_bytes
            - r.cuda_graph_bytes - r.in_use_at_start_bytes)


def test_spec_bytes_per_block_matches_the_formula():
    assert SPEC.bytes_per_block == BPB


def test_memory_bound_plan_is_available_bytes_over_bytes_per_block():
    r = reading()
    avail = 72 * GiB - (15 * GiB + 12_345) - int(3.25 * GiB) - GiB // 2 - int(0.75 * GiB) - int(1.5 * GiB)
    assert r.available_kv_bytes == available(r) == avail
    plan = plan_kv_cache(r, SPEC, PlanLimits(max_model_len=64))
    expected = avail // BPB
    assert expected == 51 * GiB // (2 << 20) - 1      # 51 GiB less 12,345 bytes, in 2 MiB blocks
    assert plan.num_blocks == expected
    assert plan.bound_by == "memory"
    assert plan.kv_cache_bytes == expected * BPB
    assert plan.available_kv_bytes == avail
    assert plan.bytes_per_block == BPB and plan.block_size == 16
    assert plan.token_capacity == expected * 16
    assert plan.max_concurrency == pytest.approx(expected / math.ceil(64 / 16), abs=0.005)
    assert plan.warnings == []
    assert plan.limits["memory"] == expected
    assert plan.limits["override"] is None and plan.limits["max_num_blocks"] is None
    assert plan.limits["index_width"] == min((OFFSET_64_BIT + 1) // SPEC.elements_per_block, MAX_BLOCK_ID + 1)


def test_plan_records_the_spec_and_backend():
    plan = plan_kv_cache(reading(), SPEC, PlanLimits(max_model_len=64, backend="triton"), tensor_parallel_size=2)
    assert (plan.num_layers, plan.kv_heads_per_rank, plan.head_dim, plan.kv_cache_dtype) == (32, 8, 128, "bfloat16")
    assert plan.backend == "triton" and plan.max_element_offset == OFFSET_64_BIT
    assert plan.tensor_parallel_size == 2
    assert plan.max_model_len == 64
    assert plan.reading == dataclasses.asdict(reading())


@pytest.mark.parametrize("max_model_len", [1, 15, 16, 17, 100, 257])
def test_max_concurrency_is_blocks_over_blocks_per_request(max_model_len):
    plan = plan_kv_cache(reading(), SPEC, PlanLimits(max_model_len=max_model_len))
    blocks_per_request = math.ceil(max_model_len / SPEC.block_size)
    assert plan.max_concurrency == pytest.approx(plan.num_blocks / blocks_per_request, abs=0.005)
    assert plan.token_capacity == plan.num_blocks * SPEC.block_size


def test_override_replaces_the_memory_limit():
    memory = available(reading()) // BPB
    plan = plan_kv_cache(reading(), SPEC, PlanLimits(max_model_len=64, num_gpu_blocks_override=100))
    assert plan.num_blocks == 100 and plan.bound_by == "override"
    assert plan.limits["override"] == 100 and plan.limits["memory"] == memory
    assert plan.kv_cache_bytes == 100 * BPB
    # an override equal to the memory limit is allowed
    plan = plan_kv_cache(reading(), SPEC, PlanLimits(max_model_len=64, num_gpu_blocks_override=memory))
    assert plan.num_blocks == memory and plan.bound_by == "override"


def test_override_larger_than_memory_is_an_error_with_the_numbers():
    memory = available(reading()) // BPB
    override = memory + 1000
    with pytest.raises(CapacityError) as err:
        plan_kv_cache(reading(), SPEC, PlanLimits(max_model_len=64, num_gpu_blocks_override=override))
    msg = str(err.value)
    assert "--num-gpu-blocks-override" in msg and str(override) in msg
    assert gib(override * BPB) in msg and gib(available(reading())) in msg
    assert f"({memory} blocks)" in msg


def test_max_num_blocks_caps_with_a_warning():
    memory = available(reading()) // BPB
    cap = memory // 3
    plan = plan_kv_cache(reading(), SPEC, PlanLimits(max_model_len=64, max_num_blocks=cap))
    assert plan.num_blocks == cap and plan.bound_by == "max_num_blocks"
    assert plan.limits["max_num_blocks"] == cap and plan.limits["memory"] == memory
    assert len(plan.warnings) == 1
    assert f"--max-num-blocks {cap}" in plan.warnings[0] and str(memory - cap) in plan.warnings[0]


def test_max_num_blocks_above_memory_does_not_bind():
    memory = available(reading()) // BPB
    plan = plan_kv_cache(reading(), SPEC, PlanLimits(max_model_len=64, max_num_blocks=memory * 2))
    assert plan.num_blocks == memory and plan.bound_by == "memory" and plan.warnings == []


def test_a_tie_is_bound_by_memory_without_a_warning():
    memory = available(reading()) // BPB
    plan = plan_kv_cache(reading(), SPEC, PlanLimits(max_model_len=64, max_num_blocks=memory))
    assert plan.num_blocks == memory and plan.bound_by == "memory" and plan.warnings == []


def test_override_and_max_num_blocks_take_the_smaller():
    plan = plan_kv_cache(reading(), SPEC, PlanLimits(max_model_len=64, num_gpu_blocks_override=100,
                                                     max_num_blocks=40))
    assert plan.num_blocks == 40 and plan.bound_by == "max_num_blocks"
    plan = plan_kv_cache(reading(), SPEC, PlanLimits(max_model_len=64, num_gpu_blocks_override=30,
                                                     max_num_blocks=40))
    assert plan.num_blocks == 30 and plan.bound_by == "override"


BIG = MemoryReading(total_bytes=150 * GiB, budget_bytes=141 * GiB, weights_bytes=0)
TINY_MODEL = KVSpec(num_layers=1, block_size=16, kv_heads_per_rank=1, head_dim=128, dtype="bfloat16")


def test_32_bit_backend_is_bound_by_index_width_with_a_warning():
    limits = PlanLimits(max_model_len=4096, max_element_offset=2**31 - 1, backend="fake32")
    plan = plan_kv_cache(BIG, TINY_MODEL, limits)
    elements_per_block = 16 * 1 * 128
    index = 2**31 // elements_per_block
    memory = (141 * GiB) // (2 * 1 * elements_per_block * 2)
    assert memory > index    # the case is only interesting if memory would allow more
    assert plan.num_blocks == index and plan.bound_by == "index_width"
    assert plan.limits["index_width"] == index and plan.limits["memory"] == memory
    assert plan.backend == "fake32" and plan.max_element_offset == OFFSET_32_BIT
    # the largest element offset in one layer tensor fits in 31 bits
    assert plan.num_blocks * elements_per_block - 1 <= 2**31 - 1
    assert len(plan.warnings) == 1
    w = plan.warnings[0]
    assert "fake32" in w and str(index) in w and str(memory) in w and str(2**31 - 1) in w


def test_one_layer_one_head_on_141_gib_plans_millions_of_blocks_bound_by_memory():
    plan = plan_kv_cache(BIG, TINY_MODEL, PlanLimits(max_model_len=4096))
    bytes_per_block = 2 * 1 * 16 * 1 * 128 * 2
    assert plan.num_blocks == (141 * GiB) // bytes_per_block
    assert plan.num_blocks > 10**6
    assert plan.bound_by == "memory" and plan.warnings == []
    assert plan.limits["index_width"] > plan.num_blocks


def test_64_bit_offsets_still_keep_block_ids_in_int32():
    # 8 bytes a block: memory would allow 2^37 blocks, block tables are int32.
    spec = KVSpec(num_layers=1, block_size=1, kv_heads_per_rank=1, head_dim=1, dtype="float32")
    r = MemoryReading(total_bytes=2 << 40, budget_bytes=1 << 40)
    plan = plan_kv_cache(r, spec, PlanLimits(max_model_len=16))
    assert plan.limits["memory"] == (1 << 40) // 8
    assert plan.num_blocks == MAX_BLOCK_ID + 1 and plan.bound_by == "index_width"


def test_weights_over_budget_is_an_error_naming_the_weights():
    for weights in (72 * GiB, 90 * GiB):     # equal to the budget, or over it
        r = reading(weights_bytes=weights)
        with pytest.raises(CapacityError) as err:
            plan_kv_cache(r, SPEC, PlanLimits(max_model_len=64))
        msg = str(err.value)
        assert f"the weights ({gib(weights)})" in msg and gib(72 * GiB) in msg and gib(80 * GiB) in msg
        assert "--gpu-memory-utilization" in msg and "--tensor-parallel-size" in msg


def test_the_budget_check_is_one_rule_with_one_message():
    assert over_budget("the weights", 71 * GiB, 72 * GiB, 80 * GiB, "fix") is None
    msg = over_budget("the weights on rank 1", 72 * GiB, 72 * GiB, 80 * GiB, "use more --tensor-parallel-size")
    assert msg == (f"the weights on rank 1 ({gib(72 * GiB)}) leave no room under the budget ({gib(72 * GiB)}: "
                   f"--gpu-memory-utilization 0.9 of {gib(80 * GiB)}) for the KV cache; use more --tensor-parallel-size")
    assert device_budget_bytes(80 * GiB, 0.9) == int(80 * GiB * 0.9)


@pytest.mark.parametrize("field,name", [("activation_peak_bytes", "activation peak"),
                                        ("non_torch_bytes", "non-torch"), ("cuda_graph_bytes", "CUDA graphs"),
                                        ("in_use_at_start_bytes",
                                         "in use at start (context, other processes, own tensors)")])
def test_no_kv_budget_left_is_an_error_naming_what_used_it(field, name):
    r = reading(**{field: 60 * GiB})      # pushes the budget below zero
    assert r.available_kv_bytes <= 0
    with pytest.raises(CapacityError) as err:
        plan_kv_cache(r, SPEC, PlanLimits(max_model_len=64))
    msg = str(err.value)
    assert "no memory left for the KV cache" in msg
    assert f"{name} {gib(60 * GiB)}" in msg
    assert gib(r.budget_bytes) in msg and gib(r.available_kv_bytes) in msg
    assert "--gpu-memory-utilization" in msg


def test_budget_exactly_zero_is_an_error():
    r = reading(activation_peak_bytes=0)
    r = reading(activation_peak_bytes=r.available_kv_bytes)
    assert r.available_kv_bytes == 0
    with pytest.raises(CapacityError, match="no memory left"):
        plan_kv_cache(r, SPEC, PlanLimits(max_model_len=64))


def test_budget_below_one_block_is_an_error_not_zero_blocks():
    r = reading(activation_peak_bytes=int(3.25 * GiB) + available(reading()) - (BPB - 1))
    assert 0 < r.available_kv_bytes < BPB
    with pytest.raises(CapacityError):
        plan_kv_cache(r, SPEC, PlanLimits(max_model_len=1))


def test_one_request_of_max_model_len_not_fitting_is_an_error():
    memory = available(reading()) // BPB
    fits = memory * SPEC.block_size
    ok = plan_kv_cache(reading(), SPEC, PlanLimits(max_model_len=fits))
    assert ok.num_blocks == memory and ok.max_concurrency == pytest.approx(1.0)
    with pytest.raises(CapacityError) as err:
        plan_kv_cache(reading(), SPEC, PlanLimits(max_model_len=fits + 1))
    msg = str(err.value)
    needed_blocks = memory + 1
    assert f"--max-model-len {fits + 1}" in msg and f"needs {needed_blocks} blocks" in msg
    assert gib(needed_blocks * BPB) in msg and gib(available(reading())) in msg
    assert f"at most {fits}" in msg and "bound by memory" in msg


def test_max_model_len_error_names_the_binding_limit():
    with pytest.raises(CapacityError) as err:
        plan_kv_cache(reading(), SPEC, PlanLimits(max_model_len=64 * 16 + 1, max_num_blocks=64))
    assert "bound by max_num_blocks" in str(err.value) and f"at most {64 * 16}" in str(err.value)


def test_kv_cache_memory_replaces_the_budget():
    kv_bytes = 10 * BPB + BPB - 1
    # weights over the budget do not matter: the KV budget is given explicitly
    r = reading(kv_cache_memory_bytes=kv_bytes, weights_bytes=100 * GiB)
    assert r.available_kv_bytes == kv_bytes
    plan = plan_kv_cache(r, SPEC, PlanLimits(max_model_len=64))
    assert plan.num_blocks == 10 and plan.bound_by == "memory"
    assert plan.available_kv_bytes == kv_bytes


def test_kv_cache_memory_of_zero_is_an_error():
    with pytest.raises(CapacityError, match="no memory left"):
        plan_kv_cache(reading(kv_cache_memory_bytes=0), SPEC, PlanLimits(max_model_len=64))


def test_several_ranks_use_the_minimum_and_warn():
    ranks = [reading(), reading(weights_bytes=18 * GiB), reading(weights_bytes=16 * GiB)]
    per_rank = [available(r) for r in ranks]
    plan = plan_kv_cache(ranks, SPEC, PlanLimits(max_model_len=64), tensor_parallel_size=3)
    assert plan.num_blocks == min(per_rank) // BPB
    assert plan.available_kv_bytes == min(per_rank)
    assert plan.per_rank_available_kv_bytes == per_rank
    assert plan.reading == dataclasses.asdict(ranks[1])      # the tightest rank
    assert plan.tensor_parallel_size == 3
    assert len(plan.warnings) == 1 and "ranks differ" in plan.warnings[0]
    assert all(str(b) in plan.warnings[0] for b in per_rank)


def test_equal_ranks_do_not_warn():
    plan = plan_kv_cache([reading(), reading()], SPEC, PlanLimits(max_model_len=64))
    assert plan.warnings == [] and plan.per_rank_available_kv_bytes == [available(reading())] * 2


def test_one_rank_out_of_memory_names_the_rank():
    with pytest.raises(CapacityError, match="on rank 1"):
        plan_kv_cache([reading(), reading(weights_bytes=100 * GiB)], SPEC, PlanLimits(max_model_len=64))


def test_limits_dict_has_every_bound():
    plan = plan_kv_cache(reading(), SPEC, PlanLimits(max_model_len=64))
    assert set(plan.limits) == {"memory", "override", "max_num_blocks", "index_width"} == set(BOUND_NAMES)
    assert plan.bound_by in BOUND_NAMES


def test_to_dict_is_json_serialisable():
    plan = plan_kv_cache([reading(), reading(weights_bytes=16 * GiB)], SPEC,
                         PlanLimits(max_model_len=64, max_num_blocks=50))
    back = json.loads(json.dumps(plan.to_dict()))
    assert back["num_blocks"] == plan.num_blocks == 50
    assert back["limits"] == plan.limits and back["warnings"] == plan.warnings
    assert back["reading"]["weights_bytes"] == 16 * GiB


def test_log_line_has_the_numbers():
    plan = plan_kv_cache(reading(), SPEC, PlanLimits(max_model_len=64))
    line = plan.log_line()
    assert "\n" not in line
    assert f"{plan.num_blocks} blocks x 16 tokens" in line and "bound by memory" in line
    assert str(plan.token_capacity) in line and gib(plan.kv_cache_bytes) in line


@pytest.mark.parametrize("kw,flag", [({"max_model_len": 0}, "--max-model-len"),
                                     ({"max_model_len": 8, "num_gpu_blocks_override": 0},
                                      "--num-gpu-blocks-override"),
                                     ({"max_model_len": 8, "max_num_blocks": 0}, "--max-num-blocks")])
def test_plan_limits_are_validated(kw, flag):
    with pytest.raises(ConfigError, match=flag):
        PlanLimits(**kw)


def test_reading_explain_adds_up():
    r = reading()
    text = r.explain()
    for part in (r.budget_bytes, r.weights_bytes, r.activation_peak_bytes, r.non_torch_bytes,
                 r.cuda_graph_bytes, r.in_use_at_start_bytes, r.available_kv_bytes):
        assert gib(part) in text
    assert r.non_kv_bytes == r.budget_bytes - r.available_kv_bytes


def test_block_id_cap_warning_does_not_blame_the_offset_width():
    spec = KVSpec(num_layers=1, block_size=1, kv_heads_per_rank=1, head_dim=1, dtype="float32")
    r = MemoryReading(total_bytes=2 << 40, budget_bytes=1 << 40)
    plan = plan_kv_cache(r, spec, PlanLimits(max_model_len=16, max_element_offset=OFFSET_64_BIT))
    assert plan.bound_by == "index_width" and len(plan.warnings) == 1
    assert "64-bit offsets would use them all" not in plan.warnings[0]


def test_a_budget_smaller_than_one_block_says_so():
    spec = KVSpec(num_layers=2, block_size=16, kv_heads_per_rank=2, head_dim=64, dtype="bfloat16")
    r = MemoryReading(total_bytes=1 << 30, budget_bytes=1 << 30, kv_cache_memory_bytes=1024)
    with pytest.raises(CapacityError, match="holds no block"):
        plan_kv_cache(r, spec, PlanLimits(max_model_len=64))


def test_process_budget_is_the_budget_less_memory_outside_the_process():
    from kvfit.kv.plan import MemoryReading
    r = MemoryReading(total_bytes=1000, budget_bytes=900, weights_bytes=100, activation_peak_bytes=50,
                      non_torch_bytes=30, cuda_graph_bytes=20, in_use_at_start_bytes=40)
    assert r.process_budget_bytes == 900 - 30 - 40
    # what the allocator may hold covers exactly weights + activations + graphs + the KV it plans
    assert r.process_budget_bytes == (r.weights_bytes + r.activation_peak_bytes + r.cuda_graph_bytes
                                      + r.available_kv_bytes)
    explicit = MemoryReading(total_bytes=1000, budget_bytes=900, kv_cache_memory_bytes=300)
    assert explicit.process_budget_bytes is None
