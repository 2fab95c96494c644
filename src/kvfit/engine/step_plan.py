"""StepPlan: what the scheduler hands the runner each step. Plain data, no torch."""

from __future__ import annotations

from dataclasses import dataclass

from kvfit.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class ScheduledSeq:
    """One request's share of a step: compute token_ids at positions start_pos..., maybe sample."""

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int                # tokens already in the cache before this step
    block_ids: tuple[int, ...]    # the request's whole block table (covers start_pos + len(token_ids))
    sample: bool                  # the chunk ends at the last known token: sample the next one
    params: SamplingParams
    num_generated: int            # output tokens so far (seeds the per-request sampler)
    # decode steps to run back to back (multi-step): step k computes position start_pos + k and
    # samples; block_ids already cover all of them. Always 1 for prefill chunks.
    num_steps: int = 1


@dataclass(frozen=True)
class StepPlan:
    seqs: tuple[ScheduledSeq, ...]
    preempted_ids: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def empty(self) -> bool:
        return not self.seqs

    @property
    def num_steps(self) -> int:
        """Device steps this plan runs: 1, or the most decode steps of any sequence (multi-step)."""
        return max((s.num_steps for s in self.seqs), default=1)
