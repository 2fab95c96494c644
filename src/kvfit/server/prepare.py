"""From a request's raw body to what its handler needs, in one synchronous call: parse and validate
the JSON, check the model name, and for a chat build the message list, render the chat template and
tokenize it.

Everything here grows with the client's input, so it never runs on the engine core and, past a small
bound, never on the event loop: prepare_request runs on the AsyncEngine's prepare threads, or, for a
large body, in a prepare worker process (prepare_pool.py), with the same code, so both give the same
result and the same APIError. The exception is a completions body of at most INLINE_BODY_BYTES: it is
parsed on the event loop (parse_request: tens of microseconds, at most a few hundred), which costs less
than the hop to a thread; what is left of it runs on the threads when it can cost more (needs_finishing:
a grammar or tools to compile), else on the loop too (it then only checks). What it returns is small
and cheap to hand back from a process: the validated body with a chat's message list emptied (25,000
pydantic messages would cost the server as much to unpickle as to validate), the chat's prompt token ids and
its last message (chat echo reads it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvfit.errors import ConfigError, KvfitError, RequestError
from kvfit.server.params import (chat_messages, check_unsupported, cut_prompt_text, structured_outputs_params,
                                 truncation)
from kvfit.server.protocol import APIError, TokenizeRequest, bad_request, parse_body
from kvfit.server.tools import check_tool_constraint

logger = logging.getLogger("kvfit")


@dataclass(frozen=True)
class PrepareContext:
    """What preparing a body needs besides the tokenizer; plain data, so a worker process gets a copy.

    chat_template: --chat-template's text (None: the model's own); max_prompt_chars: see
    async_engine.max_prompt_chars; content_format: string, openai or auto (params.chat_messages; auto: as the
    template reads content)."""

    model_names: tuple[str, ...]
    chat_template: str | None
    max_prompt_chars: int
    max_model_len: int
    content_format: str = "string"
    exclude_tools_when_tool_choice_none: bool = False     # vLLM's flag: tool_choice none renders no tools


@dataclass
class Prepared:
    """A validated body; for a chat (or /tokenize with messages) its messages are emptied and
    prompt_ids holds them rendered and tokenized, last_message the last of them as the template got it."""

    body: object
    prompt_ids: list[int] | None = None
    last_message: dict | None = None


INLINE_BODY_BYTES = 16 * 1024      # a completions body up to this is parsed on the event loop (see above)


def prepare_request(raw: bytes, model_class, context: PrepareContext, tokenizer,
                    template_variables: dict) -> Prepared:
    """Raw body bytes -> Prepared, or an APIError (400/404) in the order the handlers check.

    tokenizer: the model's (None: no tokenizer); template_variables: a cache, template text -> the
    variables it reads (the caller's, shared across requests)."""
    return finish_request(parse_request(raw, model_class, context), model_class, context, tokenizer,
                          template_variables)


def parse_request(raw: bytes, model_class, context: PrepareContext):
    """The validated body with its model name checked: prepare_request's first part."""
    body = parse_body(raw, model_class)
    check_model(body.model, context.model_names)
    return body


# the fields that give finish_request work: a grammar (_check_grammar), tools to compile, messages to render
_GRAMMAR_FIELDS = ("structured_outputs", "response_format")
_FINISHING_FIELDS = (*_GRAMMAR_FIELDS, "tools", "messages")


def _has_any(body, names: tuple[str, ...]) -> bool:
    return any(getattr(body, name, None) is not None for name in names)


def needs_finishing(body) -> bool:
    """Whether finish_request can cost more than a few checks: a grammar or tools to compile, messages to render."""
    return _has_any(body, _FINISHING_FIELDS)


def finish_request(body, model_class, context: PrepareContext, tokenizer, template_variables: dict) -> Prepared:
    """prepare_request's second part, on a parsed body: grammar and tools checked, a chat rendered and tokenized."""
    if model_class is TokenizeRequest:
        _check_tokenize_request(body, tokenizer)
    _check_grammar(body)
    check_tool_constraint(body)                         # tool_choice required or named: the tools' schemas
    if getattr(body, "messages", None) is None:         # completions, /detokenize, a /tokenize prompt
        return Prepared(body)
    content_format = context.content_format
    if content_format == "auto":        # vLLM's: openai for a template that loops over a message's content
        from kvfit.text.chat_template import detected_content_format
        source = context.chat_template if context.chat_template is not None else \
            getattr(tokenizer, "chat_template", None)
        content_format = detected_content_format(source) if isinstance(source, str) else "string"
    messages = chat_messages(body, content_format)
    check_unsupported(body)
    text = _render_chat(context, tokenizer, body, messages, template_variables)
    text = cut_prompt_text(text, truncation(body), context.max_prompt_chars)     # as vLLM, before tokenizing
    check_prompt_chars(text, context.max_prompt_chars, context.max_model_len)
    try:
        # as transformers' apply_chat_template(tokenize=True): the template writes its own special
        # tokens, so none are added unless the request asks (add_special_tokens)
        ids = tokenizer.encode(text, bool(body.add_special_tokens))
    except KvfitError as exc:
        raise as_api_error(exc) from None
    return Prepared(body.model_copy(update={"messages": []}), ids, messages[-1])


def _check_grammar(body) -> None:
    """A 400 for a structured-outputs spec past kvfit's limits or that llguidance refuses, found here (a large
    one in a child process with a timeout: structured/validate.py) so the engine only compiles valid ones."""
    if not _has_any(body, _GRAMMAR_FIELDS):
        return
    spec = structured_outputs_params(body)
    if spec is not None:
        from kvfit.structured.grammar import check_spec
        try:
            check_spec(spec)
        except RequestError as exc:
            raise as_api_error(exc) from None


def check_model(name: str | None, model_names: tuple[str, ...]) -> None:
    """None (vLLM: model is optional) or one of the served names; else vLLM's 404."""
    if name is None or name in model_names:
        return
    served = ", ".join(f"'{n}'" for n in model_names)
    raise APIError(404, f"The model `{name[:200]}` does not exist. This server serves {served} (see /v1/models)",
                   "NotFoundError", "model", 404)


def no_tokenizer_error(what: str) -> APIError:
    return bad_request(f"this model has no tokenizer (tokenizer.json), so {what} is not available",
                       code="no_tokenizer")


def check_prompt_chars(text: str, max_prompt_chars: int, max_model_len: int) -> None:
    """A 400 for a text with more characters than --max-model-len tokens can ever hold (it is not
    tokenized, however long it is)."""
    if len(text) > max_prompt_chars:
        raise bad_request(f"the prompt has {len(text)} characters, more than {max_prompt_chars} (what "
                          f"--max-model-len {max_model_len} tokens can hold at most); shorten the "
                          "prompt or raise --max-model-len", "prompt", "context_length_exceeded")


def as_api_error(exc: KvfitError) -> APIError:
    """A request the engine or tokenizer refused as the client's 400 (a RequestError carries its param and code)."""
    if isinstance(exc, RequestError):
        return bad_request(str(exc), exc.param, exc.code)
    return bad_request(str(exc))


def _check_tokenize_request(body: TokenizeRequest, tokenizer) -> None:
    from kvfit.server.tools import check_tokenize_tools
    check_unsupported(body)
    check_tokenize_tools(body)
    if tokenizer is None:
        raise no_tokenizer_error("tokenize")
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give either prompt (a text) or messages (a chat), not both or neither", param="prompt")


def _render_chat(context: PrepareContext, tokenizer, body, messages: list[dict], template_variables: dict) -> str:
    if tokenizer is None:
        raise bad_request("this model has no tokenizer, so chat is not available; use /v1/completions "
                          "with a prompt of token ids", param="messages", code="no_chat_template")
    override = context.chat_template
    source = override if override is not None else getattr(tokenizer, "chat_template", None)
    if body.chat_template_kwargs and source is not None:
        _warn_unread_kwargs(source, body.chat_template_kwargs, template_variables)
    kwargs = _template_kwargs(body, source, template_variables)
    from kvfit.server.tools import template_messages, template_tools
    tools = template_tools(body)
    if context.exclude_tools_when_tool_choice_none and getattr(body, "tool_choice", None) == "none":
        tools = None
    documents = getattr(body, "documents", None)
    if documents is not None and not (isinstance(documents, list) and all(
            isinstance(d, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in d.items())
            for d in documents)):
        raise bad_request("documents must be a list of objects of strings (e.g. {\"title\": ..., \"text\": ...})",
                          param="documents")
    try:
        return tokenizer.apply_chat_template(template_messages(messages), body.add_generation_prompt,
                                             continue_final_message=body.continue_final_message,
                                             chat_template=override, template_kwargs=kwargs,
                                             **({"tools": tools} if tools is not None else {}),
                                             **({"documents": documents} if documents is not None else {}))
    except ConfigError as exc:
        raise bad_request(f"{exc}; start the server with --chat-template, or use /v1/completions", param="messages",
                          code="no_chat_template") from None
    except RequestError as exc:      # the template refused the messages (say, a role it does not know)
        raise bad_request(str(exc), param=exc.param or "messages") from None


def _template_kwargs(body, source: str | None, template_variables: dict) -> dict | None:
    """chat_template_kwargs with vLLM's reasoning_effort: the template gets it, and enable_thinking (its value
    not "none") unless chat_template_kwargs sets that; a template that reads neither is named in the log."""
    kwargs, effort = body.chat_template_kwargs, getattr(body, "reasoning_effort", None)
    if effort is None:
        return kwargs
    added = {"reasoning_effort": effort}
    if "enable_thinking" not in (kwargs or {}):
        added["enable_thinking"] = effort != "none"
    if source is not None and not set(added) & _variables(source, template_variables):
        logger.warning("reasoning_effort does nothing here: the chat template reads neither reasoning_effort nor "
                       "enable_thinking")
    return {**(kwargs or {}), **added}


def _variables(source: str, template_variables: dict) -> set:
    from kvfit.text.chat_template import template_variables as read_variables
    if source not in template_variables:
        template_variables[source] = read_variables(source)
    return set(template_variables[source])


def _warn_unread_kwargs(source: str, kwargs: dict, template_variables: dict) -> None:
    """chat_template_kwargs the template never reads do nothing: say so in the log (as unknown fields)."""
    variables = _variables(source, template_variables)
    unread = [k for k in kwargs if k not in variables]
    if unread:
        logger.warning("chat_template_kwargs names variables the chat template does not read, so they do "
                       "nothing: %s", ", ".join(repr(k[:64]) for k in unread[:16]))
