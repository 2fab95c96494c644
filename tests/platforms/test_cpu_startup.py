"""The CPU platform's start-up estimate: the load and the profile's FLOPs, announced only where it is long."""

from __future__ import annotations

from kvfit.config import EngineConfig
from kvfit.model_facts import load_model_facts
from kvfit.platforms import cpu_startup
from kvfit.platforms.base import Platform
from kvfit.platforms.cpu import CpuPlatform

PLENTY_BYTES = 1 << 40       # host memory available: the weights fit


def test_cpu_startup_work_counts_the_load_the_profile_and_its_attention():
    config = EngineConfig.from_kwargs("llama-3.1-8b", device="cpu", max_num_batched_tokens=4096)
    facts = load_model_facts("llama-3.1-8b")
    load_bytes, flops = cpu_startup.cpu_startup_work(facts, config)
    assert load_bytes == facts.num_params * 2                  # bfloat16 checkpoint
    # widest step (256 sequences of 16 tokens) and longest (one of 4096) differ: two passes over 4096 tokens,
    # each sequence's attention the whole square of its tokens
    per_square = 4 * facts.num_attention_heads * facts.head_dim * facts.num_layers
    assert cpu_startup.profile_shapes(config, facts.max_position_embeddings) == [(256, 16), (1, 4096)]
    assert flops == 2 * facts.num_params * 4096 * 2 + per_square * (256 * 16 ** 2 + 4096 ** 2)


def test_a_512_token_profile_on_the_cpu_is_announced(monkeypatch):
    # issue 32: 512 tokens of qwen3-0.6b took 110 s on a 2-core machine and said nothing
    config = EngineConfig.from_kwargs("qwen3-0.6b", device="cpu", max_num_batched_tokens=512)
    monkeypatch.setattr(cpu_startup, "measured_matmul_flops", lambda dtype: 10e9)       # a 2-core VM in bf16
    seconds, warning = cpu_startup.cpu_startup_estimate(load_model_facts("qwen3-0.6b"), config, PLENTY_BYTES)
    assert seconds > cpu_startup.CPU_SLOW_START_S and "512 tokens" in warning and "with attention" in warning


def test_weights_larger_than_the_memory_announce_no_wait(monkeypatch):
    config = EngineConfig.from_kwargs("qwen3-0.6b", device="cpu", max_num_batched_tokens=512)
    monkeypatch.setattr(cpu_startup, "measured_matmul_flops", lambda dtype: 10e9)
    assert cpu_startup.cpu_startup_estimate(load_model_facts("qwen3-0.6b"), config, 1 << 30) is None


def test_a_small_model_starts_without_a_warning(tiny_llama):
    config = CpuPlatform().resolve_config(EngineConfig.from_kwargs(tiny_llama, device="cpu"))
    assert cpu_startup.cpu_startup_estimate(load_model_facts(tiny_llama), config, PLENTY_BYTES) is None
    assert CpuPlatform().startup_estimate(EngineConfig.from_kwargs(tiny_llama, device="cpu")) is None


def test_only_the_cpu_platform_estimates(tiny_llama, monkeypatch):
    monkeypatch.setattr(cpu_startup, "CPU_SLOW_START_S", 0.0)       # this tiny model counts as slow
    config = EngineConfig.from_kwargs(tiny_llama, device="cpu")
    seconds, warning = CpuPlatform().startup_estimate(config)
    assert seconds > 0 and "on the CPU will take about" in warning
    assert Platform().startup_estimate(config) is None              # a GPU starts in seconds
