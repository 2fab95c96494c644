"""The OpenAI-compatible HTTP app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

create_app(engine, ...) wraps an LLMEngine in an AsyncEngine (started and stopped by the app's
lifespan) and a per-app metrics registry. Handlers validate, hand the request to the engine
thread and either stream its outputs as server-sent events or wait for the last one. A client
that goes away (disconnect, cancel) has its request aborted, which frees its blocks at once.

Work that grows with a client's input (parsing the body, rendering the chat template,
tokenizing) runs on the AsyncEngine's prepare threads, so one large body never stalls the event
loop (/health, other streams) or the engine thread.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvfit.errors import ConfigError, RequestError
from kvfit.server.async_engine import AsyncEngine, RequestStream
from kvfit.server.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_WAITING_REQUESTS
from kvfit.server.metrics import CONTENT_TYPE, ServerMetrics
from kvfit.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, GenerateInput,
                                   ResponseBuilder, bad_request, chat_input, chat_messages, completion_input,
                                   error_body, new_id, parse_body, sse)

logger = logging.getLogger("kvfit")

DISCONNECT_POLL_SECONDS = 0.5             # how often a non-streaming request checks its client is there


@dataclass
class ServerState:
    engine: AsyncEngine
    metrics: ServerMetrics
    model_name: str
    api_key: str | None
    max_body_bytes: int
    created: int


def create_app(engine, served_model_name: str, api_key: str | None = None,
               max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, metrics_require_key: bool = False) -> FastAPI:
    """The app for one LLMEngine; the engine thread runs between lifespan start-up and shutdown."""
    async_engine = AsyncEngine(engine, max_waiting_requests)
    metrics = ServerMetrics(async_engine.stats, exact_prefix_cache=metrics_require_key)
    state = ServerState(async_engine, metrics, served_model_name, api_key, max_body_bytes, int(time.time()))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.to_thread(async_engine.stop)

    app = FastAPI(title="kvfit", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.kvfit = state
    _add_error_handlers(app)
    _add_routes(app, state)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(error_body(message, "invalid_request_error"), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return JSONResponse(error_body(str(exc), "invalid_request_error"), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        # the client gets an id to quote, never the exception text (it can hold internal details)
        error_id = new_id("err")
        logger.exception("internal error %s on %s", error_id, request.url.path)
        return JSONResponse(error_body(f"internal error {error_id}; see the server log", "server_error"),
                            status_code=500)


def _add_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health():
        error = state.engine.health()
        if error is not None:
            return JSONResponse(error.body(), status_code=error.status)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request):
        _check_auth(request, state)
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str, request: Request):
        _check_auth(request, state)
        _check_model(model, state)
        return _model_card(state)

    @app.post("/v1/completions")
    async def completions(request: Request):
        _check_auth(request, state)
        raw = await _read_body(request, state.max_body_bytes)
        body = await state.engine.prepare(parse_body, raw, CompletionRequest)
        _check_model(body.model, state)
        return await _generate(request, state, completion_input(body), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        _check_auth(request, state)
        raw = await _read_body(request, state.max_body_bytes)
        body = await state.engine.prepare(parse_body, raw, ChatCompletionRequest)
        _check_model(body.model, state)
        tokenizer = state.engine.engine.tokenizer
        prompt = await state.engine.prepare(lambda: _apply_chat_template(tokenizer, chat_messages(body)))
        return await _generate(request, state, chat_input(body, prompt), chat=True)


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "kvfit",
            "max_model_len": state.engine.engine.max_model_len}


# checks -----------------------------------------------------------------------------------------
def _check_auth(request: Request, state: ServerState) -> None:
    if state.api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
        raise APIError(401, "missing or wrong API key: send the header `Authorization: Bearer <key>` with the "
                            "key given to --api-key", "invalid_request_error", None, "invalid_api_key")


def _check_model(name: str, state: ServerState) -> None:
    if name != state.model_name:
        raise APIError(404, f"the model '{name}' does not exist; this server serves '{state.model_name}' "
                            "(see /v1/models)", "invalid_request_error", "model", "model_not_found")


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refusing (413) one over `limit` bytes before reading it when Content-Length says so."""
    too_large = APIError(413, f"the request body is over the limit of {limit} bytes", "invalid_request_error",
                         None, "request_too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _apply_chat_template(tokenizer, messages: list[dict]) -> str | list[int]:
    if tokenizer is None:
        raise bad_request("this model has no tokenizer, so chat is not available; use /v1/completions "
                          "with a prompt of token ids", param="messages", code="no_chat_template")
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except ConfigError as exc:
        raise bad_request(f"this model has no chat template ({exc}); use /v1/completions instead",
                          param="messages", code="no_chat_template") from None
    except RequestError as exc:      # the template refused the messages (say, a role it does not know)
        raise bad_request(str(exc), param="messages") from None


# generation -------------------------------------------------------------------------------------
async def _generate(request: Request, state: ServerState, inp: GenerateInput, chat: bool):
    builder = ResponseBuilder(chat, state.model_name)
    stream = await state.engine.add(builder.id, inp.prompt, inp.params, inp.max_tokens_given)
    if inp.stream:
        return _EventStream(_stream_events(state, builder, inp, stream), lambda: _close(state, stream))
    output = None
    try:
        while output is None or not output.finished:
            try:
                output = await stream.next(timeout=DISCONNECT_POLL_SECONDS)
            except TimeoutError:
                if await request.is_disconnected():
                    logger.info("client of %s went away; aborting it", stream.request_id)
                    return Response(status_code=499)
    finally:
        _close(state, stream)
    sample = output.outputs[0]
    return builder.full(sample.text, sample.finish_reason, stream.num_prompt_tokens, len(sample.token_ids))


async def _stream_events(state: ServerState, builder: ResponseBuilder, inp: GenerateInput, stream: RequestStream):
    """SSE chunks: deltas of the text, the finish reason, usage if asked, then [DONE].

    While a stop string may still complete, its possible beginning is held back (it would be cut).
    """
    hold = max((len(s) for s in inp.params.stop), default=1) - 1
    sent, output = "", None
    try:
        if builder.chat:
            yield sse(builder.chunk("", None, inp.include_usage, first=True))
        while output is None or not output.finished:
            try:
                output = await stream.next()
            except APIError as exc:
                yield sse(exc.body())
                yield sse("[DONE]")
                return
            sample = output.outputs[0]
            text = sample.text if output.finished else sample.text[:max(len(sample.text) - hold, len(sent))]
            delta, sent = text[len(sent):], text
            if delta or output.finished:
                yield sse(builder.chunk(delta, sample.finish_reason if output.finished else None,
                                        inp.include_usage))
        if inp.include_usage:
            yield sse(builder.usage_chunk(stream.num_prompt_tokens, len(output.outputs[0].token_ids)))
        yield sse("[DONE]")
    finally:
        # CancelledError (client gone) or GeneratorExit lands here too
        _close(state, stream)


class _EventStream(StreamingResponse):
    """A server-sent event stream that always closes its request, even when its client went away
    before the first chunk or while a chunk was being sent (the generator is then never resumed)."""

    def __init__(self, events, on_close):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _close(state: ServerState, stream: RequestStream) -> None:
    """Once per request: abort it if it did not finish (its blocks are freed at once), record metrics."""
    if stream.closed:
        return
    stream.closed = True
    if not stream.finished:
        state.engine.abort(stream.request_id)
    output = stream.output
    if stream.finished and stream.error is None:
        reason = output.outputs[0].finish_reason or "stop"
    else:
        reason = "error" if stream.error is not None else "abort"
    state.metrics.observe(stream, len(output.outputs[0].token_ids) if output is not None else 0, reason)
