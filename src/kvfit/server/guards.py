"""ASGI middleware in front of the app: refuses hostile requests before a handler runs.

GuardMiddleware, outermost inside Starlette's error middleware, checks in this order:
- Host: on a loopback bind, a Host that is not a loopback name is a 403 (a browser page whose
  domain was rebound to 127.0.0.1 sends its own name, so it cannot reach the API);
- /metrics: with a metrics key, the bearer key is required (401), but not on a CORS preflight (OPTIONS);
- Content-Type: a POST must say application/json (415), as the bodies are parsed as JSON;
- the body must arrive within body_timeout_s of the request's headers (408, connection closed);
- a client that goes away while sending its body is one debug line, not a traceback.
Every refusal is OpenAI's error JSON. The middleware holds no state between requests.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import re

from starlette.requests import ClientDisconnect

from kvfit.server.limits import DEFAULT_BODY_TIMEOUT_SECONDS, PUBLIC_MIN_PREFIX_CACHE_QUERY_TOKENS
from kvfit.server.protocol import error_body

logger = logging.getLogger("kvfit")

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def is_loopback_host(host: str) -> bool:
    """Whether a bind address or a Host name is this machine only (localhost, 127.0.0.0/8, ::1)."""
    host = host.strip().lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(host_header: str) -> str:
    """The name of a Host header, without its port: 'a:80' -> 'a', '[::1]:80' -> '::1'."""
    if host_header.startswith("["):
        return host_header[1:].partition("]")[0]
    return host_header.rpartition(":")[0] if host_header.count(":") == 1 else host_header


def bearer_matches(authorization: bytes, api_key: str) -> bool:
    """Whether an Authorization header value is `Bearer <api_key>` (constant-time comparison)."""
    scheme, _, token = authorization.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), api_key.encode("ascii"))


def public_prefix_cache_hit_rate(num_hit_tokens: int, num_query_tokens: int) -> float:
    """The hit rate an open /metrics may show: 0 until PUBLIC_MIN_PREFIX_CACHE_QUERY_TOKENS prompt
    tokens were looked up, then rounded to 0.1, so one request's hit or miss rarely moves it."""
    if num_query_tokens < PUBLIC_MIN_PREFIX_CACHE_QUERY_TOKENS:
        return 0.0
    return round(num_hit_tokens / num_query_tokens, 1)


class _BodyTimeout(Exception):
    pass


_HEAD_END = re.compile(rb"\r?\n\r?\n")


class HeadSizeCounter:
    """The bytes of one request head as they arrive, up to its blank line, whether the head comes in pieces or
    in one write: h11's own cap (h11_max_incomplete_event_size) holds only while a head is incomplete, so a
    17 KB head sent whole went through. feed() each chunk received while the head is not complete; reset()
    when a new request begins."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.num_bytes, self.complete, self._tail = 0, False, b""

    def feed(self, data: bytes) -> int:
        """Count data; the head's bytes so far (its full size once its blank line has arrived)."""
        if self.complete:
            return self.num_bytes
        if self.num_bytes == 0:
            stripped = data.lstrip(b"\r\n")       # blank lines before a request line are no head end
            self.num_bytes, data = len(data) - len(stripped), stripped
        window = self._tail + data
        end = _HEAD_END.search(window)
        if end is None:
            self.num_bytes += len(data)
            self._tail = window[-3:]
        else:
            self.num_bytes += end.end() - len(self._tail)
            self.complete = True
        return self.num_bytes


def head_too_large_response(limit_bytes: int) -> bytes:
    """A raw HTTP 431 (the connection is then closed): sent before h11 parses the head, so not through it."""
    body = json.dumps(error_body(f"the request head is larger than {limit_bytes} bytes; send fewer or shorter "
                                 "headers", "invalid_request_error", None, "request_header_too_large")).encode()
    return (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class GuardMiddleware:
    """See the module docstring. check_host: refuse non-loopback Host names (set it when bound to
    a loopback address); metrics_api_key: the key /metrics requires, or None for an open /metrics."""

    def __init__(self, app, check_host: bool = True, metrics_api_key: str | None = None,
                 body_timeout_s: float = DEFAULT_BODY_TIMEOUT_SECONDS):
        self.app, self.check_host, self.metrics_api_key = app, check_host, metrics_api_key
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self._refusal(scope)
        if refusal is not None:
            return await _send_error(send, *refusal)
        started = False

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        what = f"{scope['method']} {scope['path']}"
        try:
            await self.app(scope, _deadline_receive(receive, self.body_timeout_s), tracked_send)
        except ClientDisconnect:
            logger.debug("client went away while sending the body of %s", what)
        except _BodyTimeout:
            logger.debug("the body of %s did not arrive within %s s; closing", what, self.body_timeout_s)
            if not started:
                await _send_error(send, 408, f"the request body did not arrive within {self.body_timeout_s} s",
                                  "request_timeout", {"connection": "close"})

    def _refusal(self, scope) -> tuple | None:
        """(status, message, code, headers) of a request refused before the app, or None."""
        headers = dict(scope["headers"])          # names are lower-case bytes; a repeat keeps the last
        host = headers.get(b"host", b"").decode("latin-1")
        # no Host, or an empty one, names no loopback host either (HTTP/1.1 requires one)
        if self.check_host and not is_loopback_host(host_name(host)):
            return (403, f"the Host '{host[:64]}' is not a loopback name; this server, bound to a loopback "
                         "address, answers only to localhost, 127.0.0.1 and [::1] (bind another --host to "
                         "serve other names)", "forbidden_host", None)
        # a CORS preflight (OPTIONS) carries no key, as in vLLM: the CORS middleware answers it
        if (self.metrics_api_key is not None and scope["path"] == "/metrics" and scope["method"] != "OPTIONS"
                and not bearer_matches(headers.get(b"authorization", b""), self.metrics_api_key)):
            return (401, "/metrics requires the API key (--metrics-require-key): send `Authorization: "
                         "Bearer <key>`", "invalid_api_key", {"www-authenticate": "Bearer"})
        if scope["method"] in _BODY_METHODS and scope["path"] != "/ping":   # vLLM's POST /ping has no body
            media_type = headers.get(b"content-type", b"").partition(b";")[0].strip().lower()
            if media_type != b"application/json":
                shown = media_type.decode("latin-1")[:64] or "none"
                return (415, f"the Content-Type must be application/json, got {shown}",
                        "unsupported_media_type", None)
        return None


def _deadline_receive(receive, timeout_s: float):
    """`receive` that raises _BodyTimeout when the body is not complete within timeout_s from now;
    once the body is complete (or the client gone) it is the plain receive (disconnect polling)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    body_done = False

    async def timed_receive():
        nonlocal body_done
        if body_done:
            return await receive()
        remaining = deadline - asyncio.get_running_loop().time()
        try:
            message = await asyncio.wait_for(receive(), max(remaining, 0.0))
        except TimeoutError:
            raise _BodyTimeout() from None
        body_done = message["type"] != "http.request" or not message.get("more_body", False)
        return message

    return timed_receive


async def _send_error(send, status: int, message: str, code: str, headers: dict | None) -> None:
    body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})
