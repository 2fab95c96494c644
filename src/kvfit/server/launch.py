"""Run an app under uvicorn on a socket bound here, with a graceful SIGTERM/SIGINT shutdown.

Also the start-up safety: the API key (flag, file or KVFIT_API_KEY, checked once), the warnings
printed at start-up, the guards middleware, and uvicorn's connection limits and timeouts.

On a signal: the engine refuses new requests and ends running ones (their streams get an error
event and [DONE]), uvicorn stops accepting and drains connections, the lifespan joins the engine
thread, and the process exits 0.

When the engine dies (a tensor-parallel rank, the engine thread, a step it cannot recover from), the
server stops by itself, as vLLM's API server does on EngineDeadError: the responses in flight get
their error, then uvicorn shuts down and `kvfit serve` exits 1 (see GracefulServer.on_tick).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:       # httptools not installed: h11 serves
    HttpToolsProtocol = None

from kvfit.errors import ConfigError
from kvfit.server.guards import GuardMiddleware, HeadSizeCounter, head_too_large_response, is_loopback_host
from kvfit.server.limits import (API_KEY_ENV, DEFAULT_BODY_TIMEOUT_SECONDS, DEFAULT_HEADER_TIMEOUT_SECONDS,
                                 DEFAULT_KEEP_ALIVE_SECONDS, DEFAULT_MAX_CONNECTIONS, LINGER_BYTES,
                                 LINGER_SECONDS, MAX_HEADER_BYTES, RESERVED_FDS, VLLM_API_KEY_ENV)
from kvfit.server.logs import AccessLogMiddleware
from kvfit.server.start_gate import StartGate

GRACEFUL_SHUTDOWN_SECONDS = 10
# after the engine is found dead, how long in-flight responses get to write their 503/500 before
# uvicorn stops (its graceful shutdown then gives each connection GRACEFUL_SHUTDOWN_SECONDS more)
DEAD_ENGINE_GRACE_SECONDS = 2.0

logger = logging.getLogger("kvfit")


# start-up safety --------------------------------------------------------------------------------
def resolve_api_key(api_key: str | None, api_key_file: str | None,
                    environ: Mapping[str, str] = os.environ) -> str | None:
    """The API key from --api-key, --api-key-file (read once, here), $KVFIT_API_KEY or $VLLM_API_KEY, in that order;
    None when none is given. A ConfigError when both flags are given, the file cannot be read, or the
    key is empty or not printable ASCII (a header could never carry it, so no request would match)."""
    if api_key is not None and api_key_file is not None:
        raise ConfigError("give --api-key or --api-key-file, not both")
    if api_key_file is not None:
        try:
            key, source = Path(api_key_file).read_text(encoding="utf-8").strip(), f"--api-key-file {api_key_file}"
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ConfigError(f"cannot read --api-key-file {api_key_file}: {reason}") from None
    elif api_key is not None:
        key, source = api_key.strip(), "--api-key"
    elif API_KEY_ENV in environ:
        key, source = environ[API_KEY_ENV].strip(), f"${API_KEY_ENV}"
    elif VLLM_API_KEY_ENV in environ:      # vLLM's variable: a deployment that sets it is not left open
        key, source = environ[VLLM_API_KEY_ENV].strip(), f"${VLLM_API_KEY_ENV}"
    else:
        return None
    if not key:
        raise ConfigError(f"the API key from {source} is empty; give a non-empty key")
    bad = next((i for i, c in enumerate(key) if not "!" <= c <= "~"), None)
    if bad is not None:
        raise ConfigError(f"the API key from {source} has a character outside printable ASCII (position {bad}); "
                          "clients send it in an HTTP header, so use letters, digits and punctuation only")
    return key


def startup_warnings(host: str, api_key: str | None, key_on_command_line: bool,
                     any_origin: bool = False) -> list[str]:
    """One line per unsafe choice, for `kvfit serve` to print before it listens. any_origin: CORS lets every
    web origin in (--allowed-origins with "*", vLLM's default), so a web page in a browser can use /v1 too."""
    warnings = []
    if api_key is None:
        reach = "this machine" if is_loopback_host(host) else f"the network at {host}"
        pages = " (and, as --allowed-origins has \"*\", any web page open in a browser that reaches it)" \
            if any_origin else ""
        warnings.append(f"warning: no API key is set, so any program on {reach}{pages} can use /v1; set "
                        f"${API_KEY_ENV} or --api-key-file")
    elif key_on_command_line:
        warnings.append(f"warning: --api-key is visible to other users (ps, /proc); prefer --api-key-file "
                        f"or ${API_KEY_ENV}")
    return warnings


@dataclass(frozen=True)
class GuardOptions:
    """What GuardMiddleware enforces; validated when built, so `kvfit serve` fails before loading.

    host: the bind address (a loopback one turns the Host check on); api_key: resolved by
    resolve_api_key; metrics_require_key: /metrics wants the key too."""

    host: str
    api_key: str | None = None
    metrics_require_key: bool = False
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_SECONDS

    def __post_init__(self):
        if self.metrics_require_key and self.api_key is None:
            raise ConfigError(f"--metrics-require-key needs an API key (--api-key-file, ${API_KEY_ENV} or --api-key)")
        if not 0 < self.body_timeout_s < float("inf"):
            raise ConfigError(f"--body-timeout must be a positive number of seconds, got {self.body_timeout_s}")


def install_guards(app, options: GuardOptions) -> None:
    """Add GuardMiddleware to app (before it starts)."""
    app.add_middleware(GuardMiddleware, check_host=is_loopback_host(options.host),
                       metrics_api_key=options.api_key if options.metrics_require_key else None,
                       body_timeout_s=options.body_timeout_s)


# uvicorn ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConnectionLimits:
    """What one client's connections may hold: see limits.py for the defaults' reasons."""

    max_connections: int | None = DEFAULT_MAX_CONNECTIONS     # None: fd_connection_limit()
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_SECONDS
    keep_alive_s: int = DEFAULT_KEEP_ALIVE_SECONDS
    http_parser: str = "auto"       # "auto": httptools where installed, else h11 (see http_protocol)
    event_loop: str = "auto"        # "auto": uvloop where installed, else asyncio (see event_loop_name)

    def __post_init__(self):
        if self.max_connections is not None and self.max_connections < 1:
            raise ConfigError(f"--max-connections must be >= 1, got {self.max_connections}")
        if not 0 < self.header_timeout_s < float("inf"):
            raise ConfigError(f"--header-timeout must be a positive number of seconds, got {self.header_timeout_s}")
        if self.http_parser not in ("auto", "httptools", "h11"):
            raise ConfigError(f"the HTTP parser must be auto, httptools or h11, got {self.http_parser!r}")
        if self.event_loop not in ("auto", "uvloop", "asyncio"):
            raise ConfigError(f"the event loop must be auto, uvloop or asyncio, got {self.event_loop!r}")

    def connection_cap(self) -> int:
        """The cap uvicorn enforces: the flag's, else what the file descriptor limit leaves."""
        return self.max_connections if self.max_connections is not None else fd_connection_limit()


def fd_connection_limit() -> int:
    """Raise this process's open-file soft limit to its hard limit (each connection is a descriptor);
    the connections that leaves room for, after RESERVED_FDS for everything else."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
            except (ValueError, OSError):
                pass
    except ImportError:                # not on a POSIX system
        return 4096
    return max(soft - RESERVED_FDS, 64)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket; port 0 picks a free one (read it back with getsockname)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on connections whose socket says TCP.
    # Without it, Nagle held each response's body (uvicorn writes head and body apart) until the
    # client's delayed ACK of the head, ~40 ms on every keep-alive request and stream chunk.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}; pick another --port or --host") from None
    sock.listen(4096)           # a burst of thousands of connections waits in the backlog, not refused
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class GracefulServer(uvicorn.Server):
    """uvicorn.Server whose signal handling also ends the engine's requests, and which stops by
    itself DEAD_ENGINE_GRACE_SECONDS after dead_reason() first names why the engine cannot serve."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None],
                 dead_reason: Callable[[], str | None] | None = None,
                 dead_grace_s: float = DEAD_ENGINE_GRACE_SECONDS):
        super().__init__(config)
        self._on_exit = on_exit
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead_reason = dead_reason
        self._dead_grace_s = dead_grace_s
        self._dead_since: float | None = None

    async def on_tick(self, counter: int) -> bool:
        # uvicorn's main loop calls this every 0.1 s; True ends the loop and starts the shutdown
        if await super().on_tick(counter):
            return True
        if self._dead_reason is None:
            return False
        now = time.monotonic()
        if self._dead_since is None:
            reason = self._dead_reason()
            if reason is None:
                return False
            self._dead_since = now
            logger.error("the engine stopped (%s); shutting the server down in %.1f s", reason, self._dead_grace_s)
        return now - self._dead_since >= self._dead_grace_s

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        if self._loop is not None:       # runs on the loop, not inside the signal handler
            self._loop.call_soon_threadsafe(self._on_exit)

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn re-raises a caught signal once it has shut down, which ends the process with the
        # signal's status; a drained shutdown is a clean exit here, so restore handlers and return
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


class _HeadGuard:
    """Mixed into uvicorn's HTTP protocols: a deadline on each request head, so a connection that has not sent
    a complete head within head_timeout_s of connecting (or of starting a new request after a response) is
    closed (uvicorn has no such timeout: its keep-alive timer stops at the first byte), and a head past
    MAX_HEADER_BYTES is a 431 however it arrives (h11's own cap holds only for a head still incomplete;
    httptools has none). The protocol says when it awaits a head (_awaiting_head).

    A refused head gets a lingering close: the 431, a half-close, then what the client still sends is read and
    dropped (up to LINGER_BYTES, for LINGER_SECONDS) before the connection closes. Closing with the client's bytes
    unread makes TCP reset the connection, and a reset can overtake the 431 on the wire (nginx's lingering_close)."""

    head_timeout_s: float = DEFAULT_HEADER_TIMEOUT_SECONDS      # set per server by uvicorn_config
    _lingering: int | None = None                               # bytes dropped since the refusal; None: not refused
    _linger_timer = None

    def _awaiting_head(self) -> bool:
        raise NotImplementedError

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)
        self._head_size = HeadSizeCounter()

    def data_received(self, data: bytes) -> None:
        if self._lingering is not None:                              # refused: drop it
            self._lingering += len(data)
            if self._lingering > LINGER_BYTES:
                self.transport.close()
            return
        if self._head_timer is None and self._awaiting_head():      # a new request begins
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)
            self._head_size.reset()
        if self._awaiting_head() and self._head_size.feed(data) > MAX_HEADER_BYTES:
            self._refuse_head()
            return
        super().data_received(data)
        if self._head_timer is not None and not self._awaiting_head():   # its head is complete
            self._cancel_head_timer()

    def connection_lost(self, exc) -> None:
        self._cancel_head_timer()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        super().connection_lost(exc)

    def _refuse_head(self) -> None:
        """The 431 for a head past MAX_HEADER_BYTES, then the lingering close (the class docstring). Behind a
        response still streaming on this connection (a head pipelined after its request) the connection closes
        at once instead: a half-close would make the stream's next write fail in the app."""
        self._cancel_head_timer()
        self.transport.write(head_too_large_response(MAX_HEADER_BYTES))
        cycle = getattr(self, "cycle", None)
        if cycle is not None and not cycle.response_complete:
            self.transport.close()
            return
        self._unset_keepalive_if_required()          # uvicorn's keep-alive timer would cut the linger short
        self._lingering = 0
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.transport.resume_reading()               # reads paused by flow control would drop nothing
        self._linger_timer = self.loop.call_later(LINGER_SECONDS, self.transport.close)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a head its parser refused: a 431 where the guard refused it for its size."""
        if getattr(self, "_head_too_large", False):
            self._refuse_head()
            return
        super().send_400_response(msg)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._awaiting_head() and not self.transport.is_closing():
            logger.debug("closing a connection from %s: no complete request head within %s s",
                         self.client and self.client[0], self.head_timeout_s)
            self.transport.close()


class _H11HeadGuard(_HeadGuard, H11Protocol):
    """uvicorn's pure-Python h11 protocol with the head guard (where httptools is not installed)."""

    def _awaiting_head(self) -> bool:
        return self.conn.their_state is h11.IDLE

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        # each parsed request's head measured as h11 hands it over, whatever reads it came in (a head pipelined
        # behind another request in one read escapes the per-read count)
        parse = self.conn.next_event

        def next_event():
            event = parse()
            if isinstance(event, h11.Request) and (
                    len(event.target) + sum(len(k) + len(v) + 4 for k, v in event.headers) > MAX_HEADER_BYTES):
                self._head_too_large = True
                raise h11.RemoteProtocolError("request head too large", error_status_hint=431)
            return event
        self.conn.next_event = next_event


if HttpToolsProtocol is not None:
    class _HttpToolsHeadGuard(_HeadGuard, HttpToolsProtocol):
        """uvicorn's httptools (llhttp, in C) protocol with the head guard: vLLM's default parser, a third of
        the front-end's time per streamed token in h11 (benchmarks/profile_frontend.py)."""

        def connection_made(self, transport) -> None:
            self._head_pending = True
            super().connection_made(transport)

        def _awaiting_head(self) -> bool:
            return self._head_pending

        def on_headers_complete(self) -> None:
            self._head_pending = False
            self._cancel_head_timer()       # before the response streams: the deadline is the head's alone
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._head_pending = True       # the next bytes begin the next request's head

        # the head's size as the parser sees it, whatever reads it came in (as _H11HeadGuard.connection_made)
        def on_message_begin(self) -> None:
            self._parsed_head_bytes = 0
            super().on_message_begin()

        def on_url(self, url: bytes) -> None:
            self._count_head(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count_head(len(name) + len(value) + 4)          # "name: value\r\n"
            super().on_header(name, value)

        def _count_head(self, num_bytes: int) -> None:
            self._parsed_head_bytes += num_bytes
            if self._parsed_head_bytes > MAX_HEADER_BYTES:
                self._head_too_large = True
                raise _HeadTooLarge()       # the parser stops; uvicorn answers its error (send_400_response)


class _HeadTooLarge(Exception):
    """Raised inside httptools' parser callbacks to stop a head past MAX_HEADER_BYTES."""


def http_protocol(prefer: str = "auto") -> type:
    """The guarded HTTP protocol class: httptools where it is installed (prefer "auto" or "httptools"), else
    h11 (or prefer "h11")."""
    if prefer == "httptools" and HttpToolsProtocol is None:
        raise ConfigError("the httptools HTTP parser is not installed; pip install httptools, or use h11")
    return _H11HeadGuard if prefer == "h11" or HttpToolsProtocol is None else _HttpToolsHeadGuard


def event_loop_name(prefer: str = "auto") -> str:
    """uvloop (libuv, vLLM's default) where it is installed (prefer "auto" or "uvloop"), else asyncio's own loop."""
    installed = importlib.util.find_spec("uvloop") is not None
    if prefer == "uvloop" and not installed:
        raise ConfigError("the uvloop event loop is not installed; pip install uvloop, or use asyncio")
    return "uvloop" if prefer != "asyncio" and installed else "asyncio"


def uvicorn_config(app, limits: ConnectionLimits = ConnectionLimits(), log_level: str = "info",
                   graceful_shutdown_s: int = GRACEFUL_SHUTDOWN_SECONDS) -> uvicorn.Config:
    """uvicorn's settings for kvfit: httptools (else h11) with a head timeout, uvloop (else asyncio),
    limit_concurrency as the connection cap (past it, requests get 503), the keep-alive timeout and
    the head size cap. Requests start a few per loop pass (StartGate: a burst does not hold the loop).
    kvfit's access log (AccessLogMiddleware, outermost) replaces uvicorn's, and
    uvicorn's loggers are left unconfigured so they log in kvfit's format (logs.configure_logging)."""
    base = http_protocol(limits.http_parser)
    protocol = type("HeadTimeoutProtocol", (base,), {"head_timeout_s": limits.header_timeout_s})
    return uvicorn.Config(AccessLogMiddleware(StartGate(app)), http=protocol, loop=event_loop_name(limits.event_loop),
                          log_level=log_level, log_config=None, access_log=False, lifespan="on",
                          timeout_graceful_shutdown=graceful_shutdown_s, limit_concurrency=limits.connection_cap(),
                          timeout_keep_alive=limits.keep_alive_s, h11_max_incomplete_event_size=MAX_HEADER_BYTES)


def serve(app, sock: socket.socket, on_exit: Callable[[], None], log_level: str = "info",
          limits: ConnectionLimits = ConnectionLimits(),
          dead_reason: Callable[[], str | None] | None = None) -> None:
    """Serve app on sock until a signal, should_exit, or (given dead_reason) the engine is dead;
    returns after the lifespan shut down."""
    GracefulServer(uvicorn_config(app, limits, log_level), on_exit, dead_reason).run(sockets=[sock])
