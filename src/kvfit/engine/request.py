"""A request's state as the engine sees it. No torch."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvfit.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    PREPARING = "preparing"     # its grammar compiles / bad words tokenize off the engine thread (vLLM's WAITING_FOR_FSM)
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Prompt and generated tokens; its block table lives in the KVCacheManager under request_id."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    max_total_tokens: int = 0            # min(prompt + max_tokens, max_model_len), set at admission
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None    # monotonic s: first admitted into a step (queue time ends)
    first_token_time: float | None = None        # monotonic s: its first output token applied (prefill ends)
    num_computed_tokens: int = 0         # tokens whose K/V are in the cache
    num_cached_prompt_tokens: int = 0    # prefix-cache hit at the first admission
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None     # stop | length | abort | error (non-finite logits)
    index: int = 0                       # which of the parent's n samples (0 without n)
    parent_id: str | None = None         # the request of n samples this one belongs to
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()   # params.bad_words, tokenized at admission
    matcher: object | None = None        # structured outputs: a kvfit.structured Matcher
    cache_salt: str | None = None        # prefix-cache isolation: shares blocks only with the same salt
    # futures the request waits for (status PREPARING) before it may be scheduled: its grammar, its bad
    # words' token ids; the engine reads them and clears this when all are done
    pending: tuple = ()
    # prompt + output in one list, appended one token at a time: slicing a step's tokens and
    # committing full blocks to the prefix cache never rebuild it
    token_ids: list[int] = field(init=False)

    def __post_init__(self):
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """A copy of the generated tokens."""
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def all_token_ids(self) -> list[int]:
        return self.token_ids

    def append_output(self, token: int) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.token_ids.append(token)

    @property
    def single_step(self) -> bool:
        """Whether each token needs the host before the next (a grammar, multi-token bad words), so the
        request never runs multi-step rounds."""
        return self.matcher is not None or any(len(ids) > 1 for ids in self.bad_words_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
