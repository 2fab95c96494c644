"""Issue 27 (10), first half: a request's lists (allowed_token_ids, logit_bias, bad words) are copied to the
device once, when it joins the persistent batch; a step's host work is O(rows), not O(the lists' sizes).
Measured by what each step builds on the host, not by wall time."""

from __future__ import annotations

import torch

from kvfit.runner.logits_processing import RowExtras
from kvfit.runner.sampling_state import SamplingState
from kvfit.sampling_params import SamplingParams

V = 50_000


def lists_of(size: int) -> tuple[SamplingParams, RowExtras]:
    """A request whose four lists hold `size` entries each (the multi-token bad words never match)."""
    params = SamplingParams(seed=1, allowed_token_ids=list(range(10, 10 + size)),
                            logit_bias={t: 1.0 for t in range(20_000, 20_000 + size)})
    words = [(t,) for t in range(30_000, 30_000 + size)] + [(1, t) for t in range(40_000, 40_000 + size)]
    return params, RowExtras(prompt_token_ids=(2, 3), bad_words_token_ids=tuple(words), history=[2, 3, 4])


def host_elements_per_step(size: int, monkeypatch) -> tuple[int, list[list[int]]]:
    state = SamplingState(2, V, torch.device("cpu"))
    params, extras = lists_of(size)
    state.set_rows([0, 1], [params, SamplingParams(seed=2, top_p=0.9)], [[], []], [extras, RowExtras()])
    built = []
    real_tensor = torch.tensor

    def counting_tensor(data, *args, **kwargs):
        t = real_tensor(data, *args, **kwargs)
        built.append(t.numel())
        return t
    monkeypatch.setattr(torch, "tensor", counting_tensor)
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(0))
    tokens = [state.sample(logits, torch.tensor([0, 1]), [0, 1], torch.tensor([k, k])).tolist() for k in range(3)]
    monkeypatch.undo()
    return sum(built), tokens


def test_step_host_work_does_not_grow_with_the_lists(monkeypatch):
    small, small_tokens = host_elements_per_step(2, monkeypatch)
    large, large_tokens = host_elements_per_step(5_000, monkeypatch)
    assert small == large, f"a step built {large} host elements with 5,000-entry lists, {small} with 2"
    for tokens in large_tokens:                      # the lists still act: allowed ids only, biased ones favoured
        assert 10 <= tokens[0] < 10 + 5_000
    assert small_tokens[0][1] == large_tokens[0][1]  # the other row (seeded) is not touched by row 0's lists


def test_multi_token_bad_word_is_found_through_its_index():
    state = SamplingState(1, 64, torch.device("cpu"))
    history = [5, 6, 7]                              # prompt [5], output [6, 7]
    words = ((6, 7, 9), (8, 7, 10), (7, 11), (5, 6, 12))   # (5, 6, ...) reaches into the prompt: not banned
    state.set_rows([0], [SamplingParams(temperature=0)], [[6, 7]],
                   [RowExtras(prompt_token_ids=(5,), bad_words_token_ids=words, history=history)])
    assert sorted(state.edits[0].dynamic_bans()) == [9, 11]
    logits = torch.zeros(1, 64)
    logits[0, 9], logits[0, 11], logits[0, 10] = 5.0, 4.0, 3.0
    assert state.sample(logits, torch.tensor([0]), [0], torch.tensor([2])).tolist() == [10]
