"""From a validated request body to what the engine gets: SamplingParams and the serving options.

The mapping is vLLM's OpenAI server's (to_sampling_params): field names, defaults (completions
max_tokens 16, chat max_tokens = the rest of the context), echo asking for prompt logprobs, chat's
logprobs + top_logprobs becoming one top-k count; what the request leaves out of temperature,
top_p, top_k, min_p, repetition_penalty (and chat's max_tokens) comes from --generation-config
(RequestDefaults). A field vLLM knows but kvfit cannot honour is a
400 naming it, never ignored (protocol.UNSUPPORTED_FIELDS); SamplingParams checks every range.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from pydantic import TypeAdapter, ValidationError

from kvfit.engine.admission import check_cache_salt, check_logprobs_count
from kvfit.errors import RequestError
from kvfit.sampling_params import MAX_LOGPROBS, SamplingParams
from kvfit.structured_params import StructuredOutputsParams
from kvfit.text.chat_template import TEXT_PART_SEPARATOR
from kvfit.server.protocol import (REMOVED_GUIDED_FIELDS, TEMPLATE_MESSAGE_FIELDS, UNSUPPORTED_FIELDS, ChatCompletionRequest,
                                   CompletionRequest, bad_request)

DEFAULT_COMPLETION_MAX_TOKENS = 16     # OpenAI's default for /v1/completions; chat defaults to the context
MAX_STOP_STRINGS = 16                  # each is searched after every token
MAX_TOKEN_ID_DIGITS = 10               # a logit_bias key: token ids are below 2**31
# request fields that are SamplingParams fields of the same name and meaning
PASSED_FIELDS = ("n", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens",
                 "logit_bias", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                 "bad_words", "allowed_token_ids")
# request fields whose default, when the request leaves them out, is --generation-config's (vLLM's list;
# its max_tokens default is applied where max_tokens is worked out)
DEFAULTED_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class GenerateInput:
    """What the engine gets: a prompt (text or token ids), sampling params, and the serving options.

    echo: the prompt text goes before each choice's text (completions; chat: the last message
    when it is the assistant's). top_logprobs: the top-k count to show per token (None: no logprobs).
    """

    prompt: str | list[int]
    params: SamplingParams
    max_tokens_given: bool         # False: max_tokens fills the context (chat without a limit)
    stream: bool
    include_usage: bool
    echo: bool = False
    echo_text: str | None = None   # chat: the assistant message that echo repeats
    top_logprobs: int | None = None
    prompt_logprobs: bool = False  # the client asked for prompt_logprobs (shown as vLLM does)
    continuous_usage: bool = False  # every stream chunk carries the usage so far (vLLM's continuous_usage_stats)
    cache_salt: str | None = None   # vLLM's prefix-cache isolation: blocks are shared only with the same salt
    tools: object = None            # chat: a server.tools.ToolPlan when the output becomes tool calls
    role: str = "assistant"         # chat: the reply's role (vLLM: the last message's without add_generation_prompt)
    tokens_as_token_ids: bool = False   # logprobs tokens shown as "token_id:<id>" (vLLM's return_tokens_as_token_ids)
    prompt_tokens_details: bool = False  # usage shows cached_tokens (--enable-prompt-tokens-details)
    return_token_ids: bool = False  # vLLM's: prompt_token_ids and token_ids in the reply (chunks: the new ids)
    truncate: tuple[int, str] | None = None   # truncate_prompt_tokens (-1: what max_tokens leaves), "left" or "right"
    add_special_tokens: bool = True  # a text prompt's tokenizing adds the tokenizer's special tokens (bos)
    echo_only: bool = False         # completions' echo with max_tokens 0 (a scorer's request): the reply is the prompt
    #                                 (and its logprobs) alone; the engine samples one token, left out (vLLM's)

    @property
    def n(self) -> int:
        return self.params.n


@dataclass(frozen=True)
class RequestDefaults:
    """What --generation-config gives requests (vLLM's get_diff_sampling_param): params the request
    leaves out (DEFAULTED_FIELDS, and max_tokens where the request's own default is open: chat), and
    max_tokens_cap, vLLM's override_max_tokens (the max_new_tokens of a --generation-config folder given
    by path) that lowers every request's max_tokens. The vLLM front-end flags that shape every request:
    enable_force_include_usage (a stream's usage as if stream_options asked for it, continuous usage too: vLLM's
    should_include_usage), return_tokens_as_token_ids (the default of the request field of that name),
    enable_prompt_tokens_details."""

    params: dict = field(default_factory=dict)
    max_tokens_cap: int | None = None
    max_logprobs: int = MAX_LOGPROBS        # the engine's --max-logprobs (resolved), for the field's own 400
    enable_force_include_usage: bool = False
    return_tokens_as_token_ids: bool = False
    enable_prompt_tokens_details: bool = False

    @classmethod
    def from_config(cls, params: dict, generation_config: str, max_logprobs: int = MAX_LOGPROBS,
                    override_max_tokens: int | None = None, **frontend) -> "RequestDefaults":
        """frontend: the front-end flags above, by name. The cap on every request's max_tokens is vLLM's: a
        generation-config folder's max_new_tokens, or with auto / vllm --override-generation-config's
        (override_max_tokens)."""
        cap = params.get("max_tokens") if generation_config not in ("auto", "vllm") else override_max_tokens
        return cls(dict(params), cap, max_logprobs, **frontend)

    def max_tokens(self, requested: int | None) -> int | None:
        if requested is None:
            return self.params.get("max_tokens")
        return requested if self.max_tokens_cap is None else min(requested, self.max_tokens_cap)


NO_DEFAULTS = RequestDefaults()


def check_unsupported(req) -> None:
    """A 400 for a field vLLM knows that kvfit does not honour (any request body)."""
    for name in REMOVED_GUIDED_FIELDS:
        if getattr(req, name, None) is not None:
            key = name.removeprefix("guided_")
            raise bad_request(f"{name} was removed in vLLM 0.12 and is not accepted; send "
                              f"structured_outputs: {{\"{key}\": ...}} instead", param=name)
    for name, (neutral, instead) in UNSUPPORTED_FIELDS.items():
        value = getattr(req, name, None)
        if value is not None and not _neutral(value, neutral) and not (name == "best_of" and value == req.n):
            raise bad_request(f"{name} is not supported by kvfit: {instead}", param=name)


def _neutral(value, neutral: tuple) -> bool:
    """Whether value is one of the values that ask for nothing, read laxly as the request models read fields
    ("false" is false, 1.0 is 1)."""
    for want in neutral:
        try:
            if TypeAdapter(type(want)).validate_python(value) == want:
                return True
        except ValidationError:
            pass
    return False


def structured_outputs_params(req) -> StructuredOutputsParams | None:
    """StructuredOutputsParams from structured_outputs or response_format (only one of them); a 400 naming the
    field when it is malformed or past a limit (structured_params)."""
    fields = dict(req.structured_outputs or {})
    fmt = req.response_format
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            fmt_fields = {"json_object": True}
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            # a schema is needed (vLLM builds no constraint without one and refuses the request)
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise bad_request("response_format json_schema needs a json_schema object with a 'schema' object",
                                  param="response_format")
            if not isinstance(spec.get("name"), str):       # required by OpenAI's and vLLM's request models
                raise bad_request("response_format json_schema needs a 'name' (a string)", param="response_format")
            fmt_fields = {"json": spec["schema"]}
        elif kind == "text":
            fmt_fields = {}
        else:
            raise bad_request(f"response_format type must be text, json_object or json_schema, got {kind!r:.40}",
                              param="response_format")
        if fmt_fields and fields:
            raise bad_request("give response_format or structured_outputs, not both", param="response_format")
        fields = fields or fmt_fields
    if not fields:
        return None
    allowed = [f.name for f in dataclasses.fields(StructuredOutputsParams)]
    unknown = [k for k in fields if k not in allowed]
    if unknown:
        raise bad_request(f"structured_outputs has no field {unknown[0][:40]!r}; its fields are {', '.join(allowed)}",
                          param="structured_outputs")
    try:
        return StructuredOutputsParams(**fields)
    except RequestError as exc:
        raise bad_request(str(exc), param=exc.param or "structured_outputs", code=exc.code) from None


def _logit_bias_token_ids(bias) -> dict:
    """logit_bias's JSON object keys as token ids: ASCII digits only (str.isdigit also takes "²" and a
    fullwidth "５"), at most MAX_TOKEN_ID_DIGITS of them (int() refuses 5,000 digits); else a 400 naming
    logit_bias. Its values are SamplingParams' to check."""
    if not isinstance(bias, dict):
        return bias
    ids = {}
    for key, value in bias.items():
        text = key.strip() if isinstance(key, str) else ""
        if not (text.isascii() and text.isdigit() and len(text) <= MAX_TOKEN_ID_DIGITS):
            raise bad_request(f"logit_bias keys must be token ids in ASCII digits (at most {MAX_TOKEN_ID_DIGITS}), "
                              f"got {str(key)[:20]!r}", param="logit_bias")
        ids[int(text)] = value
    return ids


def _check_top_k_count(value: int | None, param: str, max_logprobs: int, whole_vocabulary: bool = True) -> None:
    """whole_vocabulary: -1 asks for every token's logprob (vLLM's prompt_logprobs and chat top_logprobs; not the
    completions logprobs field); the engine checks the vocabulary's size against --max-logprobs."""
    if value is not None and value < (-1 if whole_vocabulary else 0):
        either = ", or -1 for the whole vocabulary" if whole_vocabulary else ""
        raise bad_request(f"{param} must be >= 0{either}, got {value}", param=param)
    if value == -1:
        return
    try:
        check_logprobs_count(value, max_logprobs, param)
    except RequestError as exc:
        raise bad_request(str(exc), param=param) from None


def sampling_params(req, max_tokens: int | None, logprobs: int | None, defaults: dict | None = None) -> SamplingParams:
    """SamplingParams of a request; SamplingParams validates every range and names the field (a 400).

    logprobs: the top-k count the engine returns per generated token (None: none). defaults: the
    --generation-config defaults (vLLM's get_diff_sampling_param) for the fields the request leaves out."""
    check_unsupported(req)
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", param="stop")
    if req.prompt_logprobs and req.stream:        # vLLM's rule: 0 passes (a stream never shows prompt logprobs)
        raise bad_request("prompt_logprobs is not available with stream: true", param="prompt_logprobs")
    prompt_logprobs = None if req.stream else req.prompt_logprobs
    if getattr(req, "echo", None) and logprobs is not None and not isinstance(req, ChatCompletionRequest):
        prompt_logprobs = logprobs if prompt_logprobs is None else max(prompt_logprobs, logprobs)
    # the fields that carry their SamplingParams name, passed on when given (its defaults are vLLM's)
    kwargs = {name: value for name, value in (defaults or {}).items() if name in DEFAULTED_FIELDS}
    kwargs.update({name: getattr(req, name) for name in PASSED_FIELDS if getattr(req, name) is not None})
    if "logit_bias" in kwargs:
        kwargs["logit_bias"] = _logit_bias_token_ids(kwargs["logit_bias"])
    kwargs.update({name: getattr(req, name) for name in ("temperature", "top_p", "top_k")
                   if getattr(req, name) is not None})
    extra = {"logprobs": logprobs, "prompt_logprobs": prompt_logprobs, "structured_outputs": structured_outputs_params(req)}
    kwargs.update({name: value for name, value in extra.items() if value is not None})
    try:
        return SamplingParams(seed=req.seed, max_tokens=max_tokens,
                              stop=stop, stop_token_ids=tuple(req.stop_token_ids or ()),
                              ignore_eos=bool(req.ignore_eos), **kwargs)
    except RequestError as exc:
        raise bad_request(str(exc), param=exc.param, code=exc.code) from None


def _cache_salt(req) -> str | None:
    try:
        return check_cache_salt(req.cache_salt)
    except RequestError as exc:
        raise bad_request(str(exc), param=exc.param) from None


def _stream_flags(req, force_usage: bool = False) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage_stats); force_usage (--enable-force-include-usage) turns both
    usage flags on for a stream, whatever stream_options says (vLLM's should_include_usage)."""
    stream, options = bool(req.stream), req.stream_options
    if options is not None and not options.empty() and not stream:     # {} passes, as in vLLM
        raise bad_request("stream_options is only allowed with stream: true", param="stream_options")
    if stream and force_usage:
        return stream, True, True
    include_usage = bool(stream and options and options.include_usage)
    return stream, include_usage, include_usage and options.continuous_usage_stats


def truncation(req) -> tuple[int, str] | None:
    """(truncate_prompt_tokens, side) of a request, the side "left" unless it says (vLLM's for generative models);
    None without truncation."""
    keep = getattr(req, "truncate_prompt_tokens", None)
    return None if keep is None else (keep, req.truncation_side or "left")


def truncate_prompt(ids: list[int], truncate: tuple[int, str] | None, max_model_len: int,
                    max_tokens: int | None) -> list[int]:
    """A prompt's token ids cut to truncate_prompt_tokens as vLLM cuts them: -1 keeps what max_model_len leaves
    after max_tokens; more than that is a 400; "left" keeps the last tokens, "right" the first."""
    if truncate is None:
        return ids
    keep, side = truncate
    limit = max_model_len - (max_tokens or 0)
    if limit <= 0:
        raise bad_request(f"max_tokens={max_tokens} leaves no room for a prompt in max_model_len={max_model_len}; "
                          "ask for fewer tokens", param="max_tokens")
    if keep > limit:
        raise bad_request(f"truncate_prompt_tokens={keep} cannot be greater than max_model_len - max_tokens = "
                          f"{limit}; ask for a smaller truncation size", param="truncate_prompt_tokens")
    keep = limit if keep == -1 else keep
    if keep <= 0:
        raise bad_request(f"truncate_prompt_tokens keeps {keep} prompt tokens; keep at least one",
                          param="truncate_prompt_tokens")
    if keep >= len(ids):
        return ids
    return ids[-keep:] if side == "left" else ids[:keep]


def cut_prompt_text(text: str, truncate: tuple[int, str] | None, max_chars: int) -> str:
    """A prompt text longer than max_chars (what --max-model-len tokens can hold at most), cut from truncate's side
    to max_chars before it is tokenized, as vLLM cuts it: it still holds at least max_model_len tokens, so
    truncate_prompt then keeps the same tokens. Without truncation the text is left whole (and refused)."""
    if truncate is None or len(text) <= max_chars:
        return text
    return text[-max_chars:] if truncate[1] == "left" else text[:max_chars]


def _rendering(req, defaults: RequestDefaults) -> dict:
    """GenerateInput's logprobs and usage rendering: the request's return_tokens_as_token_ids, else the server's."""
    as_ids = req.return_tokens_as_token_ids
    return {"tokens_as_token_ids": defaults.return_tokens_as_token_ids if as_ids is None else as_ids,
            "prompt_tokens_details": defaults.enable_prompt_tokens_details,
            "return_token_ids": bool(req.return_token_ids)}


DEFAULT_MAX_COMPLETION_PROMPTS = 1024     # vLLM's VLLM_MAX_COMPLETION_PROMPTS default


def max_completion_prompts() -> int:
    """Prompts one completions request may hold: $VLLM_MAX_COMPLETION_PROMPTS (vLLM's), else 1,024."""
    value = os.environ.get("VLLM_MAX_COMPLETION_PROMPTS", "").strip()
    return int(value) if value.isascii() and value.isdigit() and int(value) > 0 else DEFAULT_MAX_COMPLETION_PROMPTS


MAX_COMPLETION_PROMPTS = max_completion_prompts()      # read once, when the server starts (not a request)


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completions request: one text or token-id list, or (vLLM's batch) a list of them."""
    prompt = req.prompt
    if isinstance(prompt, list) and not prompt:
        raise bad_request("the prompt is empty; give at least one token", param="prompt")
    prompts = prompt if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) else [prompt]
    if len(prompts) > MAX_COMPLETION_PROMPTS:
        raise bad_request(f"{len(prompts)} prompts in one request are over the limit of {MAX_COMPLETION_PROMPTS}; "
                          "send fewer a request "
                          "(or raise VLLM_MAX_COMPLETION_PROMPTS, vLLM's setting, which kvfit reads too)",
                          param="prompt")
    for i, one in enumerate(prompts):
        if not one:
            where = f"prompt {i} of {len(prompts)}" if len(prompts) > 1 else "the prompt"
            raise bad_request(f"{where} is empty; give at least one token", param="prompt")
    return prompts


def completion_inputs(req: CompletionRequest, defaults: RequestDefaults = NO_DEFAULTS) -> list[GenerateInput]:
    """One GenerateInput per prompt (vLLM: each prompt of a batch is its own engine request, same params).
    max_tokens: the request's, else 16 (vLLM's CompletionRequest default), lowered to defaults' cap."""
    prompts = completion_prompts(req)
    if req.max_completion_tokens is not None:     # vLLM ignores it here, so a client's limit would be lost
        raise bad_request("max_completion_tokens is a /v1/chat/completions field; /v1/completions takes "
                          "max_tokens", param="max_completion_tokens")
    _check_top_k_count(req.logprobs, "logprobs", defaults.max_logprobs, whole_vocabulary=False)
    _check_top_k_count(req.prompt_logprobs, "prompt_logprobs", defaults.max_logprobs)
    echo_only = bool(req.echo) and req.max_tokens == 0       # vLLM: the prompt alone, scored
    requested = DEFAULT_COMPLETION_MAX_TOKENS if req.max_tokens is None else 1 if echo_only else req.max_tokens
    max_tokens = defaults.max_tokens(requested)
    stream, include_usage, continuous_usage = _stream_flags(req, defaults.enable_force_include_usage)
    params = sampling_params(req, max_tokens, req.logprobs, defaults.params)
    salt = _cache_salt(req)
    return [GenerateInput(prompt, params, True, stream, include_usage, echo=bool(req.echo), top_logprobs=req.logprobs,
                          prompt_logprobs=req.prompt_logprobs is not None and not stream, continuous_usage=continuous_usage,
                          cache_salt=salt, echo_only=echo_only, truncate=truncation(req),
                          add_special_tokens=req.add_special_tokens is not False, **_rendering(req, defaults))
            for prompt in prompts]


def _template_content(message, content_format: str) -> str | list[dict]:
    """A message's content as the template gets it (vLLM's --chat-template-content-format): string, its text
    parts joined by a line break; openai, a list of {"type": "text", "text": ...} parts (a text is one part;
    a tool message's content stays a string, as vLLM gives it)."""
    content = message.content
    texts = [] if content is None else [content] if isinstance(content, str) else \
        [part if isinstance(part, str) else part.value for part in content]
    if content_format == "openai" and message.role != "tool":
        return [{"type": "text", "text": text} for text in texts]
    return TEXT_PART_SEPARATOR.join(texts)


def content_text(content: str | list[dict]) -> str:
    """A template message's content as one text (openai parts joined by a line break, as vLLM's chat echo)."""
    return content if isinstance(content, str) else TEXT_PART_SEPARATOR.join(part["text"] for part in content)


def chat_messages(req, content_format: str = "string") -> list[dict]:
    """Messages as the chat template wants them: role and content (see _template_content)."""
    if not req.messages:
        raise bad_request("messages must hold at least one message", param="messages")
    out = []
    for m in req.messages:
        message = {"role": m.role, "content": _template_content(m, content_format)}
        # as transformers: fields left out (None) are not there for the template
        message.update({k: getattr(m, k) for k in TEMPLATE_MESSAGE_FIELDS if getattr(m, k) is not None})
        if m.role == "assistant":       # vLLM: reasoning (else the deprecated reasoning_content) under both names
            reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
            if reasoning is not None:
                message["reasoning"] = message["reasoning_content"] = reasoning
        out.append(message)
    return out


def chat_input(req: ChatCompletionRequest, prompt: str | list[int], messages: list[dict],
               defaults: RequestDefaults = NO_DEFAULTS) -> GenerateInput:
    """prompt: the messages after the chat template (token ids, or text). max_tokens: the request's
    (lowered to defaults' cap), else defaults' max_tokens, else the rest of the context."""
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"{param} must be >= 1, got {max_tokens}", param=param)
    _check_top_k_count(req.top_logprobs, "top_logprobs", defaults.max_logprobs)
    _check_top_k_count(req.prompt_logprobs, "prompt_logprobs", defaults.max_logprobs)
    if req.top_logprobs and not req.logprobs:       # vLLM's rule: 0 (its default) needs nothing
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    top_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    stream, include_usage, continuous_usage = _stream_flags(req, defaults.enable_force_include_usage)
    params = sampling_params(req, defaults.max_tokens(max_tokens), top_logprobs, defaults.params)
    # vLLM's chat echo: the last message is repeated before the reply when it is the assistant's
    echo_text = content_text(messages[-1]["content"]) if req.echo and messages[-1]["role"] == "assistant" else None
    # a default max_tokens is cut at the context (vLLM's min), a requested one past it is a 400
    return GenerateInput(prompt, params, max_tokens is not None, stream, include_usage, echo=bool(req.echo),
                         echo_text=echo_text, top_logprobs=top_logprobs,
                         prompt_logprobs=req.prompt_logprobs is not None and not stream, continuous_usage=continuous_usage,
                         cache_salt=_cache_salt(req), truncate=truncation(req), **_rendering(req, defaults),
                         role="assistant" if req.add_generation_prompt else messages[-1]["role"])
