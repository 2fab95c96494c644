"""SamplingState on CPU (plus one GPU test): greedy, top-k, top-p, temperature, seeds that ignore the
batch, output-token counts, and no host synchronisation in sample()."""

from __future__ import annotations

import random

import pytest
import torch

from kvfit.sampling_params import SamplingParams
from kvfit.runner.sampling_state import SamplingState, filter_thresholds, hashed_exponential

V = 64


def logits_batch(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, V, generator=gen) * 3          # [n, V]; continuous, so no ties


def run(state: SamplingState, logits: torch.Tensor, rows: list[int], num_generated: list[int]) -> list[int]:
    return state.sample(logits, torch.tensor(rows), rows, torch.tensor(num_generated)).tolist()


def sample(logits: torch.Tensor, params: list[SamplingParams], num_generated: list[int],
           rows: list[int] | None = None) -> list[int]:
    """A fresh state with params[i] on rows[i] (default: row i); one sample() over all of them."""
    rows = list(range(len(params))) if rows is None else rows
    state = SamplingState(max(rows) + 1, logits.shape[-1], torch.device("cpu"))
    state.set_rows(rows, params, [[] for _ in rows])
    return run(state, logits, rows, num_generated)


def test_greedy_is_argmax():
    logits = logits_batch(8)
    params = [SamplingParams(temperature=0)] * 8
    assert sample(logits, params, [0] * 8) == torch.argmax(logits, dim=-1).tolist()
    assert sample(logits.bfloat16(), params, [0] * 8) == torch.argmax(logits.bfloat16(), dim=-1).tolist()


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
    others = [SamplingParams(temperature=0.8), SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, seed=9), SamplingParams(temperature=1.3, top_k=3),
              SamplingParams(temperature=1.0, top_p=0.9)]
    for _ in range(5):
        torch.rand(100)                                  # the global generator moves on; seeded rows must not care
        out = sample(logits, others[:2] + [target] + others[2:], [0, 1, 5, 2, 3, 4])
        assert out[2] == alone
    # another position in the batch, another batch size, another persistent row, rows out of order
    batch = torch.cat([logits_batch(3, seed=5), logits[2:3]])
    params = [SamplingParams(temperature=1.0)] * 3 + [target]
    assert sample(batch, params, [7, 7, 7, 5], rows=[4, 0, 2, 9])[3] == alone
    # a batch where the sort runs for every row (all filter) but the target's rule is unchanged
    params = [SamplingParams(temperature=1.0, top_p=0.5)] * 3 + [target]
    assert sample(batch, params, [7, 7, 7, 5], rows=[1, 2, 3, 0])[3] == alone


def test_same_seed_and_num_generated_repeat_the_draw():
    logits = logits_batch(1, seed=6).expand(40, V)
    p = SamplingParams(temperature=1.0, seed=42)
    draws = sample(logits, [p] * 40, list(range(40)))
    assert draws == sample(logits, [p] * 40, list(range(40)))
    assert draws == [sample(logits[:1], [p], [n])[0] for n in range(40)]   # one row at a time: the same


def test_different_seeds_differ_over_many_draws():
    logits = torch.zeros(64, V)                          # uniform: two seeds agree on a draw with prob 1/V
    a = sample(logits, [SamplingParams(seed=1)] * 64, list(range(64)))
    b = sample(logits, [SamplingParams(seed=2)] * 64, list(range(64)))
    assert sum(x != y for x, y in zip(a, b)) > 48
    assert len(set(a)) > 20                              # and one seed's draws vary with num_generated


def test_samples_only_from_the_top_k_set():
    logits = logits_batch(1, seed=7)
    k = 5
    top = set(torch.topk(logits[0], k).indices.tolist())
    p = SamplingParams(temperature=2.0, top_k=k, seed=0)   # high temperature spreads mass over the top k
    draws = sample(logits.expand(300, V), [p] * 300, list(range(300)))
    assert set(draws) == top                             # only the top k, and every one of them reachable


def test_top_k_keeps_ties_with_the_kth_logit():
    logits = torch.tensor([[2.0, 2.0, 2.0, 0.0]])
    p = SamplingParams(temperature=1.0, top_k=1, seed=0)
    assert set(sample(logits.expand(200, 4), [p] * 200, list(range(200)))) == {0, 1, 2}


@pytest.mark.parametrize("seed", [None, 3])
def test_samples_only_from_the_top_p_nucleus(seed):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(probs)[None].expand(600, 4)       # [600, 4]
    # the smallest prefix reaching 0.7 is {0, 1}
    p = SamplingParams(temperature=1.0, top_p=0.7, seed=seed)
    draws = sample(logits, [p] * 600, list(range(600)))
    assert set(draws) == {0, 1}
    assert abs(draws.count(0) / 600 - 0.625) < 0.07      # renormalised inside the nucleus: 0.5 / 0.8


def test_top_k_and_top_p_together():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = torch.log(probs)[None].expand(300, 4)
    # top-k 3 renormalises to [4/9, 3/9, 2/9]; the prefix reaching 0.95 is all three (top-p alone keeps 4)
    p = SamplingParams(temperature=1.0, top_k=3, top_p=0.95, seed=0)
    assert set(sample(logits, [p] * 300, list(range(300)))) == {0, 1, 2}
    # top-p applies to the top-k distribution: 0.7 of [4/9, 3/9, 2/9] is {0, 1}
    p = SamplingParams(temperature=1.0, top_k=3, top_p=0.7, seed=0)
    assert set(sample(logits, [p] * 300, list(range(300)))) == {0, 1}


@pytest.mark.parametrize("seed", [None, 5])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_frequencies_follow_the_temperature(temperature, seed):
    probs = torch.tensor([0.6, 0.3, 0.1])
    n = 3000
    logits = torch.log(probs)[None].expand(n, 3)
    draws = sample(logits, [SamplingParams(temperature=temperature, seed=seed)] * n, list(range(n)))
    scaled = probs ** (1 / temperature)
    expected = (scaled / scaled.sum()).tolist()
    for token in range(3):
        assert abs(draws.count(token) / n - expected[token]) < 0.04


def test_low_temperature_is_nearly_greedy():
    logits = logits_batch(16, seed=8)
    params = [SamplingParams(temperature=1e-4, seed=1)] * 16
    assert sample(logits, params, list(range(16))) == torch.argmax(logits, dim=-1).tolist()


def test_mixed_greedy_and_sampled_rows():
    logits = logits_batch(6, seed=9)
    greedy = torch.argmax(logits, dim=-1).tolist()
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=1.0), SamplingParams(temperature=2.0, top_p=1e-6, seed=4)]
    before = logits.clone()
    out = sample(logits, params, [0] * 6, rows=[5, 3, 0, 1, 7, 2])
    assert torch.equal(logits, before)                   # the caller's logits are read, never written
    assert [out[i] for i in (0, 2, 3, 5)] == [greedy[i] for i in (0, 2, 3, 5)]
    assert all(0 <= t < V for t in out)


def test_large_and_negative_seeds_work():
    logits = logits_batch(1, seed=10)
    for seed in (-2, 0, 2**62, 2**80, -(2**70)):
        p = SamplingParams(temperature=1.0, seed=seed)
        assert sample(logits, [p], [3]) == sample(logits, [p], [3])
    # seeds are taken mod 2^64: -2 and 2^64 - 2 are one seed, -2 and 2 are not (-1 is no seed: vLLM's reading)
    many = logits.expand(32, V)
    draws = {s: sample(many, [SamplingParams(seed=s)] * 32, list(range(32))) for s in (-2, 2**64 - 2, 2)}
    assert draws[-2] == draws[2**64 - 2] != draws[2]


def test_hash_is_splitmix64():
    """The seeded stream is pinned: element (s, v) is splitmix64's output v + 1 from mix64(mix64(seed) ^ n)."""
    mask = (1 << 64) - 1

    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    seeds, steps = [0, -1, 2**62 + 12345, -(2**63)], [0, 7, 2**40, 1]
    noise = hashed_exponential(torch.tensor(seeds), torch.tensor(steps), 5)               # [4, 5]
    for s, (seed, step) in enumerate(zip(seeds, steps)):
        key = mix(mix(seed & mask) ^ step)
        for v in range(5):
            j = mix((key + (v + 1) * 0x9E3779B97F4A7C15) & mask) >> 41
            u = torch.tensor((j + 0.5) / 2**23, dtype=torch.float32)
            assert noise[s, v] == -torch.log(u)


def test_hashed_noise_is_exponential():
    noise = hashed_exponential(torch.arange(64), torch.zeros(64, dtype=torch.int64), 4096)   # [64, 4096]
    assert bool((noise > 0).all()) and bool(torch.isfinite(noise).all())
    assert abs(noise.mean().item() - 1.0) < 0.01 and abs(noise.var().item() - 1.0) < 0.03
    assert abs((noise > 1.0).float().mean().item() - 0.36788) < 0.01     # P(q > 1) = e^-1


def reference_kept(logits: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """The old sampler's rule, one row: logits [V] -> token ids with nonzero probability."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs > top_p
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(drop, 0.0))
    return set(torch.nonzero(probs).flatten().tolist())


def test_filter_thresholds_match_the_old_rule():
    rng = random.Random(0)
    logits = logits_batch(40, seed=11)
    top_k = [rng.choice([0, 1, 2, 5, 17, V - 1, V, V + 3]) for _ in range(40)]
    top_p = [rng.choice([1.0, 0.999, 0.9, 0.5, 0.1, 1e-6]) for _ in range(40)]
    threshold = filter_thresholds(logits, torch.tensor(top_k, dtype=torch.int32), torch.tensor(top_p), True)
    for row in range(40):
        kept = set(torch.nonzero(logits[row] >= threshold[row]).flatten().tolist())
        assert kept == reference_kept(logits[row], top_k[row], top_p[row]), (top_k[row], top_p[row])
    # rows that all set top-k: sorting only the largest max(k) logits (torch.topk) gives the same cut
    with_k = [row for row in range(40) if 0 < top_k[row] < V]
    ks = torch.tensor([top_k[row] for row in with_k], dtype=torch.int32)
    partial = filter_thresholds(logits[with_k], ks, torch.tensor([top_p[row] for row in with_k]), True, int(ks.max()))
    assert torch.equal(partial, threshold[with_k])


def test_top_k_shortcut_draws_what_the_full_sort_draws(monkeypatch):
    logits = logits_batch(32, seed=15)
    params = [SamplingParams(top_k=k, top_p=p, seed=s) for k, p, s in zip([3, 40, 9, 1] * 8, [1.0, 0.8] * 16,
                                                                           range(32))]
    shortcut = sample(logits, params, list(range(32)))
    monkeypatch.setattr("kvfit.runner.sampling_state.MAX_TOPK_CANDIDATES", 2)   # 40 > 2: the full sort
    assert sample(logits, params, list(range(32))) == shortcut


def test_sample_counts_output_tokens():
    state = SamplingState(8, V, torch.device("cpu"))
    rows = [6, 1, 3]
    state.set_rows(rows, [SamplingParams(temperature=0), SamplingParams(seed=2), SamplingParams()], [[], [], []])
    expected = torch.zeros(8, V, dtype=torch.int32)
    for step in range(5):
        tokens = run(state, logits_batch(3, seed=step), rows, [step] * 3)
        for row, token in zip(rows, tokens):
            expected[row, token] += 1
    assert torch.equal(state.output_token_counts, expected)
    assert state.output_token_counts.sum().item() == 15


def test_tokens_not_counted_are_left_out_of_the_counts():
    """Multi-step decoding samples rows past their last step; those tokens are dropped, not counted."""
    state = SamplingState(4, V, torch.device("cpu"))
    state.set_rows([0, 2], [SamplingParams(temperature=0), SamplingParams(temperature=0)], [[], []])
    logits = logits_batch(2)
    tokens = state.sample(logits, torch.tensor([0, 2]), [0, 2], torch.tensor([0, 0]),
                          counted=torch.tensor([True, False])).tolist()
    assert tokens == torch.argmax(logits, dim=-1).tolist()
    assert state.output_token_counts[0, tokens[0]].item() == 1 and state.output_token_counts[2].sum().item() == 0


def test_set_rows_counts_a_resumed_requests_outputs():
    state = SamplingState(4, V, torch.device("cpu"))
    outputs = [[5, 5, 9, 63, 5], []]
    state.set_rows([2, 0], [SamplingParams(seed=1), SamplingParams(temperature=0)], outputs)
    assert state.output_token_counts[2].tolist() == torch.bincount(torch.tensor(outputs[0]), minlength=V).tolist()
    assert state.output_token_counts[[0, 1, 3]].sum().item() == 0
    # a row taken again by another request starts from that request's outputs, not the old ones
    state.set_rows([2], [SamplingParams(temperature=0.5, top_k=3)], [[7]])
    assert state.output_token_counts[2].nonzero().flatten().tolist() == [7]
    assert state.output_token_counts[2, 7].item() == 1
    assert state.temperature[2].item() == 0.5 and state.top_k[2].item() == 3
    assert (state.greedy[2], state.seeded[2], state.uses_top_k[2], state.uses_top_p[2]) == (False, False, True, False)


def test_set_rows_writes_parameters_and_mirrors():
    state = SamplingState(4, V, torch.device("cpu"))
    state.set_rows([3, 1], [SamplingParams(temperature=0.7, top_p=0.9, top_k=-1, seed=-2),
                            SamplingParams(temperature=0, top_k=4, seed=3)], [[], []])
    assert state.temperature.tolist() == pytest.approx([0, 0, 0, 0.7])
    assert state.top_p.tolist() == pytest.approx([1, 1, 1, 0.9])
    assert state.top_k.tolist() == [0, 4, 0, 0]
    assert state.seed.tolist() == [0, 3, 0, -2]
    assert state.greedy == [True, True, True, False]
    assert state.seeded == [False, False, False, True]          # a greedy row never pays for the hash
    assert state.uses_top_k == [False] * 4 and state.uses_top_p == [False, False, False, True]
    assert state.repetition_penalty.tolist() == [1.0] * 4 and state.presence_penalty.tolist() == [0.0] * 4


def test_clear_rows_resets_the_row():
    state = SamplingState(3, V, torch.device("cpu"))
    params = SamplingParams(temperature=1.5, top_k=4, top_p=0.8, seed=9)
    state.set_rows([0, 2], [params, params], [[1, 2], [3]])
    state.clear_rows([2])
    assert (state.greedy[2], state.seeded[2], state.uses_top_k[2], state.uses_top_p[2]) == (True, False, False, False)
    assert state.output_token_counts[2].sum().item() == 0 and state.output_token_counts[0].sum().item() == 2
    assert (state.temperature[2].item(), state.top_p[2].item(), state.top_k[2].item(), state.seed[2].item()) \
        == (0.0, 1.0, 0, 0)
    assert state.greedy[0] is False and state.temperature[0].item() == 1.5     # the other row is untouched
    logits = logits_batch(1, seed=12)
    assert run(state, logits, [2], [0]) == torch.argmax(logits, dim=-1).tolist()  # a free row is greedy


def test_sample_makes_no_host_sync(monkeypatch):
    """CPU stand-in for CUDA's sync debug mode: every tensor-to-host read raises inside sample()."""
    state = SamplingState(8, V, torch.device("cpu"))
    params = [SamplingParams(temperature=0), SamplingParams(seed=1, top_p=0.9), SamplingParams(top_k=3),
              SamplingParams(temperature=0.5), SamplingParams(seed=2)]
    rows = [4, 0, 7, 2, 5]
    state.set_rows(rows, params, [[1], [], [2, 3], [], []])
    logits, rows_d, num_generated = logits_batch(5, seed=13), torch.tensor(rows), torch.tensor([0, 1, 2, 3, 4])

    def host_read(*args, **kwargs):
        raise AssertionError("sample() read a tensor on the host")
    for name in ("item", "tolist", "nonzero", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    monkeypatch.setattr(torch, "nonzero", host_read)
    monkeypatch.setattr(torch, "masked_select", host_read)
    for k in range(3):                                   # multi-step decoding: the step's num_generated moves on
        tokens = state.sample(logits, rows_d, rows, num_generated + k)
    monkeypatch.undo()
    assert tokens.shape == (5,) and tokens.dtype == torch.int64
    assert state.output_token_counts.sum().item() == 3 + 3 * 5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_sample_makes_no_host_sync_and_matches_cpu_seeded_draws():
    vocab = 1000
    params = [SamplingParams(temperature=0), SamplingParams(seed=1, top_p=0.9), SamplingParams(top_k=50),
              SamplingParams(temperature=0.7, seed=-5, top_k=20), SamplingParams(seed=2**70)]
    rows = [4, 0, 7, 2, 5]
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(14)) * 3
    states = {}
    for device in ("cpu", "cuda"):
        state = SamplingState(8, vocab, torch.device(device))
        state.set_rows(rows, params, [[1], [], [2, 3], [], []])
        states[device] = state
    gpu, rows_d = states["cuda"], torch.tensor(rows, device="cuda")
    num_generated, logits_d = torch.tensor([0, 1, 2, 3, 4], device="cuda"), logits.cuda().bfloat16()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = [gpu.sample(logits_d, rows_d, rows, num_generated + k) for k in range(3)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cpu_tokens = run(states["cpu"], logits.bfloat16(), rows, [0, 1, 2, 3, 4])
    for i in (0, 1, 3, 4):                               # greedy and seeded rows agree across devices
        assert tokens[0][i].item() == cpu_tokens[i]
    assert gpu.output_token_counts.sum().item() == 3 + 3 * 5


@pytest.mark.parametrize("scale", [12.0, 1.0])       # peaky rows (the cut among the candidates) and flat ones
def test_cpu_top_p_among_the_largest_logits_equals_the_whole_sort(scale, monkeypatch):
    from kvfit.runner import row_ops
    from kvfit.runner.row_ops import CPU_TOP_P_CANDIDATES, _sorted_thresholds
    vocab = 4 * CPU_TOP_P_CANDIDATES + 7
    gen = torch.Generator().manual_seed(3)
    top_k = [0, 0, 0, 0, 5, 50, CPU_TOP_P_CANDIDATES, CPU_TOP_P_CANDIDATES + 1, 2000, vocab - 1, vocab, 0, 0, 0]
    top_p = [1.0, 0.5, 0.9, 0.999, 0.9, 0.95, 0.8, 0.8, 0.9, 0.7, 0.6, 1e-6, 1.0, 0.9]
    scaled = torch.randn(len(top_k), vocab, generator=gen) * scale
    scaled[12, 100:] = float("-inf")                  # a row masked to 100 ids (top-p off)
    scaled[13, 17] = float("nan")                     # a row that is not finite
    # a top-k past the candidates whose renormalised mass moves the cut: the candidates hold 0.93 of the whole
    # row but the top 1,500 hold 0.96, so the cut at 0.9 of the top-k mass is some 40 ranks before 0.9 of the row's
    noise = torch.rand(vocab, generator=gen) * 0.01
    scaled[8] = torch.cat([torch.full((CPU_TOP_P_CANDIDATES,), 3.0), torch.zeros(476),
                           torch.full((vocab - CPU_TOP_P_CANDIDATES - 476,), -1.0)]) + noise
    top_k[8] = CPU_TOP_P_CANDIDATES + 476
    top_k, top_p = torch.tensor(top_k, dtype=torch.int32), torch.tensor(top_p)
    sorted_rows = []

    def counted(rows, *args):
        sorted_rows.append(rows.shape[0])
        return _sorted_thresholds(rows, *args)
    monkeypatch.setattr(row_ops, "_sorted_thresholds", counted)
    got = filter_thresholds(scaled, top_k, top_p, True)
    # peaky rows are cut among the candidates; sorted whole: top-p and top-k off (rows 0 and 12), the NaN row
    # and the top-ks between the candidates and the whole row (rows 7, 8, 9)
    assert sorted_rows == ([6] if scale > 1 else [8])
    want = _sorted_thresholds(scaled, top_k, top_p, True, vocab)
    assert got[:13].tolist() == want[:13].tolist()
    assert got[13].isnan() == want[13].isnan()


def test_cpu_top_p_cut_holds_for_logits_of_any_magnitude():
    """Temperature 1e-5 or a logit bias makes logits of 1e6 and more: the cut's mass is taken from differences to
    the row max (as softmax), never from a logsumexp rounded at the max's magnitude."""
    from kvfit.runner.row_ops import _sorted_thresholds
    vocab = 2260
    row = torch.full((1, vocab), 2.0 ** 23 - 2)
    row[0, 0], row[0, 1:1024] = 2.0 ** 23, 2.0 ** 23 - 1           # 1,024 ids hold 0.69 of the mass, not 0.8
    off = torch.tensor([0], dtype=torch.int32)
    assert filter_thresholds(row, off, torch.tensor([0.8]), True).item() == 2.0 ** 23 - 2
    gen = torch.Generator().manual_seed(0)
    for offset in (300.0, 3e4):
        scaled = torch.randn(64, 4096, generator=gen) * 3 + offset
        top_k, top_p = torch.zeros(64, dtype=torch.int32), torch.full((64,), 0.9)
        assert torch.equal(filter_thresholds(scaled, top_k, top_p, True),
                           _sorted_thresholds(scaled, top_k, top_p, True, 4096))
