"""FP8 experts' launch configs: the tuned table's lookup and fallback, the config rules, and the CPU-side parts
of `benchmarks/bench_fused_moe.py --fp8` (candidate enumeration, the printed table, one config swept through
Triton's interpreter at a tiny shape)."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")     # before the kernel's module is (re)imported

from kvfit.kernels import fp8_fused_experts as fe  # noqa: E402
from kvfit.kernels import fused_moe as fm  # noqa: E402

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
QWEN3_30B = (128, 2048, 768, 8)          # E, H, I, top_k
BLOCK = (128, 128)


@pytest.fixture
def bench():
    sys.path.insert(0, BENCHMARKS)
    try:
        yield importlib.import_module("bench_fused_moe")
    finally:
        sys.path.remove(BENCHMARKS)


def _tuned(monkeypatch, per_m: dict, block=BLOCK, shape=QWEN3_30B) -> None:
    num_experts, hidden, inter, top_k = shape
    monkeypatch.setattr(fe, "TUNED_FP8_CONFIGS", {(num_experts, hidden, inter, top_k, fe.fp8_scales_name(block)): per_m})


def test_fp8_config_takes_the_nearest_tuned_entry(monkeypatch):
    small = {**fm.make_config(16, 64, 128, 1, 4, 3), fe.DOWN_BLOCK_N_KEY: 128}
    large = fm.make_config(64, 64, 128, 8, 4, 3)
    _tuned(monkeypatch, {1: small, 256: large})
    e, h, i, k = QWEN3_30B
    assert fe.fp8_config(1, e, h, i, k, BLOCK) == small
    assert fe.fp8_config(128, e, h, i, k, BLOCK) == small        # equally near: the smaller M
    assert fe.fp8_config(129, e, h, i, k, BLOCK) == large
    assert fe.fp8_config(8192, e, h, i, k, BLOCK) == large
    fe.fp8_config(1, e, h, i, k, BLOCK)["BLOCK_SIZE_M"] = 128     # a copy: the table stays as pasted
    assert fe.fp8_config(1, e, h, i, k, BLOCK) == small


def test_fp8_config_falls_back_off_the_tuned_shape(monkeypatch):
    _tuned(monkeypatch, {1: fm.make_config(16, 64, 128, 1, 4, 3)})
    e, h, i, k = QWEN3_30B
    for m in (1, 512, 8192):
        for block, other in ((None, QWEN3_30B), (BLOCK, (e, h, i // 2, k)), (BLOCK, (e, h, i, 4))):
            want = fe.fallback_fp8_config(m, other[0], other[1], other[2], other[3], block)
            assert fe.fp8_config(m, *other, block) == want


def test_fallback_is_the_bf16_tuning_fitted_to_blocks():
    e, h, i, k = QWEN3_30B
    for m in (1, 8, 512, 8192):
        bf16 = fm.get_config(m, e, h, i, k, torch.bfloat16)
        got = fe.fallback_fp8_config(m, e, h, i, k, BLOCK)
        assert got["BLOCK_SIZE_K"] == 128 and got["BLOCK_SIZE_M"] == bf16["BLOCK_SIZE_M"]
        assert got["BLOCK_SIZE_M"] * got["BLOCK_SIZE_N"] <= fe.MAX_BLOCKWISE_TILE
        assert fe.fallback_fp8_config(m, e, h, i, k, None) == bf16


def test_fp8_scales_name():
    assert fe.fp8_scales_name((128, 128)) == "fp8_block128x128"
    assert fe.fp8_scales_name(None) == "fp8_channel"


@pytest.mark.parametrize("config,message", [
    ({**fm.make_config(16, 64, 64, 1, 4, 3)}, "BLOCK_SIZE_K=64 must equal"),
    ({**fm.make_config(16, 64, 128, 1, 4, 3), fe.DOWN_BLOCK_N_KEY: 96}, "BLOCK_SIZE_N_DOWN=96"),
    ({**fm.make_config(16, 64, 128, 1, 4, 3), "BLOCK_SIZE_X": 16}, "exactly the keys"),
])
def test_check_fp8_config_rejects(config, message):
    with pytest.raises(ValueError, match=message):
        fe.check_fp8_config(config, BLOCK)


def test_check_fp8_config_accepts_the_down_key_and_any_k_per_channel():
    fe.check_fp8_config({**fm.make_config(16, 64, 128, 1, 4, 3), fe.DOWN_BLOCK_N_KEY: 128}, BLOCK)
    fe.check_fp8_config(fm.make_config(16, 64, 64, 1, 4, 3), None)


def test_bench_fp8_candidates_are_valid_launches(bench):
    e, h, i, k = QWEN3_30B
    seen = set()
    for m in bench.FP8_M_VALUES:
        configs = bench.fp8_candidates(m, e, k, h, i, BLOCK)
        assert configs[0] == fe.fallback_fp8_config(m, e, h, i, k, BLOCK)    # the default row's baseline
        assert len({tuple(sorted(c.items())) for c in configs}) == len(configs) >= 5
        for cfg in configs:
            fe.check_fp8_config(cfg, BLOCK)
            bm, bn = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"]
            assert bm * bn <= fe.MAX_BLOCKWISE_TILE
            assert cfg["num_stages"] * fm.stage_bytes(bm, bn, 128, 1) <= fm.SMEM_BYTES
            seen.add(tuple(sorted(cfg.items())))
    assert len(seen) <= 48          # distinct compiles in the whole sweep: its budget holds them


def test_bench_tuned_table_pastes_as_the_dict(bench):
    best = {(128, 2048, 768, 8, "fp8_block128x128"): {
        8: {**fm.make_config(16, 64, 128, 1, 4, 4), fe.DOWN_BLOCK_N_KEY: 128},
        1: fm.make_config(16, 32, 128, 1, 4, 3)}}
    text = bench.tuned_table("TUNED_FP8_CONFIGS", best)
    assert text.startswith("TUNED_FP8_CONFIGS: dict[")
    scope = {}
    exec(text, scope)                                                   # noqa: S102 - our own printed literal
    assert scope["TUNED_FP8_CONFIGS"] == best
    assert list(scope["TUNED_FP8_CONFIGS"][next(iter(best))]) == [1, 8]   # rows by M


@pytest.mark.skipif(fe.triton is None, reason="needs triton")
def test_bench_sweeps_one_config_at_a_tiny_shape(bench, monkeypatch):
    """The sweep's CPU-visible path: FP8 experts built as the bench builds them, its reference loop, one
    candidate checked against it (timing replaced: CUDA graphs need a GPU)."""
    global fe
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from triton.runtime.interpreter import InterpretedFunction
        from triton_interpreter import apply_interpreter_fixes
        apply_interpreter_fixes()
        if not isinstance(fe._gate_up_fp8_kernel, InterpretedFunction):
            from kvfit.kernels import fp8_quantize
            if not isinstance(fp8_quantize._quantize_kernel, InterpretedFunction):
                importlib.reload(fp8_quantize)              # first: fe's kernel calls its fp8 helpers
            fe = importlib.reload(fe)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(bench, "DEVICE", device)
    monkeypatch.setattr(bench, "graph_seconds", lambda fn: 1.0)
    num_experts, top_k, hidden, inter, block = 4, 2, 64, 64, (32, 32)
    gen = torch.Generator(device=device).manual_seed(0)
    experts = bench.fp8_experts(num_experts, hidden, inter, block, gen)
    assert [t.shape for t in experts] == [(4, 128, 64), (4, 4, 2), (4, 64, 64), (4, 2, 2)]
    x = torch.randn(5, hidden, device=device, generator=gen)
    weights, ids = fm.select_experts(torch.randn(5, num_experts, device=device, generator=gen), top_k, True)
    ref = bench.fp8_reference(x, experts, block, weights, ids)
    config = bench.fp8_candidates(5, num_experts, top_k, hidden, inter, block)[0]
    assert config["BLOCK_SIZE_K"] == 32

    def run(cfg):
        return fe.fused_fp8_experts(x, *experts[:4], block, weights, ids, cfg)
    results = bench.sweep_configs("tiny", run, [config], ref, deadline=float("inf"))
    assert list(results.values()) == [1.0]
