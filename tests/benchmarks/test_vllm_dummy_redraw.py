"""bench_vs_vllm.redraw_like_kvfit: vLLM's FP8 dummy weights redrawn as kvfit draws its own, in place."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import bench_vs_vllm  # noqa: E402


def _vllm_like_module() -> torch.nn.Module:
    """Parameters named and typed as vLLM's block-FP8 Qwen3-MoE layer holds them, drawn as vLLM's dummy loader."""
    def param(shape, dtype):
        drawn = torch.empty(shape, dtype=torch.float16).uniform_(-1e-3, 1e-3)
        return torch.nn.Parameter(drawn.to(dtype), requires_grad=False)
    module = torch.nn.Module()
    module.register_parameter("w13_weight", param((4, 256, 128), torch.float8_e4m3fn))
    module.register_parameter("w13_weight_scale_inv", param((4, 2, 1), torch.float32))
    module.register_parameter("input_layernorm_weight", param((128,), torch.bfloat16))
    module.register_parameter("gate_weight", param((4, 128), torch.bfloat16))
    module.register_parameter("qkv_input_scale", param((1,), torch.float32))
    return module


def test_vllms_own_fp8_draw_is_nearly_all_zeros():
    """Why the redraw exists: e4m3 cannot hold +-1e-3 (its smallest step is 2^-9), so vLLM's draw is zeros."""
    module = _vllm_like_module()
    assert (module.w13_weight.float() == 0).float().mean() > 0.9


def test_redraw_gives_kvfits_distribution_in_place():
    module = _vllm_like_module()
    pointers = {name: p.data_ptr() for name, p in module.named_parameters()}
    counts = bench_vs_vllm.redraw_like_kvfit(module)
    assert counts == {"fp8": 1, "scales": 2, "norms": 1, "other": 1}
    assert pointers == {name: p.data_ptr() for name, p in module.named_parameters()}
    weights = module.w13_weight.float() * module.w13_weight_scale_inv.flatten()[0]
    assert weights.std().item() == pytest.approx(bench_vs_vllm.DUMMY_STD, rel=0.05)
    assert (weights == 0).float().mean() < 0.05
    assert torch.all(module.w13_weight_scale_inv == bench_vs_vllm.FP8_DUMMY_SCALE)
    assert torch.all(module.input_layernorm_weight == 1)
    assert torch.all(module.qkv_input_scale == 1 / 64)
    assert module.gate_weight.float().std().item() == pytest.approx(bench_vs_vllm.DUMMY_STD, rel=0.2)


def test_redraw_fills_a_transposed_fp8_weight_in_place():
    """vLLM may keep an FP8 weight as a transposed view after loading: the redraw must land in it."""
    module = torch.nn.Module()
    weight = torch.zeros(4, 128, 256).to(torch.float8_e4m3fn).transpose(1, 2)
    module.register_parameter("w13_weight", torch.nn.Parameter(weight, requires_grad=False))
    bench_vs_vllm.redraw_like_kvfit(module)
    assert (module.w13_weight.float() == 0).float().mean() < 0.05


def test_redraw_matches_kvfits_own_fp8_dummy_weights():
    """The same spread as kvfit's dummy loader gives a block-FP8 weight (its per-block scales, dequantized)."""
    from kvfit.models.loader import DUMMY_STD
    assert bench_vs_vllm.DUMMY_STD == DUMMY_STD
    module = _vllm_like_module()
    bench_vs_vllm.redraw_like_kvfit(module)
    ours = module.w13_weight.float() * bench_vs_vllm.FP8_DUMMY_SCALE
    drawn = torch.empty(4, 256, 128).normal_(0.0, DUMMY_STD, generator=torch.Generator().manual_seed(1))
    blocks = drawn.reshape(4, 2, 128, 128)
    scale = blocks.abs().amax(dim=(2, 3), keepdim=True) / 448
    kvfits = ((blocks / scale).to(torch.float8_e4m3fn).float() * scale).reshape(4, 256, 128)
    assert ours.std().item() == pytest.approx(kvfits.std().item(), rel=0.05)
