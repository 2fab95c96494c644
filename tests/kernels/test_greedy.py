"""The one-pass greedy kernels against torch.argmax and isfinite().all() (Triton's interpreter on CPU)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

COMPILE_CHECK = __name__ == "__main__" and sys.argv[1:] == ["--compile-check"]
if not torch.cuda.is_available() and not COMPILE_CHECK:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from kvfit.kernels import greedy  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1" and not COMPILE_CHECK:
    import importlib

    from triton.runtime.interpreter import InterpretedFunction
    if not isinstance(greedy._chunk_kernel, InterpretedFunction):     # imported before TRITON_INTERPRET was set
        greedy = importlib.reload(greedy)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(greedy, "CHUNK", 64)     # several chunks per row at test sizes


@pytest.mark.filterwarnings("ignore:All-NaN slice")       # the NaN row, in the interpreter's numpy max
@pytest.mark.parametrize("vocab", [64, 100, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tokens_and_finite_match_torch(vocab, dtype):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(7, vocab, generator=g).to(dtype)
    logits[1, [5, vocab - 1]] = 50.0                  # a tie across chunks: the first index wins
    logits[2, [3, 4]] = 60.0                          # a tie inside one chunk
    logits[3, 9] = float("nan")
    logits[4, vocab - 1] = float("inf")
    logits[5, 0] = float("-inf")
    logits[6] = -3.0                                  # every logit equal: index 0
    logits = logits.to(DEVICE)
    tokens, finite = greedy.greedy_tokens(logits)
    expected_finite = torch.isfinite(logits).all(-1)
    assert torch.equal(finite, expected_finite)
    assert finite.tolist() == [True, True, True, False, False, False, True]
    assert torch.equal(tokens[finite], torch.argmax(logits, -1)[finite])
    assert bool(((tokens >= 0) & (tokens < vocab)).all())        # the counts are indexed by every row's
    assert tokens.dtype == torch.int64 and tokens[1] == 5 and tokens[2] == 3 and tokens[6] == 0


@pytest.mark.filterwarnings("ignore:All-NaN slice")
def test_rows_of_nan_still_give_ids_in_range():
    # every chunk's max NaN: no chunk matches the row's max; NaN beside a masked tail lane
    logits = torch.randn(3, 130)
    logits[0] = float("nan")
    logits[1, ::3] = float("nan")
    logits[2, 129] = float("nan")
    tokens, finite = greedy.greedy_tokens(logits.to(DEVICE))
    assert finite.tolist() == [False, False, False]
    assert bool(((tokens >= 0) & (tokens < 130)).all())


def test_rows_of_a_wider_buffer_and_no_rows():
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(3, 300, generator=g).to(DEVICE)
    logits = wide[:, :250]                            # row stride 300
    tokens, finite = greedy.greedy_tokens(logits)
    assert torch.equal(tokens, torch.argmax(logits, -1)) and bool(finite.all())
    tokens, finite = greedy.greedy_tokens(wide[:0])
    assert tokens.shape == (0,) and finite.shape == (0,)


def test_applies_only_on_cuda_rows_with_unit_stride():
    assert not greedy.applies(torch.zeros(2, 8))
    if torch.cuda.is_available():
        assert greedy.applies(torch.zeros(2, 8, device="cuda"))
        assert not greedy.applies(torch.zeros(8, 2, device="cuda").t())


def _compile_check() -> None:
    """Both kernels compiled for sm_90 with PDL as a launch specialises them; ptxas: no spills."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))      # tests/ (a script here)
    from triton_interpreter import compile_sm90
    ptrs = {"logits_ptr": "*fp32", "part_max_ptr": "*fp32", "part_idx_ptr": "*i32", "part_bad_ptr": "*i8",
            "tokens_ptr": "*i64", "finite_ptr": "*i1"}
    for kernel, consts, warps in ((greedy._chunk_kernel, dict(CHUNK=4096, PDL=True), 8),
                                  (greedy._combine_kernel, dict(P_PAD=64, PDL=True), 1)):
        sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in kernel.arg_names}
        _, spills, report = compile_sm90(kernel, sig, consts, {n for n in sig if sig[n].startswith("*")},
                                         {"num_warps": warps})
        print(f"{kernel.__name__}: spills {spills} B")
        assert spills == 0, report
    print("ok: greedy kernels compile for sm_90")


def test_kernels_compile_for_sm90():
    from triton_interpreter import run_compile_check
    run_compile_check(__file__, "ok: greedy kernels compile")


if COMPILE_CHECK:
    _compile_check()
