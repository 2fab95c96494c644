"""Response and stream-chunk bodies of /v1/completions and /v1/chat/completions, from RequestOutputs.

Shapes are OpenAI's, with vLLM's extras (stop_reason per choice, prompt_logprobs):
- completions logprobs: {tokens, token_logprobs, top_logprobs: [{token text: logprob}], text_offset},
  top_logprobs holding the top-k and the chosen token; with echo the prompt comes first (its
  first token has no logprob: null);
- chat logprobs: {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}.
Logprobs are clamped at -9999.0 (vLLM's rule: -inf is not JSON). Usage sums the n choices.
vLLM's front-end flags: --return-tokens-as-token-ids shows each logprobs token as "token_id:<id>"
(TokenTexts), --enable-prompt-tokens-details adds usage.prompt_tokens_details (cached_tokens).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from kvfit.engine.output import CompletionOutput, Logprob, RequestOutput
from kvfit.server.params import GenerateInput
from kvfit.server.protocol import new_id

MIN_LOGPROB = -9999.0
# vLLM's ChatMessage after role and content: what it writes as null when unused (tool_calls, left out when empty,
# and reasoning follow)
_NULL_MESSAGE_FIELDS = {"role": None, "content": None, "refusal": None, "annotations": None, "audio": None,
                        "function_call": None}


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int | None = None) -> dict:
    """OpenAI's usage; with num_cached_tokens (--enable-prompt-tokens-details) its prompt_tokens_details, null
    when no prompt token came from the prefix cache (vLLM's rule)."""
    body = {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}
    if num_cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": num_cached_tokens} if num_cached_tokens else None
    return body


def cached_tokens(inp: GenerateInput, outputs: list) -> int | None:
    """The prompt tokens the prefix cache served, summed over the prompts' final outputs, when usage shows them
    (--enable-prompt-tokens-details); else None."""
    if not inp.prompt_tokens_details:
        return None
    return sum(output.num_cached_tokens for output in outputs if output is not None)


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def token_id_text(token_id: int) -> str:
    """A token as vLLM's --return-tokens-as-token-ids shows it in logprobs."""
    return f"token_id:{token_id}"


class TokenTexts:
    """The text of one token for logprobs: `token_id:<id>` with as_token_ids (--return-tokens-as-token-ids),
    else decoded(): the engine's decoded_token, else the tokenizer's decode of that one id (special tokens
    shown), else `token_id:<id>` without a tokenizer."""

    def __init__(self, tokenizer, as_token_ids: bool = False):
        self.tokenizer, self.as_token_ids = tokenizer, as_token_ids

    def __call__(self, token_id: int, logprob: Logprob | None = None) -> str:
        return token_id_text(token_id) if self.as_token_ids else self.decoded(token_id, logprob)

    def decoded(self, token_id: int, logprob: Logprob | None = None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        if self.tokenizer is None:
            return token_id_text(token_id)
        return self.tokenizer.token_text(token_id)


def _top(step: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely entries of a position, most likely first."""
    return sorted(step.items(), key=lambda item: -item[1].logprob)[:k]


def completion_logprobs(token_ids: list[int], steps: list, k: int, text_of: TokenTexts,
                        initial_offset: int = 0) -> dict:
    """OpenAI's completions logprobs object; a step of None (the first prompt token) has no logprobs."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = initial_offset
    for token_id, step in zip(token_ids, steps):
        chosen = step.get(token_id) if step else None
        token = text_of(token_id, chosen)
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
        if not step:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_clamp(chosen.logprob) if chosen is not None else None)
        entries = _top(step, k) + ([(token_id, chosen)] if chosen is not None else [])
        top_logprobs.append({text_of(t, lp): _clamp(lp.logprob) for t, lp in entries})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def _chat_entry(token: str, logprob: float, text: str | None = None) -> dict:
    """One chat logprobs entry; bytes are text's (default: the token's)."""
    text = token if text is None else text
    return {"token": token, "logprob": _clamp(logprob), "bytes": list(text.encode("utf-8", errors="replace"))}


def chat_logprobs(token_ids: list[int], steps: list, k: int, text_of: TokenTexts) -> dict:
    """OpenAI's chat logprobs object: one entry per generated token, each with its top k. A chosen token's
    bytes are its decoded text's, also when it is shown as `token_id:<id>` (vLLM's rule)."""
    content = []
    for token_id, step in zip(token_ids, steps):
        chosen = (step or {}).get(token_id)
        token = text_of(token_id, chosen)
        entry = _chat_entry(token, chosen.logprob if chosen is not None else MIN_LOGPROB,
                            text_of.decoded(token_id, chosen) if chosen is not None else token)
        entry["top_logprobs"] = [_chat_entry(text_of(t, lp), lp.logprob) for t, lp in _top(step or {}, k)]
        content.append(entry)
    return {"content": content}


def prompt_logprobs_json(steps: list | None) -> list | None:
    """vLLM's prompt_logprobs field: per prompt token None or {token id: {logprob, rank, decoded_token}}."""
    if steps is None:
        return None
    return [None if step is None else
            {str(t): {"logprob": _clamp(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for t, lp in step.items()} for step in steps]


@dataclass
class _Sent:
    """What a stream has sent of one choice."""

    text: str = ""
    num_tokens: int = 0
    text_offset: int = 0
    started: bool = False
    done: bool = False


class ResponseBuilder:
    """One prompt's bodies: the full response, or its stream chunks, for completions or chat.

    A completions batch has one builder per prompt, sharing response_id; prompt i's choices are
    numbered from first_index = i * n (vLLM's prompt-major order)."""

    def __init__(self, chat: bool, model: str, inp: GenerateInput, tokenizer, response_id: str | None = None,
                 first_index: int = 0):
        self.chat, self.model, self.inp = chat, model, inp
        self.id = response_id or new_id("chatcmpl" if chat else "cmpl")
        self.first_index = first_index
        self.created = int(time.time())
        self.text_of = TokenTexts(tokenizer, inp.tokens_as_token_ids)
        self._tokenizer = tokenizer
        self._object = "chat.completion" if chat else "text_completion"
        self._chunk_object = "chat.completion.chunk" if chat else "text_completion"
        # while a stop string may still complete, its possible beginning is held back (it would be cut)
        self._hold = max((len(s) for s in inp.params.stop), default=1) - 1
        self._sent: dict[int, _Sent] = {}
        self._tool_streams: dict = {}       # choice index -> server.tools.ToolStream (chat with a tool plan)
        self.prompt_cut = False             # truncate_prompt_tokens cut the prompt: echo decodes what was kept

    def _envelope(self, obj: str, choices: list, extra: dict | None = None) -> dict:
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        body.update(extra or {})
        return body

    # what echo puts first ---------------------------------------------------------------------
    def _prompt_text(self, output: RequestOutput) -> str:
        if isinstance(self.inp.prompt, str) and not self.prompt_cut:   # the text as the client sent it
            return self.inp.prompt
        if output.prompt is not None:
            return output.prompt
        # token-id prompts: their text as vLLM echoes it, special tokens included
        if self._tokenizer is None:
            return ""
        return self._tokenizer.decode(output.prompt_token_ids, skip_special_tokens=False)

    def _echo_prefix(self, output: RequestOutput) -> tuple[str, list[int], list]:
        """(text, token ids, logprob steps) that echo puts before a choice's own."""
        if not self.inp.echo:
            return "", [], []
        if self.chat:
            return self.inp.echo_text or "", [], []
        steps = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
        return self._prompt_text(output), list(output.prompt_token_ids), list(steps)

    def _logprobs(self, token_ids: list[int], steps: list | None, initial_offset: int = 0) -> dict | None:
        k = self.inp.top_logprobs
        if k is None:
            return None
        steps = steps if steps is not None else [None] * len(token_ids)
        if self.chat:
            return chat_logprobs(token_ids, steps, k, self.text_of)
        return completion_logprobs(token_ids, steps, k, self.text_of, initial_offset)

    # full response ------------------------------------------------------------------------------
    def _shown(self, sample: CompletionOutput) -> CompletionOutput:
        """The sample as the reply shows it: echo with max_tokens 0 shows none of the generated token."""
        if not self.inp.echo_only:
            return sample
        return replace(sample, text="", token_ids=[], logprobs=None if sample.logprobs is None else [])

    def full(self, output: RequestOutput, num_prompt_tokens: int) -> dict:
        choices = [self._full_choice(output, self._shown(sample))
                   for sample in sorted(output.outputs, key=lambda s: s.index)]
        extra = {"usage": usage(num_prompt_tokens, sum(len(s.token_ids) for s in output.outputs),
                                cached_tokens(self.inp, [output]))}
        if self.chat:       # vLLM: on the response for chat, per choice otherwise; null when not asked for
            extra["prompt_logprobs"] = prompt_logprobs_json(output.prompt_logprobs) \
                if self.inp.prompt_logprobs else None
            extra["prompt_token_ids"] = list(output.prompt_token_ids) if self.inp.return_token_ids else None
        return self._envelope(self._object, choices, extra)

    def _full_choice(self, output: RequestOutput, sample: CompletionOutput) -> dict:
        prefix_text, prefix_ids, prefix_steps = self._echo_prefix(output)     # chat: text only
        steps = sample.logprobs or [None] * len(sample.token_ids)
        logprobs = self._logprobs(prefix_ids + list(sample.token_ids), prefix_steps + list(steps))
        text = prefix_text + sample.text
        choice = {"index": self.first_index + sample.index}
        reason = sample.finish_reason
        if self.chat and self.inp.tools is not None:        # the text may be tool calls (server/tools.py)
            choice["message"], reason = self.inp.tools.message(sample.text, reason)
            choice["message"]["role"] = self.inp.role          # as without tools (vLLM: one role per request)
            if prefix_text:
                choice["message"]["content"] = prefix_text + (choice["message"]["content"] or "")
        elif self.chat:
            choice["message"] = {"role": self.inp.role, "content": text}
        else:
            choice["text"] = text
        if self.chat:       # vLLM's ChatMessage fields, null when unused (no reasoning parser here)
            choice["message"] = {**_NULL_MESSAGE_FIELDS, **choice["message"]}
            choice["message"].setdefault("reasoning", None)
        choice.update({"logprobs": logprobs, "finish_reason": reason,
                       "stop_reason": sample.stop_reason})
        # vLLM's extra fields are always there, null unless asked for: the prompt's per choice for completions
        choice["token_ids"] = list(sample.token_ids) if self.inp.return_token_ids else None
        if not self.chat:
            choice["prompt_logprobs"] = prompt_logprobs_json(output.prompt_logprobs) \
                if self.inp.prompt_logprobs else None
            choice["prompt_token_ids"] = list(output.prompt_token_ids) if self.inp.return_token_ids else None
        return choice

    # stream chunks ------------------------------------------------------------------------------
    def role_chunks(self, num_prompt_tokens: int, prompt_ids: list[int] | None = None) -> list[dict]:
        """Chat streams open with the role, once per choice (OpenAI's first chunk); with return_token_ids the
        first of them carries the prompt's token ids (vLLM's)."""
        if not self.chat:
            return []
        so_far = usage(num_prompt_tokens, 0)
        bodies = [self._chunk_body(i, {"role": self.inp.role, "content": ""}, None, None, None, so_far)
                  for i in range(self.inp.n)]
        if self.inp.return_token_ids:                   # vLLM: on each choice's role chunk
            for body in bodies:
                body["prompt_token_ids"] = list(prompt_ids or [])
        return bodies

    def _chunk_body(self, index: int, delta, logprobs, reason, stop_reason=None, so_far: dict | None = None,
                    ids: dict | None = None) -> dict:
        if self.chat:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": reason}
        choice["stop_reason"] = stop_reason
        if ids:
            choice.update(ids)
        if not (self.inp.include_usage and self.inp.continuous_usage):    # vLLM leaves the key out then
            return self._envelope(self._chunk_object, [choice])
        return self._envelope(self._chunk_object, [choice], {"usage": so_far})

    def chunks(self, output: RequestOutput) -> list[dict]:
        """The chunks that a new (cumulative) output adds, one per choice that moved."""
        # continuous usage counts the chunk's own choice, as vLLM does (never more than max_tokens)
        return [c for sample in sorted(output.outputs, key=lambda s: s.index)
                if (c := self._choice_chunk(output, self._shown(sample), usage(len(output.prompt_token_ids),
                                                                               len(sample.token_ids)))) is not None]

    def _choice_chunk(self, output: RequestOutput, sample: CompletionOutput, so_far: dict) -> dict | None:
        sent = self._sent.setdefault(sample.index, _Sent())
        if sent.done:
            return None
        finished = sample.finish_reason is not None
        if not sent.started and not sample.token_ids and not finished:
            return None     # a choice not begun yet (n > 1: its first token comes in a later step): its first chunk waits
        text = sample.text if finished else sample.text[:max(len(sample.text) - self._hold, len(sent.text))]
        delta, sent.text = text[len(sent.text):], text
        new_ids = list(sample.token_ids[sent.num_tokens:])
        new_steps = list(sample.logprobs[sent.num_tokens:]) if sample.logprobs is not None else None
        sent.num_tokens = len(sample.token_ids)
        ids = {"token_ids": list(new_ids)} if self.inp.return_token_ids else None     # vLLM: the new ones
        has_ids = ids is not None and bool(new_ids)     # a token without text yet still goes out with its id
        prefix_text = ""
        if not sent.started:
            sent.started = True
            if ids is not None and not self.chat:       # completions: the prompt's with each choice's first chunk
                ids["prompt_token_ids"] = list(output.prompt_token_ids)
            prefix_text, prefix_ids, prefix_steps = self._echo_prefix(output)
            delta = prefix_text + delta
            if prefix_ids:                                  # completions' echo
                new_steps = prefix_steps + (new_steps or [None] * len(new_ids))
                new_ids = prefix_ids + new_ids
        logprobs = self._logprobs(new_ids, new_steps, sent.text_offset) if new_ids else None
        if logprobs is not None and not self.chat:
            sent.text_offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        reason = sample.finish_reason
        if self.chat and self.inp.tools is not None:        # content and tool-call deltas (server/tools.py)
            stream = self._tool_streams.setdefault(sample.index, self.inp.tools.stream())
            body_delta = stream.delta(text, finished, sample.finish_reason)
            if prefix_text:
                body_delta["content"] = prefix_text + body_delta.get("content", "")
            reason = stream.finish_reason(reason) if finished else None
            if not (body_delta or finished or logprobs is not None or has_ids):
                return None
        elif not (delta or finished or logprobs is not None or has_ids):
            return None
        else:
            body_delta = delta if not self.chat else ({"content": delta} if delta or not finished else {})
        sent.done = finished
        return self._chunk_body(self.first_index + sample.index, body_delta, logprobs, reason, sample.stop_reason, so_far,
                                ids)

    def usage_chunk(self, num_prompt_tokens: int, num_completion_tokens: int,
                    num_cached_tokens: int | None = None) -> dict:
        return self._envelope(self._chunk_object, [],
                              {"usage": usage(num_prompt_tokens, num_completion_tokens, num_cached_tokens)})
