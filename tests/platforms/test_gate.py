"""The Triton kernels' one gate: a CUDA tensor with Triton installed; never a host tensor."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvfit.platforms import gate


def test_host_tensors_take_the_torch_path():
    t = torch.zeros(2, 3)
    assert not gate.on_gpu(t) and not gate.triton_applies(t)


def test_gpu_tensors_take_the_kernels_where_triton_imports(monkeypatch):
    on_gpu = SimpleNamespace(is_cuda=True)       # the gate asks nothing else of the tensor
    assert gate.on_gpu(on_gpu) and gate.triton_applies(on_gpu) == gate.triton_importable()
    monkeypatch.setattr(gate, "triton_importable", lambda: False)     # a CPU-only install
    assert not gate.triton_applies(on_gpu)


def test_every_kernel_gate_asks_it(monkeypatch):
    from kvfit.kernels import (fp8_block_gemm, fp8_fused_experts, fp8_gemv, fp8_quantize, fused_moe, fused_ops, gemv,
                               greedy)
    from kvfit.kernels.fp8 import Fp8Weight
    monkeypatch.setattr(gate, "on_gpu", lambda t: True)          # as if these host tensors were on a GPU
    x = torch.zeros(1, 16)
    expected = gate.triton_importable()
    assert fused_ops.available(x) == expected and fused_moe.fused_moe_applies(x) == expected
    assert gemv.gemv_applies(x, torch.zeros(8, 16)) == expected and greedy.applies(x) == expected
    fp8_weight = Fp8Weight(torch.zeros(8, 16, dtype=torch.float8_e4m3fn), torch.ones(8, 1), None)
    assert fp8_quantize.quantize_kernel_applies(x) == expected and fp8_block_gemm.block_gemm_applies(x) == expected
    assert fp8_gemv.fp8_gemv_applies(x, fp8_weight) == expected and fp8_fused_experts.fused_experts_applies(x) == expected
