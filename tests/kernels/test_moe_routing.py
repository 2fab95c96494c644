"""The one-launch MoE routing kernel (kernels/moe_routing.py) against select_experts' torch path: the same
experts in the same order, the same weights (Triton's interpreter on CPU, the real kernel on a GPU)."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

COMPILE_CHECK = __name__ == "__main__" and sys.argv[1:] == ["--compile-check"]
if not torch.cuda.is_available() and not COMPILE_CHECK:
    os.environ.setdefault("TRITON_INTERPRET", "1")     # before the kernel's module is (re)imported
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

from kvfit.kernels import fused_moe as fm  # noqa: E402
from kvfit.kernels import moe_routing as mr  # noqa: E402

if INTERPRET and mr.triton is not None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from triton_interpreter import apply_interpreter_fixes
    apply_interpreter_fixes()
    from triton.runtime.interpreter import InterpretedFunction
    if not isinstance(mr._softmax_topk_kernel, InterpretedFunction):   # imported before TRITON_INTERPRET
        mr = importlib.reload(mr)

needs_triton = pytest.mark.skipif(mr.triton is None, reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _torch_routing(logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype):
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


@needs_triton
@pytest.mark.parametrize("num_experts,top_k", [(128, 8), (8, 2), (60, 4), (5, 5), (256, 1)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_topk_equals_torch(num_experts, top_k, renormalize, dtype):
    gen = torch.Generator().manual_seed(num_experts * 10 + top_k)
    logits = (torch.randn(11, num_experts, generator=gen) * 3).to(dtype).to(DEVICE)
    weights, ids = mr.softmax_topk(logits, top_k, renormalize, dtype)
    want_w, want_ids = _torch_routing(logits, top_k, renormalize, dtype)
    assert ids.dtype == torch.int64 and weights.dtype == dtype
    if dtype == torch.float32:
        assert torch.equal(ids, want_ids)
    else:       # bf16 logits tie often: another of the tied ids may be picked, with the same probability
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        assert torch.equal(probs.gather(1, ids), probs.gather(1, want_ids))
        assert (ids.sort(dim=1).values.diff(dim=1) != 0).all()          # k distinct experts per token
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    assert torch.allclose(weights.float(), want_w.float(), rtol=tol, atol=tol), (weights - want_w).abs().max()


@needs_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")         # the interpreter's numpy on NaN and inf
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_logits_still_name_valid_distinct_experts(bad):
    """A row of NaN or infinite router logits (an overflowed hidden state) must not name an expert past E (the
    grouped GEMMs would read past the experts' weights): k distinct ids in [0, E), whatever the weights."""
    logits = torch.randn(4, 60, device=DEVICE)
    logits[0] = bad                        # the whole row
    logits[1, 7] = bad                     # one entry
    logits[2, ::3] = bad
    weights, ids = mr.softmax_topk(logits, 8, True)
    assert ((ids >= 0) & (ids < 60)).all()
    assert (ids.sort(dim=1).values.diff(dim=1) != 0).all()
    want_w, want_ids = _torch_routing(logits[3:], 8, True, torch.float32)
    assert torch.equal(ids[3:], want_ids) and torch.allclose(weights[3:], want_w, atol=1e-6)   # a finite row


@needs_triton
def test_the_kernel_is_select_experts_path_where_triton_runs(monkeypatch):
    """select_experts takes the kernel for a row-major [T, E] tensor where Triton applies (CUDA, or the test's
    stand-in), the torch path otherwise; no tokens give empty results."""
    logits = torch.randn(6, 16, device=DEVICE)
    monkeypatch.setattr(fm, "routing_kernel_applies", lambda x, k: True)
    monkeypatch.setattr(fm, "softmax_topk", mr.softmax_topk)
    weights, ids = fm.select_experts(logits, 3, True, weights_dtype=torch.bfloat16)
    want_w, want_ids = _torch_routing(logits, 3, True, torch.bfloat16)
    assert torch.equal(ids, want_ids) and torch.allclose(weights.float(), want_w.float(), atol=8e-3)
    empty_w, empty_ids = mr.softmax_topk(logits[:0], 3, True)
    assert empty_w.shape == (0, 3) and empty_ids.shape == (0, 3)
    assert not mr.routing_kernel_applies(logits.t(), 3)            # not row-major
    assert not mr.routing_kernel_applies(torch.randn(2, 2048, device=DEVICE), 2)   # past MAX_ROUTED_EXPERTS


def _compile_check() -> None:
    """The routing kernel compiled for sm_90 (Qwen3-30B-A3B's 128 experts, top 8; Mixtral's 8, top 2; 1,024
    experts): no register spills."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from triton_interpreter import compile_sm90
    for dtype in ("bf16", "fp32"):
        for e, k in ((128, 8), (8, 2), (1024, 8)):
            sig = {"logits_ptr": f"*{dtype}", "weights_ptr": f"*{dtype}", "ids_ptr": "*i64", "stride_l": "i32",
                   "E": "constexpr", "E_PAD": "constexpr", "K": "constexpr", "K_PAD": "constexpr",
                   "RENORMALIZE": "constexpr"}
            e_pad = 1 << (e - 1).bit_length()
            _, spills, report = compile_sm90(mr._softmax_topk_kernel, sig,
                                             {"E": e, "E_PAD": e_pad, "K": k, "K_PAD": 1 << (k - 1).bit_length(),
                                              "RENORMALIZE": True},
                                             {"logits_ptr", "weights_ptr", "ids_ptr"},
                                             {"num_warps": 1 if e_pad <= 256 else 4})
            assert spills == 0, report
    print("ok: the routing kernel compiles")


@needs_triton
def test_the_routing_kernel_compiles_for_sm90():
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from triton_interpreter import run_compile_check
    run_compile_check(__file__, "ok: the routing kernel compiles")


if COMPILE_CHECK:
    _compile_check()
