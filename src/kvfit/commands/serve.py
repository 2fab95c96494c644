"""`kvfit serve MODEL`: an OpenAI-compatible HTTP server (completions, chat, models, health, metrics)."""

from __future__ import annotations

from kvfit.errors import ConfigError


def register(sub) -> None:
    from kvfit.commands.flags import add_engine_flags
    # the server's defaults, without importing fastapi for every other subcommand
    from kvfit.server.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_WAITING_REQUESTS
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("model", metavar="MODEL", help="model folder (or a catalog name with --load-format dummy)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0 = any free port)")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1/* (/health and /metrics stay open)")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: MODEL)")
    p.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                   help="requests allowed to wait for the batch; beyond it new ones get 429")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get 413 (default 1 MiB)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level")
    add_engine_flags(p)
    p.set_defaults(run=run)


def _check_args(args) -> None:
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_waiting_requests < 0:
        raise ConfigError(f"--max-waiting-requests must be >= 0, got {args.max_waiting_requests}")
    if args.max_request_body_bytes < 1024:
        raise ConfigError(f"--max-request-body-bytes must be >= 1024, got {args.max_request_body_bytes}")
    if args.api_key is not None and not args.api_key.strip():
        raise ConfigError("--api-key must not be empty")


def run(args) -> int:
    from kvfit.commands.flags import engine_kwargs
    from kvfit.commands.common import setup_logging
    _check_args(args)
    setup_logging()
    from kvfit.config import EngineConfig
    from kvfit.engine.llm_engine import LLMEngine
    from kvfit.server.app import create_app
    from kvfit.server.launch import bind_socket, serve, url_of
    config = EngineConfig.from_kwargs(args.model, **engine_kwargs(args))
    sock = bind_socket(args.host, args.port)     # before loading: a taken port fails fast
    try:
        engine = LLMEngine(config)
        try:
            name = config.model.served_model_name or args.model
            app = create_app(engine, name, api_key=args.api_key, max_waiting_requests=args.max_waiting_requests,
                             max_body_bytes=args.max_request_body_bytes)
            print(f"capacity: {engine.plan.log_line()}", flush=True)
            print(f"kvfit serve: model '{name}' listening on {url_of(sock)} (OpenAI API under /v1)", flush=True)
            serve(app, sock, app.state.kvfit.engine.begin_shutdown, log_level=args.log_level)
        finally:
            engine.shutdown()
    finally:
        sock.close()
    print("kvfit serve: stopped", flush=True)
    return 0
