"""A row whose logits are not finite gets NONFINITE_TOKEN on every sampler path (issue 27 (7)): the other
rows of its step draw what they draw without it, whatever filters either side uses."""

from __future__ import annotations

import pytest
import torch

from kvfit.runner.sampling_state import NONFINITE_TOKEN, SamplingState
from kvfit.sampling_params import SamplingParams

V = 64
PATHS = {
    "greedy": SamplingParams(temperature=0),
    "top_p": SamplingParams(temperature=1.0, top_p=0.9, seed=1),
    "top_k_top_p": SamplingParams(temperature=0.7, top_k=5, top_p=0.8, seed=2),
    "top_k": SamplingParams(temperature=1.0, top_k=5, seed=3),
    "min_p": SamplingParams(temperature=1.0, min_p=0.1, seed=4),
    "top_p_logprobs": SamplingParams(temperature=1.0, top_p=0.5, seed=5, logprobs=3),
    "top_p_penalty": SamplingParams(temperature=1.0, top_p=0.9, seed=6, repetition_penalty=1.3),
}
POISONS = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def draw(params: list[SamplingParams], logits: torch.Tensor) -> list[int]:
    rows = list(range(len(params)))
    state = SamplingState(len(params), V, torch.device("cpu"))
    state.set_rows(rows, params, [[] for _ in rows])
    return state.sample_step(logits, torch.tensor(rows), rows, torch.zeros(len(rows), dtype=torch.int64)).tokens.tolist()


@pytest.mark.parametrize("poison", sorted(POISONS))
@pytest.mark.parametrize("bad", sorted(PATHS))
def test_a_nonfinite_row_ends_alone_on_every_path(bad, poison):
    others = [p for name, p in sorted(PATHS.items()) if name != "greedy"]
    logits = torch.randn(len(others) + 1, V, generator=torch.Generator().manual_seed(0)) * 3
    clean = draw(others, logits[1:])                     # the seeded rows alone, no bad row beside them
    poisoned = logits.clone()
    if poison == "-inf":
        poisoned[0] = float("-inf")                      # every logit -inf: nothing to draw
    else:
        poisoned[0, 7] = POISONS[poison]                  # one bad logit is enough
    tokens = draw([PATHS[bad]] + others, poisoned)
    assert tokens[0] == NONFINITE_TOKEN
    assert tokens[1:] == clean


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_finite_rows_is_isfinite_all_without_the_bool_matrix(dtype):
    from kvfit.runner.row_ops import finite_rows
    torch.manual_seed(0)
    logits = torch.randn(12, 300).to(dtype)
    big = torch.finfo(dtype).max
    logits[1, 0] = big                                  # the largest finite values stay finite
    logits[1, 1] = -big
    logits[2, 299] = float("nan")
    logits[3, 150] = float("inf")
    logits[4, 7] = float("-inf")
    logits[5] = float("-inf")                           # every logit masked
    logits[6, 3], logits[6, 4] = float("inf"), float("-inf")
    logits[7, 5], logits[7, 6] = float("nan"), float("inf")
    want = torch.isfinite(logits).all(dim=-1)
    assert finite_rows(logits).tolist() == want.tolist()
    assert want.tolist() == [True, True, False, False, False, False, False, False, True, True, True, True]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_row_argmax_is_torch_argmax_ties_and_nan_included(dtype):
    from kvfit.runner.row_ops import row_argmax
    torch.manual_seed(1)
    logits = torch.randint(0, 5, (64, 4099)).to(dtype)        # many ties: the first largest index wins
    logits[3, 17], logits[3, 9] = float("nan"), float("nan")
    logits[4, 100], logits[4, 50] = float("inf"), float("inf")
    logits[5] = float("-inf")
    assert row_argmax(logits).tolist() == torch.argmax(logits, dim=-1).tolist()
    assert row_argmax(logits)[3] == 9 and row_argmax(logits)[4] == 50 and row_argmax(logits)[5] == 0
