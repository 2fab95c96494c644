"""KVSpec: bytes per block and the cache layout, computed once, from tiny made-up models."""

from __future__ import annotations

import dataclasses

import pytest

from kvfit.errors import ConfigError
from kvfit.kv.spec import (KV_CACHE_DTYPES, KVSpec, check_block_size, kv_heads_per_rank, num_blocks_for_tokens,
                           resolve_kv_cache_dtype)
from kvfit.model_facts import facts_from_config

BASE_CFG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 4,
            "vocab_size": 100, "max_position_embeddings": 256, "torch_dtype": "bfloat16"}
MLA_CFG = {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
           "moe_intermediate_size": 32, "num_hidden_layers": 5, "num_attention_heads": 8,
           "num_key_value_heads": 8, "n_routed_experts": 4, "n_shared_experts": 1, "first_k_dense_replace": 1,
           "q_lora_rank": 24, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
           "v_head_dim": 16, "vocab_size": 100, "max_position_embeddings": 256, "torch_dtype": "bfloat16"}


def facts(**overrides):
    return facts_from_config({**BASE_CFG, **overrides})


@pytest.mark.parametrize("layers,block_size,kv_heads,head_dim,dtype,dtype_bytes", [
    (1, 1, 1, 1, "float32", 4),
    (3, 16, 4, 8, "bfloat16", 2),
    (32, 16, 8, 128, "float16", 2),
    (80, 32, 1, 128, "fp8_e4m3", 1),
])
def test_bytes_per_block_is_k_and_v_of_every_layer(layers, block_size, kv_heads, head_dim, dtype, dtype_bytes):
    spec = KVSpec(layers, block_size, kv_heads, head_dim, dtype)
    assert spec.dtype_bytes == dtype_bytes
    assert spec.elements_per_block == block_size * kv_heads * head_dim
    assert spec.bytes_per_block == 2 * layers * block_size * kv_heads * head_dim * dtype_bytes
    assert spec.to_dict()["bytes_per_block"] == spec.bytes_per_block


def test_from_model_uses_model_dims_and_tp_split():
    f = facts()
    head_dim = BASE_CFG["hidden_size"] // BASE_CFG["num_attention_heads"]
    for tp, heads in [(1, 4), (2, 2), (4, 1)]:
        spec = KVSpec.from_model(f, block_size=16, tensor_parallel_size=tp)
        assert (spec.num_layers, spec.block_size, spec.kv_heads_per_rank, spec.head_dim, spec.dtype) == \
            (3, 16, heads, head_dim, "bfloat16")
        assert spec.bytes_per_block == 2 * 3 * 16 * heads * head_dim * 2


def test_mla_has_one_latent_tensor_not_split_by_tp():
    f = facts_from_config(MLA_CFG)
    latent = MLA_CFG["kv_lora_rank"] + MLA_CFG["qk_rope_head_dim"]
    for tp in (1, 2, 8):
        spec = KVSpec.from_model(f, block_size=16, tensor_parallel_size=tp)
        assert spec.mla and spec.tensors_per_layer == 1
        assert spec.kv_heads_per_rank == 1 and spec.head_dim == latent
        assert spec.bytes_per_block == MLA_CFG["num_hidden_layers"] * 16 * latent * 2   # no factor 2 for K/V
        assert spec.layer_shape(7) == (7, 16, 1, latent)
    with pytest.raises(ConfigError, match="--tensor-parallel-size 3"):
        KVSpec.from_model(f, tensor_parallel_size=3)   # 8 attention heads do not split 3 ways


@pytest.mark.parametrize("num_kv_heads,tp,expected", [
    (8, 1, 8), (8, 2, 4), (8, 8, 1),      # split
    (8, 16, 1), (2, 8, 1), (1, 4, 1),     # replicated: tp is a multiple of the heads
])
def test_kv_heads_per_rank(num_kv_heads, tp, expected):
    assert kv_heads_per_rank(num_kv_heads, tp) == expected


@pytest.mark.parametrize("num_kv_heads,tp", [(8, 3), (8, 12), (4, 6), (8, 0), (8, -2)])
def test_kv_heads_per_rank_errors(num_kv_heads, tp):
    with pytest.raises(ConfigError, match="--tensor-parallel-size"):
        kv_heads_per_rank(num_kv_heads, tp)


@pytest.mark.parametrize("kv_cache_dtype,model_dtype,expected,nbytes", [
    ("auto", "bfloat16", "bfloat16", 2),
    ("auto", "float32", "float32", 4),
    ("auto", "float16", "float16", 2),
    ("bfloat16", "float32", "bfloat16", 2),
    ("float16", "bfloat16", "float16", 2),
    ("float32", "bfloat16", "float32", 4),
    ("fp8", "bfloat16", "fp8_e4m3", 1),
    ("fp8_e4m3", "float16", "fp8_e4m3", 1),
    ("FP8", "bfloat16", "fp8_e4m3", 1),
])
def test_kv_cache_dtype(kv_cache_dtype, model_dtype, expected, nbytes):
    assert resolve_kv_cache_dtype(kv_cache_dtype, model_dtype) == expected
    f = facts(torch_dtype=model_dtype)
    spec = KVSpec.from_model(f, block_size=16, kv_cache_dtype=kv_cache_dtype)
    assert spec.dtype == expected and spec.dtype_bytes == nbytes
    assert spec.bytes_per_block == 2 * f.num_layers * 16 * f.num_kv_heads * f.head_dim * nbytes


def test_every_listed_kv_cache_dtype_resolves():
    for name in KV_CACHE_DTYPES:
        assert resolve_kv_cache_dtype(name, "bfloat16") in ("bfloat16", "float16", "float32", "fp8_e4m3")


@pytest.mark.parametrize("name", ["int8", "fp4", "float64", ""])
def test_unknown_kv_cache_dtype_is_an_error(name):
    with pytest.raises(ConfigError, match="--kv-cache-dtype") as err:
        KVSpec.from_model(facts(), kv_cache_dtype=name)
    assert "fp8" in str(err.value) and "auto" in str(err.value)


@pytest.mark.parametrize("bad", [0, -16, 3, 12, 24, 100, 1.5, 16.0, "16", True, None])
def test_block_size_must_be_a_positive_power_of_two(bad):
    with pytest.raises(ConfigError, match="--block-size"):
        check_block_size(bad)
    with pytest.raises(ConfigError, match="--block-size"):
        KVSpec.from_model(facts(), block_size=bad)


@pytest.mark.parametrize("good", [1, 2, 16, 32, 128, 1 << 20])
def test_power_of_two_block_sizes_are_accepted(good):
    assert check_block_size(good) == good
    assert KVSpec.from_model(facts(), block_size=good).block_size == good


def test_layer_shape_is_blocks_tokens_heads_dim():
    spec = KVSpec(num_layers=2, block_size=16, kv_heads_per_rank=4, head_dim=8, dtype="bfloat16")
    assert spec.layer_shape(10) == (10, 16, 4, 8)
    # elements of one layer tensor = num_blocks * elements_per_block
    n, b, h, d = spec.layer_shape(10)
    assert n * b * h * d == 10 * spec.elements_per_block


@pytest.mark.parametrize("block_size,heads,head_dim", [(16, 1, 128), (16, 8, 128), (32, 4, 64), (1, 1, 1),
                                                       (16, 3, 96)])
@pytest.mark.parametrize("max_offset", [2**31 - 1, 2**63 - 1])
def test_max_addressable_blocks(block_size, heads, head_dim, max_offset):
    spec = KVSpec(1, block_size, heads, head_dim, "bfloat16")
    epb = block_size * heads * head_dim
    n = spec.max_addressable_blocks(max_offset)
    assert n == (max_offset + 1) // epb
    # the last element of the last block is addressable; one more block would not be
    assert n * epb - 1 <= max_offset
    assert (n + 1) * epb - 1 > max_offset


def test_max_addressable_blocks_32_bit_powers_of_two():
    spec = KVSpec(1, 16, 8, 128, "bfloat16")   # 2^14 elements per block
    assert spec.max_addressable_blocks(2**31 - 1) == 2**31 // 2**14 == 131072
    assert spec.max_addressable_blocks(2**63 - 1) == 2**49


def test_num_blocks_for_tokens_rounds_up():
    spec = KVSpec(1, 16, 1, 8, "float32")
    assert [spec.num_blocks_for_tokens(t) for t in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]
    # the free function is the same rule, for callers that hold a block size but no spec
    assert [num_blocks_for_tokens(t, 4) for t in (0, 1, 4, 5, 2**40 + 1)] == [0, 1, 1, 2, 2**38 + 1]


def test_spec_is_frozen():
    spec = KVSpec(1, 16, 1, 8, "float32")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.num_layers = 2


def test_auto_cache_dtype_follows_the_dtype_the_model_runs_in():
    from kvfit.config import EngineConfig
    from kvfit.planning import spec_and_limits
    from kvfit.model_facts import facts_from_config
    from kvfit.catalog import model_config
    facts = facts_from_config({**model_config("qwen3-0.6b"), "torch_dtype": "float32"})
    spec32, _ = spec_and_limits(facts, EngineConfig.from_kwargs("qwen3-0.6b"), 2**63 - 1, "torch")
    spec16, _ = spec_and_limits(facts, EngineConfig.from_kwargs("qwen3-0.6b", dtype="bfloat16"), 2**63 - 1, "torch")
    assert spec32.dtype == "float32" and spec16.dtype == "bfloat16"
    assert spec32.bytes_per_block == 2 * spec16.bytes_per_block


def test_the_model_dtype_is_resolved_once():
    from kvfit.planning import resolve_model_dtype
    f32 = facts(torch_dtype="float32")
    assert resolve_model_dtype(f32, "auto") == "float32"          # the checkpoint's
    assert [resolve_model_dtype(f32, name) for name in ("bf16", "BFloat16", "half", "fp32")] == \
        ["bfloat16", "bfloat16", "float16", "float32"]
