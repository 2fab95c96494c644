"""The one finish decision and the one output path: tokens in, RequestOutputs out.

Each token the runner sampled is applied here, in order: the incremental detokenizer extends the
request's text (O(1) per token) and looks for stop strings in what is new; eos, stop_token_ids,
stop strings and max_tokens/max_model_len decide whether the request ends, in vLLM's order.
"""

from __future__ import annotations

from kvfit.engine.detokenizer import IncrementalDetokenizer
from kvfit.engine.output import CompletionOutput, RequestOutput
from kvfit.engine.request import Request


class OutputProcessor:
    """Per-request text state for every active request."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._prompts: dict[str, str | None] = {}
        self._stop_reasons: dict[str, int | str] = {}

    def add(self, req: Request, prompt: str | None) -> None:
        self._detok[req.request_id] = IncrementalDetokenizer(self.tokenizer, req.params.stop)
        self._prompts[req.request_id] = prompt

    def drop(self, request_id: str) -> None:
        self._detok.pop(request_id, None)
        self._prompts.pop(request_id, None)
        self._stop_reasons.pop(request_id, None)

    def finish_reason(self, req: Request) -> str | None:
        """The request's last token just arrived: why it ends now, or None. The only place that decides.
        A stop token id or stop string is kept as the output's stop_reason (vLLM's field)."""
        token = req.token_ids[-1]
        params = req.params
        if not params.ignore_eos and token in req.eos_token_ids:
            return "stop"
        if token in params.stop_token_ids:
            self._stop_reasons[req.request_id] = token
            return "stop"
        detok = self._detok.get(req.request_id)
        stop = detok.add(token) if detok is not None else None
        if stop is not None:
            self._stop_reasons[req.request_id] = stop
            return "stop"               # a stop string: left out of the text
        if req.num_tokens >= req.max_total_tokens:
            return "length"
        return None

    def output(self, req: Request, finished: bool) -> RequestOutput:
        """The request's output so far (finished: its final text; the request's state is dropped)."""
        detok = self._detok.get(req.request_id)
        prompt = self._prompts.get(req.request_id)
        stop_reason = self._stop_reasons.get(req.request_id) if finished else None
        if finished:
            text = detok.final_text() if detok is not None else ""
            self.drop(req.request_id)
        else:
            text = detok.text if detok is not None else ""
        sample = CompletionOutput(index=0, text=text, token_ids=req.output_token_ids,
                                  finish_reason=req.finish_reason if finished else None, stop_reason=stop_reason)
        return RequestOutput(request_id=req.request_id, prompt=prompt, prompt_token_ids=req.prompt_token_ids,
                             outputs=[sample], finished=finished, num_cached_tokens=req.num_cached_prompt_tokens)
