"""A request's state as the scheduler sees it. No torch."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvfit.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Prompt, generated tokens and the cache blocks holding their K/V."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    max_total_tokens: int = 0            # min(prompt + max_tokens, max_model_len)
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0         # tokens whose K/V are in the cache
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)   # chained hashes of full blocks
    num_cached_prompt_tokens: int = 0    # prefix-cache hit at the first admission
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None     # stop | length | abort

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list (decode steps take one token)."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        return self.prompt_token_ids[start:end] + self.output_token_ids[:max(end - num_prompt, 0)]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
