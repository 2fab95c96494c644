"""What the HTTP front-end and the engine core process say to each other (msgspec structs over pyzmq).

Front-end -> core: AddCommand, AbortCommand, CloseCommand (refuse adds, end what runs: a SIGTERM),
StopCommand (exit). Core -> front-end: Ready once start-up is done (or StartFailed), AddResult for
each AddCommand, and an OutputBatch per engine step: for every request that moved, a *delta* (the
tokens, text and logprobs new since the last batch), so a message never grows with the length of the
output. The front-end folds deltas back into cumulative RequestOutputs (OutputAccumulator).

Text is made on the front-end (FrontEndText): the core runs a request with detokenize=False and sends
token ids; the front-end decodes them incrementally and names the logprobs' tokens, off the core's GIL.
The one exception is a request with stop strings: only the core can end it the moment its text holds
one (no step wasted past it, none of its tokens sent), so the core detokenizes that request and its
deltas carry the text.

msgspec encodes these (and the engine's Logprob dataclass) as msgpack: no pickle per token. The only
pickle is a request's SamplingParams, once, inside its AddCommand (a nested frozen dataclass with
validation; the two processes are one program, so the bytes are trusted).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

import msgspec

from kvfit.engine.output import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from kvfit.sampling_params import SamplingParams
from kvfit.server.protocol import APIError
from kvfit.text.detokenizer import IncrementalDetokenizer


class ErrorInfo(msgspec.Struct, frozen=True):
    """An APIError's fields (server/protocol.py), so a refusal keeps its status, param and code."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    @classmethod
    def of(cls, error: APIError) -> "ErrorInfo":
        return cls(error.status, error.message, error.type, error.param, error.code)

    def error(self) -> APIError:
        return APIError(self.status, self.message, self.type, self.param, self.code)


# front-end -> core -------------------------------------------------------------------------------
class AddCommand(msgspec.Struct, tag=True):
    request_id: str
    prompt_ids: list[int]
    params: bytes                  # pickle of a SamplingParams, validated on the front-end
    max_tokens_given: bool = True
    cache_salt: str | None = None


class AbortCommand(msgspec.Struct, tag=True):
    request_ids: list[str]


class CloseCommand(msgspec.Struct, tag=True):
    """Shutting down: refuse new requests, end running ones with a 503."""


class StopCommand(msgspec.Struct, tag=True):
    """Exit the core loop and shut the engine down."""


Command = AddCommand | AbortCommand | CloseCommand | StopCommand


# core -> front-end -------------------------------------------------------------------------------
class Ready(msgspec.Struct, tag=True):
    """Start-up is done: what the front-end needs to know of the engine."""

    max_model_len: int
    max_logprobs: int
    max_num_seqs: int
    default_sampling_params: dict
    capacity_line: str
    stats: dict
    eos_token_ids: list[int] = []
    max_requests_at_once: int = 0       # EngineCore.max_requests_at_once


class StartFailed(msgspec.Struct, tag=True):
    """Start-up failed: `config` errors are a user's mistake (exit 2), others exit 1."""

    message: str
    config: bool = False


class AddResult(msgspec.Struct, array_like=True):
    request_id: str
    num_prompt_tokens: int = 0
    error: ErrorInfo | None = None


class SampleDelta(msgspec.Struct, array_like=True):
    """What one sample gained: text_keep characters of the text sent before stay (a stop string can cut
    text already sent), then `text`; new token ids and their logprobs."""

    index: int
    text_keep: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None


class RequestDelta(msgspec.Struct, array_like=True):
    request_id: str
    finished: bool
    samples: list[SampleDelta]
    num_cached_tokens: int = 0
    prompt: str | None = None
    # sent once, with the first delta that has them
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # the finished delta: the engine's RequestMetrics times (the core's time.monotonic(); only their differences
    # are read): arrival, first scheduled, first token, finished
    metrics: tuple[float, float | None, float | None, float | None] | None = None


class OutputBatch(msgspec.Struct, tag=True):
    """One round of the core loop's news: the adds it took or refused, deltas of one engine step,
    requests ended with an error, the stats after it, and (once) why the engine can no longer serve."""

    added: list[AddResult]
    deltas: list[RequestDelta]
    errors: list[tuple[str, ErrorInfo]]
    stats: dict
    dead_reason: str | None = None


Reply = Ready | StartFailed | OutputBatch


# deltas ------------------------------------------------------------------------------------------
class DeltaTracker:
    """Core side: turns the engine's cumulative RequestOutputs into deltas (what each sample sent)."""

    def __init__(self):
        # request id -> ({sample index: (text sent, tokens sent, finish sent)}, prompt logprobs sent)
        self._sent: dict[str, tuple[dict[int, tuple[str, int, bool]], bool]] = {}

    def delta(self, output: RequestOutput) -> RequestDelta:
        sent, prompt_sent = self._sent.get(output.request_id, ({}, False))
        samples = []
        for sample in output.outputs:
            text, num_tokens, done = sent.get(sample.index, ("", 0, False))
            if done:
                continue
            keep = len(text) if sample.text.startswith(text) else _common_prefix(text, sample.text)
            new_ids = sample.token_ids[num_tokens:]
            if not new_ids and keep == len(text) == len(sample.text) and sample.finish_reason is None:
                continue
            samples.append(SampleDelta(sample.index, keep, sample.text[keep:], list(new_ids),
                                       None if sample.logprobs is None else sample.logprobs[num_tokens:],
                                       sample.cumulative_logprob, sample.finish_reason, sample.stop_reason))
            sent[sample.index] = (sample.text, len(sample.token_ids), sample.finish_reason is not None)
        prompt_logprobs = None
        if not prompt_sent and output.prompt_logprobs is not None:
            prompt_logprobs, prompt_sent = output.prompt_logprobs, True
        if output.finished:
            self._sent.pop(output.request_id, None)
        else:
            self._sent[output.request_id] = (sent, prompt_sent)
        m = output.metrics
        metrics = None if m is None else (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finished_time)
        return RequestDelta(output.request_id, output.finished, samples, output.num_cached_tokens, output.prompt,
                            prompt_logprobs, metrics)

    def drop(self, request_id: str) -> None:
        self._sent.pop(request_id, None)


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class FrontEndText:
    """Front-end side: the text of one request the core runs without detokenizing, per sample, and the
    text of its logprobs' tokens. The same text the core's OutputProcessor would make: the output ids
    decoded incrementally, less a final eos or stop token id (kept with include_stop_str_in_output)."""

    def __init__(self, tokenizer, params: SamplingParams, eos_token_ids: Iterable[int],
                 token_text: Callable[[int], str]):
        self._tokenizer, self._params, self._token_text = tokenizer, params, token_text
        eos = () if params.ignore_eos else tuple(eos_token_ids)
        self._stop_ids = frozenset((*eos, *params.stop_token_ids))
        self._samples: dict[int, IncrementalDetokenizer] = {}

    @staticmethod
    def applies(tokenizer, params) -> bool:
        """The front-end makes this request's text: a tokenizer, text asked for, no stop strings."""
        return (tokenizer is not None and isinstance(params, SamplingParams) and params.detokenize
                and not params.stop)

    @staticmethod
    def core_params(params: SamplingParams) -> SamplingParams:
        """What the core runs: the same request without text."""
        return dataclasses.replace(params, detokenize=False)

    def extend(self, index: int, new_ids: list[int], num_tokens: int, finish_reason: str | None) -> str:
        """Sample `index` gained new_ids (num_tokens in all); its text so far (final once it finished)."""
        detok = self._samples.get(index)
        if detok is None:
            params = self._params
            detok = self._samples[index] = IncrementalDetokenizer(
                self._tokenizer, (), params.skip_special_tokens, params.include_stop_str_in_output,
                params.spaces_between_special_tokens)
        ids = new_ids
        # the core's finish rule: an eos or stop token id (from min_tokens on) ends a sample without its text
        if (finish_reason == "stop" and ids and ids[-1] in self._stop_ids and num_tokens >= self._params.min_tokens
                and not self._params.include_stop_str_in_output):
            ids = ids[:-1]
        for token_id in ids:
            detok.add(token_id, check_stop=False)
        if finish_reason is None:
            return detok.text
        self._samples.pop(index, None)
        return detok.final_text()

    def name_tokens(self, positions: list) -> list:
        """Logprob positions with each token's text (vLLM's decoded_token); None positions stay None."""
        return [None if position is None else self._named(position) for position in positions]

    def _named(self, position: PositionLogprobs) -> PositionLogprobs:
        return {token_id: Logprob(lp.logprob, lp.rank, self._token_text(token_id))
                for token_id, lp in position.items()}


class OutputAccumulator:
    """Front-end side: one request's deltas folded back into the cumulative RequestOutput the response
    builders read. fold() extends this request's lists in place (no copy a step); snapshot() makes the output
    when it is read (its token and logprob lists copied, so later folds do not change it), once however many
    deltas were folded since. text: where the front-end makes the request's text (FrontEndText), else the core
    sends it."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], text: FrontEndText | None = None):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.prompt: str | None = None
        self.prompt_logprobs = None
        self.samples: dict[int, CompletionOutput] = {}     # mutable: snapshot() copies their lists
        self.num_tokens = 0                                  # over every choice
        self._text = text
        self._last: RequestDelta | None = None

    def apply(self, delta: RequestDelta) -> RequestOutput:
        self.fold(delta)
        return self.snapshot()

    def fold(self, delta: RequestDelta) -> int:
        """Fold one delta in -> the request's output tokens so far, over every choice."""
        made = self._text
        if delta.prompt is not None:
            self.prompt = delta.prompt
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = (delta.prompt_logprobs if made is None
                                    else made.name_tokens(delta.prompt_logprobs))
        for d in delta.samples:
            sample = self.samples.get(d.index)
            if sample is None:
                sample = self.samples[d.index] = CompletionOutput(index=d.index)
            sample.token_ids.extend(d.token_ids)
            self.num_tokens += len(d.token_ids)
            if d.logprobs is not None:
                if sample.logprobs is None:
                    sample.logprobs = []
                sample.logprobs.extend(d.logprobs if made is None else made.name_tokens(d.logprobs))
            sample.text = (sample.text[:d.text_keep] + d.text if made is None
                           else made.extend(d.index, d.token_ids, len(sample.token_ids), d.finish_reason))
            sample.cumulative_logprob, sample.finish_reason, sample.stop_reason = (
                d.cumulative_logprob, d.finish_reason, d.stop_reason)
        self._last = delta
        return self.num_tokens

    def snapshot(self) -> RequestOutput:
        """The cumulative output as of the last fold."""
        delta = self._last
        outputs = [dataclasses.replace(sample, token_ids=list(sample.token_ids),
                                       logprobs=None if sample.logprobs is None else list(sample.logprobs))
                   for _, sample in sorted(self.samples.items())]
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                             prompt_logprobs=self.prompt_logprobs, outputs=outputs, finished=delta.finished,
                             num_cached_tokens=delta.num_cached_tokens,
                             metrics=None if delta.metrics is None else RequestMetrics(*delta.metrics))


ENCODER = msgspec.msgpack.Encoder()
COMMAND_DECODER = msgspec.msgpack.Decoder(Command)
REPLY_DECODER = msgspec.msgpack.Decoder(Reply)
