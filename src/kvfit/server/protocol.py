"""The OpenAI wire format: request bodies (validated), response and chunk bodies, error bodies.

Plain data and pure functions; no engine, no HTTP framework. Anything a client can get wrong
raises APIError, which the app turns into OpenAI's error JSON with the status code.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from kvfit.sampling_params import SamplingParams
from kvfit.errors import RequestError

DEFAULT_COMPLETION_MAX_TOKENS = 16     # OpenAI's default for /v1/completions; chat defaults to the context
MAX_STOP_STRINGS = 16                  # each is searched after every token


class APIError(Exception):
    """A request the server will not serve: status code plus OpenAI's error fields."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


# request bodies ---------------------------------------------------------------------------------
class _Body(BaseModel):
    # strict: 1.0 is not an int and "1" is not a number; unknown fields are ignored, as vLLM does
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    # accepted only at their neutral values: kvfit does not implement them
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions, through the openai client's extra_body
    top_k: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    tools: list[Any] | None = None
    response_format: dict | None = None


MAX_JSON_DEPTH = 32                    # OpenAI bodies nest about 5 levels (messages[i].content[j].text)
MAX_JSON_INT = 2**64                   # integers in [-MAX_JSON_INT, MAX_JSON_INT): seeds and ids fit
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")   # then 20 zeros: maybe an int past MAX_JSON_INT
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")          # an escaped UTF-16 surrogate, maybe lone


def parse_body(raw: bytes, model_class: type[_Body]) -> _Body:
    """Bytes -> a validated request model, or a 400 APIError naming the first bad field.

    Limits (each a 400 `invalid_json`): nesting past MAX_JSON_DEPTH, integers outside
    +-MAX_JSON_INT, non-finite numbers; text holding a lone surrogate is a 400 naming its field.
    The checks past the parser run only when a cheap scan of the bytes says they may fail.
    """
    data = _load_json(raw)
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _deeper_than(data, MAX_JSON_DEPTH):
        raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
    if _MAYBE_SURROGATE.search(raw):
        _reject_surrogates(data)
    try:
        return model_class.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from None


def _load_json(raw: bytes):
    # the C parser stops at the interpreter's recursion limit (RecursionError) and at 4,300 digits
    # (ValueError); the int hook, slower, runs only when a long run of digits is present
    parse_int = _bounded_int if b"0" * 20 in raw.translate(_DIGITS_AS_ZERO) else None
    try:
        # JSON on the wire is UTF-8 (RFC 8259); strict decoding also refuses encoded surrogates
        return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant, parse_float=_finite_float,
                          parse_int=parse_int)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels",
                          code="invalid_json") from None
    except ValueError as exc:            # _bounded_int, _finite_float, or an int past 4,300 digits
        message = str(exc) if isinstance(exc, _NumberError) else "an integer has too many digits"
        raise bad_request(f"the request body is not valid JSON: {message}", code="invalid_json") from None


class _NumberError(ValueError):
    pass


def _reject_constant(name: str):
    # Python's json reads NaN and Infinity, which JSON does not allow (and which would reach the sampler)
    raise _NumberError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):       # 1e400 reads as inf
        raise _NumberError(f"the number {text[:32]} is out of range")
    return value


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > 20:
        raise _NumberError(f"an integer of {digits} digits is out of range (allowed: -2**64 to 2**64 - 1)")
    value = int(text)
    if not -MAX_JSON_INT <= value < MAX_JSON_INT:
        raise _NumberError(f"the integer {value} is out of range (allowed: -2**64 to 2**64 - 1)")
    return value


def _deeper_than(data, limit: int) -> bool:
    """Whether parsed JSON nests more than `limit` containers, one level at a time (no recursion)."""
    level = [data]
    for _ in range(limit):
        level = [v for c in level for v in (c.values() if isinstance(c, dict) else c)
                 if isinstance(v, (dict, list))]
        if not level:
            return False
    return True


def _reject_surrogates(data) -> None:
    """A 400 naming the first string (key or value) holding a lone UTF-16 surrogate (not text)."""
    stack = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                item_path = f"{path}.{key}" if path else str(key)
                if not _is_text(key):
                    raise bad_request("a field name holds a lone UTF-16 surrogate, which is not text",
                                      code="invalid_text")
                stack.append((item, item_path))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(value))
        elif isinstance(value, str) and not _is_text(value):
            param = re.split(r"[.\[]", path, maxsplit=1)[0]
            raise bad_request(f"'{path}' holds a lone UTF-16 surrogate (such as \\ud800), which is not text; "
                              "send valid UTF-8 or a surrogate pair", param=param, code="invalid_text")


def _is_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# fields with several accepted shapes: one readable line instead of one error per shape
_SHAPES = {"prompt": "a string or a list of token ids", "stop": "a string or a list of strings",
           "messages": "a list of {role, content} objects with role system, developer, user, assistant or "
                       "tool and content a string or a list of text parts"}


def _validation_error(exc: ValidationError) -> APIError:
    errors = exc.errors()
    param = str(errors[0]["loc"][0]) if errors[0]["loc"] else None
    mine = [e for e in errors if e["loc"] and str(e["loc"][0]) == param]
    if any(e["type"] == "missing" and len(e["loc"]) == 1 for e in mine):
        return bad_request(f"'{param}' is required", param=param, code="missing_field")
    if param in _SHAPES:
        return bad_request(f"'{param}' must be {_SHAPES[param]} ({_loc(mine[0]['loc'])}: {mine[0]['msg']})",
                           param=param)
    details = "; ".join(dict.fromkeys(f"{_loc(e['loc'])}: {e['msg']}" for e in mine[:4]))
    return bad_request(f"invalid '{param}': {details}", param=param)


def _loc(loc: tuple) -> str:
    # union members show up in loc as type names ('str', 'list[int]'); keep fields and indices
    return ".".join(str(x) for x in loc if isinstance(x, int) or ("[" not in str(x) and str(x) not in
                                                                  ("str", "int", "float", "bool")))


# from a request to engine inputs ----------------------------------------------------------------
@dataclass(frozen=True)
class GenerateInput:
    """What the engine gets: a prompt (text or token ids), sampling params, and the options."""

    prompt: str | list[int]
    params: SamplingParams
    max_tokens_given: bool         # False: max_tokens fills the context (chat without a limit)
    stream: bool
    include_usage: bool


def _reject_unsupported(req: _SamplingFields) -> None:
    """Fields kvfit does not implement: a 400 unless they hold their neutral value."""
    if req.n not in (None, 1):
        raise bad_request(f"n must be 1 (kvfit returns one choice per request), got {req.n}", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0):
            raise bad_request(f"{name} is not supported; leave it at 0", param=name)
    unsupported = {"logit_bias": bool(req.logit_bias), "tools": bool(getattr(req, "tools", None)),
                   "echo": bool(getattr(req, "echo", None)), "suffix": bool(getattr(req, "suffix", None)),
                   "best_of": getattr(req, "best_of", None) not in (None, 1),
                   # completions: an int (any value asks for logprobs); chat: a bool
                   "logprobs": getattr(req, "logprobs", None) not in (None, False)}
    for name, is_set in unsupported.items():
        if is_set:
            raise bad_request(f"{name} is not supported by kvfit", param=name)
    fmt = getattr(req, "response_format", None)
    if fmt and fmt.get("type") not in (None, "text"):
        raise bad_request("response_format other than text is not supported", param="response_format")


def sampling_params(req: _SamplingFields, max_tokens: int | None) -> SamplingParams:
    """Build SamplingParams; it validates every range and names the field (a 400 with that param)."""
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", param="stop")
    try:
        return SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                              top_p=1.0 if req.top_p is None else req.top_p,
                              top_k=-1 if req.top_k is None else req.top_k, seed=req.seed, max_tokens=max_tokens,
                              stop=stop, stop_token_ids=tuple(req.stop_token_ids or ()),
                              ignore_eos=bool(req.ignore_eos))
    except RequestError as exc:
        raise bad_request(str(exc), param=exc.param, code=exc.code) from None


def _stream_flags(req: _SamplingFields) -> tuple[bool, bool]:
    stream = bool(req.stream)
    if req.stream_options is not None and not stream:
        raise bad_request("stream_options is only allowed with stream: true", param="stream_options")
    return stream, bool(stream and req.stream_options and req.stream_options.include_usage)


def completion_input(req: CompletionRequest) -> GenerateInput:
    _reject_unsupported(req)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request(f"one prompt per request (got a batch of {len(prompt)}); send them as "
                              "separate requests", param="prompt")
        prompt = prompt[0]
    if not prompt:
        raise bad_request("the prompt is empty; give at least one token", param="prompt")
    max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    stream, include_usage = _stream_flags(req)
    return GenerateInput(prompt, sampling_params(req, max_tokens), True, stream, include_usage)


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """Messages as the chat template wants them: role and one string of content."""
    if not req.messages:
        raise bad_request("messages must hold at least one message", param="messages")
    out = []
    for m in req.messages:
        content = m.content if isinstance(m.content, str) or m.content is None \
            else "".join(part.text for part in m.content)
        message = {"role": m.role, "content": content or ""}
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out


def chat_input(req: ChatCompletionRequest, prompt: str | list[int]) -> GenerateInput:
    """prompt: the messages after the chat template."""
    _reject_unsupported(req)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"{param} must be >= 1, got {max_tokens}", param=param)
    stream, include_usage = _stream_flags(req)
    return GenerateInput(prompt, sampling_params(req, max_tokens), max_tokens is not None, stream, include_usage)


# response bodies --------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


class ResponseBuilder:
    """Builds one request's bodies (full response or stream chunks) for completions or chat."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list, extra: dict | None = None) -> dict:
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        body.update(extra or {})
        return body

    def full(self, text: str, reason: str | None, num_prompt_tokens: int, num_completion_tokens: int) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            obj = "text_completion"
        return self._envelope(obj, [choice], {"usage": usage(num_prompt_tokens, num_completion_tokens)})

    def chunk(self, delta: str, reason: str | None, include_usage: bool, first: bool = False) -> dict:
        if self.chat:
            if first:
                message = {"role": "assistant", "content": delta}
            else:                   # the last chunk carries only the finish reason when it adds no text
                message = {"content": delta} if delta or reason is None else {}
            choice = {"index": 0, "delta": message, "logprobs": None, "finish_reason": reason}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": reason}
            obj = "text_completion"
        return self._envelope(obj, [choice], {"usage": None} if include_usage else None)

    def usage_chunk(self, num_prompt_tokens: int, num_completion_tokens: int) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(obj, [], {"usage": usage(num_prompt_tokens, num_completion_tokens)})


def sse(data: dict | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"data: {text}\n\n".encode("utf-8")
