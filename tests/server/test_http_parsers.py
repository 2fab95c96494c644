"""Both HTTP parsers kvfit serves with (httptools where installed, h11 otherwise) keep the head guard: a head
that stalls is closed after --header-timeout, a head past 16 KiB is a 431, while a response that streams for
longer than the head timeout and a keep-alive connection idle between requests are left alone."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from server_testing import answer_lifespan, bare_uvicorn

from kvfit.errors import ConfigError
from kvfit.server.launch import ConnectionLimits, HttpToolsProtocol, http_protocol

HEAD_TIMEOUT_S = 0.5
PARSERS = ["h11"] + (["httptools"] if HttpToolsProtocol is not None else [])


async def _app(scope, receive, send):
    if await answer_lifespan(scope, receive, send):
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"transfer-encoding", b"chunked")]})
    if scope["path"] == "/slow":           # streams for 3 head timeouts
        for _ in range(6):
            await send({"type": "http.response.body", "body": b"x", "more_body": True})
            await asyncio.sleep(HEAD_TIMEOUT_S / 2)
    await send({"type": "http.response.body", "body": b"ok", "more_body": False})


def _server(parser: str):
    return bare_uvicorn(_app, ConnectionLimits(max_connections=16, header_timeout_s=HEAD_TIMEOUT_S, http_parser=parser))


def _read_response(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"0\r\n\r\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


@pytest.mark.parametrize("parser", PARSERS)
def test_the_head_guard_holds_for_each_parser(parser):
    with _server(parser) as address:
        with socket.create_connection(address, timeout=5) as conn:       # a head that stalls is closed
            conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
            start = time.monotonic()
            assert conn.recv(100) == b""
            assert time.monotonic() - start < 4 * HEAD_TIMEOUT_S
        with socket.create_connection(address, timeout=5) as conn:       # an oversized head is a 431
            conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 17 * 1024 + b"\r\n\r\n")
            assert conn.recv(100).startswith(b"HTTP/1.1 431")
        with socket.create_connection(address, timeout=10) as conn:
            conn.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")        # streams past the head timeout
            assert _read_response(conn).endswith(b"ok\r\n0\r\n\r\n")
            time.sleep(3 * HEAD_TIMEOUT_S)                                # idle between requests: keep-alive's
            conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert b"ok" in _read_response(conn)


def test_an_unknown_or_missing_parser_is_refused():
    with pytest.raises(ConfigError, match="auto, httptools or h11"):
        ConnectionLimits(http_parser="picohttp")
    assert http_protocol("h11").__name__ == "_H11HeadGuard"
    if HttpToolsProtocol is None:
        with pytest.raises(ConfigError, match="pip install httptools"):
            http_protocol("httptools")


@pytest.mark.parametrize("parser", PARSERS)
def test_a_large_head_pipelined_behind_a_request_is_a_431(parser):
    """The head is counted as the parser reads it, not per socket read: 40 KB of head in the same write as a small
    request before it is refused (a per-read count starts at the first request and misses it)."""
    with _server(parser) as address:
        with socket.create_connection(address, timeout=5) as conn:
            conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
                         b"GET / HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 40_000 + b"\r\n\r\n")
            data = b""
            while chunk := conn.recv(65536):
                data += chunk
            assert b"HTTP/1.1 431" in data and data.count(b"HTTP/1.1 200") <= 1


@pytest.mark.parametrize("parser", PARSERS)
def test_a_refused_head_is_answered_before_the_close_however_much_more_comes(parser):
    """A lingering close: after the 431 the server reads and drops what the client still sends, then closes, so
    the client reads the 431 and an orderly end (closing with its bytes unread would reset the connection, and a
    reset can overtake the answer). Past LINGER_BYTES the connection is closed, whatever it costs the client."""
    with _server(parser) as address:
        with socket.create_connection(address, timeout=10) as conn:
            conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 17 * 1024)
            time.sleep(0.2)                                  # refused by now, with these bytes still coming
            for _ in range(20):
                conn.sendall(b"a" * 16 * 1024)
            conn.shutdown(socket.SHUT_WR)
            data = b""
            while chunk := conn.recv(65536):                 # a reset here would be a ConnectionResetError
                data += chunk
            assert data.startswith(b"HTTP/1.1 431"), data[:200]
        with socket.create_connection(address, timeout=10) as conn:
            conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 17 * 1024)
            assert conn.recv(100).startswith(b"HTTP/1.1 431")
            start = time.monotonic()
            # the server closes past LINGER_BYTES: a reset or a broken pipe, not a send left blocked (a timeout)
            # by a server that stopped reading without closing (how much the kernels' buffers hold varies)
            with pytest.raises(OSError) as err:
                while time.monotonic() - start < 10:
                    conn.sendall(b"a" * 65536)
            assert not isinstance(err.value, TimeoutError), err.value


@pytest.mark.parametrize("parser", PARSERS)
def test_a_large_head_behind_a_streaming_response_closes_without_an_app_error(parser):
    """A head past 16 KiB sent while the previous response still streams: the connection closes (no lingering
    half-close under a live stream), and the streaming app sees no failed write."""
    errors = []

    async def app(scope, receive, send):
        try:
            await _app(scope, receive, send)
        except Exception as exc:             # what uvicorn would log as "Exception in ASGI application"
            errors.append(exc)
            raise
    with bare_uvicorn(app, ConnectionLimits(max_connections=16, header_timeout_s=HEAD_TIMEOUT_S,
                                            http_parser=parser)) as address:
        with socket.create_connection(address, timeout=10) as conn:
            conn.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
            conn.recv(1000)
            conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 17 * 1024 + b"\r\n\r\n")
            while conn.recv(65536):
                pass
            time.sleep(4 * HEAD_TIMEOUT_S)           # the stream would have written its remaining chunks by now
    assert errors == []
