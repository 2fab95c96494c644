"""What a request's parameters do to its logits before the draw, and the log probabilities it asked for.

Applied by SamplingState.sample() to the rows that need it, in vLLM v1's order: raw logprobs (of the logits
with only the structured-output bitmask applied: vLLM's model runner masks the logits before its sampler), then
on fp32 logits allowed_token_ids, bad words, min_tokens, logit_bias, the structured-output bitmask, then the
penalties (repetition, frequency, presence); temperature, min_p,
top-k and top-p come after, in the sampler.

A request's lists (allowed ids, logit_bias, bad words, held-back ids) go to the device once, when it joins
the persistent batch (`row_edits`); per step only positions and lengths travel, in one int64 and one fp32
host-to-device copy built from host mirrors (`StepEdits`), so a step's host work is O(rows) whatever the
lists hold; no step reads the device. Entries that depend on how many tokens a request generated
(min_tokens) carry a bound and are compared on the device against num_generated, so multi-step
decoding advances them without the host.

Output-token counts and prompt presence share one int32 tensor ([R, vocab]): the low bits count a
token in the output, PROMPT_BIT marks it in the prompt (set only for rows with a repetition penalty).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from kvfit.step import TokenLogprobs

PROMPT_BIT = 1 << 30                  # in SamplingState.output_token_counts: the token is in the prompt
COUNT_MASK = PROMPT_BIT - 1           # the output count (at most max_model_len < 2^30)
ALWAYS = 1 << 62                      # an edit's bound on num_generated when it always applies
NEG_INF = float("-inf")


@dataclass(frozen=True)
class RowExtras:
    """What a row needs beyond its SamplingParams (from the engine's NewRequest).

    eos_token_ids: held back with stop_token_ids until min_tokens; bad_words_token_ids: each bad word's
    token ids (the last one is banned when the output ends in the others); history: the request's
    token ids (prompt + output, a list the runner extends) for multi-token bad words.
    """

    prompt_token_ids: Sequence[int] = ()
    eos_token_ids: Sequence[int] = ()
    bad_words_token_ids: Sequence[Sequence[int]] = ()
    history: list[int] | None = None


@dataclass
class RowEdits:
    """One row's edits, built once at set_rows: the fixed entries (logit_bias, one-token bad words, the ids
    min_tokens holds back) and the allowed ids are device tensors there, so a step's host work for the row
    is O(1) whatever the sizes of its lists (issue 27 (10)). Multi-token bad words are matched on the host,
    looked up by their prefix's last token: O(the words that can match now), not O(all of them)."""

    fixed_index: torch.Tensor | None = None   # [2, S] int64: (token, bound); applied while num_generated < bound
    fixed_values: torch.Tensor | None = None  # [S] fp32: a bias or -inf
    fixed_always: bool = False                # some fixed entry has no bound (else all end at min_tokens)
    min_tokens: int = 0
    allowed_ids: torch.Tensor | None = None   # [K] int64, distinct: every other token gets -inf
    # prefix's last token -> [(prefix, the banned last token)]
    bad_sequences: dict[int, list[tuple[tuple[int, ...], int]]] = field(default_factory=dict)
    history: list[int] | None = None
    num_prompt_tokens: int = 0

    @property
    def num_fixed(self) -> int:
        return 0 if self.fixed_values is None else self.fixed_values.shape[0]

    @property
    def empty(self) -> bool:
        return not (self.num_fixed or self.allowed_ids is not None or self.bad_sequences)

    def fixed_live(self, num_generated: int) -> bool:
        """Whether the fixed entries can still change a logit (the device compares the bounds exactly)."""
        return bool(self.num_fixed) and (self.fixed_always or num_generated < self.min_tokens)

    def dynamic_bans(self) -> list[int]:
        """Last tokens of multi-token bad words whose prefix the output ends with (vLLM: output tokens only)."""
        if not self.bad_sequences or self.history is None:
            return []
        history, num_output = self.history, len(self.history) - self.num_prompt_tokens
        if num_output <= 0:
            return []
        return [last for prefix, last in self.bad_sequences.get(history[-1], ())
                if len(prefix) <= num_output and tuple(history[len(history) - len(prefix):]) == prefix]


def row_edits(params, extras: RowExtras, device: torch.device) -> RowEdits:
    """A row's edits, with its lists copied to the device once."""
    entries = [(token, float(value), ALWAYS) for token, value in (params.logit_bias or {}).items()]
    bad_sequences: dict[int, list[tuple[tuple[int, ...], int]]] = {}
    for ids in extras.bad_words_token_ids:
        if len(ids) == 1:
            entries.append((ids[0], NEG_INF, ALWAYS))
        elif ids:
            bad_sequences.setdefault(ids[-2], []).append((tuple(ids[:-1]), ids[-1]))
    edits = RowEdits(fixed_always=bool(entries), min_tokens=params.min_tokens, bad_sequences=bad_sequences,
                     history=extras.history, num_prompt_tokens=len(extras.prompt_token_ids))
    if params.min_tokens:
        entries += [(token, NEG_INF, params.min_tokens)
                    for token in dict.fromkeys((*extras.eos_token_ids, *params.stop_token_ids))]
    if entries:
        tokens, values, bounds = zip(*entries)
        edits.fixed_index = torch.tensor([tokens, bounds], dtype=torch.int64).to(device, non_blocking=True)
        edits.fixed_values = torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)
    if params.allowed_token_ids is not None:
        allowed = sorted(set(params.allowed_token_ids))
        edits.allowed_ids = torch.tensor(allowed, dtype=torch.int64).to(device, non_blocking=True)
    return edits


class StepEdits:
    """The logit edits of one step: host entries (multi-token bad words matched now) plus, per row, its
    device tensors from RowEdits. O(rows) host work: no row's list is walked here."""

    def __init__(self):
        self.pos: list[int] = []
        self.tok: list[int] = []
        self.val: list[float] = []
        self.until: list[int] = []
        self.fixed_pos: list[int] = []
        self.fixed: list[RowEdits] = []
        self.allowed_pos: list[int] = []
        self.allowed: list[torch.Tensor] = []

    def add_row(self, pos: int, edits: RowEdits, num_generated: int) -> None:
        if edits.fixed_live(num_generated):
            self.fixed_pos.append(pos)
            self.fixed.append(edits)
        # multi-token bad words, from the host history: right at a round's first step; such a request runs
        # one step per round (the scheduler), so what the batch samples for it past that step is dropped
        for token in edits.dynamic_bans():
            self.pos.append(pos)
            self.tok.append(token)
            self.val.append(NEG_INF)
            self.until.append(ALWAYS)
        if edits.allowed_ids is not None:
            self.allowed_pos.append(pos)
            self.allowed.append(edits.allowed_ids)

    @property
    def empty(self) -> bool:
        return not self.pos and not self.fixed_pos and not self.allowed_pos

    def host_lists(self) -> dict[str, list[int]]:
        """The int64 lists this step sends to the device (in the step's one copy)."""
        return {"edit_pos": self.pos, "edit_tok": self.tok, "edit_until": self.until,
                "fixed_pos": self.fixed_pos, "fixed_len": [e.num_fixed for e in self.fixed],
                "allowed_rows": self.allowed_pos, "allowed_len": [t.shape[0] for t in self.allowed]}

    def device_edits(self, index: dict, edit_values: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """apply_edits' tensors from host_lists' device copies (index) and the rows' own tensors; a few
        device ops per row, none reading the device."""
        parts = [torch.stack([index["edit_pos"], index["edit_tok"], index["edit_until"]])]   # [3, D]
        values = [edit_values]                                                               # [D]
        if self.fixed:
            pos = torch.repeat_interleave(index["fixed_pos"], index["fixed_len"],
                                          output_size=sum(e.num_fixed for e in self.fixed))   # [S]
            parts.append(torch.cat([pos[None], torch.cat([e.fixed_index for e in self.fixed], dim=1)]))
            values.append(torch.cat([e.fixed_values for e in self.fixed]))
        allowed_index = None
        if self.allowed:
            j = torch.repeat_interleave(torch.arange(len(self.allowed), device=edit_values.device),
                                        index["allowed_len"], output_size=sum(t.shape[0] for t in self.allowed))
            allowed_index = torch.stack([j, torch.cat(self.allowed)])                        # [2, K]
        return torch.cat(parts, dim=1), torch.cat(values), index["allowed_rows"], allowed_index


def apply_edits(logits: torch.Tensor, num_generated: torch.Tensor, edit_index: torch.Tensor,
                edit_values: torch.Tensor, allowed_rows: torch.Tensor | None,
                allowed_index: torch.Tensor | None) -> None:
    """In place on fp32 logits [N, V]: allowed-token masks, then the additive edits.

    edit_index: [3, E] int64 (position, token, bound); edit_values: [E] fp32 (a bias or -inf), applied
    where num_generated[position] < bound. allowed_rows: [A] positions; allowed_index: [2, K] (index
    among them, token): every other token of those rows gets -inf.
    """
    if allowed_rows is not None and allowed_rows.numel():
        mask = torch.full((allowed_rows.shape[0], logits.shape[1]), NEG_INF, device=logits.device)   # [A, V]
        mask[allowed_index[0], allowed_index[1]] = 0.0
        logits.index_add_(0, allowed_rows, mask)
    if edit_values.numel():
        pos, tok, until = edit_index
        live = num_generated.index_select(0, pos) < until                                 # [E] bool
        values = torch.where(live, edit_values, torch.zeros_like(edit_values))
        logits.index_put_((pos, tok), values, accumulate=True)


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
                    repetition: torch.Tensor) -> torch.Tensor:
    """Penalise fp32 logits of P rows in place; returns them.

    logits: [P, V] fp32; counts: [P, V] int32 (output count | PROMPT_BIT; overwritten); presence, frequency,
    repetition: [P] fp32. Repetition as transformers' RepetitionPenaltyLogitsProcessor, on every token
    of the prompt or the output: negative logits times the penalty, others divided by it; then
    frequency_penalty x the output count and presence_penalty once per token the output holds (OpenAI).
    """
    seen = counts != 0                                                                    # [P, V] prompt or output
    output_counts = counts.bitwise_and_(COUNT_MASK)                                       # [P, V] in place
    rep = repetition[:, None]
    factor = torch.where(logits < 0, rep, rep.reciprocal())                               # [P, V]
    logits.mul_(factor.masked_fill_(~seen, 1.0))
    del factor, seen
    # frequency x count + presence x (count > 0), subtracted
    penalty = output_counts.to(torch.float32).mul_(frequency[:, None])                    # [P, V]
    penalty.add_((output_counts > 0).to(torch.float32).mul_(presence[:, None]))
    return logits.sub_(penalty)


def top_logprobs(raw_logits: torch.Tensor, num_logprobs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw logits [L, V] -> (logsumexp [L] fp32, top-k fp32 log-softmax values [L, k], their ids [L, k]).

    The fp32 log-softmax of a token is its fp32 logit minus the logsumexp, so only [L] stays alive until
    the token is drawn (pack_logprobs), not an [L, V] tensor beside the sampler's."""
    logits = raw_logits.to(torch.float32)                                                 # [L, V]
    lse = torch.logsumexp(logits, dim=-1)                                                 # [L]
    if not num_logprobs:
        empty = logits.new_empty((logits.shape[0], 0))
        return lse, empty, empty.to(torch.int64)
    top = torch.topk(logits, num_logprobs, dim=-1)
    return lse, top.values.sub_(lse[:, None]), top.indices


def pack_logprobs(lse: torch.Tensor, top_values: torch.Tensor, top_ids: torch.Tensor, raw_logits: torch.Tensor,
                  tokens: torch.Tensor) -> torch.Tensor:
    """One fp64 tensor [L, 3 + 2k] per step (one copy to the host): the token's id, logprob and rank
    (1 + how many tokens have a larger logprob, as vLLM counts), then the top-k ids and logprobs.

    raw_logits: [L, V] the same logits top_logprobs saw; token ids are exact in fp64. tokens: [L] int64
    (a NONFINITE_TOKEN row's values are meaningless)."""
    safe = tokens.clamp(min=0)
    chosen = raw_logits.gather(1, safe[:, None])                                          # [L, 1] model dtype
    rank = (raw_logits > chosen).sum(dim=-1, keepdim=True) + 1                            # [L, 1]
    chosen = chosen.to(torch.float32).sub_(lse[:, None])
    return torch.cat([safe[:, None].to(torch.float64), chosen.to(torch.float64), rank.to(torch.float64),
                      top_ids.to(torch.float64), top_values.to(torch.float64)], dim=1)


def unpack_logprobs(packed: list[list[float]], num_logprobs: Sequence[int]) -> list[TokenLogprobs]:
    """Host rows of pack_logprobs, each cut to its own request's k."""
    out = []
    for row, k in zip(packed, num_logprobs):
        width = (len(row) - 3) // 2
        out.append(TokenLogprobs(token_id=int(row[0]), logprob=row[1], rank=int(row[2]),
                                 top_ids=tuple(int(t) for t in row[3:3 + k]),
                                 top_logprobs=tuple(row[3 + width:3 + width + k])))
    return out
