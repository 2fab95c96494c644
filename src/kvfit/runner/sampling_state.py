"""Sampling for the persistent batch: per-row parameters kept on the device, every row sampled at once.

A request's parameters are written to its row once (set_rows), not rebuilt each step. sample() is a
few whole-batch kernels: temperature, one sort for the rows that filter (top-k, top-p), noise, one
argmax. It never synchronises with the host, so multi-step decoding feeds its tokens straight into
the next step.

Draws use the exponential race: argmax_i(p_i / q_i) with q_i ~ Exp(1) i.i.d. picks i with probability
p_i; it is taken in log space, argmax_i(logit_i / T - log q_i), which needs no softmax and never
underflows. Unseeded rows draw q from the default generator (one exponential_ for all of them).
A seeded row's q is a counter-based hash of (seed, num_generated, token id), so its token depends on
nothing but those and its own logits: not on the batch, its row, other rows or the global RNG.

Before the draw, rows whose parameters change their logits (penalties, logit_bias, bad words,
min_tokens, allowed_token_ids, a grammar bitmask) are edited on an fp32 copy (runner/logits_processing.py);
greedy rows then take the argmax of the edited logits, as vLLM's. Log probabilities are the raw
logits' fp32 log-softmax (vLLM's default logprobs_mode, raw_logprobs), taken before any edit but a grammar's
bitmask (vLLM's model runner masks the logits before its sampler).

Invariants:
- a row's host mirrors (greedy / seeded / top-k / top-p) and its device parameters are written
  together, by set_rows and clear_rows only;
- a free row (never set, or cleared) holds neutral parameters (greedy) and zero counts;
- token_counts.gather([row]) & COUNT_MASK counts every token sample() kept for the row since set_rows,
  plus the output_token_ids set_rows was given; PROMPT_BIT marks the prompt's tokens of a row with a
  repetition penalty (runner/token_counts.py: counts per token id, or the row's token ids, whichever is
  smaller for the model length).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

import torch

from kvfit.planning import persistent_batch_bytes, sampler_chunk_rows, token_history_applies
from kvfit.platforms.gate import triton_applies
from kvfit.runner.logits_processing import (RowEdits, RowExtras, StepEdits, apply_edits,
                                            apply_penalties, pack_logprobs, row_edits, top_logprobs)
from kvfit.runner.row_ops import filter_thresholds, finite_rows, row_argmax
from kvfit.runner.token_counts import DenseCounts, TokenHistory
from kvfit.sampling_params import SamplingParams

# The token a row gets on the device when its logits are not finite (NaN or inf); the runner reports its
# request in SampledTokens.nonfinite_ids (the tokens it returns are never this).
NONFINITE_TOKEN = -1

# splitmix64 (Steele, Lea, Flood 2014): the golden-ratio increment and the two finaliser multipliers,
# as signed int64 (torch has no uint64 arithmetic; int64 multiplication wraps, which is what we want).
_U64 = 1 << 64


def _signed(value: int) -> int:
    return value - _U64 if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)
_UNIFORM_BITS = 23      # u = (j + 0.5) / 2^23: exact in fp32 and strictly inside (0, 1), so -log(u) > 0
# When every filtering row sets a top-k no larger than this, a top-k of the largest k replaces the full sort.
MAX_TOPK_CANDIDATES = 4096


def sampling_state_bytes(max_num_rows: int, vocab_size: int, max_row_tokens: int | None = None) -> int:
    """Device bytes a SamplingState holds (the penalties' record of tokens dominates), for capacity planning."""
    return persistent_batch_bytes(max_num_rows, 0, vocab_size, max_row_tokens=max_row_tokens)


def _xorshift_right_(z: torch.Tensor, shift: int) -> torch.Tensor:
    # z ^= z >>> shift. torch's >> on int64 is arithmetic (copies the sign bit): mask to make it logical.
    return z.bitwise_xor_(z.bitwise_right_shift(shift).bitwise_and_((1 << (64 - shift)) - 1))


def mix64_(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser, in place on an int64 tensor (any shape); returns z."""
    _xorshift_right_(z, 30).mul_(_MIX1)
    _xorshift_right_(z, 27).mul_(_MIX2)
    return _xorshift_right_(z, 31)


def hashed_exponential(seed: torch.Tensor, num_generated: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise from a hash of (seed, num_generated, token id): equal inputs give equal noise on any batch.

    seed, num_generated: [S] int64 -> [S, vocab_size] float32, every value > 0.
    Element (s, v) is splitmix64's output number v + 1 from the state mix64(mix64(seed) ^ num_generated).
    """
    key = mix64_(mix64_(seed.clone()).bitwise_xor_(num_generated))                       # [S]
    counter = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=seed.device).mul_(_GOLDEN)  # [V]
    z = key[:, None] + counter                                                            # [S, V]
    _xorshift_right_(z, 30).mul_(_MIX1)
    _xorshift_right_(z, 27).mul_(_MIX2)
    # splitmix64 ends with z ^= z >>> 31, which leaves the top 33 bits alone: take the top 23 directly
    j = z.bitwise_right_shift_(64 - _UNIFORM_BITS).bitwise_and_((1 << _UNIFORM_BITS) - 1)
    u = j.to(torch.float32).add_(0.5).mul_(2.0 ** -_UNIFORM_BITS)                        # [S, V] in (0, 1)
    return u.log_().neg_()


@dataclass
class _Plan:
    """Which logits rows need which work, decided on the host from the mirrors (no device sync)."""

    sampled: list[int]        # positions in the batch of the non-greedy rows
    seeded: list[int]         # positions among `sampled` of the seeded rows
    filtered: list[int]       # positions among `sampled` of the rows using top-k or top-p
    any_top_p: bool
    num_candidates: int       # the largest logits the filters can keep: V unless every filtered row sets top-k
    min_p: list[int]          # positions among `sampled` of the rows using min_p
    min_p_values: list[float]
    penalized: list[int]      # positions in the batch of rows with a penalty
    logprobs: list[int]       # positions in the batch of rows that asked for logprobs
    num_logprobs: int         # the largest k they asked for
    edits: StepEdits
    masked: list[int]         # positions in the batch with a grammar bitmask row

    @property
    def processed(self) -> bool:
        """Whether any row's logits change before the draw (then an fp32 copy is edited)."""
        return bool(self.penalized or not self.edits.empty or self.masked)

    def device_tensors(self, device: torch.device, num_rows: int) -> dict[str, torch.Tensor | None]:
        """Every host list in one int64 and one fp32 host-to-device copy (async). A position list that
        covers every row it indexes maps to None (no gather needed)."""
        e = self.edits
        num_sampled = len(self.sampled)
        lists = {"sampled": (self.sampled, num_rows), "seeded": (self.seeded, num_sampled),
                 "filtered": (self.filtered, num_sampled), "min_p": (self.min_p, -1),
                 "penalized": (self.penalized, num_rows), "logprobs": (self.logprobs, num_rows),
                 "masked": (self.masked, num_rows), **{name: (ids, -1) for name, ids in e.host_lists().items()}}
        partial = {name: len(ids) != total for name, (ids, total) in lists.items()}
        values = [i for name, (ids, _) in lists.items() if partial[name] for i in ids]
        flat = torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)
        out, start = {}, 0
        for name, (ids, _) in lists.items():
            out[name] = flat[start:start + len(ids)] if partial[name] else None
            start += len(ids) if partial[name] else 0
        values_f = e.val + self.min_p_values
        floats = (torch.tensor(values_f, dtype=torch.float32).to(device, non_blocking=True) if values_f
                  else torch.empty(0, dtype=torch.float32, device=device))
        out["edit_values"], out["min_p_values"] = floats[:len(e.val)], floats[len(e.val):]
        return out


def _take(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return x if index is None else x.index_select(0, index)


@dataclass
class SampleResult:
    """What one sample() returns: tokens [N] int64, and for the rows that asked for logprobs (positions
    `logprob_positions`, each wanting `num_logprobs` top entries) pack_logprobs' fp64 [L, 2 + 2k]."""

    tokens: torch.Tensor
    logprobs: torch.Tensor | None = None
    logprob_positions: list[int] | None = None
    num_logprobs: list[int] | None = None


class SamplingState:
    """Per-row sampling parameters kept on the device, rows indexed like the runner's persistent batch."""

    def __init__(self, max_num_rows: int, vocab_size: int, device: torch.device,
                 max_row_tokens: int | None = None) -> None:
        """max_row_tokens: the most tokens a row's request holds (max_model_len); when given and smaller than the
        vocabulary, the penalties read the rows' token ids rather than per-id counts
        (planning.token_history_applies)."""
        self.max_num_rows, self.vocab_size, self.device = max_num_rows, vocab_size, torch.device(device)

        def zeros(dtype: torch.dtype, *shape: int) -> torch.Tensor:
            return torch.zeros(max_num_rows, *shape, dtype=dtype, device=self.device)
        self.temperature = zeros(torch.float32)            # [R]; 0 = greedy
        self.top_p = zeros(torch.float32).fill_(1.0)       # [R]; 1 = off
        self.top_k = zeros(torch.int32)                    # [R]; 0 = off
        self.seed = zeros(torch.int64)                     # [R]; the seed mod 2^64, as int64
        self.presence_penalty = zeros(torch.float32)       # [R]; 0 = off
        self.frequency_penalty = zeros(torch.float32)      # [R]; 0 = off
        self.repetition_penalty = zeros(torch.float32).fill_(1.0)   # [R]; 1 = off
        self.token_counts = (TokenHistory(max_num_rows, vocab_size, max_row_tokens, self.device)
                             if token_history_applies(vocab_size, max_row_tokens)
                             else DenseCounts(max_num_rows, vocab_size, self.device))
        # host mirrors, so sample() decides which work to skip without reading the device
        self.greedy = [True] * max_num_rows
        self.seeded = [False] * max_num_rows
        self.uses_top_k = [False] * max_num_rows
        self.top_k_host = [0] * max_num_rows               # the top-k of rows that use it, else 0
        self.uses_top_p = [False] * max_num_rows
        self.min_p = [0.0] * max_num_rows                  # of sampled rows (min_p leaves greedy alone)
        self.penalized = [False] * max_num_rows
        self.num_logprobs: list[int | None] = [None] * max_num_rows
        self.edits: list[RowEdits | None] = [None] * max_num_rows

    def set_rows(self, rows: Sequence[int], params: Sequence[SamplingParams],
                 output_token_ids: Sequence[Sequence[int]], extras: Sequence[RowExtras] | None = None) -> None:
        """Give rows to new (or resumed) requests: their parameters, and counts of the tokens they generated
        (extras: prompt, eos ids, tokenized bad words, history; default none)."""
        extras = [RowExtras()] * len(rows) if extras is None else extras
        assert len(rows) == len(params) == len(output_token_ids) == len(extras), "one of each per row"
        self._check_rows(rows)
        if not rows:
            return
        rows_d = self._to_device(rows, torch.int64)                                       # [n]
        self.temperature[rows_d] = self._to_device([p.temperature for p in params], torch.float32)
        self.top_p[rows_d] = self._to_device([float(p.top_p) for p in params], torch.float32)
        self.top_k[rows_d] = self._to_device([max(p.top_k, 0) for p in params], torch.int32)
        self.seed[rows_d] = self._to_device([_signed((p.seed or 0) % _U64) for p in params], torch.int64)
        penalties = self._to_device([[float(p.presence_penalty), float(p.frequency_penalty),
                                      float(p.repetition_penalty)] for p in params], torch.float32)   # [n, 3]
        self.presence_penalty[rows_d], self.frequency_penalty[rows_d], self.repetition_penalty[rows_d] = penalties.t()
        assert all(0 <= t < self.vocab_size for ids in output_token_ids for t in ids), "token id out of vocab"
        self.token_counts.reset(rows_d)
        self.token_counts.set_rows(rows, [e.prompt_token_ids if p.repetition_penalty != 1 else ()
                                          for p, e in zip(params, extras)], output_token_ids, self._to_device)
        for row, p, e in zip(rows, params, extras):
            self.greedy[row] = p.greedy
            self.seeded[row] = p.seed is not None and not p.greedy
            self.uses_top_k[row] = 0 < p.top_k < self.vocab_size and not p.greedy
            self.top_k_host[row] = p.top_k if self.uses_top_k[row] else 0
            self.uses_top_p[row] = p.top_p < 1.0 and not p.greedy
            self.min_p[row] = float(p.min_p) if not p.greedy else 0.0
            self.penalized[row] = p.uses_penalties
            self.num_logprobs[row] = p.logprobs
            edits = row_edits(p, e, self.device)
            self.edits[row] = None if edits.empty else edits

    @property
    def output_token_counts(self) -> torch.Tensor:
        """Every row's [R, vocab] int32 output counts | PROMPT_BIT, whichever form keeps them (tests, diagnostics)."""
        return self.token_counts.dense()

    def clear_rows(self, rows: Sequence[int]) -> None:
        """Free rows (their requests finished or were preempted): neutral parameters, zero counts."""
        self._check_rows(rows)
        if not rows:
            return
        rows_d = self._to_device(rows, torch.int64)                                       # [n]
        for tensor, neutral in ((self.temperature, 0.0), (self.top_p, 1.0), (self.top_k, 0), (self.seed, 0),
                                (self.presence_penalty, 0.0), (self.frequency_penalty, 0.0),
                                (self.repetition_penalty, 1.0)):
            tensor.index_fill_(0, rows_d, neutral)
        self.token_counts.reset(rows_d)
        for row in rows:
            self.greedy[row], self.seeded[row], self.uses_top_k[row], self.uses_top_p[row] = True, False, False, False
            self.top_k_host[row], self.min_p[row], self.penalized[row] = 0, 0.0, False
            self.num_logprobs[row], self.edits[row] = None, None

    def sample(self, logits: torch.Tensor, rows: torch.Tensor, rows_host: Sequence[int],
               num_generated: torch.Tensor, counted: torch.Tensor | None = None) -> torch.Tensor:
        """sample_step's tokens only: [N] int64."""
        return self.sample_step(logits, rows, rows_host, num_generated, counted).tokens

    def sample_step(self, logits: torch.Tensor, rows: torch.Tensor, rows_host: Sequence[int],
                    num_generated: torch.Tensor, counted: torch.Tensor | None = None,
                    num_generated_host: Sequence[int] | None = None, bitmask: torch.Tensor | None = None, masked: Sequence[int] = ()) -> SampleResult:
        """One token per logits row, with no host synchronisation; records the kept ones in token_counts.

        logits: [N, V] any float dtype (computed in fp32); rows: [N] int64, the persistent-batch row of each;
        rows_host: the same as a list; num_generated: [N] int64, tokens each request generated before
        this one (a seeded row's noise and min_tokens depend on it); a row whose logits are not all finite
        gets NONFINITE_TOKEN and is not counted; counted: [N] bool, the rows whose token is kept
        (multi-step decoding samples rows past their last step and drops those tokens).
        num_generated_host: the same as num_generated at the round's first step (default: every row 0
        and min_tokens always checked on the device).
        bitmask: [len(masked), words] int32 on the device, the grammar rows of the positions `masked`.
        """
        assert logits.shape == (len(rows_host), self.vocab_size), "logits: [len(rows_host), vocab_size]"
        plan = self._plan(rows_host, num_generated_host, masked)
        if not plan.sampled and not plan.processed and not plan.logprobs:
            if triton_applies(logits):       # (imported here: Triton stays unimported on CPU)
                from kvfit.kernels import greedy
                if greedy.applies(logits):   # argmax and the finite check in one read of the logits
                    tokens, finite = greedy.greedy_tokens(logits)                          # [N], [N]
                    return SampleResult(self._count(tokens, logits, rows, counted, finite))
            tokens = row_argmax(logits)                                                    # [N]
            return SampleResult(self._count(tokens, logits, rows, counted))
        chunk = sampler_chunk_rows(self.vocab_size)
        if logits.shape[0] > chunk:
            return self._sample_chunks(chunk, plan.num_logprobs, logits, rows, rows_host, num_generated, counted,
                                       num_generated_host, bitmask, masked)
        return self._sample_planned(plan, logits, rows, rows_host, num_generated, counted, bitmask)

    def _sample_chunks(self, chunk: int, num_logprobs: int, logits, rows, rows_host, num_generated, counted,
                       num_generated_host, bitmask, masked) -> SampleResult:
        """sample_step over row chunks of `chunk` rows, so the fp32 temporaries are [chunk, V], not [N, V].
        A row's token depends only on its own logits, parameters and noise, so the result is the one-pass
        result (exactly, for greedy and seeded rows; unseeded rows draw the same distribution). Every chunk
        packs logprobs num_logprobs wide, so their rows concatenate."""
        results, starts = [], range(0, logits.shape[0], chunk)
        for a in starts:
            b = a + chunk
            lo, hi = bisect.bisect_left(masked, a), bisect.bisect_left(masked, b)    # masked: ascending
            plan = self._plan(rows_host[a:b], None if num_generated_host is None else num_generated_host[a:b],
                              [m - a for m in masked[lo:hi]])
            plan.num_logprobs = num_logprobs if plan.logprobs else 0
            results.append(self._sample_planned(plan, logits[a:b], rows[a:b], rows_host[a:b], num_generated[a:b],
                                                None if counted is None else counted[a:b],
                                                None if bitmask is None or lo == hi else bitmask[lo:hi]))
        tokens = torch.cat([r.tokens for r in results])                                    # [N]
        packed = [r.logprobs for r in results if r.logprobs is not None]
        if not packed:
            return SampleResult(tokens)
        return SampleResult(tokens, torch.cat(packed),
                            [a + i for a, r in zip(starts, results) for i in r.logprob_positions or ()],
                            [k for r in results for k in r.num_logprobs or ()])

    def _sample_planned(self, plan: _Plan, logits, rows, rows_host, num_generated, counted, bitmask) -> SampleResult:
        """sample_step's work past its plan, for rows whose temporaries fit at once."""
        index = plan.device_tensors(logits.device, logits.shape[0])
        raw = None
        lp_logits = logits
        if plan.logprobs:
            if plan.masked:     # vLLM applies the grammar's bitmask to the logits before the sampler's logprobs
                lp_logits = logits.to(torch.float32, copy=True)
                self._apply_bitmask(lp_logits, index, bitmask)
            raw = top_logprobs(_take(lp_logits, index["logprobs"]), plan.num_logprobs)    # before any other edit
        work = self._processed_logits(logits, rows, num_generated, plan, index, bitmask)  # [N, V]
        if plan.sampled:
            tokens = self._sample_rows(work, rows, num_generated, plan, index)             # [N]
        else:
            tokens = row_argmax(work)                                                      # [N]
        del work
        tokens = self._count(tokens, logits, rows, counted)
        if raw is None:
            return SampleResult(tokens)
        lp_idx = index["logprobs"]
        packed = pack_logprobs(*raw, _take(lp_logits, lp_idx), _take(tokens, lp_idx))       # [L, 3 + 2k] fp64
        return SampleResult(tokens, packed, plan.logprobs, [self.num_logprobs[rows_host[i]] for i in plan.logprobs])

    def _count(self, tokens: torch.Tensor, logits: torch.Tensor, rows: torch.Tensor,
               counted: torch.Tensor | None, finite: torch.Tensor | None = None) -> torch.Tensor:
        # finite: [N] bool, whether every logit of the row is finite (computed here when None)
        if finite is None:
            finite = finite_rows(logits)                                                   # [N] bool
        kept = finite if counted is None else finite & counted
        self.token_counts.add(tokens, rows, kept)
        # a row whose logits are not finite gets no token: its request ends alone (finish reason "error")
        return torch.where(finite, tokens, NONFINITE_TOKEN)

    @staticmethod
    def _apply_bitmask(work: torch.Tensor, index: dict, bitmask: torch.Tensor) -> None:
        """The grammars' bitmask on fp32 logits [N, V], in place (a row it does not cover: unchanged)."""
        from kvfit.structured.bitmask import apply_bitmask
        m_idx = index["masked"]                     # bitmask row j belongs to position masked[j]
        if m_idx is None:
            apply_bitmask(work, bitmask)
        else:
            picked = work.index_select(0, m_idx)
            apply_bitmask(picked, bitmask)
            work.index_copy_(0, m_idx, picked)

    def _processed_logits(self, logits: torch.Tensor, rows: torch.Tensor, num_generated: torch.Tensor,
                          plan: _Plan, index: dict, bitmask: torch.Tensor | None) -> torch.Tensor:
        """Logits after allowed ids, bad words, min_tokens, logit_bias, the grammar and penalties (fp32
        when any row changes; else the logits themselves, never written)."""
        if not plan.processed:
            return logits
        work = logits.to(torch.float32, copy=True)                                         # [N, V]
        apply_edits(work, num_generated, *plan.edits.device_edits(index, index["edit_values"]))
        if plan.masked:
            self._apply_bitmask(work, index, bitmask)
        if plan.penalized:
            p_idx = index["penalized"]
            p_rows = _take(rows, p_idx)                                                    # [P]
            penalised = apply_penalties(work if p_idx is None else work.index_select(0, p_idx),
                                        self.token_counts.gather(p_rows),
                                        self.presence_penalty[p_rows], self.frequency_penalty[p_rows],
                                        self.repetition_penalty[p_rows])                   # [P, V]
            if p_idx is None:
                return penalised
            work.index_copy_(0, p_idx, penalised)
        return work

    def _plan(self, rows_host: Sequence[int], num_generated_host: Sequence[int] | None = None,
              masked: Sequence[int] = ()) -> _Plan:
        sampled = [i for i, row in enumerate(rows_host) if not self.greedy[row]]
        sampled_rows = [rows_host[i] for i in sampled]
        filtered = [j for j, row in enumerate(sampled_rows) if self.uses_top_k[row] or self.uses_top_p[row]]
        top_ks = [self.top_k_host[sampled_rows[j]] for j in filtered]
        largest_k = max(top_ks) if top_ks and min(top_ks) > 0 else self.vocab_size
        min_p = [j for j, row in enumerate(sampled_rows) if self.min_p[row] > 0]
        logprobs = [i for i, row in enumerate(rows_host) if self.num_logprobs[row] is not None]
        edits = StepEdits()
        for i, row in enumerate(rows_host):
            if self.edits[row] is not None:
                edits.add_row(i, self.edits[row], 0 if num_generated_host is None else num_generated_host[i])
        return _Plan(sampled=sampled,
                     seeded=[j for j, row in enumerate(sampled_rows) if self.seeded[row]],
                     filtered=filtered,
                     any_top_p=any(self.uses_top_p[row] for row in sampled_rows),
                     num_candidates=largest_k if largest_k <= MAX_TOPK_CANDIDATES else self.vocab_size,
                     min_p=min_p, min_p_values=[self.min_p[sampled_rows[j]] for j in min_p],
                     penalized=[i for i, row in enumerate(rows_host) if self.penalized[row]],
                     logprobs=logprobs,
                     num_logprobs=max((self.num_logprobs[rows_host[i]] for i in logprobs), default=0),
                     edits=edits, masked=list(masked))

    def _sample_rows(self, logits: torch.Tensor, rows: torch.Tensor, num_generated: torch.Tensor,
                     plan: _Plan, index: dict) -> torch.Tensor:
        # the M non-greedy rows of the N; greedy rows keep their argmax
        sampled_idx, seeded_idx, filtered_idx = index["sampled"], index["seeded"], index["filtered"]
        sub_rows = _take(rows, sampled_idx)                                                # [M]
        temperature = self.temperature[sub_rows]                                           # [M] all > 0
        scaled = torch.empty((len(plan.sampled), self.vocab_size), dtype=torch.float32, device=logits.device)
        torch.div(_take(logits, sampled_idx), temperature[:, None], out=scaled)            # [M, V] fp32
        if plan.min_p:
            # min_p (after temperature, as vLLM): keep tokens with p >= min_p * p_max, i.e.
            # logit >= max logit + log(min_p)
            m_idx = index["min_p"]
            sub = scaled.index_select(0, m_idx)                                            # [P, V]
            floor = sub.max(dim=-1, keepdim=True).values + index["min_p_values"].log()[:, None]
            scaled.index_copy_(0, m_idx, sub.masked_fill_(sub < floor, float("-inf")))
        if plan.filtered:
            f_rows = _take(sub_rows, filtered_idx)                                         # [F]
            threshold = filter_thresholds(_take(scaled, filtered_idx), self.top_k[f_rows], self.top_p[f_rows],
                                          plan.any_top_p, plan.num_candidates)             # [F]
            if filtered_idx is not None:
                threshold = torch.full_like(temperature, float("-inf")).index_copy_(0, filtered_idx, threshold)
            scaled.masked_fill_(scaled < threshold[:, None], float("-inf"))
        noise = self._exponential_noise(scaled, sub_rows, _take(num_generated, sampled_idx), seeded_idx, plan)
        sampled = row_argmax(scaled.sub_(noise.log_()))                                    # [M]
        if sampled_idx is None:
            return sampled
        return row_argmax(logits).index_copy_(0, sampled_idx, sampled)                     # [N]

    def _exponential_noise(self, scaled: torch.Tensor, sub_rows: torch.Tensor, num_generated: torch.Tensor,
                           seeded_idx: torch.Tensor | None, plan: _Plan) -> torch.Tensor:
        # -> [M, V] float32 Exp(1): hashed for seeded rows, the default generator for the others
        if len(plan.seeded) == len(plan.sampled):
            return hashed_exponential(self.seed[sub_rows], num_generated, self.vocab_size)
        # CUDA's exponential_ never returns 0 (it moves that mass to -log(1 - eps)); on CPU the chance is 2^-53
        noise = torch.empty_like(scaled).exponential_()      # seeded rows are overwritten: one pass, no gather
        if plan.seeded:
            seeded_rows = sub_rows.index_select(0, seeded_idx)                             # [S]
            hashed = hashed_exponential(self.seed[seeded_rows], num_generated.index_select(0, seeded_idx),
                                        self.vocab_size)                                   # [S, V]
            noise.index_copy_(0, seeded_idx, hashed)
        return noise

    def _check_rows(self, rows: Sequence[int]) -> None:
        assert all(0 <= r < self.max_num_rows for r in rows), f"rows must be in [0, {self.max_num_rows})"
        assert len(set(rows)) == len(rows), "rows must be distinct"

    def _to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)
