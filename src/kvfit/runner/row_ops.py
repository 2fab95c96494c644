"""The sampler's reductions over each row of [N, V] logits: the greedy token, whether the row is finite, and the
smallest logit top-k then top-p keep. Each is torch's plain rule, with the ops picked where their costs differ
by device (platforms.gate.on_cpu): a CPU's argmax and whole-row sort cost many times a reduction or a top-k.
"""

from __future__ import annotations

import torch

from kvfit.platforms.gate import on_cpu

CPU_TOP_P_CANDIDATES = 1024     # top-p on a CPU looks for a row's cut among this many largest logits first


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] -> [N] bool: whether every logit of the row is finite. A row's max and min are finite exactly when
    all of it is (a NaN makes both NaN, +inf the max, -inf the min): two reductions, where isfinite().all()
    writes and reads back an [N, V] bool (12x slower on a CPU at [256, 32000]; 39 MB a step at a 152k
    vocabulary)."""
    return torch.isfinite(logits.amax(dim=-1)) & torch.isfinite(logits.amin(dim=-1))


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """[N, V] -> [N] int64: torch.argmax(x, dim=-1) (the first index of a row's largest value; a NaN counts as the
    largest). On a CPU through torch.max, which returns the same index and vectorises where argmax does not
    (256 rows x 151,936 bf16 logits: 23 against 126 ms)."""
    if on_cpu(x):
        return torch.max(x, dim=-1).indices
    return torch.argmax(x, dim=-1)


def filter_thresholds(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, any_top_p: bool,
                      num_candidates: int | None = None) -> torch.Tensor:
    """The smallest logit each row keeps after top-k then top-p; logits equal to it are kept too.

    scaled: [F, V] float32 logits / temperature; top_k: [F] int32 (0 = off); top_p: [F] float32 (1 = off)
    -> [F] float32. One sort for all rows: top-k keeps ranks < k; top-p keeps the smallest prefix of the
    renormalised top-k distribution reaching top_p (rank r dropped when the mass before it exceeds top_p).
    num_candidates (host int, default V): when every row sets a top-k, their largest; below V only that
    many largest logits are sorted (torch.topk), since nothing past them can be kept. On a CPU, top-p over
    whole rows first looks among each row's largest logits (_cpu_top_p_thresholds).
    """
    vocab_size = scaled.shape[-1]
    n = vocab_size if num_candidates is None else min(num_candidates, vocab_size)
    if any_top_p and n == vocab_size and on_cpu(scaled) and vocab_size > 2 * CPU_TOP_P_CANDIDATES:
        return _cpu_top_p_thresholds(scaled, top_k, top_p)
    return _sorted_thresholds(scaled, top_k, top_p, any_top_p, n)


def _top_k_ranks(top_k: torch.Tensor, n: int) -> torch.Tensor:
    """[F] int64: the ranks top-k keeps among n (n where top-k is off or reaches past n)."""
    return torch.where((top_k > 0) & (top_k < n), top_k, n).to(torch.int64)


def _top_p_keep(probs: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[F] int64: the ranks top-p keeps of descending probabilities [F, n] within top-k's k: rank r is dropped when
    the mass before it exceeds top_p; rank 0 always (a row with a NaN or inf logit, whose probabilities are all
    NaN, keeps one rank too, so it cannot index -1 and fail the whole step; its token is NONFINITE_TOKEN anyway,
    and its request ends alone). top_p 1 is off: rounding can push the mass before the tail over 1.0, which must
    not drop it."""
    mass_before = torch.cumsum(probs, dim=-1).sub_(probs)                                # [F, n] nondecreasing
    within = (mass_before <= top_p[:, None]).sum(dim=-1).clamp_(min=1)
    return torch.where(top_p < 1.0, torch.minimum(within, k), k)


def _sorted_thresholds(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, any_top_p: bool,
                       n: int) -> torch.Tensor:
    """filter_thresholds over each row's n largest logits, sorted (n = V: the whole row)."""
    vocab_size = scaled.shape[-1]
    if n < vocab_size:
        sorted_logits = torch.topk(scaled, n, dim=-1).values                             # [F, n] descending
    else:
        sorted_logits = torch.sort(scaled, dim=-1, descending=True).values               # [F, V]
    k = _top_k_ranks(top_k, n)                                                           # [F]
    num_keep = k
    if any_top_p:
        ranks = torch.arange(n, device=scaled.device)                                     # [n]
        sorted_logits.masked_fill_(ranks >= k[:, None], float("-inf"))
        num_keep = _top_p_keep(torch.softmax(sorted_logits, dim=-1), k, top_p)            # [F]
    return sorted_logits.gather(1, (num_keep - 1)[:, None]).squeeze(1)                    # rank < k: unmasked


def _cpu_top_p_thresholds(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """filter_thresholds with top-p on a CPU, where sorting whole rows costs 8-20x finding their largest logits:
    each row's cut is looked for among its CPU_TOP_P_CANDIDATES largest logits, which hold it whenever their
    probability mass (of the top-k renormalised distribution) passes top_p, or, with top-p off, the row's top-k
    lies among them. The other rows (a flat distribution, a NaN) are sorted whole, as on other devices."""
    m = CPU_TOP_P_CANDIDATES
    vocab_size = scaled.shape[-1]
    candidates = torch.topk(scaled, m, dim=-1).values                                     # [F, m] descending
    k = _top_k_ranks(top_k, vocab_size)                                                  # [F]
    # logits less the row's max, as softmax takes them: exact differences, however large the logits (a logsumexp
    # of the logits themselves is rounded at the max's magnitude, and temperature 1e-5 makes logits of 1e6)
    top = candidates[:, :1]                                                               # [F, 1] the row max
    shifted = candidates.sub(top).masked_fill_(torch.arange(m) >= k[:, None], float("-inf"))   # [F, m]
    # the renormaliser: the top-k mass, among the candidates where k <= m, the whole row's where top-k is off
    # (k = V); a top-k between them needs the k-th largest logit: those rows are sorted whole (`exact` below)
    row_mass = scaled.sub(top).exp_().sum(dim=-1)                                         # [F]
    log_mass = torch.where(k <= m, torch.logsumexp(shifted, dim=-1), row_mass.log())      # [F]
    probs = shifted.sub_(log_mass[:, None]).exp_()                                        # [F, m]
    num_keep = _top_p_keep(probs, k, top_p)
    # rows whose cut lies among the candidates (a NaN row fails both tests and is sorted whole)
    exact = torch.where(top_p < 1.0, (probs.sum(dim=-1) > top_p) & ((k <= m) | (k == vocab_size)), k <= m)
    out = candidates.gather(1, (num_keep.clamp(max=m) - 1)[:, None]).squeeze(1)            # [F]
    rest = (~exact).nonzero().squeeze(1)                             # a host read (on a CPU nothing waits on it)
    if rest.numel():
        out[rest] = _sorted_thresholds(scaled[rest], top_k[rest], top_p[rest], True, vocab_size)
    return out
