"""What a caller sees of one request, in vLLM's shape: RequestOutput with one CompletionOutput per
sample (`out.outputs[0].text`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """A token's log probability under the model (fp32 log-softmax), its rank (1 = most likely) and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# per position: token id -> Logprob (the chosen or prompt token, plus the top-k asked for)
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One sample of a request. text and token_ids hold the generated part only.

    finish_reason: stop | length | abort | error (non-finite logits); stop_reason: the stop string
    or stop token id that ended it (None for eos, length and the others).
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When the engine saw the request's stages, in its process's time.monotonic() seconds (vLLM's
    RequestOutput.metrics): arrival, first admission into a step, first output token applied, end."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    def phases(self) -> dict[str, float] | None:
        """vLLM's per-request phases in seconds (queue, prefill, decode, inference); None before the end or
        without a first token."""
        if None in (self.first_scheduled_time, self.first_token_time, self.finished_time):
            return None
        return {"queue": self.first_scheduled_time - self.arrival_time,
                "prefill": self.first_token_time - self.first_scheduled_time,
                "decode": self.finished_time - self.first_token_time,
                "inference": self.finished_time - self.first_scheduled_time}


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None      # set on a finished request's output
