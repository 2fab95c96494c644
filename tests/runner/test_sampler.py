"""Sampler on CPU: greedy, top-k, top-p, temperature, and per-request seeds that ignore batching."""

from __future__ import annotations

import pytest
import torch

from kvfit.engine.sampling_params import SamplingParams
from kvfit.runner.sampler import sample

V = 64


def logits_batch(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, V, generator=gen) * 3          # [n, V]; continuous, so no ties


def test_greedy_is_argmax():
    logits = logits_batch(8)
    params = [SamplingParams(temperature=0)] * 8
    assert sample(logits, params, [0] * 8) == torch.argmax(logits, dim=-1).tolist()


def test_greedy_ignores_seed_top_k_and_top_p():
    logits = logits_batch(4, seed=1)
    params = [SamplingParams(temperature=0, seed=3, top_k=5, top_p=0.5)] * 4
    assert sample(logits, params, [0, 1, 2, 3]) == torch.argmax(logits, dim=-1).tolist()


@pytest.mark.parametrize("seed", [None, 11])
def test_top_k_one_equals_greedy(seed):
    logits = logits_batch(16, seed=2)
    params = [SamplingParams(temperature=1.5, top_k=1, seed=seed)] * 16
    assert sample(logits, params, list(range(16))) == torch.argmax(logits, dim=-1).tolist()


@pytest.mark.parametrize("seed", [None, 12])
def test_tiny_top_p_equals_greedy(seed):
    logits = logits_batch(16, seed=3)
    params = [SamplingParams(temperature=1.0, top_p=1e-6, seed=seed)] * 16
    assert sample(logits, params, list(range(16))) == torch.argmax(logits, dim=-1).tolist()


def test_seeded_token_does_not_depend_on_the_batch():
    logits = logits_batch(6, seed=4)
    target = SamplingParams(temperature=1.0, seed=1234)
    alone = sample(logits[2:3], [target], [5])[0]
    for _ in range(5):
        torch.rand(100)                                  # the global generator moves on; seeded rows must not care
        others = [SamplingParams(temperature=0.8), SamplingParams(temperature=0),
                  SamplingParams(temperature=1.0, seed=9), SamplingParams(temperature=1.3, top_k=3),
                  SamplingParams(temperature=1.0, top_p=0.9)]
        params = others[:2] + [target] + others[2:]
        out = sample(logits, params, [0, 1, 5, 2, 3, 4])
        assert out[2] == alone
    # a different position in the batch, with a different batch size
    batch = torch.cat([logits_batch(3, seed=5), logits[2:3]])
    params = [SamplingParams(temperature=1.0)] * 3 + [target]
    assert sample(batch, params, [7, 7, 7, 5])[3] == alone


def test_same_seed_and_num_generated_repeat_the_draw():
    logits = logits_batch(1, seed=6)
    p = SamplingParams(temperature=1.0, seed=42)
    draws = [sample(logits, [p], [n])[0] for n in range(40)]
    assert draws == [sample(logits, [p], [n])[0] for n in range(40)]


def test_different_seeds_differ_over_many_draws():
    logits = torch.zeros(1, V)                           # uniform: two seeds agree on a draw with prob 1/V
    a = [sample(logits, [SamplingParams(seed=1)], [n])[0] for n in range(64)]
    b = [sample(logits, [SamplingParams(seed=2)], [n])[0] for n in range(64)]
    assert sum(x != y for x, y in zip(a, b)) > 48
    # and one seed's draws vary with num_generated
    assert len(set(a)) > 20


def test_samples_only_from_the_top_k_set():
    logits = logits_batch(1, seed=7)[0]
    k = 5
    top = set(torch.topk(logits, k).indices.tolist())
    p = SamplingParams(temperature=5.0, top_k=k, seed=0)   # high temperature spreads mass over the top k
    draws = [sample(logits[None], [p], [n])[0] for n in range(300)]
    assert set(draws) <= top
    assert set(draws) == top                             # and every one of them is reachable


def test_samples_only_from_the_top_p_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(probs)[None]                      # [1, 4]
    # the smallest prefix reaching 0.7 is {0, 1}
    p = SamplingParams(temperature=1.0, top_p=0.7, seed=3)
    draws = [sample(logits, [p], [n])[0] for n in range(300)]
    assert set(draws) == {0, 1}
    # renormalised inside the nucleus: 0.5 / 0.8 for token 0
    assert abs(draws.count(0) / 300 - 0.625) < 0.1


def test_top_k_and_top_p_together():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = torch.log(probs)[None]
    p = SamplingParams(temperature=1.0, top_k=3, top_p=0.95, seed=0)
    draws = {sample(logits, [p], [n])[0] for n in range(300)}
    assert draws == {0, 1, 2}


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_frequencies_follow_the_temperature(temperature):
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = torch.log(probs)[None]
    p = SamplingParams(temperature=temperature, seed=5)
    n = 3000
    draws = [sample(logits, [p], [i])[0] for i in range(n)]
    scaled = probs ** (1 / temperature)
    expected = (scaled / scaled.sum()).tolist()
    for token in range(3):
        assert abs(draws.count(token) / n - expected[token]) < 0.04


def test_low_temperature_is_nearly_greedy():
    logits = logits_batch(16, seed=8)
    params = [SamplingParams(temperature=1e-4, seed=1)] * 16
    assert sample(logits, params, list(range(16))) == torch.argmax(logits, dim=-1).tolist()


def test_mixed_greedy_and_sampled_rows():
    logits = logits_batch(4, seed=9)
    greedy = torch.argmax(logits, dim=-1).tolist()
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=1)]
    out = sample(logits, params, [0, 0, 0, 0])
    assert out[0] == greedy[0] and out[2] == greedy[2] and out[3] == greedy[3]
    assert all(isinstance(t, int) and 0 <= t < V for t in out)


def test_large_and_negative_seeds_work():
    logits = logits_batch(1, seed=10)
    for seed in (-1, 0, 2**62, 2**80):
        p = SamplingParams(temperature=1.0, seed=seed)
        assert sample(logits, [p], [3]) == sample(logits, [p], [3])
