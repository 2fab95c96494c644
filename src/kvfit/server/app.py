"""The OpenAI-compatible HTTP app: /v1/completions, /v1/chat/completions, /v1/models, and vLLM's
/tokenize, /detokenize, /version, plus /health and /metrics.

create_app(engine, ...) wraps an LLMEngine in an AsyncEngine (started and stopped by the app's
lifespan, with the periodic stats line) and a per-app metrics registry. Handlers validate, hand the
request to the engine thread and either stream its outputs as server-sent events or wait for the
last one. A client that goes away (disconnect, cancel) has its request aborted, which frees its
blocks at once.

Work that grows with a client's input (parsing the body, building a chat's message list, rendering
its template, tokenizing: prepare.prepare_request) runs on the AsyncEngine's prepare threads, and for
a body over large_body_bytes in prepare worker processes (prepare_pool.py), so one large body never
stalls the event loop (/health, other streams) or the engine thread, not even through the GIL.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvfit.errors import ConfigError
from kvfit.server.async_engine import AddRequest, AsyncEngine, PromptRefused, RequestStream, ServingEngine
from kvfit.server.frontend import DEFAULT_FRONTEND, FrontendOptions, install_frontend_middleware
from kvfit.server.limits import APP_MAX_WAITING_REQUESTS, default_max_body_bytes
from kvfit.server.logs import ACCESS_SCOPE_KEY, STATS_INTERVAL_SECONDS, AccessRecord, StatsLogger
from kvfit.server.metrics import CONTENT_TYPE, ServerMetrics
from kvfit.server.params import NO_DEFAULTS, GenerateInput, RequestDefaults, chat_input, completion_inputs
from kvfit.server.prepare import (INLINE_BODY_BYTES, PrepareContext, Prepared, check_model, finish_request,
                                  needs_finishing, no_tokenizer_error, parse_request, prepare_request)
from kvfit.server.prepare_pool import (LARGE_BODY_BYTES, THREAD_RENDER_CPU_SECONDS, PreparePool,
                                      default_num_processes)
from kvfit.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                   TokenizeRequest, bad_request, error_body, new_id, sse)
from kvfit.server.responses import ResponseBuilder, cached_tokens, usage
from kvfit.server.tools import NO_TOOLS, ToolOptions, apply_tools
from kvfit.text.chat_template import RenderOnProcess, thread_share
from kvfit.version import __version__

logger = logging.getLogger("kvfit")


@dataclass
class ServerState:
    engine: ServingEngine
    metrics: ServerMetrics
    model_names: tuple[str, ...]            # --served-model-name: the first is reported in responses
    api_key: str | None
    max_body_bytes: int
    created: int
    prepare_context: PrepareContext
    prepare_pool: PreparePool | None = None  # bodies over large_body_bytes are prepared there (None: threads)
    large_body_bytes: int = LARGE_BODY_BYTES
    defaults: RequestDefaults = NO_DEFAULTS  # --generation-config's, for what a request leaves out
    template_variables: dict = field(default_factory=dict)    # template text -> the variables it reads
    tool_options: ToolOptions = NO_TOOLS    # --enable-auto-tool-choice, --tool-call-parser

    @property
    def model_name(self) -> str:
        return self.model_names[0]


def _model_names(served_model_name: str | Sequence[str]) -> tuple[str, ...]:
    names = (served_model_name,) if isinstance(served_model_name, str) else tuple(served_model_name)
    if not names or not all(isinstance(n, str) and n.strip() for n in names):
        raise ConfigError(f"--served-model-name needs one or more non-empty names, got {list(names)!r:.80}")
    return tuple(dict.fromkeys(names))


def create_app(engine, served_model_name: str | Sequence[str], api_key: str | None = None,
               max_waiting_requests: int = APP_MAX_WAITING_REQUESTS,
               max_body_bytes: int | None = None, metrics_require_key: bool = False,
               chat_template: str | None = None, stats_interval_s: float = STATS_INTERVAL_SECONDS,
               prepare_processes: int | None = None, large_body_bytes: int = LARGE_BODY_BYTES,
               tool_options: ToolOptions = NO_TOOLS, frontend: FrontendOptions = DEFAULT_FRONTEND) -> FastAPI:
    """The app for one LLMEngine; the engine thread runs between lifespan start-up and shutdown.

    served_model_name: one name or several (the first is reported); chat_template: a template text
    (see text.chat_template.load_chat_template) used instead of the model's; stats_interval_s:
    seconds between stats lines (0: none); prepare_processes: worker processes for bodies over
    large_body_bytes (None: prepare_pool.default_num_processes(); 0: none, every body on the threads);
    frontend: vLLM's front-end flags (server/frontend.py)."""
    names = _model_names(served_model_name)
    if prepare_processes is not None and prepare_processes < 0:
        raise ConfigError(f"prepare_processes must be >= 0, got {prepare_processes}")
    # an LLMEngine runs on a thread of this process; `kvfit serve` passes its engine core process's client
    serving = engine if isinstance(engine, ServingEngine) else AsyncEngine(engine, max_waiting_requests)
    if chat_template is not None and serving.tokenizer is None:
        raise ConfigError("--chat-template needs the model's tokenizer (tokenizer.json), which this model lacks")
    async_engine = serving
    metrics = ServerMetrics(serving.stats, metrics_require_key, names[0], serving.max_model_len)
    defaults = frontend.request_defaults(serving)
    context = PrepareContext(names, chat_template, serving.max_prompt_chars, serving.max_model_len,
                             frontend.content_format, frontend.exclude_tools_when_tool_choice_none)
    num_processes = default_num_processes() if prepare_processes is None else prepare_processes
    pool = _prepare_pool(serving, context, num_processes) if num_processes > 0 else None
    if max_body_bytes is None:
        max_body_bytes = default_max_body_bytes(serving.max_model_len)
    state = ServerState(serving, metrics, names, api_key, max_body_bytes, int(time.time()), context, pool,
                        large_body_bytes, defaults=defaults, tool_options=tool_options)
    stats_logger = StatsLogger(metrics, async_engine.stats, stats_interval_s) if stats_interval_s > 0 else None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start(asyncio.get_running_loop())
        task = asyncio.create_task(stats_logger.run()) if stats_logger is not None else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            try:
                await asyncio.to_thread(async_engine.stop)
            finally:
                if pool is not None:          # its workers must not outlive the server
                    await asyncio.to_thread(pool.shutdown)

    app = FastAPI(title="kvfit", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.kvfit = state
    _add_error_handlers(app)
    _add_routes(app, state)
    _add_token_routes(app, state)
    install_frontend_middleware(app, frontend)
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

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        """vLLM's /ping (GET and POST, e.g. SageMaker's health check): /health's answer."""
        return await health()

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/models")
    async def models(request: Request):
        _check_auth(request, state)
        return {"object": "list", "data": [_model_card(state, name) for name in state.model_names]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str, request: Request):
        _check_auth(request, state)
        check_model(model, state.model_names)
        return _model_card(state, model)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = (await _prepare(request, state, CompletionRequest)).body
        return await _generate(request, state, completion_inputs(body, state.defaults), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        prepared = await _prepare(request, state, ChatCompletionRequest)
        # chat_input reads only the last message (chat echo); the rest are in prompt_ids
        inp = chat_input(prepared.body, prepared.prompt_ids, [prepared.last_message], state.defaults)
        inp = apply_tools(inp, prepared.body, state.tool_options)      # tool_choice (server/tools.py)
        return await _generate(request, state, [inp], chat=True)


def _add_token_routes(app: FastAPI, state: ServerState) -> None:
    """vLLM's /tokenize and /detokenize (same shapes); they use the API key like /v1."""

    @app.post("/tokenize")
    async def tokenize(request: Request):
        prepared = await _prepare(request, state, TokenizeRequest)     # checks the fields, renders messages
        body, tokenizer, ids = prepared.body, _tokenizer(state, "tokenize"), prepared.prompt_ids
        if ids is None:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await state.engine.encode(body.prompt, add_special_tokens=special)
        max_model_len, strs = state.engine.max_model_len, body.return_token_strs

        def respond() -> Response:       # hundreds of thousands of ids: their strings and JSON off the event loop
            content = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
                       "token_strs": tokenizer.convert_ids_to_tokens(ids) if strs else None}
            return _json_response(content)
        return await state.engine.prepare(respond)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = (await _prepare(request, state, DetokenizeRequest)).body
        tokenizer = _tokenizer(state, "detokenize")
        vocab_size = tokenizer.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab_size})", param="tokens")
        text = await state.engine.prepare(lambda: tokenizer.decode(body.tokens, skip_special_tokens=False))
        return {"prompt": text}


def _model_card(state: ServerState, name: str) -> dict:
    """vLLM's ModelCard: root is the model's folder (the first served name where there is none), no parent (no
    adapters), one permission entry as vLLM writes it."""
    root = getattr(state.engine, "model_folder", None) or state.model_names[0]
    permission = {"id": f"modelperm-{state.created}", "object": "model_permission", "created": state.created,
                  "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                  "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                  "organization": "*", "group": None, "is_blocking": False}
    return {"id": name, "object": "model", "created": state.created, "owned_by": "kvfit", "root": root,
            "parent": None, "max_model_len": state.engine.max_model_len, "permission": [permission]}


# checks -----------------------------------------------------------------------------------------
def _check_auth(request: Request, state: ServerState) -> None:
    if state.api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
        raise APIError(401, "missing or wrong API key: send the header `Authorization: Bearer <key>` with the "
                            "key given to --api-key", "invalid_request_error", None, "invalid_api_key")


def _tokenizer(state: ServerState, what: str):
    tokenizer = state.engine.tokenizer
    if tokenizer is None:
        raise no_tokenizer_error(what)
    return tokenizer


async def _prepare(request: Request, state: ServerState, model_class) -> Prepared:
    """The validated body of a POST that names a model (a chat's prompt ids too): key checked, size
    capped, prepared off the loop, in a worker process when the body is over large_body_bytes; a small
    completions body is parsed on the loop (prepare.py says why)."""
    _check_auth(request, state)
    raw = await _read_body(request, state.max_body_bytes)
    if state.prepare_pool is not None and len(raw) > state.large_body_bytes:
        return await state.prepare_pool.prepare(raw, model_class)
    if model_class is CompletionRequest and len(raw) <= INLINE_BODY_BYTES:
        body = parse_request(raw, model_class, state.prepare_context)      # small: cheaper here than on a thread
        if not needs_finishing(body):
            return Prepared(body)
        return await state.engine.prepare(finish_request, body, model_class, state.prepare_context,
                                          state.engine.tokenizer, state.template_variables)
    args = (raw, model_class, state.prepare_context, state.engine.tokenizer, state.template_variables)
    if state.prepare_pool is None:
        return await state.engine.prepare(prepare_request, *args)
    try:        # a chat template that runs long on a thread holds this process's GIL: it goes on in a worker
        return await state.engine.prepare(thread_share, THREAD_RENDER_CPU_SECONDS, prepare_request, *args)
    except RenderOnProcess:
        # the thread logged what preparing logs (ignored fields, unread chat_template_kwargs: all before the
        # template renders); the worker's copies of those lines would log them twice
        return await state.prepare_pool.prepare(raw, model_class, replay_logs=False)


def _prepare_pool(engine: ServingEngine, context: PrepareContext, num_processes: int) -> PreparePool | None:
    """Worker processes that read the engine's tokenizer from its model folder; None (every body on
    the threads) when a worker could not rebuild it (an engine stand-in's own tokenizer)."""
    from kvfit.text.tokenizer import Tokenizer
    if engine.tokenizer is None:
        return PreparePool(None, context, num_processes)
    if isinstance(engine.tokenizer, Tokenizer) and engine.model_folder is not None:
        return PreparePool(engine.model_folder, context, num_processes)
    return None


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


# generation -------------------------------------------------------------------------------------
def _num_output_tokens(output) -> int:
    return sum(len(sample.token_ids) for sample in output.outputs) if output is not None else 0


async def _generate(request: Request, state: ServerState, inputs: list[GenerateInput], chat: bool):
    """One engine request per prompt (a completions batch has several, vLLM's way); the response
    holds their choices prompt-major, the usage summed."""
    response_id = new_id("chatcmpl" if chat else "cmpl")
    n, tokenizer = inputs[0].n, state.engine.tokenizer
    builders = [ResponseBuilder(chat, state.model_name, inp, tokenizer, response_id, i * n)
                for i, inp in enumerate(inputs)]
    access = request.scope.get(ACCESS_SCOPE_KEY)
    streams = await _add_all(state, response_id, inputs)
    for builder, stream in zip(builders, streams):
        builder.prompt_cut = stream.prompt_cut
    if inputs[0].stream:
        return _EventStream(_stream_events(state, builders, inputs[0], streams, access),
                            lambda: _close_all(state, streams, access))
    try:
        outputs = await _until_finished_or_gone(request, streams)
        if outputs is None:
            logger.info("client of %s went away; aborting it", response_id)
            return Response(status_code=499)
    finally:
        _close_all(state, streams, access)
    # a response with logprobs of n samples can take seconds to build and encode: off the event loop
    return await asyncio.to_thread(_full_response, builders, outputs, streams)


def _full_response(builders: list[ResponseBuilder], outputs: list, streams: list[RequestStream]) -> Response:
    """The whole non-streamed response, encoded (as JSONResponse does)."""
    bodies = [b.full(out, s.num_prompt_tokens) for b, out, s in zip(builders, outputs, streams)]
    body = bodies[0]
    if len(bodies) > 1:
        body["choices"] = [choice for b in bodies for choice in b["choices"]]
        body["usage"] = usage(sum(b["usage"]["prompt_tokens"] for b in bodies),
                              sum(b["usage"]["completion_tokens"] for b in bodies),
                              cached_tokens(builders[0].inp, outputs))
    return _json_response(body)


def _json_response(body: dict) -> Response:
    """body encoded as JSONResponse does (compact, non-ASCII kept), off the event loop where the caller is."""
    try:
        content = json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:      # a lone surrogate (a \\ud800 escape decoded somewhere): ASCII JSON keeps it escaped
        content = json.dumps(body, allow_nan=False, separators=(",", ":")).encode("ascii")
    return Response(content, media_type="application/json")


async def _until_finished_or_gone(request: Request, streams: list[RequestStream]) -> list | None:
    """Every stream's final output, or None as soon as the client disconnects (the caller aborts them:
    a request nobody waits for stops costing anything at once, not at its next quiet moment)."""
    async def finals():
        outputs = []
        for stream in streams:                   # they run together; each is awaited to its end
            output = None
            while output is None or not output.finished:
                output = await stream.next()
            outputs.append(output)
        return outputs

    async def gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    results, watcher = asyncio.create_task(finals()), asyncio.create_task(gone())
    try:
        await asyncio.wait((results, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (results, watcher):
            task.cancel()
    if results.done() and not results.cancelled():
        return results.result()                  # an engine error (APIError) is raised here
    return None


async def _add_all(state: ServerState, response_id: str, inputs: list[GenerateInput]) -> list[RequestStream]:
    """Queue every prompt's request (ServingEngine.add_batch: one batch's adds reach the core together, one batch
    at a time); if one is refused, those queued are aborted and the whole request fails with that prompt's error
    (its index named in a batch)."""
    batch = len(inputs) > 1
    wanted, cap = len(inputs) * inputs[0].n, state.engine.max_requests_at_once
    if batch and cap and wanted > cap:     # as n alone past it (EngineCore.add): refused before any is queued
        raise APIError(400, f"{len(inputs)} prompts x n={inputs[0].n} = {wanted} requests can never be queued "
                            f"here: at most --max-num-seqs + --max-waiting-requests = {cap} run or wait at once; "
                            "send fewer prompts a request", "invalid_request_error", "prompt")
    requests = [AddRequest(f"{response_id}-{i}" if batch else response_id,     # vLLM's sub-request ids
                           inp.prompt, inp.params, inp.max_tokens_given, inp.cache_salt, inp.truncate,
                           inp.add_special_tokens)
                for i, inp in enumerate(inputs)]
    try:
        return await state.engine.add_batch(requests, state.metrics.progress)
    except PromptRefused as exc:
        error = exc.error
        if not batch or error.status >= 500:          # one prompt's, or the engine's (shutting down, dead)
            raise error from None
        raise APIError(error.status, f"prompt {exc.index} of {len(inputs)}: {error.message}", error.type,
                       error.param or "prompt", error.code) from None


async def _moves(stream: RequestStream):
    """The stream's outputs until it finished, or its APIError last."""
    try:
        while not stream.finished:
            yield await stream.next()
    except APIError as exc:
        yield exc


async def _merged(streams: list[RequestStream]):
    """(prompt index, output or APIError) as any stream moves, until every one finished or one failed."""
    if len(streams) == 1:            # the common case: read it directly (no pump task, no second queue)
        async with contextlib.aclosing(_moves(streams[0])) as moves:
            async for item in moves:
                yield 0, item
        return
    # bounded: while the client does not read, each pump waits with its one output in hand and its stream folds
    # the newer ones into its slot (an unbounded queue kept a copy per step)
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))

    async def pump(i: int, stream: RequestStream) -> None:
        async for item in _moves(stream):
            await queue.put((i, item))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            yield i, item
            if isinstance(item, APIError):
                return
            remaining -= item.finished
    finally:
        for task in tasks:
            task.cancel()


async def _stream_events(state: ServerState, builders: list[ResponseBuilder], inp: GenerateInput,
                         streams: list[RequestStream], access: AccessRecord | None):
    """SSE chunks: each choice's deltas and finish reason, usage if asked, then [DONE]."""
    outputs = [None] * len(streams)
    try:
        for body in builders[0].role_chunks(streams[0].num_prompt_tokens, streams[0].prompt_ids):
            yield sse(body)
        async with contextlib.aclosing(_merged(streams)) as moves:
            async for i, item in moves:
                if isinstance(item, APIError):
                    yield sse(item.body())
                    yield sse("[DONE]")
                    return
                outputs[i] = item
                for body in builders[i].chunks(item):
                    yield sse(body)
        if inp.include_usage:
            yield sse(builders[0].usage_chunk(sum(s.num_prompt_tokens for s in streams),
                                              sum(_num_output_tokens(out) for out in outputs),
                                              cached_tokens(inp, outputs)))
        yield sse("[DONE]")
    finally:
        # CancelledError (client gone) or GeneratorExit lands here too
        _close_all(state, streams, access)


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


def _close_all(state: ServerState, streams: list[RequestStream], access: AccessRecord | None = None) -> None:
    """Close every prompt's request; the access line gets their summed token counts."""
    for stream in streams:
        _close(state, stream)
    if access is not None and streams:
        access.prompt_tokens = sum(s.num_prompt_tokens for s in streams)
        access.output_tokens = sum(_num_output_tokens(s.output) for s in streams)


def _close(state: ServerState, stream: RequestStream) -> None:
    """Once per request: abort it if it did not finish (its blocks are freed at once), record metrics."""
    if stream.closed:
        return
    stream.closed = True
    if not stream.finished:
        state.engine.abort(stream.request_id)
    output = stream.output
    num_output_tokens = _num_output_tokens(output)
    if stream.finished and stream.error is None:
        reason = output.outputs[0].finish_reason or "stop"
    else:
        reason = "error" if stream.error is not None else "abort"
    state.metrics.observe(stream, num_output_tokens, reason, time.monotonic())
