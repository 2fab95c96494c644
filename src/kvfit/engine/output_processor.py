"""The one finish decision and the one output path: tokens in, RequestOutputs out.

Each token the runner sampled is applied here, in order: the incremental detokenizer extends the
request's text (O(1) per token) and looks for stop strings in what is new; eos, stop_token_ids,
stop strings and max_tokens/max_model_len decide whether the request ends, in vLLM's order. Before
min_tokens nothing but the length ends a request (the sampler holds eos and stop_token_ids back; stop
strings are not looked for, as vLLM). Log probabilities arrive with their tokens and are kept here,
with their decoded text (vLLM's: the token decoded alone, special tokens kept).
"""

from __future__ import annotations

import time

from kvfit.engine.output import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from kvfit.engine.request import Request
from kvfit.step import TokenLogprobs
from kvfit.text.detokenizer import IncrementalDetokenizer


class _State:
    """Per-request text and logprob state."""

    __slots__ = ("detok", "prompt", "stop_reason", "logprobs", "cumulative_logprob", "prompt_logprobs")

    def __init__(self, detok: IncrementalDetokenizer | None, prompt: str | None, req: Request):
        self.detok, self.prompt, self.stop_reason = detok, prompt, None
        params = req.params
        self.logprobs: list[PositionLogprobs] | None = None if params.logprobs is None else []
        self.cumulative_logprob: float | None = None if params.logprobs is None else 0.0
        # vLLM's shape: one entry per prompt token, the first None (nothing precedes it)
        self.prompt_logprobs: list[PositionLogprobs | None] | None = (
            None if params.prompt_logprobs is None else [None] * req.num_prompt_tokens)


class OutputProcessor:
    """Per-request text state for every active request."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # vLLM's eos_token_id (the tokenizer's): its stop has no stop_reason; the other ids that end a request
        # (generation_config.json's, stop_token_ids) are stop_reason
        self._primary_eos = None if tokenizer is None else tokenizer.eos_token_id
        self._states: dict[str, _State] = {}

    def add(self, req: Request, prompt: str | None) -> None:
        params = req.params
        detok = None
        if params.detokenize:
            detok = IncrementalDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens,
                                           params.include_stop_str_in_output, params.spaces_between_special_tokens)
        self._states[req.request_id] = _State(detok, prompt, req)

    def drop(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def finish_reason(self, req: Request) -> str | None:
        """The request's last token just arrived: why it ends now, or None. The only place that decides.
        A stop token id or stop string is kept as the output's stop_reason (vLLM's field)."""
        token = req.token_ids[-1]
        params = req.params
        state = self._states.get(req.request_id)
        detok = state.detok if state is not None else None
        before_min = req.num_output_tokens < params.min_tokens
        stop_token = not params.ignore_eos and token in req.eos_token_ids
        if not before_min and (stop_token or token in params.stop_token_ids):
            if state is not None and (token != self._primary_eos or not stop_token):
                state.stop_reason = token
            if detok is not None and params.include_stop_str_in_output:
                detok.add(token, check_stop=False)      # its text (if any survives skip_special_tokens) stays
            return "stop"
        # a stop string counts once the output is longer than min_tokens (vLLM)
        stop = detok.add(token, check_stop=req.num_output_tokens > params.min_tokens) if detok is not None else None
        if stop is not None:
            state.stop_reason = stop
            return "stop"
        if req.matcher is not None and req.matcher.is_terminated():
            return "stop"               # the grammar is complete: nothing more may follow
        if req.num_tokens >= req.max_total_tokens:
            return "length"
        return None

    def add_logprobs(self, req: Request, entry: TokenLogprobs) -> None:
        """The logprobs of the request's newest token (call once per applied token, in order)."""
        state = self._states.get(req.request_id)
        if state is None or state.logprobs is None:
            return
        state.logprobs.append(self._position(entry, req.params.detokenize))
        state.cumulative_logprob += entry.logprob

    def add_prompt_logprobs(self, req: Request, first: int, entries: list[TokenLogprobs]) -> None:
        """Prompt logprobs for positions first.. (a chunk; a recomputed chunk rewrites the same values)."""
        state = self._states.get(req.request_id)
        if state is None or state.prompt_logprobs is None:
            return
        for position, entry in enumerate(entries, start=first):
            state.prompt_logprobs[position] = self._position(entry, req.params.detokenize)

    def _position(self, entry: TokenLogprobs, detokenize: bool) -> PositionLogprobs:
        # the token first (with its rank), then the top-k (ranks 1..k), as vLLM's dict
        ids = (entry.token_id, *entry.top_ids)
        values = (entry.logprob, *entry.top_logprobs)
        ranks = (entry.rank, *range(1, len(entry.top_ids) + 1))
        out = {}
        for token_id, value, rank in zip(ids, values, ranks):
            if token_id not in out:
                out[token_id] = Logprob(logprob=value, rank=rank, decoded_token=self._decoded(token_id, detokenize))
        return out

    def _decoded(self, token_id: int, detokenize: bool) -> str | None:
        if not detokenize or self.tokenizer is None:
            return None
        return self.tokenizer.token_text(token_id)

    def sample(self, req: Request, finished: bool) -> CompletionOutput:
        """The request's sample so far (finished: its final text; the request's state is dropped)."""
        state = self._states.get(req.request_id)
        detok = state.detok if state is not None else None
        if finished:
            text = detok.final_text() if detok is not None else ""
            self.drop(req.request_id)
        else:
            text = detok.text if detok is not None else ""
        return CompletionOutput(
            index=req.index, text=text, token_ids=req.output_token_ids,
            cumulative_logprob=state.cumulative_logprob if state else None,
            logprobs=list(state.logprobs) if state and state.logprobs is not None else None,
            finish_reason=req.finish_reason if finished else None,
            stop_reason=state.stop_reason if finished and state else None)

    def fail(self, req: Request, reason: str) -> RequestOutput:
        """The final output of a request the engine ended in error (finish reason 'error'), with why as its
        stop_reason (one line the client sees)."""
        state = self._states.get(req.request_id)
        if state is not None:
            state.stop_reason = reason
        return self.output(req, finished=True)

    def output(self, req: Request, finished: bool) -> RequestOutput:
        """The request's output so far, one sample (finished: the final one)."""
        state = self._states.get(req.request_id)
        prompt = state.prompt if state else None
        prompt_logprobs = list(state.prompt_logprobs) if state and state.prompt_logprobs is not None else None
        sample = self.sample(req, finished)
        metrics = (RequestMetrics(req.arrival_time, req.first_scheduled_time, req.first_token_time, time.monotonic())
                   if finished else None)
        return RequestOutput(request_id=req.request_id, prompt=prompt, prompt_token_ids=req.prompt_token_ids,
                             prompt_logprobs=prompt_logprobs, outputs=[sample], finished=finished,
                             num_cached_tokens=req.num_cached_prompt_tokens, metrics=metrics)
