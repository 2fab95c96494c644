"""StepDelta: what the scheduler hands the runner each step. Plain data, no torch.

The contract is incremental (as vLLM v1's scheduler output): a request's prompt, sampling params
and first block ids reach the runner once, in `new_requests`, when it is first scheduled (again
after a preemption, with the tokens it had generated). Later steps carry only the scheduled ids
with their token counts and the block ids appended to their tables since the last step, plus the
ids that finished or were preempted. The runner keeps everything else in its persistent batch.

Invariants:
- block tables are append-only: a request's table is its first block ids plus every later
  new_block_ids, in order, until it finishes or is preempted;
- the runner computes tokens num_computed..num_computed + num_scheduled_tokens of a request's
  token ids (prompt + output), where num_computed starts at NewRequest.num_computed_tokens and
  grows by what each step computed; it samples when that reaches the end of its known tokens;
- removed_ids are applied before new_requests, so an id can end and start again in one delta;
- a delta with `continues` (async scheduling) is scheduled while the previous delta is still on the
  device: a request of it that the previous delta samples decodes one token per step and takes as its
  first input the token the device sampled at its last step there (the host has not seen it yet); the
  others (prefill chunks, admissions) read known tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfit.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequest:
    """A request the runner has not seen (or has dropped after a preemption)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]    # generated before a preemption; () for a new request
    params: SamplingParams
    block_ids: tuple[int, ...]           # the table so far (prefix-cache hits and this step's blocks)
    num_computed_tokens: int             # tokens whose K/V are already in those blocks (prefix hits)
    eos_token_ids: tuple[int, ...] = ()  # held back with stop_token_ids until params.min_tokens
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()   # params.bad_words, tokenized at admission


@dataclass(frozen=True)
class StepDelta:
    """One step: the scheduled requests in batch order and what changed since the last step."""

    request_ids: tuple[str, ...] = ()              # scheduled, in batch order (new ones included)
    num_scheduled_tokens: tuple[int, ...] = ()     # tokens computed this step, per scheduled request
    new_block_ids: tuple[tuple[int, ...], ...] = ()  # appended to each scheduled table ((): none)
    # decode steps run back to back (multi-step): step k computes one more token of each sequence
    # whose num_steps > k, fed by the token sampled at step k-1. () means one step for every request.
    num_steps: tuple[int, ...] = ()
    new_requests: tuple[NewRequest, ...] = ()
    finished_ids: tuple[str, ...] = ()             # ended (stop, length, abort) since the last delta
    preempted_ids: tuple[str, ...] = ()            # preempted this step: their blocks are gone
    # structured outputs: {request_id: the tokens its grammar allows now, as an int32 bitmask's bytes
    # (bit t of word t // 32; kvfit.structured.bitmask)}, for scheduled requests with a grammar (such a
    # request always runs single steps)
    token_bitmasks: dict[str, bytes] | None = None
    # async scheduling: this delta continues the previous one on the device (see the invariants)
    continues: bool = False
    # leading blocks of the first scheduled request whose contents (the same tokens at the same positions, by
    # chained hash) every running request has computed, in those blocks or in copies of its own (vLLM's
    # num_common_prefix_blocks): a decode step may attend them once for all its sequences through the first
    # request's blocks (cascade attention). 0 when prefix caching is off.
    num_common_prefix_blocks: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def empty(self) -> bool:
        """Nothing to run (the runner may still have rows to drop)."""
        return not self.request_ids

    @property
    def max_num_steps(self) -> int:
        """Device steps this delta runs: 1, or the most decode steps of any request (multi-step)."""
        return max(self.num_steps, default=1)

    @property
    def removed_ids(self) -> tuple[str, ...]:
        return self.finished_ids + self.preempted_ids

    def steps_of(self, index: int) -> int:
        return self.num_steps[index] if self.num_steps else 1


@dataclass(frozen=True)
class TokenLogprobs:
    """One position's log probabilities (raw fp32 log-softmax), on the host: the token's with its rank
    (1 = most likely), then the top-k ids and logprobs, most likely first."""

    token_id: int
    logprob: float
    rank: int
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


@dataclass
class SampledTokens:
    """What the runner sampled for one delta, on the host (rank 0).

    tokens: {request_id: tokens sampled for it, in order: one per device step of the delta};
    nonfinite_ids: requests whose logits were not finite (NaN or inf) at the device step after their last
    token in `tokens` (each is a key of `tokens`, its list possibly empty): the engine ends each alone with
    finish reason "error"; the rest of the batch goes on;
    logprobs: {request_id: one TokenLogprobs per sampled token} for requests that asked (logprobs);
    prompt_logprobs: {request_id: (first position, [TokenLogprobs of prompt tokens from there])} for
    requests that asked (prompt_logprobs); position p's entry is prompt token p given tokens < p.
    """

    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    nonfinite_ids: set[str] = field(default_factory=set)

    def nonfinite_at(self, step: int) -> list[str]:
        """The requests whose logits were not finite at device step `step` of the delta, in batch order."""
        if not self.nonfinite_ids:
            return []
        return [rid for rid, toks in self.tokens.items() if len(toks) == step and rid in self.nonfinite_ids]
