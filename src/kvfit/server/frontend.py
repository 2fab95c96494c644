"""vLLM's front-end flags of `kvfit serve`, with vLLM's names and defaults: CORS, X-Request-Id headers, what usage
and logprobs show, the chat template's content format and --override-generation-config. FrontendOptions holds
them (frozen, checked when built, so `kvfit serve` fails before loading); create_app applies them.

Middleware order (outermost first): GuardMiddleware (launch.install_guards), RequestIdHeaders, CORSMiddleware,
the routes, as vLLM stacks its request-id, auth and CORS middleware: a CORS preflight (OPTIONS) is answered
before any handler, so it needs no API key.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

from kvfit.errors import ConfigError, RequestError
from kvfit.sampling_params import SamplingParams
from kvfit.server.params import RequestDefaults
from kvfit.text.generation_config import apply_generation_overrides, generation_overrides

logger = logging.getLogger("kvfit")

CHAT_TEMPLATE_CONTENT_FORMATS = ("auto", "string", "openai")
REQUEST_ID_HEADER = b"x-request-id"


@dataclass(frozen=True)
class FrontendOptions:
    """One field per `vllm serve` flag of the same name (defaults: vLLM's).

    chat_template_content_format: how a message's content reaches the template: string (text parts joined by
    a line break), openai (a list of {"type": "text", "text": ...} parts, vLLM's openai format) or auto, which
    inspects the template as vLLM's does (text.chat_template.detected_content_format). override_generation_config: the checked
    fields (text.generation_config.generation_overrides), merged over --generation-config's defaults."""

    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    enable_request_id_headers: bool = False
    enable_prompt_tokens_details: bool = False
    enable_force_include_usage: bool = False
    return_tokens_as_token_ids: bool = False
    exclude_tools_when_tool_choice_none: bool = False
    chat_template_content_format: str = "auto"
    override_generation_config: dict | None = None

    def __post_init__(self):
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"--{name.replace('_', '-')} must be a JSON list of strings like [\"*\"], "
                                  f"got {value!r:.80}")
            object.__setattr__(self, name, tuple(value))
        if self.chat_template_content_format not in CHAT_TEMPLATE_CONTENT_FORMATS:
            raise ConfigError(f"--chat-template-content-format must be one of "
                              f"{', '.join(CHAT_TEMPLATE_CONTENT_FORMATS)}, got {self.chat_template_content_format!r}")
        if self.override_generation_config is not None:
            object.__setattr__(self, "override_generation_config",
                               generation_overrides(self.override_generation_config))
            _check_params(apply_generation_overrides({}, self.override_generation_config))   # before loading

    def request_defaults(self, serving) -> RequestDefaults:
        """What every request of `serving` (a ServingEngine) gets: its --generation-config defaults with
        override_generation_config merged over them (checked together by SamplingParams), and these flags."""
        params = serving.default_sampling_params
        if self.override_generation_config:
            params = apply_generation_overrides(params, self.override_generation_config)
            _check_params(params)
            logger.info("default sampling params with --override-generation-config: %s",
                        ", ".join(f"{k}={v}" for k, v in params.items()) or "none")
        override_cap = (self.override_generation_config or {}).get("max_new_tokens")
        return RequestDefaults.from_config(params, serving.generation_config, serving.max_logprobs, override_cap,
                                           enable_force_include_usage=self.enable_force_include_usage,
                                           return_tokens_as_token_ids=self.return_tokens_as_token_ids,
                                           enable_prompt_tokens_details=self.enable_prompt_tokens_details)

    @property
    def content_format(self) -> str:
        """string, openai, or auto (resolved for each template: text.chat_template.detected_content_format)."""
        return self.chat_template_content_format


def _check_params(params: dict) -> None:
    """Default sampling params (vLLM's names) with --override-generation-config's: SamplingParams' ranges."""
    try:
        SamplingParams(**params)
    except RequestError as exc:
        raise ConfigError(f"--override-generation-config: {exc}") from None


DEFAULT_FRONTEND = FrontendOptions()


def install_frontend_middleware(app, options: FrontendOptions) -> None:
    """CORS (always, as vLLM) and, with --enable-request-id-headers, X-Request-Id on every response."""
    from starlette.middleware.cors import CORSMiddleware
    app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins),
                       allow_methods=list(options.allowed_methods), allow_headers=list(options.allowed_headers),
                       allow_credentials=options.allow_credentials)
    if options.enable_request_id_headers:
        app.add_middleware(RequestIdHeaders)        # added last: outside CORS, as vLLM's


class RequestIdHeaders:
    """vLLM's XRequestIdMiddleware: each response carries X-Request-Id, the request's own X-Request-Id header
    when the client sent one, else a fresh uuid4 hex."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = next((v for k, v in scope["headers"] if k == REQUEST_ID_HEADER), None)
        request_id = request_id if request_id is not None else uuid.uuid4().hex.encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (REQUEST_ID_HEADER, request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
