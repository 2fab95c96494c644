"""Run an app under uvicorn on a socket bound here, with a graceful SIGTERM/SIGINT shutdown.

On a signal: the engine refuses new requests and ends running ones (their streams get an error
event and [DONE]), uvicorn stops accepting and drains connections, the lifespan joins the engine
thread, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
from typing import Callable

import uvicorn

GRACEFUL_SHUTDOWN_SECONDS = 10


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket; port 0 picks a free one (read it back with getsockname)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        from kvfit.errors import ConfigError
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}; pick another --port or --host") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class GracefulServer(uvicorn.Server):
    """uvicorn.Server whose signal handling also ends the engine's requests, and exits 0."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]):
        super().__init__(config)
        self._on_exit = on_exit
        self._loop: asyncio.AbstractEventLoop | None = None

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


def serve(app, sock: socket.socket, on_exit: Callable[[], None], log_level: str = "info") -> None:
    """Serve app on sock until a signal (or should_exit); returns after the lifespan shut down."""
    config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS)
    GracefulServer(config, on_exit).run(sockets=[sock])
