"""`kvfit serve MODEL`: an OpenAI-compatible HTTP server (completions, chat, models, health, metrics)."""

from __future__ import annotations

import logging
import sys

from kvfit.errors import ConfigError

WAITING_REQUESTS_PER_SEQ = 16     # the default --max-waiting-requests is this many per batch slot
# Served decode rounds are one step by default (--num-scheduler-steps given explicitly keeps its rounds): a
# request that arrives while a K-step round is on the device waits for it before its prefill, and since steps
# with prefill chunks run as CUDA graphs, one-step rounds cost no throughput. On an H100 (2026-12-07, same lease,
# benchmarks/results/2026-12-07-h100-serve-mixed-graphs-*): qwen3-0.6b, 512 at once, 22,629 tok/s against 21,702
# with rounds of 8 from a quarter of --max-num-seqs running (ITL p50 8.7 against 23.6 ms); llama-3.1-8b at
# 27 req/s, TTFT p50 58.6 against 125.6 ms (vllm serve: 58.5), the same throughput.
SERVED_SCHEDULER_STEPS = 1


def register(sub) -> None:
    from kvfit.commands.flags import (add_engine_flags, add_model_argument, add_vllm_frontend_flags,
                                      add_vllm_server_flags, refuse)
    # the server's defaults, without importing fastapi for every other subcommand
    from kvfit.server.limits import (API_KEY_ENV, DEFAULT_BODY_TIMEOUT_SECONDS, DEFAULT_HEADER_TIMEOUT_SECONDS,
                                     BODY_BYTES_PER_TOKEN, MIN_MAX_BODY_BYTES, DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_WAITING_REQUESTS)
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_model_argument(p, "a catalog name with --load-format dummy")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0 = any free port)")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1/* (/health stays open); visible in `ps`: "
                        f"prefer --api-key-file or ${API_KEY_ENV} (default: none, no key)")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help=f"read the API key from this file, once at start-up (default: ${API_KEY_ENV}, if set)")
    p.add_argument("--metrics-require-key", action="store_true",
                   help="require the API key on /metrics too (default: open, prefix-cache figures coarsened)")
    p.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                   help="open connections; past it requests get 503 (default: as many as the open-file limit "
                        "allows, raised to its hard limit at start-up; requests past --max-waiting-requests get 429)")
    p.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_SECONDS, metavar="SECONDS",
                   help="a connection must send a complete request head within this (default "
                        f"{DEFAULT_HEADER_TIMEOUT_SECONDS} s), else it is closed")
    p.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_SECONDS, metavar="SECONDS",
                   help=f"a request body must arrive within this (default {DEFAULT_BODY_TIMEOUT_SECONDS} s), "
                        "else 408")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model names clients may send; the first is the one responses report (default: MODEL)")
    p.add_argument("--chat-template", default=None, metavar="PATH_OR_TEMPLATE",
                   help="the chat template: a .jinja file or the template text (default: the model's own)")
    p.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                   help=f"requests (an n > 1 request counts n) allowed to wait for the batch; beyond it new ones get "
                        f"429 (default: {WAITING_REQUESTS_PER_SEQ} x --max-num-seqs, so a burst of thousands of "
                        "streams is queued)")
    p.add_argument("--max-request-body-bytes", type=int, default=None,
                   help=f"larger request bodies get 413 (default: {BODY_BYTES_PER_TOKEN} bytes a token of "
                        f"--max-model-len, at least {MIN_MAX_BODY_BYTES >> 20} MiB)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="the server's log level (kvfit and uvicorn; info: an access line per request and a stats "
                        "line every 10 s while busy)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="parse tool calls out of the output of tool_choice auto requests (the default when tools "
                        "are given) with --tool-call-parser (default: off; auto is then a 400)")
    p.add_argument("--tool-call-parser", default=None, choices=("hermes", "llama3_json", "mistral"),
                   help="the tool-call format of the model: hermes (Qwen), llama3_json, mistral (default: none)")
    add_vllm_server_flags(p)
    add_vllm_frontend_flags(p)
    refuse(p, "--response-role", "chat replies always have the role assistant", ("assistant",))
    refuse(p, "--root-path", "the routes are served at the root (/v1, /health); put kvfit behind a proxy that "
           "strips the prefix")
    add_engine_flags(p)
    p.set_defaults(run=run)


def _check_args(args) -> None:
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
        raise ConfigError(f"--max-waiting-requests must be >= 0, got {args.max_waiting_requests}")
    if args.max_request_body_bytes is not None and args.max_request_body_bytes < 1024:
        raise ConfigError(f"--max-request-body-bytes must be >= 1024, got {args.max_request_body_bytes}")


def frontend_options(args):
    """FrontendOptions (server/frontend.py) from vLLM's front-end flags of the same names."""
    from dataclasses import fields
    from kvfit.server.frontend import FrontendOptions
    return FrontendOptions(**{f.name: getattr(args, f.name) for f in fields(FrontendOptions)})


def with_served_steps(settings: dict) -> dict:
    """The engine settings of kvfit serve: --num-scheduler-steps as given, else SERVED_SCHEDULER_STEPS."""
    if settings.get("num_scheduler_steps") is None:
        return {**settings, "num_scheduler_steps": SERVED_SCHEDULER_STEPS}
    return settings


def build_engine(config):
    """The engine core process's factory (picklable): the LLMEngine, with the slow-start notices."""
    from kvfit.commands.common import engine_startup
    from kvfit.engine.llm_engine import LLMEngine
    with engine_startup(config):
        return LLMEngine(config)


def run(args) -> int:
    import functools
    import os
    from kvfit.commands.flags import apply_server_log_flags, engine_kwargs
    from kvfit.server.logs import STATS_INTERVAL_SECONDS, configure_logging
    _check_args(args)
    from kvfit.server.tools import ToolOptions
    tool_options = ToolOptions(args.enable_auto_tool_choice, args.tool_call_parser)   # before loading
    frontend = frontend_options(args)
    from kvfit.config import EngineConfig
    from kvfit.text.chat_template import load_chat_template
    from kvfit.text.tokenizer import load_tokenizer
    from kvfit.server.app import create_app
    from kvfit.server.core_process import EngineCoreClient
    from kvfit.server.gc_tuning import tune_gc_after_startup
    from kvfit.server.launch import (ConnectionLimits, GuardOptions, bind_socket, install_guards, resolve_api_key,
                                     serve, startup_warnings, url_of)
    settings = engine_kwargs(args)
    names = settings.pop("served_model_name", None) or [args.model]      # the first is the reported one
    settings = with_served_steps(settings)
    config = EngineConfig.from_kwargs(args.model, served_model_name=names[0], **settings)   # a missing model first
    chat_template = load_chat_template(args.chat_template) if args.chat_template is not None else None
    api_key = resolve_api_key(args.api_key, args.api_key_file)     # before loading: a bad key fails fast
    guards = GuardOptions(args.host, api_key, args.metrics_require_key, args.body_timeout)
    limits = ConnectionLimits(args.max_connections, args.header_timeout)
    max_waiting_requests = (args.max_waiting_requests if args.max_waiting_requests is not None
                            else WAITING_REQUESTS_PER_SEQ * config.scheduler.max_num_seqs)
    sock = bind_socket(args.host, args.port)     # before loading: a taken port fails fast
    configure_logging(args.log_level)            # once the flags are good: a mistake stays one error line
    apply_server_log_flags(args)                 # vLLM's --disable-log-requests
    folder = config.model.model if os.path.isdir(config.model.model) else None
    try:
        # the engine runs in its own process (server/core_process.py); this one serves HTTP
        engine = EngineCoreClient.launch(functools.partial(build_engine, config),
                                         tokenizer=load_tokenizer(folder) if folder is not None else None,
                                         generation_config=config.model.generation_config, model_folder=folder,
                                         max_waiting_requests=max_waiting_requests, log_level=args.log_level)
        try:
            name = names[0]
            app = create_app(engine, names, api_key=api_key, chat_template=chat_template,
                             max_body_bytes=args.max_request_body_bytes,
                             metrics_require_key=args.metrics_require_key, tool_options=tool_options,
                             stats_interval_s=0 if args.vllm_disable_log_stats else STATS_INTERVAL_SECONDS,
                             frontend=frontend)
            install_guards(app, guards)
            for line in startup_warnings(args.host, api_key, key_on_command_line=args.api_key is not None,
                                         any_origin="*" in frontend.allowed_origins):
                logging.getLogger("kvfit").warning(line.removeprefix("warning: "))    # the log's one format
            # the capacity line is the engine core's, in the log (once); stdout: the URL, then "stopped"
            print(f"kvfit serve: model '{name}' listening on {url_of(sock)} (OpenAI API under /v1)", flush=True)
            tune_gc_after_startup("HTTP front-end")
            serve(app, sock, engine.begin_shutdown, log_level=args.uvicorn_log_level or args.log_level,
                  limits=limits, dead_reason=engine.check_dead)     # a dead engine ends the server: exit 1
            dead_reason = engine.check_dead()
        finally:
            engine.stop()
    finally:
        sock.close()
    print("kvfit serve: stopped", flush=True)
    if dead_reason is not None:     # a supervisor should restart it: not a clean exit
        print(f"error: the engine stopped while serving ({dead_reason})", file=sys.stderr, flush=True)
        return 1
    return 0
